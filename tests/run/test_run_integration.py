"""prepare-full then run, end to end, against the real llama-server and the tiny model zoo.

Both commands run as real subprocesses through the installed ``cache-family`` entry point. The
numbers measured here come from tiny random-weight models and are never performance claims;
the test checks custody, receipts and the server's own cache evidence (``cache_n``).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from real_run_harness import CLI, cli, operator_for, prepare_then_run, sha256_of  # noqa: F401

from cache_family.actors.audit.first_tokens import check_first_tokens
from cache_family.actors.audit.replay import replay
from cache_family.oracles.native_parts import Parts
from cache_family.schemas.journal import (
    ChildSpawned,
    ServerMetricsRead,
    WarmupExclusion,
    read_journal,
)
from cache_family.schemas.matrix import MATRIX_FILENAME, decode_matrix
from cache_family.schemas.receipts import (
    SYNTHETIC_EVIDENCE_CLASS,
    decode_cell_receipt,
    decode_row_receipt,
)
from cache_family.schemas.server_metrics import ServerMetricsVerdict
from cache_family.states.handoff import RUNTIME_SLICE_TOPOLOGIES

pytestmark = pytest.mark.native


def test_prepare_full_then_run_checks_correctness_then_measures_both_native_arms_for_real(
    native_parts: Parts, oracle_tools: Path, tmp_path: Path
) -> None:
    out, ran = prepare_then_run(native_parts, oracle_tools, tmp_path, ["llama"], "prepare-full")
    # The zoo's catalog is synthetic: the progress, the last line and every receipt say so.
    final, head = ran.stdout.splitlines()
    assert final.startswith("completed: ") and final.endswith("(synthetic)")
    # The last line is the sealed journal's head: the SHA-256 of its last line.
    last_line = (out / "journal.jsonl").read_bytes().splitlines()[-1]
    assert head == f"journal head: sha256 {hashlib.sha256(last_line).hexdigest()}"
    assert "(synthetic)" in ran.stderr

    matrix = decode_matrix((out / MATRIX_FILENAME).read_bytes())
    assert matrix.status == "completed" and matrix.terminal_refusal is None
    assert matrix.catalog is not None and matrix.catalog.synthetic
    assert matrix.catalog.path == str(native_parts.zoo_catalog) and not matrix.catalog.packaged
    assert SYNTHETIC_EVIDENCE_CLASS in matrix.scope and all(r.synthetic for r in matrix.rows)
    [entry] = [r for r in matrix.rows if r.case == "llama"]
    assert entry.result.status == "completed"
    row_dir = out / str(entry.result.evidence).removesuffix("/row.json")
    row = decode_row_receipt((row_dir / "row.json").read_bytes())
    assert row.status == "completed" and row.evidence_class == SYNTHETIC_EVIDENCE_CLASS
    # The real correctness oracle ran every topology first; its accepted prompt then drove
    # every request of the row, and its text is in no receipt.
    checked = row.correctness
    assert checked.status == "completed" and checked.prompt_sha256 is not None
    assert [(t.topology, t.status) for t in checked.topologies] == [
        (name, "pass") for name in RUNTIME_SLICE_TOPOLOGIES
    ]
    assert all(t.benchmark_prompt_token_count == row.prefix_tokens + 1 for t in checked.topologies)  # type: ignore[operator]
    assert checked.suffix_prefill_matches is True
    report = json.loads(
        (out / checked.topologies[0].evidence_dir / "state-handoff.json").read_bytes()  # type: ignore[operator]
    )
    prompt_text = report["benchmark_prompt_text"]
    assert hashlib.sha256(prompt_text.encode()).hexdigest() == checked.prompt_sha256
    for receipt_path in [*row_dir.rglob("cell.json"), row_dir / "row.json", out / MATRIX_FILENAME]:
        assert prompt_text not in receipt_path.read_text()
    # The row's report entry, as production-cache-bench.json holds it: the first topology's figures.
    production = json.loads((out / "production-cache-bench.json").read_bytes())
    assert production == [json.loads((row_dir / "row.json").read_bytes())["producer_report_row"]]
    assert production[0]["skippy"]["status"] == "pass"
    first = checked.topologies[0]
    assert production[0]["skippy"]["cache_storage_bytes"] == first.cache_storage_bytes
    assert production[0]["llama_server"]["status"] == "ok" and production[0]["synthetic"] is True
    assert [(o.arm, o.status) for o in row.observations] == [
        ("native-serial", "completed"),
        ("native-concurrent", "completed"),
    ]

    serial = decode_cell_receipt((row_dir / "native-serial" / "cell.json").read_bytes())
    assert serial.status == "completed" and serial.accepted_for_parity
    rung = serial.measurement.rungs[0]
    assert rung.warmup_excluded_ids == (0,) and [r.excluded_warmup for r in rung.rows] == [
        True,
        False,
        False,
    ]
    summary = rung.serial_summary
    assert summary is not None and summary.warm_requests == 2
    # The server's own evidence that the warm requests hit its prompt cache.
    assert summary.warm_cache_n_min is not None and summary.warm_cache_n_min > 0
    assert summary.warm_mean_ms is not None and summary.warm_median_ms is not None
    assert all(r.tokens_predicted == 1 for r in rung.rows)

    sweep = decode_cell_receipt((row_dir / "sweep-native-concurrent" / "cell.json").read_bytes())
    assert sweep.status == "completed"
    assert [r.concurrency for r in sweep.measurement.rungs] == [1, 2]
    for ladder_rung in sweep.measurement.rungs:
        assert ladder_rung.host_retained and ladder_rung.status == "completed"
        metrics = ladder_rung.rung_summary
        assert metrics is not None and metrics.complete
        # The server timed every event: its own TTFT and TPOT are always there. The client's
        # are wherever it read the stream as it came; a request it could not observe (a busy
        # machine kept it from reading) leaves the percentiles and, being judged by neither
        # objective, takes the goodput with it.
        assert isinstance(metrics.server_ttft_p50_ms, float)
        assert isinstance(metrics.server_tpot_p99_ms, float)
        observed = metrics.measured_requests - metrics.ttft_unobserved_count
        assert (metrics.ttft_p50_ms is not None) == (observed > 0)
        assert (metrics.ttft_p99_ms is not None) == (observed > 0)
        assert (metrics.goodput_requests_per_sec is not None) == (
            observed == metrics.measured_requests
        )
        assert all(r.tokens_predicted == 128 for r in ladder_rung.rows)
    # No client figure of the run is one a stalled client faked: the server's own timings of
    # every streamed request say so.
    check = check_first_tokens(str(out))
    assert check.requests >= check.per_event > 0
    assert check.faked == [], check.lines()
    for cell in (serial, sweep):
        assert cell.synthetic and cell.evidence_class == SYNTHETIC_EVIDENCE_CLASS
        assert cell.cleanup is not None and cell.cleanup.clean
        assert all(p.matches for p in cell.before_identity + cell.after_identity)
        assert {p.name for p in cell.before_identity} >= {"binary", "native_build", "model"}

    read = read_journal((out / "journal.jsonl").read_bytes())
    spawned = [line.record for line in read.lines if isinstance(line.record, ChildSpawned)]
    hosts = [s for s in spawned if s.role == "host"]
    assert len(hosts) == 2  # one host per arm, retained for the whole ladder
    assert [s.role for s in spawned] == ["correctness"] * 4 + ["host"] * 2
    # The typed reader keeps the host's argv and the prompt's provenance (the records' own
    # fields), so folds and replay see exactly what the file holds.
    argv = list(hosts[0].host_argv)
    # The host ran the run's private copy of the pinned build (the bytes its pins hashed),
    # and so did the other arm's: one copy per run.
    # Hosts reach the run directory through the handle opened at admission (the runner's
    # /proc/PID/fd/N), so a parent swapped for a link afterwards cannot redirect them.
    through = re.fullmatch(r"/proc/\d+/fd/\d+/(.+)", argv[0])
    inside = Path(through.group(1)) if through else Path(argv[0]).relative_to(out)
    copy = inside
    assert copy.parts[0].startswith("exec-state-") and copy.parts[1:] == (
        "native-0",
        "bin",
        "llama-server",
    )
    assert hosts[1].host_argv[0] == argv[0] and not Path(argv[0]).exists()
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and "--no-webui" in argv
    assert argv[argv.index("-t") + 1] == "1" and {h.host_threads for h in hosts} == {"1"}
    assert all("OMP_NUM_THREADS" in h.host_env_names for h in hosts)
    prompts = [line.record for line in read.lines if isinstance(line.record, WarmupExclusion)]
    assert {p.prompt_tokens for p in prompts} == {row.prefix_tokens + 1}  # type: ignore[operator]
    assert {p.prompt_sha256 for p in prompts} == {checked.prompt_sha256}  # both arms
    assert prompts[0].prompt_source == "correctness-benchmark-prompt"

    # The host's own counters, read before and after every rung (llama-server --metrics): one
    # read per rung, their deltas journaled, and the server's totals agree with the sum of the
    # per-request figures (the serial warmup went to the host within rung 0's interval).
    assert "--metrics" in argv
    reads = [line.record for line in read.lines if isinstance(line.record, ServerMetricsRead)]
    assert [(r.cell_id.rsplit("/", 1)[1], r.scope, r.index, r.status) for r in reads] == [
        ("native-serial", "rung", 0, "read"),
        ("native-concurrent", "rung", 0, "read"),
        ("native-concurrent", "rung", 1, "read"),
    ]
    for cell, rung_receipt in [
        (serial, serial.measurement.rungs[0]),
        *((sweep, r) for r in sweep.measurement.rungs),
    ]:
        server_metrics = rung_receipt.server_metrics
        assert isinstance(server_metrics, ServerMetricsVerdict)
        assert server_metrics.status == "read" and server_metrics.server is not None
        assert server_metrics.server.server == "llama.cpp" and server_metrics.client is not None
        requests = len(rung_receipt.rows)
        assert server_metrics.client.accounted == requests
        assert server_metrics.server.prompt_tokens == requests * (row.prefix_tokens + 1)  # type: ignore[operator]
        assert server_metrics.agreement == "agrees", (cell.cell_id, server_metrics)
        assert cell.measurement.server_metrics_disagreeing_rungs == ()

    verdict = replay(str(out))
    assert verdict.exit_code == 0, verdict.lines
    assert f"identical {MATRIX_FILENAME}" in " ".join(verdict.lines)


def test_prepare_use_cases_then_run_uses_each_use_case_prompt(
    native_parts: Parts, oracle_tools: Path, tmp_path: Path
) -> None:
    out, _ = prepare_then_run(
        native_parts, oracle_tools, tmp_path, ["qwen3_dense"], "prepare-use-cases"
    )
    matrix = decode_matrix((out / MATRIX_FILENAME).read_bytes())
    use_cases = [r.use_case for r in matrix.rows]
    assert len(use_cases) == 8 and None not in use_cases
    assert {r.result.status for r in matrix.rows} == {"completed"}
    read = read_journal((out / "journal.jsonl").read_bytes())
    prompts = [line.record for line in read.lines if isinstance(line.record, WarmupExclusion)]
    # The correctness tool was handed each use case's prompt and cut it; its accepted text
    # then drove the row's requests.
    assert {p.prompt_source for p in prompts} == {"correctness-benchmark-prompt"}
    accepted = [
        decode_row_receipt((out / str(r.result.evidence)).read_bytes()) for r in matrix.rows
    ]
    assert all(r.correctness.status == "completed" for r in accepted)
    assert {p.prompt_sha256 for p in prompts} == {r.correctness.prompt_sha256 for r in accepted}
    assert len({r.correctness.prompt_sha256 for r in accepted}) == 8  # each its own prompt
    assert replay(str(out)).exit_code == 0
