"""`cache-family report-run`: statistics, plots, links, determinism and tolerant reading, on
small run directories built from the real receipt structs (tests/report_run_builder.py)."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import msgspec
import pytest
from report_run_builder import rung, serial_rung, write_run

from cache_family.cli import main
from cache_family.errors import Refused
from cache_family.report.run import read_run
from cache_family.report.run_report import PAIRED_NOT_RUN, SYNTHETIC_BANNER, render_run_report
from cache_family.report.stats import bootstrap_median_difference, median
from cache_family.schemas.matrix import FailedMatrix, encode_matrix
from cache_family.schemas.measurement import RequestRow, RungSummary
from cache_family.schemas.production import ProducerRow
from cache_family.schemas.receipts import RungReceipt

PRODUCERS = Path(__file__).resolve().parents[1] / "support" / "golden" / "report" / "producers"

# --- statistics on constructed data ---------------------------------------------------------


def test_a_real_difference_gives_an_interval_excluding_zero() -> None:
    rng = random.Random(7)
    old = [100.0 + rng.random() * 10 for _ in range(40)]
    new = [70.0 + rng.random() * 10 for _ in range(40)]
    effect = bootstrap_median_difference(old, new)
    assert effect is not None
    assert effect.low < effect.difference < effect.high < 0
    assert -35 < effect.difference < -25
    assert effect.verdict == "new faster"
    slower = bootstrap_median_difference(new, old)
    assert slower is not None and slower.low > 0 and slower.verdict == "new slower"


def test_identical_samples_give_an_interval_containing_zero() -> None:
    rng = random.Random(11)
    same = [50.0 + rng.random() * 30 for _ in range(25)]
    effect = bootstrap_median_difference(same, list(same))
    assert effect is not None
    assert effect.difference == 0
    assert effect.low <= 0 <= effect.high
    assert effect.low < effect.high
    assert effect.verdict == "no clear difference"


def test_overlapping_samples_are_not_called_different() -> None:
    rng = random.Random(3)
    old = [rng.gauss(100, 20) for _ in range(15)]
    new = [rng.gauss(101, 20) for _ in range(15)]
    effect = bootstrap_median_difference(old, new)
    assert effect is not None and effect.low < 0 < effect.high


def test_the_bootstrap_is_reproducible_and_needs_two_samples_per_arm() -> None:
    old, new = [1.0, 5.0, 2.0, 8.0], [3.0, 1.0, 0.5, 2.5]
    assert bootstrap_median_difference(old, new) == bootstrap_median_difference(old, new)
    rng = random.Random(5)
    wide = [rng.random() * 100 for _ in range(30)]
    seeded = {bootstrap_median_difference(wide, wide[::-1], seed=s, resamples=50) for s in (1, 2)}
    assert len(seeded) == 2  # the seed is what makes it reproducible
    assert bootstrap_median_difference([1.0], new) is None
    assert bootstrap_median_difference(old, []) is None
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5


# --- rendering from receipts ------------------------------------------------------------------


def native_only(tmp_path: Path) -> Path:
    return write_run(
        tmp_path / "run",
        [
            {
                "native-concurrent": [
                    rung(0, 1, [10.0, 20.0, 30.0, 40.0]),
                    rung(1, 2, [15.5, 25.0, 35.0]),
                ]
            },
            {"native-concurrent": [rung(0, 1, [12.0, 13.0]), rung(1, 4, [44.25, 46.0])]},
        ],
    )


def paired(tmp_path: Path, *, verdicts: bool = False) -> Path:
    old = [100.0 + 3 * i for i in range(12)]
    new = [50.0 + 3 * i for i in range(12)]
    arms = {
        "native-concurrent": [rung(0, 1, old), rung(1, 2, old)],
        "skippy-old": [rung(0, 1, old), rung(1, 2, old)],
        "skippy-new": [rung(0, 1, new), rung(1, 2, old)],
    }
    marks = {
        (0, "skippy-new", 0): {"expected_hits": 11, "observed_hits": 11, "rule": "exact prefix"},
        (0, "skippy-new", 1): {"expected_hits": 11, "observed_hits": 7},
    }
    return write_run(tmp_path / "run", [arms], verdicts=marks if verdicts else None)


def render(run_dir: Path, **kwargs: str) -> dict[str, bytes]:
    return render_run_report(read_run(str(run_dir), **kwargs))


def test_plots_exist_are_linked_and_carry_the_run_numbers(tmp_path: Path) -> None:
    files = render(native_only(tmp_path))
    plots = sorted(name for name in files if name.startswith("plots/"))
    assert plots == ["plots/row-0000-fam0-p32.svg", "plots/row-0001-fam1-p32.svg"]
    markdown = files["report.md"].decode()
    html = files["report.html"].decode()
    for name in plots:
        assert f"]({name})" in markdown
        assert f'href="{name}"' in html
    svg = files["plots/row-0000-fam0-p32.svg"].decode()
    assert svg.startswith("<svg ") and svg.endswith("</svg>\n")
    titles = re.findall(r"<title>([^<]*)</title>", svg)
    # TTFT p50 of rung 0 is 30.0 (sorted [10, 20, 30, 40][2]); p99 of rung 1 is 35.0.
    # Every curve names its output tokens per request.
    assert "native-concurrent, 16 output tok/req, p50 at concurrency 1: 30.0 ms" in titles
    assert "native-concurrent, 16 output tok/req, p99 at concurrency 2: 35.0 ms" in titles
    throughput = "native-concurrent, 16 output tok/req at concurrency 2: 20.12 requests/s"
    assert throughput in titles
    goodput = "native-concurrent, 16 output tok/req at concurrency 1: 9.25 requests/s"
    assert goodput in titles
    tokens = "native-concurrent, 16 output tok/req at concurrency 1: 100.00 tokens/s"
    assert tokens in titles
    second = files["plots/row-0001-fam1-p32.svg"].decode()
    assert "native-concurrent, 16 output tok/req, p99 at concurrency 4: 46.0 ms" in second
    # The same figures are in the Markdown tables (latencies, then rates and cache) and
    # inline in the HTML page.
    assert "| native-concurrent | 16 | 1 | completed | 4/4 | 30.0 | 40.0 | 1.0 | 1.5 |" in markdown
    assert "| native-concurrent | 1 | 10.12 | 100.00 | 9.25 | 3/4 |" in markdown
    assert html.count("<svg ") == 2
    assert "native-concurrent, 16 output tok/req, p99 at concurrency 4: 46.0 ms" in html


def test_rendering_is_deterministic(tmp_path: Path) -> None:
    run = paired(tmp_path, verdicts=True)
    first = render(run)
    again = render(run)
    assert first == again
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    assert render(copy) == first  # nothing depends on where the run lives


def test_synthetic_runs_carry_the_banner(tmp_path: Path) -> None:
    files = render(native_only(tmp_path))
    assert f"> {SYNTHETIC_BANNER}" in files["report.md"].decode()
    assert f'<div class="banner">{SYNTHETIC_BANNER}</div>' in files["report.html"].decode()
    real = write_run(
        tmp_path / "real", [{"native-concurrent": [rung(0, 1, [1.0, 2.0])]}], synthetic=False
    )
    assert SYNTHETIC_BANNER not in render(real)["report.md"].decode()


def test_without_old_and_new_cells_the_report_says_paired_serving_not_run(tmp_path: Path) -> None:
    markdown = render(native_only(tmp_path))["report.md"].decode()
    # One line says what the run did not measure; no empty section stands for it.
    not_run = [line for line in markdown.splitlines() if line.startswith("Not in this run")]
    assert not_run == [
        "Not in this run, so not reported: old and new stage servers side by side "
        f"({PAIRED_NOT_RUN}), workloads."
    ]
    assert "## Old versus new" not in markdown and "## Workloads" not in markdown
    assert "| Row | Output tok/req | Concurrency | Metric |" not in markdown
    # Nor do summary columns that set new against old or native.
    assert "| Row | Output tok/req | Correctness | Not completed |" in markdown
    assert "New vs old" not in markdown


def test_old_versus_new_shows_the_effect_and_its_interval(tmp_path: Path) -> None:
    files = render(paired(tmp_path))
    markdown = files["report.md"].decode()
    lines = [line for line in markdown.splitlines() if line.startswith("| fam0-p32 | ")]
    ttft_c1 = next(line for line in lines if line.startswith("| fam0-p32 | 16 | 1 | TTFT |"))
    cells = [c.strip() for c in ttft_c1.strip("|").split("|")]
    assert cells[4:8] == ["12", "12", "116.5", "66.5"]
    assert cells[8] == "-50.0"
    low, high = (float(x) for x in cells[9].strip("[]").split(","))
    assert low <= -50.0 <= high < 0
    assert cells[11] == "new faster"
    same = next(line for line in lines if line.startswith("| fam0-p32 | 16 | 2 | TTFT |"))
    assert same.endswith("| no clear difference |")
    assert "seed 20261201" in markdown and "2000 resamples" in markdown
    # All three concurrent arms are plotted, whatever their names.
    svg = files["plots/row-0000-fam0-p32.svg"].decode()
    for arm in ("native-concurrent", "skippy-old", "skippy-new"):
        assert f"{arm}, 16 output tok/req, p50 at concurrency 1" in svg


def test_cache_verdict_columns_appear_only_when_receipts_carry_them(tmp_path: Path) -> None:
    without = render(paired(tmp_path))["report.md"].decode()
    assert "Cache verdict" not in without
    run = paired(tmp_path / "with", verdicts=True)
    markdown = render(run)["report.md"].decode()
    assert "Expected hits | Observed hits | Cache verdict |" in markdown
    assert "| skippy-new | 16 | 1 | completed | 12/12 |" in markdown
    # The verdicts are in the rates table, the one that names no output tokens.
    new_rows = [line for line in markdown.splitlines() if line.startswith("| skippy-new | 1 | ")]
    assert new_rows[0].endswith("| 11 | 11 | ok [1] |")
    # The rule, a sentence the same for each rung, is said once under the tables.
    assert markdown.count("exact prefix") == 1 and "- [1] exact prefix" in markdown
    new_rows = [line for line in markdown.splitlines() if line.startswith("| skippy-new | 2 | ")]
    assert new_rows[0].endswith("| 11 | 7 | **short** |")
    old_rows = [line for line in markdown.splitlines() if line.startswith("| skippy-old | 1 | ")]
    assert old_rows[0].endswith("| n/a | n/a | n/a |")


def test_a_wrongly_typed_verdict_member_is_refused_with_its_path(tmp_path: Path) -> None:
    run = paired(tmp_path)
    path = run / "cell-0000" / "sweep-skippy-new" / "cell.json"
    document = json.loads(path.read_text())
    document["measurement"]["rungs"][1]["cache_verdict"] = {"observed_hits": "7"}
    path.write_text(json.dumps(document))
    with pytest.raises(Refused) as refused:
        read_run(str(run))
    # The receipt schema types the verdict (schemas.receipts.CacheVerdict): the cell receipt is
    # refused, and the refusal names the member's path.
    assert refused.value.codes == ["report.receipt"]
    assert "$.measurement.rungs[1].cache_verdict.observed_hits" in str(refused.value)


def test_a_missing_cell_receipt_is_refused_and_a_path_outside_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = native_only(tmp_path)
    # Cells publish before their row, so a cell receipt the row names was removed: the arm
    # was silently dropped from a report that exited 0.
    (run / "cell-0001" / "sweep-native-concurrent" / "cell.json").unlink()
    assert main(["report-run", str(run)]) == 2
    err = capsys.readouterr().err
    assert (
        "refused: report.receipt at $.observations[0].cell_dir: "
        f"{run}/cell-0001/row.json: cell receipt "
        "cell-0001/sweep-native-concurrent/cell.json is missing" in err
    )
    assert not (run / "report.md").exists()
    matrix = json.loads((run / "cache-family-matrix.json").read_text())
    matrix["rows"][0]["result"]["evidence"] = "../elsewhere/row.json"
    (run / "cache-family-matrix.json").write_text(json.dumps(matrix))
    with pytest.raises(Refused) as refused:
        read_run(str(run))
    assert refused.value.codes == ["report.receipt", "report.receipt"]
    assert refused.value.refusals[0].path == "$.rows[0].result.evidence"


def test_a_missing_row_receipt_is_refused(tmp_path: Path) -> None:
    run = native_only(tmp_path)
    # The matrix is published last, naming only row receipts already published.
    (run / "cell-0000" / "row.json").unlink()
    with pytest.raises(Refused) as refused:
        read_run(str(run))
    assert [(r.code, r.path) for r in refused.value.refusals] == [
        ("report.receipt", "$.rows[0].result.evidence")
    ]
    assert "row receipt cell-0000/row.json is missing" in str(refused.value)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_or_infinity_in_a_receipt_is_refused_not_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], constant: str
) -> None:
    run = native_only(tmp_path)
    cell = run / "cell-0000" / "sweep-native-concurrent" / "cell.json"
    text = cell.read_text()
    assert '"ttft_ms": 10.0' in text
    cell.write_text(text.replace('"ttft_ms": 10.0', f'"ttft_ms": {constant}', 1))
    assert main(["report-run", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"refused: report.json at $: {cell}: cell receipt holds {constant}, which is" in err
    assert not (run / "report.md").exists()


LONG_INTEGER = "1" * 5000  # past CPython's 4,300-digit limit on int() of a string


def test_an_integer_of_5000_digits_in_a_cell_receipt_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = native_only(tmp_path)
    cell = run / "cell-0000" / "sweep-native-concurrent" / "cell.json"
    text = cell.read_text()
    cell.write_text(text.replace('"tokens_predicted": 16', f'"tokens_predicted": {LONG_INTEGER}'))
    assert main(["report-run", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert (
        f"refused: report.json at $: {cell}: cell receipt holds an integer literal of more "
        "than 4300 digits" in err
    )


def test_an_integer_of_5000_digits_in_the_production_rows_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = native_only(tmp_path)
    production = tmp_path / "production-cache-bench.json"
    production.write_text(f'[{{"prefix_tokens": {LONG_INTEGER}}}]')
    argv = ["report-run", str(run), "--production", str(production)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert (
        f"refused: report.json at $: {production}: report input holds an integer literal "
        "of more than 4300 digits" in err
    )


def test_a_receipt_that_does_not_decode_is_refused(tmp_path: Path) -> None:
    run = native_only(tmp_path)
    row = run / "cell-0000" / "row.json"
    document = json.loads(row.read_text())
    document["observations"] = "none"
    row.write_text(json.dumps(document))
    with pytest.raises(Refused) as refused:
        read_run(str(run))
    assert refused.value.codes == ["report.receipt"]
    assert str(row) in refused.value.refusals[0].message


def test_the_html_is_self_contained_and_links_the_receipts(tmp_path: Path) -> None:
    html = render(paired(tmp_path))["report.html"].decode()
    assert "<script" not in html
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    hrefs = re.findall(r'href="([^"]*)"', html)
    assert "cache-family-matrix.json" in hrefs
    assert "cell-0000/row.json" in hrefs
    assert "cell-0000/sweep-skippy-new/cell.json" in hrefs
    assert all(":" not in h and not h.startswith("/") for h in hrefs)
    assert not re.search(r'src="(?!data:)', html)
    # The tables of the Markdown are the tables of the page.
    assert html.count("<table>") == render(paired(tmp_path / "again"))["report.md"].decode().count(
        "\n| --- "
    )


def test_markup_in_receipt_text_is_escaped_in_the_page(tmp_path: Path) -> None:
    run = native_only(tmp_path)
    row = run / "cell-0000" / "row.json"
    document = json.loads(row.read_text())
    document["row_key"] = "<b>x</b>|[l](javascript:alert(1))"
    row.write_text(json.dumps(document))
    files = render(run)
    html = files["report.html"].decode()
    assert "<b>x</b>" not in html and "&lt;b&gt;x&lt;/b&gt;" in html
    assert 'href="javascript' not in html
    assert all("<b>" not in v.decode() for k, v in files.items() if k.endswith(".svg"))


def test_reference_tables_come_from_the_runs_production_rows(tmp_path: Path) -> None:
    run = native_only(tmp_path)
    assert "## Reference tables" not in render(run)["report.md"].decode()
    shutil.copyfile(
        PRODUCERS / "production-cache-bench-a.json", run / "production-cache-bench.json"
    )
    files = render(run, corpus=str(PRODUCERS / "corpus.json"))
    markdown = files["report.md"].decode()
    assert "## Reference tables" in markdown
    assert "### Full-GGUF llama-server vs Skippy" in markdown
    assert "### Package-Only Giant Models" in markdown
    assert "[production-cache-bench.json](production-cache-bench.json)" in markdown
    html = files["report.html"].decode()
    heading = '<h3 id="full-gguf-llama-server-vs-skippy">Full-GGUF llama-server vs Skippy</h3>'
    assert heading in html


def test_the_command_writes_into_the_run_dir_or_elsewhere_with_relative_links(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = native_only(tmp_path)
    assert main(["report-run", str(run)]) == 0
    assert capsys.readouterr().out == f"Wrote {run}/report.md\nWrote {run}/report.html\n"
    expected = render(run)
    for name, data in expected.items():
        assert (run / name).read_bytes() == data
    out = tmp_path / "site" / "deep"
    assert main(["report-run", str(run), "--output", str(out)]) == 0
    markdown = (out / "report.md").read_text()
    assert "[row.json](../../run/cell-0000/row.json)" in markdown
    html = (out / "report.html").read_text()
    assert 'href="../../run/cell-0000/sweep-native-concurrent/cell.json"' in html
    assert "](plots/row-0000-fam0-p32.svg)" in markdown
    assert sorted(p.name for p in (out / "plots").iterdir()) == [
        "row-0000-fam0-p32.svg",
        "row-0001-fam1-p32.svg",
    ]


def test_a_refused_run_dir_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = native_only(tmp_path)
    (run / "report.md").write_text("old\n")
    (run / "cell-0000" / "row.json").write_text("{not json")
    assert main(["report-run", str(run)]) == 2
    assert "refused: report.json" in capsys.readouterr().err
    assert (run / "report.md").read_text() == "old\n"
    assert not (run / "plots").exists()
    assert main(["report-run", str(tmp_path / "nothing")]) == 2
    assert "file.missing" in capsys.readouterr().err


def test_any_arm_with_ladder_summaries_is_plotted_whatever_its_kind(tmp_path: Path) -> None:
    run = paired(tmp_path)
    path = run / "cell-0000" / "sweep-skippy-new" / "cell.json"
    document = json.loads(path.read_text())
    document["measurement"]["kind"] = "paired"
    path.write_text(json.dumps(document))
    svg = render(run)["plots/row-0000-fam0-p32.svg"].decode()
    assert "skippy-new, 16 output tok/req, p50 at concurrency 2" in svg


def test_a_failed_pipeline_matrix_is_refused_with_its_reason(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    failed = FailedMatrix(request_sha256="0" * 64, detail="journal unwritable")
    (run / "cache-family-matrix.json").write_bytes(encode_matrix(failed))
    with pytest.raises(Refused) as refused:
        read_run(str(run))
    assert refused.value.codes == ["report.receipt"]
    assert "pipeline failed (owned_plan_or_matrix_execution_refused)" in str(refused.value)


def test_a_rung_without_a_summary_renders_as_not_available(tmp_path: Path) -> None:
    failed = msgspec.structs.replace(
        rung(0, 1, [5.0, 6.0]), status="failed", rung_summary=None, rows=()
    )
    run = write_run(tmp_path / "run", [{"native-concurrent": [failed]}])
    files = render(run)
    markdown = files["report.md"].decode()
    assert "| native-concurrent | n/a | 1 | failed | n/a | n/a | n/a | n/a | n/a |" in markdown
    assert "| native-concurrent | 1 | n/a | n/a | n/a | n/a |" in markdown
    svg = files["plots/row-0000-fam0-p32.svg"].decode()
    assert "<circle" not in svg and "<polyline" not in svg


# --- what a reader sees first: not-observable figures, the summary, the like-for-like win ----


def unobserved_rung(index: int, concurrency: int, elapsed: list[float]) -> RungReceipt:
    """A rung whose every first token came only with the final event: no TTFT, no TPOT."""
    rows = tuple(
        RequestRow(
            request_id=i,
            status="completed",
            elapsed_ms=e,
            tokens_predicted=128,
            ttft_unobserved="first_token_with_final",
        )
        for i, e in enumerate(elapsed)
    )
    summary = RungSummary(
        concurrency=concurrency,
        requested_requests=len(rows),
        measured_requests=len(rows),
        makespan_seconds=1.0,
        throughput_requests_per_sec=5.0,
        output_tokens_per_sec=640.0,
        goodput_requests_per_sec=None,
        observed_completion_tokens=128 * len(rows),
        latency_p50_ms=sorted(elapsed)[len(elapsed) // 2],
        complete=True,
        ttft_unobserved_requests=len(rows),
    )
    return RungReceipt(
        rung_index=index,
        concurrency=concurrency,
        requested_requests=len(rows),
        status="completed",
        output_tokens=128,
        rows=rows,
        rung_summary=summary,
    )


def test_first_token_times_that_were_not_observable_are_said_so_and_not_plotted(
    tmp_path: Path,
) -> None:
    new = [50.0 + 3 * i for i in range(12)]
    run = write_run(
        tmp_path / "run",
        [
            {
                "native-concurrent": [unobserved_rung(0, 1, [57.0 + i for i in range(12)])],
                "skippy-new": [rung(0, 1, new, output_tokens=16)],
            }
        ],
    )
    files = render(run)
    markdown = files["report.md"].decode()
    assert (
        "| native-concurrent | 128 | 1 | completed | 12/12 | not observable | not observable "
        "| not observable | not observable |" in markdown
    )
    assert "| native-concurrent | 1 | 5.00 | 640.00 | n/a |" in markdown
    svg = files["plots/row-0000-fam0-p32.svg"].decode()
    assert "not observable: native-concurrent" in svg
    # No TTFT or TPOT point of the native arm; its throughput and tokens/s are drawn.
    assert "native-concurrent, 128 output tok/req, p50 at" not in svg
    assert "native-concurrent, 128 output tok/req at concurrency 1: 5.00 requests/s" in svg
    assert "skippy-new, 16 output tok/req, p50 at concurrency 1" in svg
    # The summary does not compare the new arm's latency with different work.
    summary = next(line for line in markdown.splitlines() if line.startswith("| [fam0-p32]"))
    assert "TTFT not observable; latency compares different work: 128/16 output tok/req" in (
        summary
    )


def test_the_servers_own_first_token_and_token_times_stand_beside_the_clients(
    tmp_path: Path,
) -> None:
    """A rung whose server timed every event and whose client stalled on some requests: the
    client's figures of those are not observable, the server's own are shown, labelled."""
    stalled = unobserved_rung(0, 2, [60.0 + i for i in range(12)])
    assert stalled.rung_summary is not None
    summary = msgspec.structs.replace(
        stalled.rung_summary,
        ttft_p50_ms=40.0,
        tpot_p50_ms=0.5,
        ttft_unobserved_requests=3,
        server_ttft_p50_ms=12.5,
        server_ttft_p99_ms=14.0,
        server_tpot_p50_ms=0.3,
        server_tpot_p99_ms=0.6,
    )
    run = write_run(
        tmp_path / "run",
        [{"native-concurrent": [msgspec.structs.replace(stalled, rung_summary=summary)]}],
    )
    markdown = render(run)["report.md"].decode()
    assert "| Arm | Concurrency | Server's TTFT p50 ms | Server's TTFT p99 ms " in markdown
    assert "| native-concurrent | 2 | 12.5 | 14.0 | 0.3 | 0.6 | 40.0 | 0.5 | 3/12 |" in markdown
    # A run whose servers timed no event has no such table.
    plain = write_run(tmp_path / "plain", [{"native-concurrent": [rung(0, 1, [5.0, 6.0])]}])
    assert "Server's TTFT" not in render(plain)["report.md"].decode()


def test_the_report_opens_with_a_summary_linking_rows_and_cells_that_did_not_complete(
    tmp_path: Path,
) -> None:
    old = [100.0 + 3 * i for i in range(12)]
    new = [50.0 + 3 * i for i in range(12)]
    arms = {
        "native-concurrent": [rung(0, 1, old)],
        "skippy-old": [rung(0, 1, old)],
        "skippy-new": [rung(0, 1, new)],
    }
    run = write_run(
        tmp_path / "run",
        [arms],
        statuses={(0, "skippy-old"): ("incomplete", "cleanup_unclean")},
    )
    files = render(run)
    markdown = files["report.md"].decode()
    headings = [line for line in markdown.splitlines() if line.startswith("## ")]
    assert headings[0] == "## Summary"
    line = next(line for line in markdown.splitlines() if line.startswith("| [fam0-p32]"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[0] == "[fam0-p32](#fam0-p32)"
    assert cells[1] == "16, 16, 16"
    assert cells[3].startswith("TTFT c=1: -50.0 ms [") and cells[3].endswith("new faster")
    assert cells[4].startswith("TTFT c=1: -50.0 ms [")
    assert cells[5] == (
        "[skippy-old: incomplete (cleanup_unclean)](cell-0000/sweep-skippy-old/cell.json)"
    )
    html = files["report.html"].decode()
    assert '<h3 id="fam0-p32">fam0-p32</h3>' in html
    assert '<a href="#fam0-p32">fam0-p32</a>' in html
    assert html.index('id="summary"') < html.index('id="concurrency-curves"')


def test_long_per_rung_tables_start_folded(tmp_path: Path) -> None:
    many = {"native-concurrent": [rung(i, 2**i, [10.0, 20.0]) for i in range(8)]}
    files = render(write_run(tmp_path / "run", [many]))
    html = files["report.html"].decode()
    assert html.count("<details>") == 1
    folded = html[html.index("<details>") : html.index("</details>")]
    assert "<summary>Per-rung figures of fam0-p32</summary>" in folded
    # Two tables (latencies, then rates and cache), each with a header and eight rungs.
    assert folded.count("<table>") == 2 and folded.count("<tr>") == 18
    short = render(native_only(tmp_path / "short"))["report.html"].decode()
    assert "<details>" not in short


def test_the_reference_win_stands_beside_the_same_request_timed_inside_the_server(
    tmp_path: Path,
) -> None:
    producer = ProducerRow(
        family="Fam",
        model_id="fam/model",
        payload="resident-kv",
        stage_load_mode="runtime-slice",
        use_case=None,
        use_case_label=None,
        prefix_tokens=32,
        benchmark_prompt_token_count=33,
        notes="",
        case={},
        skippy={
            "status": "pass",
            "cache_hit_import_ms": (0.1, 0.1, 0.1),
            "cache_hit_decode_ms": (0.3, 0.3, 0.3),
        },
        llama_server={"status": "ok", "warm_median_ms": 2.4},
    )
    serial = serial_rung([9.0, 2.0, 2.4, 2.8], [(5.0, 3.0), (0.2, 0.4), (0.3, 0.5), (0.4, 0.6)])
    run = write_run(
        tmp_path / "run",
        [{"native-serial": [serial], "native-concurrent": [rung(0, 1, [1.0, 2.0])]}],
        producers={0: producer},
    )
    markdown = render(run)["report.md"].decode()
    line = next(
        line for line in markdown.splitlines() if line.startswith("| fam0-p32 | 16 | pass |")
    )
    # hit 0.4 ms; warm median 2.4 ms (6.00x, the reference's win); inside the server the
    # warm requests took 0.6, 0.8 and 1.0 ms (median 0.8: 2.00x); 1.6 ms were HTTP and client.
    assert line == "| fam0-p32 | 16 | pass | 0.4 | 2.4 | 6.00x | 0.8 | 2.00x | 1.6 |"
    assert "Skippy win against the server's time" in markdown


def test_repeated_notes_of_the_reference_tables_are_footnotes(tmp_path: Path) -> None:
    run = native_only(tmp_path)
    shutil.copyfile(
        PRODUCERS / "production-cache-bench-a.json", run / "production-cache-bench.json"
    )
    markdown = render(run, corpus=str(PRODUCERS / "corpus.json"))["report.md"].decode()
    section = markdown[markdown.index("## Reference tables") :]
    section = section[: section.index("\n## ", 1)]
    notes = [line for line in section.splitlines() if re.match(r"^- \[\d+\] ", line)]
    assert notes, section
    texts = [line.split("] ", 1)[1] for line in notes]
    assert len(texts) == len(set(texts))
    for text in texts:  # each note said once, under the tables, never in a cell
        assert section.count(text) == 1
