"""The run report's page in headless Chromium (Debian's ``chromium``; skipped, saying so,
without it), for a full run and a workloads-only run, at a desktop width and a phone's:
nothing sticks out of the page, the console stays empty, at 1400 px no table scrolls
sideways and no per-rung row is taller than one line, and a whole-page screenshot of each
is left in the test's directory for a reader to look at."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from browser_check import WIDTHS, assert_compact, browser, open_page, png_width
from report_run_builder import (
    demo_like_stages,
    open_loop_receipt,
    overlap_receipt,
    rung,
    write_run,
)

from cache_family.cli import main

PRODUCERS = Path(__file__).resolve().parents[1] / "support" / "golden" / "report" / "producers"
#: A verdict rule as long as a real one: said once under the tables, not in each row.
RULE = (
    "exact-prefix (llama, plain attention: the common prefix, all but the last prompt "
    "token); a slot's first request is cold"
)


def full_run(root: Path) -> Path:
    old = [100.0 + 3 * i for i in range(12)]
    new = [50.0 + 3 * i for i in range(12)]
    arms = {
        "native-concurrent": [rung(i, 2**i, old, output_tokens=128) for i in range(4)],
        "skippy-old": [rung(i, 2**i, old) for i in range(4)],
        "skippy-new": [rung(i, 2**i, new) for i in range(4)],
    }
    verdicts = {
        (row, arm, i): {"expected_hits": 11, "observed_hits": 11, "rule": RULE}
        for row in (0, 1)
        for arm in arms
        for i in range(4)
    }
    run = write_run(root, [arms, arms], verdicts=verdicts)
    shutil.copyfile(
        PRODUCERS / "production-cache-bench-a.json", run / "production-cache-bench.json"
    )
    return run


def workloads_run(root: Path) -> Path:
    return write_run(
        root,
        [{"native-overlap": [], "native-open-loop": []}],
        workloads={
            (0, "native-overlap"): overlap_receipt(0, "native-overlap"),
            (0, "native-open-loop"): open_loop_receipt(0, "native-open-loop", demo_like_stages()),
        },
    )


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("kind", ["full", "workloads"])
def test_a_full_and_a_workloads_only_report_read_in_chromium(
    kind: str, width: int, tmp_path: Path
) -> None:
    browser()  # skips, saying so, without Chromium
    run = (full_run if kind == "full" else workloads_run)(tmp_path / "run")
    corpus = ["--use-case-corpus", str(PRODUCERS / "corpus.json")] if kind == "full" else []
    assert main(["report-run", str(run), *corpus]) == 0
    shot = tmp_path / f"report-{kind}-{width}.png"
    opened = open_page(run / "report.html", width, full_page=shot)
    assert opened.console == []
    assert_compact(opened.layout, width)
    assert png_width(shot) == max(width, 500)  # the window holds the page's frame
    if kind == "full":
        assert "<details>" in opened.dom and 'id="summary"' in opened.dom
        assert opened.dom.count("<svg ") == 2
        assert opened.dom.count(RULE) == 2  # once under each row's tables, not in each rung
    else:
        assert "Not in this run, so not reported:" in opened.dom
        assert "Use-Case Benchmark Matrix" not in opened.dom
        assert opened.dom.count("<svg ") == 2
