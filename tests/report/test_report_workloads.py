"""The run report for what a run measured: workload sections whose tables and plots say what
they hold (no "0/0", rates rounded for reading, axes named), open-loop rates marked when
they sent too few requests to judge, and a run that measured only some things reporting
only those, with one line naming the rest."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest
from report_run_builder import (
    demo_like_stages,
    open_loop_receipt,
    overlap_receipt,
    rung,
    stage,
    write_run,
)

from cache_family.report import build_report
from cache_family.report.run import read_run
from cache_family.report.run_report import PAIRED_NOT_RUN, render_run_report
from cache_family.report.workloads import (
    PERCENTILE_SENDS,
    TOO_FEW,
    WorkloadView,
    rate_labels,
    sends_to_judge,
    workload_sections,
)
from cache_family.schemas.workload_records import OpenLoopStageMeasured

PRODUCERS = Path(__file__).resolve().parents[1] / "support" / "golden" / "report" / "producers"


def open_loop_section(
    stages: list[OpenLoopStageMeasured], over: float | None = None
) -> tuple[list[str], dict[str, str]]:
    receipt = open_loop_receipt(0, "native-open-loop", stages)
    receipt = msgspec.structs.replace(receipt, over_saturated_at_per_s=over)
    svgs: dict[str, str] = {}
    lines = workload_sections([WorkloadView("cell-0000/x/workload.json", receipt)], svgs)
    return lines, svgs


def table_rows(lines: list[str], first: str) -> list[list[str]]:
    """The cells of each table line whose first cell is ``first``."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line[:1] == "|"]
    return [row for row in rows if row[0] == first]


def test_closed_loop_and_skipped_stages_say_so_instead_of_0_of_0() -> None:
    stages = [
        *demo_like_stages()[:3],
        stage("rate", target_rate_per_s=400.0, skipped_because="over-saturated at 300/s"),
    ]
    lines, _ = open_loop_section(stages)
    table = "\n".join(line for line in lines if line.startswith("|"))
    assert "0/0" not in table and "0 of 0" not in table
    sent = [
        row[4] for kind in ("synchronous", "throughput", "rate") for row in table_rows(lines, kind)
    ]
    assert sent == ["closed loop", "closed loop", "24 of 24", "not sent"]


def test_a_rate_with_too_few_sends_is_marked_with_the_number_needed() -> None:
    enough = stage(
        "rate", target_rate_per_s=50.0, scheduled=100, launched=100, completed=100,
        achieved_rate_per_s=48.0,
    )  # fmt: skip
    lines, svgs = open_loop_section([*demo_like_stages(), enough])
    assert [row[-1] for row in table_rows(lines, "rate")] == [
        f"{TOO_FEW}: 24 sent, 100 needed",
        f"{TOO_FEW}: 24 sent, 100 needed",
        "-",
    ]
    # The plot says it too, at the rates it concerns.
    (svg,) = svgs.values()
    assert f"{TOO_FEW} at 300, 340/s" in svg


@pytest.mark.parametrize(
    ("pattern", "burstiness", "needed"),
    [("constant", None, 100), ("poisson", None, 100), ("gamma", 2.0, 100), ("gamma", 0.5, 194)],
)
def test_the_sends_a_rate_needs_follow_its_pattern(
    pattern: str, burstiness: float | None, needed: int
) -> None:
    # A p99 needs 100 sends; a Poisson rate within 20 % at 95 % needs 98; a burstier gamma
    # schedule (shape 0.5: gaps twice as spread) needs twice that.
    assert sends_to_judge(pattern, burstiness) == needed
    assert needed >= PERCENTILE_SENDS


def test_rates_read_rounded_and_stay_distinct() -> None:
    assert rate_labels([300.141, 340.351]) == ("300", "340")
    assert rate_labels([42.44, 49.0253, 1.23456]) == ("42.4", "49", "1.23")
    # Two rates that would read the same get one more digit each, until they differ.
    assert rate_labels([300.141, 300.449]) == ("300.1", "300.4")


def test_plot_axes_name_what_they_hold_and_ticks_read_rounded() -> None:
    _, svgs = open_loop_section(demo_like_stages())
    (open_loop,) = svgs.values()
    axis_labels = re.findall(r'font-size="10" font-family="sans-serif">([^<]*)</text>', open_loop)
    assert "offered rate (requests/s)" in axis_labels
    assert "concurrency" not in axis_labels
    assert "300" in axis_labels and "340" in axis_labels
    assert "300.141" not in open_loop.replace("300.14/s", "")  # only the exact tooltip value
    assert "achieved at offered rate 300 requests/s: 225.30/s" in open_loop
    svgs = {}
    workload_sections(
        [WorkloadView("cell-0000/y/workload.json", overlap_receipt(0, "native-overlap"))], svgs
    )
    (overlap,) = svgs.values()
    assert ">designed overlap (%)</text>" in overlap and ">concurrency</text>" not in overlap
    assert "achieved at designed overlap 90 %: 89.94 %" in overlap


def test_the_over_saturated_rate_reads_rounded() -> None:
    lines, _ = open_loop_section(demo_like_stages(), over=49.0253)
    assert "Over-saturated at 49/s: the rates below it are the ones the server sustained." in lines


def _production(run: Path, keep: str) -> None:
    """The golden production rows, only those of one reference table."""
    rows = json.loads((PRODUCERS / "production-cache-bench-a.json").read_text())
    if keep == "full":
        chosen = [
            r for r in rows if not r.get("use_case") and r["stage_load_mode"] != "layer-package"
        ]
    else:
        chosen = [r for r in rows if r.get("use_case")]
    (run / "production-cache-bench.json").write_text(json.dumps(chosen))


def test_a_workloads_only_run_reports_its_workloads_and_names_what_it_did_not_run(
    tmp_path: Path,
) -> None:
    run = write_run(
        tmp_path / "run",
        [{"native-overlap": [], "native-open-loop": []}],
        workloads={
            (0, "native-overlap"): overlap_receipt(0, "native-overlap"),
            (0, "native-open-loop"): open_loop_receipt(0, "native-open-loop", demo_like_stages()),
        },
    )
    _production(run, "full")
    files = render_run_report(read_run(str(run), corpus=str(PRODUCERS / "corpus.json")))
    markdown = files["report.md"].decode()
    not_run = [line for line in markdown.splitlines() if line.startswith("Not in this run")]
    assert not_run == [
        "Not in this run, so not reported: use-case rows, package-only rows, concurrency "
        f"ladders, old and new stage servers side by side ({PAIRED_NOT_RUN})."
    ]
    for absent in (
        "### Use-Case Benchmark Matrix",
        "### Package-Only Giant Models",
        "| Use case |",
        "## Concurrency curves",
        "## Old versus new",
    ):
        assert absent not in markdown, absent
    assert "### Full-GGUF llama-server vs Skippy" in markdown and "## Workloads" in markdown
    assert sorted(n for n in files if n.startswith("plots/")) == [
        "plots/workload-cell-0000_native-open-loop.svg",
        "plots/workload-cell-0000_native-overlap.svg",
    ]


def test_a_use_case_run_shows_the_matrix_and_not_the_empty_full_table(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [{"native-concurrent": [rung(0, 1, [10.0, 20.0])]}])
    _production(run, "use-case")
    markdown = render_run_report(read_run(str(run), corpus=str(PRODUCERS / "corpus.json")))[
        "report.md"
    ].decode()
    assert "### Use-Case Benchmark Matrix" in markdown
    assert "| Use case | Qwen3 dense | Gemma2 |" in markdown
    assert "### Full-GGUF llama-server vs Skippy" not in markdown
    assert "### Package-Only Giant Models" not in markdown
    assert "Not in this run, so not reported: full-GGUF rows, package-only rows, " in markdown


def test_the_combined_report_keeps_every_table_even_empty(tmp_path: Path) -> None:
    """`cache-family report` writes the reference's text: its tables stay, rows or not."""
    only_full = tmp_path / "full.json"
    rows = json.loads((PRODUCERS / "production-cache-bench-a.json").read_text())
    only_full.write_text(json.dumps([r for r in rows if not r.get("use_case")][:1]))
    text = build_report([str(only_full)], str(PRODUCERS / "corpus.json"))
    assert "### Use-Case Benchmark Matrix" in text and "### Package-Only Giant Models" in text
