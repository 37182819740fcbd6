"""Server metrics through a real ``cache-family run`` whose host is the FAULT-INJECTION
``fake_run_llama_server.py`` (a real child process speaking llama-server's HTTP): a server
whose own counters disagree with its per-request figures is flagged in every rung's receipt
and in the run report; a malformed exposition is journaled refused with its code; a host
without ``/metrics`` says so. The run itself completes in each case, and replays identically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from run_harness import make_prepared
from signal_harness import behave, logs_dir, start_run, wait_exit

from cache_family.actors.audit.replay import replay
from cache_family.report.run import read_run
from cache_family.report.run_report import render_run_report
from cache_family.schemas.journal import ServerMetricsRead, read_journal
from cache_family.schemas.receipts import CellReceipt, decode_cell_receipt
from cache_family.schemas.server_metrics import ServerMetricsVerdict


async def _run_with_fake(tmp_path: Path, **behaviour: Any) -> Path:
    prepared = make_prepared(tmp_path / "p")
    behave(prepared, **behaviour)
    out, logs = tmp_path / "out", logs_dir(tmp_path)
    code = await wait_exit(await start_run(prepared, out, logs))
    assert code == 0, (logs / "run.stderr").read_text()
    return out


def _cells(out: Path) -> dict[str, CellReceipt]:
    return {
        path.parent.name: decode_cell_receipt(path.read_bytes())
        for path in sorted((out / "cell-0000").glob("*/cell.json"))
    }


def _reads(out: Path) -> list[ServerMetricsRead]:
    read = read_journal((out / "journal.jsonl").read_bytes())
    return [line.record for line in read.lines if isinstance(line.record, ServerMetricsRead)]


def _verdicts(cell: CellReceipt) -> list[ServerMetricsVerdict]:
    verdicts = [rung.server_metrics for rung in cell.measurement.rungs]
    assert all(isinstance(v, ServerMetricsVerdict) for v in verdicts)
    return verdicts  # type: ignore[return-value]


async def test_a_server_whose_counters_disagree_is_flagged_in_every_rung_and_the_report(
    tmp_path: Path,
) -> None:
    # The FAKE counts 3 cached tokens more per request than each request reported.
    out = await _run_with_fake(tmp_path, metrics=True, metrics_cached_skew=3)
    cells = _cells(out)
    assert set(cells) == {"native-serial", "sweep-native-concurrent"}
    for cell in cells.values():
        assert cell.status == "completed"  # flagged, not hidden, and the measurement stands
        verdicts = _verdicts(cell)
        assert [v.agreement for v in verdicts] == ["disagrees"] * len(verdicts)
        # llama.cpp counts the prompt as its processed plus its cached tokens: both disagree.
        assert {v.disagreeing for v in verdicts} == {("prompt_tokens", "cached_tokens")}
        for rung, verdict in zip(cell.measurement.rungs, verdicts, strict=True):
            assert verdict.server is not None and verdict.client is not None
            sent = len(rung.rows)
            assert verdict.server.cached_tokens == verdict.client.cached_tokens + 3 * sent
            assert verdict.server.prompt_tokens == verdict.client.prompt_tokens + 3 * sent
            assert verdict.server.predicted_tokens == verdict.client.predicted_tokens
        assert cell.measurement.server_metrics_disagreeing_rungs == tuple(
            range(len(cell.measurement.rungs))
        )
    assert all(r.status == "read" and r.path == "/metrics" for r in _reads(out))
    report = render_run_report(read_run(str(out)))["report.md"].decode()
    assert "| Cached tok |" in report
    assert "disagrees: prompt, cached" in report
    verdict = replay(str(out))
    assert verdict.exit_code == 0, verdict.lines


async def test_a_malformed_exposition_is_journaled_refused_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    body = "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total{ 7\n"
    out = await _run_with_fake(tmp_path, metrics=True, metrics_body=body)
    reads = _reads(out)
    assert reads and {(r.status, r.refusal_code) for r in reads} == {
        ("refused", "server_metrics.malformed")
    }
    assert all(r.counters == () for r in reads)
    for cell in _cells(out).values():
        assert cell.status == "completed"
        assert {(v.status, v.refusal_code, v.server) for v in _verdicts(cell)} == {
            ("refused", "server_metrics.malformed", None)
        }
    assert replay(str(out)).exit_code == 0


async def test_an_oversized_exposition_is_refused_without_being_read_whole(
    tmp_path: Path,
) -> None:
    # Past the 1 MiB cap: the read stops there, over the real socket, and says so.
    body = "# TYPE llamacpp:prompt_tokens_total counter\n" + "# padding\n" * 120_000
    out = await _run_with_fake(tmp_path, metrics=True, metrics_body=body)
    reads = _reads(out)
    assert reads and {(r.status, r.refusal_code) for r in reads} == {
        ("refused", "server_metrics.oversized")
    }
    assert all(r.before_bytes is None for r in reads)
    assert replay(str(out)).exit_code == 0


async def test_a_host_without_metrics_says_so_and_nothing_is_guessed(tmp_path: Path) -> None:
    out = await _run_with_fake(tmp_path)  # the FAKE answers /metrics with 404
    reads = _reads(out)
    assert reads and {(r.status, r.reason) for r in reads} == {("none", "the host answered 404")}
    for cell in _cells(out).values():
        for verdict in _verdicts(cell):
            assert verdict.status == "none" and verdict.server is None
            assert verdict.agreement is None and verdict.client is not None
    report = render_run_report(read_run(str(out)))["report.md"].decode()
    assert "| none |" in report
    assert "- none: the host answered 404 (native-serial, native-concurrent)" in report
