"""`cache-family report`: the combined README tables, against golden files and rule by rule.

Golden cases live in tests/golden/report/<case>/ (inputs, corpus.json, expected.md):
``producers`` reads a rich producer-A file and a native producer-B file together,
``edge`` covers escapes, ties, storage forms, duplicates, unknown names, plumbing labels
and package baselines, ``empty`` the header-only form. Regenerate one only after checking
the new text by hand: ``cache-family report --input ... --use-case-corpus corpus.json
--output expected.md`` from inside its directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from cache_family.errors import Refused
from cache_family.report import build_report, corpus_shown
from cache_family.report.decode import Refusals
from cache_family.report.render import cell, hit_ms, render_report, speedup
from cache_family.report.rows import ReportRow, SkippyFigures, read_rows
from cache_family.schemas.corpus import default_corpus_path

GOLDEN = Path(__file__).resolve().parents[1] / "support" / "golden" / "report"
CASES = {
    "producers": ["production-cache-bench-a.json", "production-cache-bench-b.json"],
    "edge": ["production-cache-bench.json"],
    "empty": ["production-cache-bench.json"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_report(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(GOLDEN / case)
    text = build_report(CASES[case], "corpus.json")
    assert text == (GOLDEN / case / "expected.md").read_text(encoding="utf-8")


def test_golden_files_hold_the_sections_they_claim() -> None:
    """The golden texts themselves carry the cases the issue names (guards a careless regen)."""
    producers = (GOLDEN / "producers" / "expected.md").read_text(encoding="utf-8")
    edge = (GOLDEN / "edge" / "expected.md").read_text(encoding="utf-8")
    empty = (GOLDEN / "empty" / "expected.md").read_text(encoding="utf-8")
    for text in (producers, edge, empty):
        assert text.endswith(" |\n")
        assert not text.endswith("\n\n")
        for heading in (
            "### Full-GGUF llama-server vs Skippy",
            "### Use-Case Benchmark Matrix",
            "### Package-Only Giant Models",
        ):
            assert f"\n{heading}\n" in f"\n{text}"
    # a failed correctness row is shown, never with a speedup
    assert "| fail | 128 | 129 | 10.1 | n/a | n/a | 3.2 MiB | metadata-derived |" in producers
    # package-only rows from both producers, baseline label in place of a number
    assert producers.count("| Skippy stage recompute |") == 2
    # summarization_rag has a matrix row but no corpus entry: no source row for it
    assert "| Summarization/RAG | 2.50x |" in producers
    assert "| Summarization/RAG | `" not in producers
    # escapes, duplicates (last wins), the empty-matrix header
    assert "| Odd/Family X | `org/'model'/v2` | `custom/payload` | pass/ok |" in edge
    assert "| Tool calling | 4.00x |" in edge
    assert "(old)" not in edge
    assert "| Use case |  |\n| --- |  |\n" in empty


# --- values, rule by rule ----------------------------------------------------------------


def _row(**skippy: Any) -> ReportRow:
    return ReportRow(file="/x.json", index=0, skippy=SkippyFigures(**skippy))


def test_hit_is_the_median_of_per_repeat_sums_with_half_sums_for_an_even_count() -> None:
    odd = _row(cache_hit_import_ms=(3.0, 1.0, 2.0, None), cache_hit_decode_ms=(1.0, 1.0, 1.0, 5.0))
    assert hit_ms(odd) == 3.0
    even = _row(cache_hit_import_ms=(1.0, 4.0, 2.0, 3.0), cache_hit_decode_ms=(0.5,) * 4)
    assert hit_ms(even) == 3.0
    # a/2 + b/2 of the middle two, not (a + b) / 2, which would overflow here
    big = _row(cache_hit_import_ms=(1e308, 1e308), cache_hit_decode_ms=(5e307, 5e307))
    assert hit_ms(big) == 1.5e308


def test_hit_without_a_complete_pair_is_unknown_without_falling_back() -> None:
    row = _row(
        cache_hit_import_ms=(None, 1.0), cache_hit_decode_ms=(1.0, None), cache_hit_total_ms=9.0
    )
    assert hit_ms(row) is None
    assert hit_ms(_row(cache_hit_import_ms=(1.0,), cache_hit_total_ms=9.0)) == 9.0


def test_no_speedup_unless_correctness_passed() -> None:
    passed = ReportRow(
        file="/x.json",
        index=0,
        skippy=SkippyFigures(status="pass", cache_hit_total_ms=2.0, recompute_total_ms=6.0),
    )
    assert speedup(passed, package=True) == 3.0
    assert speedup(passed, package=False) is None  # recompute is for package rows only
    for status in ("fail", "Pass", None):
        failed = ReportRow(
            file="/x.json",
            index=0,
            skippy=SkippyFigures(status=status, cache_hit_total_ms=2.0, recompute_total_ms=6.0),
        )
        assert speedup(failed, package=True) is None


def test_a_zero_hit_or_an_infinite_ratio_is_no_speedup() -> None:
    zero = ReportRow(
        file="/x.json",
        index=0,
        skippy=SkippyFigures(status="pass", cache_hit_total_ms=0.0, recompute_total_ms=6.0),
    )
    huge = ReportRow(
        file="/x.json",
        index=0,
        skippy=SkippyFigures(status="pass", cache_hit_total_ms=1e-300, recompute_total_ms=1e300),
    )
    assert speedup(zero, package=True) is None
    assert speedup(huge, package=True) is None


def test_cell_escapes_pipes_line_breaks_and_backticks() -> None:
    assert cell("a|b\nc\rd`e`") == "a/b c d'e'"


def test_storage_overflow_of_a_shown_row_is_refused_but_not_of_a_hidden_one() -> None:
    overflow = ReportRow(
        file="/in.json",
        index=4,
        family="Llama",
        payload="resident-kv",
        stage_load_mode="runtime-slice",
        prefix_tokens=2**33,
        resident_kv_bytes_per_token=2**31,
    )
    hidden = ReportRow(**{**_fields(overflow), "stage_load_mode": "runtime-slice"})
    refusals = Refusals()
    render_report([hidden], (), "c.json", refusals)  # llama status not ok: in no table
    assert not refusals
    shown = ReportRow(**{**_fields(overflow), "stage_load_mode": "layer-package"})
    render_report([shown], (), "c.json", refusals)
    with pytest.raises(Refused) as refused:
        refusals.raise_any()
    (only,) = refused.value.refusals
    assert only.code == "report.storage_overflow"
    assert only.path == "$[4].case.resident_kv_bytes_per_token"
    assert "/in.json" in only.message


def test_the_largest_product_that_fits_is_rendered() -> None:
    row = ReportRow(
        file="/in.json",
        index=0,
        payload="resident-kv",
        prefix_tokens=1,
        resident_kv_bytes_per_token=2**64 - 1,
    )
    refusals = Refusals()
    text = render_report([row], (), "c.json", refusals)
    assert not refusals
    assert f"| {float(2**64 - 1) / 1048576.0:.1f} MiB | metadata-derived |" in text


def _fields(row: ReportRow) -> dict[str, Any]:
    return {name: getattr(row, name) for name in ReportRow.__dataclass_fields__}


# --- lenient reading -------------------------------------------------------------------------


def test_rows_are_lenient_about_missing_and_unknown_members(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    path.write_text(
        json.dumps(
            [
                {},
                {
                    "family": "Llama",
                    "payload": None,
                    "use_case": None,
                    "prefix_tokens": None,
                    "future_member": {"nested": [1, "two", None]},
                    "skippy": {"status": None, "cache_hit_import_ms": None, "extra": "x"},
                    "llama_server": {"status": "ok", "warm_median_ms": 3, "runs": []},
                    "case": {"resident_kv_bytes_per_token": None, "ctx_size": 512},
                },
            ]
        )
    )
    refusals = Refusals()
    rows = read_rows([str(path)], refusals)
    assert not refusals
    empty, llama = rows
    assert (empty.family, empty.model_id, empty.stage_load_mode, empty.notes) == ("", "", "", "")
    assert empty.skippy.status is None and empty.payload is None
    assert llama.llama_server.warm_median_ms == 3.0  # an integer is a number of ms
    assert isinstance(llama.llama_server.warm_median_ms, float)
    assert not llama.plumbing


def test_plumbing_rule(tmp_path: Path) -> None:
    variants: list[dict[str, Any]] = [
        {"synthetic": True},
        {"evidence_class": "synthetic: tiny random-weight zoo model"},
        {"notes": "rows from a SYNTHETIC catalog"},
        {"notes": "scripted fake tool"},
        {"synthetic": False},
        {"synthetic": None, "evidence_class": None},
        {"evidence_class": ""},
        {"evidence_class": "reference-oracle evidence"},
        {"notes": "gretelai/synthetic_text_to_sql"},  # a word inside a name is not a label
    ]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(variants))
    refusals = Refusals()
    marks = [row.plumbing for row in read_rows([str(path)], refusals)]
    assert not refusals
    assert marks == [True, True, True, True, False, False, False, False, False]


def test_default_corpus_is_the_one_preparation_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rows.json"
    path.write_text("[]")
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    text = build_report([str(path)])
    shown = corpus_shown(default_corpus_path(), os.getcwd())
    assert f"Prompt sources are checked in at `{shown}` with source\n" in text
    corpus = json.loads(Path(default_corpus_path()).read_text(encoding="utf-8"))
    for entry in corpus["use_cases"]:
        assert f"| {entry['label']} | `{entry['source']['dataset']}` |" in text


def test_corpus_shown_is_relative_inside_the_working_directory_only() -> None:
    assert corpus_shown("/repo/corpus/use-cases.json", "/repo") == "corpus/use-cases.json"
    assert corpus_shown("/elsewhere/c.json", "/repo") == "/elsewhere/c.json"


def test_a_real_models_evidence_is_named_beside_its_figures(tmp_path: Path) -> None:
    """A trained model's row names what its figures are in Notes and beside its win; a row
    whose correctness failed is never a win; other evidence classes render as before."""
    evidence = (
        "real model org/m:Q4 on Some CPU (2 CPUs), 2 threads, 1-min load average 1.5 at run "
        "start; no GPU: CPU figures, not a GPU claim"
    )
    base: dict[str, Any] = {
        "family": "Gemma3 270M",
        "model_id": "org/m:Q4",
        "payload": "resident-kv",
        "stage_load_mode": "runtime-slice",
        "use_case": None,
        "prefix_tokens": 128,
        "benchmark_prompt_token_count": 140,
        "notes": "completed",
        "skippy": {"status": "pass", "cache_hit_import_ms": [1.0], "cache_hit_decode_ms": [1.0]},
        "llama_server": {"status": "ok", "warm_median_ms": 6.0},
        "case": {"resident_kv_bytes_per_token": 18432},
        "evidence_class": evidence,
    }
    failed = {**base, "family": "Failed", "skippy": {**base["skippy"], "status": "fail"}}
    other = {**base, "family": "Other", "evidence_class": "reference-oracle evidence"}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([base, failed, other]))
    text = build_report([str(path)])
    real_line = next(line for line in text.splitlines() if line.startswith("| Gemma3 270M |"))
    assert "**3.00x faster** (CPU, see Notes)" in real_line
    assert real_line.endswith(f"| {evidence}; completed |")
    failed_line = next(line for line in text.splitlines() if line.startswith("| Failed |"))
    assert "| n/a |" in failed_line and "faster" not in failed_line
    other_line = next(line for line in text.splitlines() if line.startswith("| Other |"))
    assert other_line.endswith("| **3.00x faster** | 2.2 MiB | metadata-derived | completed |")
