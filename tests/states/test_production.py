"""``production-cache-bench.{json,md}`` and ``row.json``'s ``producer_report_row``: the native
projection (producer B) from constructed row receipts, one row per planned row, and the
in-run producer variant of the reference renderer."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import trio
from cell_journal_builder import row_records

from cache_family.actors.journal.writer import JournalWriter, journal_path
from cache_family.actors.run.matrix import finish_run
from cache_family.actors.run.report_files import production_md
from cache_family.report import build_report
from cache_family.report.decode import Refusals
from cache_family.report.producer import producer_sources, render_producer_report
from cache_family.report.render import render_report
from cache_family.report.rows import ReportRow, read_rows, rows_from_bytes
from cache_family.schemas.journal import (
    ArmPlan,
    PlannedRowBrief,
    ReceiptPublished,
    RunStarted,
    UseCaseSourceBrief,
    read_journal,
)
from cache_family.schemas.matrix import MATRIX_FILENAME
from cache_family.schemas.measurement import SerialSummary
from cache_family.schemas.production import (
    NOTES_COMPLETED,
    NOTES_INCOMPLETE,
    PRODUCTION_JSON,
    PRODUCTION_MD,
    encode_production,
)
from cache_family.schemas.receipts import (
    SYNTHETIC_EVIDENCE_CLASS,
    ArmObservation,
    CorrectnessObservation,
    CorrectnessTopology,
    RowReceipt,
    RungBrief,
)
from cache_family.states.fold import JournalIndex
from cache_family.states.projection import project_row

# Producer B's allowlist, in its order.
ALLOWLIST = [
    "family",
    "model_id",
    "payload",
    "stage_load_mode",
    "use_case",
    "use_case_label",
    "prefix_tokens",
    "benchmark_prompt_token_count",
    "notes",
    "case",
    "skippy",
    "llama_server",
]
SKIPPY_FIGURES = [
    "status",
    "cache_storage_bytes",
    "cache_hit_import_ms",
    "cache_hit_decode_ms",
    "cache_hit_total_ms",
    "recompute_total_ms",
]


def brief(index: int = 0, **overrides: object) -> PlannedRowBrief:
    fields: dict[str, object] = {
        "index": index,
        "case": "llama",
        "prefix_tokens": 128,
        "use_case": None,
        "model_status": "present",
        "output_relative": "llama-p128",
        "family": "Llama",
        "model_id": "meta/Llama:Q8_0",
        "payload": "resident-kv",
        "stage_load_mode": "runtime-slice",
        "resident_kv_bytes_per_token": 4096,
    }
    fields.update(overrides)
    return msgspec.convert(fields, PlannedRowBrief)


def topology(**overrides: object) -> CorrectnessTopology:
    fields: dict[str, object] = {
        "topology": "one-stage",
        "status": "pass",
        "evidence_dir": "cell-0000/correctness/topology-00",
        "cache_storage_bytes": 65536,
        "cache_hit_import_ms": (1.0, 2.0),
        "cache_hit_decode_ms": (3.0, 4.0),
        "cache_hit_total_ms": 5.0,
        "recompute_total_ms": 40.0,
        "benchmark_prompt_token_count": 129,
    }
    fields.update(overrides)
    return msgspec.convert(fields, CorrectnessTopology)


def serial(status: str = "completed", reason: str | None = None) -> ArmObservation:
    summary = SerialSummary(
        warm_mean_ms=10.5, warm_median_ms=10.0, excluded_runs=1, warm_requests=2, complete=True
    )
    rungs = (
        (RungBrief(rung_index=0, concurrency=1, status="completed", serial_summary=summary),)
        if status == "completed"
        else ()
    )
    return ArmObservation(
        arm="native-serial", planned="planned", status=status, reason=reason, rungs=rungs
    )  # type: ignore[arg-type]


def receipt(
    *,
    status: str = "completed",
    correctness: CorrectnessObservation,
    observations: tuple[ArmObservation, ...],
    row_dir: str = "cell-0000",
) -> RowReceipt:
    return msgspec.convert(
        {
            "run_id": "run-test",
            "request_sha256": "1" * 64,
            "catalog_sha256": "2" * 64,
            "row_index": 0,
            "row_key": "llama-p128",
            "case_key": "llama",
            "prefix_tokens": 128,
            "use_case": None,
            "row_dir": row_dir,
            "model_status": "present",
            "status": status,
            "reason": None if status == "completed" else "correctness_failed",
            "terminal_refusal": None,
            "lifecycle": ["correctness", "finalize"],
            "final_state": "finalize",
            "observations": [msgspec.to_builtins(o) for o in observations],
            "journal_through_seq": 9,
            "correctness": msgspec.to_builtins(correctness),
        },
        RowReceipt,
    )


def published(row: object) -> dict[str, object]:
    [value] = json.loads(encode_production((row,)))  # type: ignore[arg-type]
    assert isinstance(value, dict)
    return value


def test_a_completed_row_projects_the_first_topology_and_the_serial_summary() -> None:
    passed = CorrectnessObservation(
        status="completed",
        planned_topologies=("one-stage", "split-stage0"),
        topologies=(topology(), topology(topology="split-stage0", cache_storage_bytes=1)),
        prompt_sha256="a" * 64,
    )
    row = published(
        project_row(brief(), receipt(correctness=passed, observations=(serial(),)), synthetic=False)
    )
    assert list(row) == ALLOWLIST
    assert row["notes"] == NOTES_COMPLETED
    assert row["benchmark_prompt_token_count"] == 129
    assert row["case"] == {"resident_kv_bytes_per_token": 4096}
    skippy = row["skippy"]
    assert isinstance(skippy, dict) and sorted(skippy) == sorted(SKIPPY_FIGURES)
    assert skippy == {
        "status": "pass",
        "cache_storage_bytes": 65536,
        "cache_hit_import_ms": [1.0, 2.0],
        "cache_hit_decode_ms": [3.0, 4.0],
        "cache_hit_total_ms": 5.0,
        "recompute_total_ms": 40.0,
    }
    assert row["llama_server"] == {"status": "ok", "warm_mean_ms": 10.5, "warm_median_ms": 10.0}
    # No prompt text, hash or path leaks into a report row.
    assert "a" * 64 not in json.dumps(row) and "topology-00" not in json.dumps(row)


def test_a_failed_correctness_row_is_unmeasured_and_its_baseline_keeps_its_reason() -> None:
    failed = CorrectnessObservation(
        status="failed-or-incomplete",
        reason="state-handoff report refused: cache_hit_matches false",
        topologies=(topology(status="refused", cache_hit_total_ms=None),),
    )
    skipped = serial("skipped", "correctness did not pass")
    row = published(
        project_row(
            brief(),
            receipt(status="failed", correctness=failed, observations=(skipped,)),
            synthetic=False,
        )
    )
    assert list(row) == ALLOWLIST
    assert row["skippy"] == {"status": "unmeasured"}
    assert row["llama_server"] == {"status": "skipped", "reason": "correctness did not pass"}
    assert row["notes"] == NOTES_INCOMPLETE
    # The prompt token count comes from the first topology's evidence, passed or not.
    assert row["benchmark_prompt_token_count"] == 129


@pytest.mark.parametrize("model_status", ["missing-model", "not-launched"])
def test_rows_never_launched_are_unmeasured_with_nulls(model_status: str) -> None:
    row = published(project_row(brief(model_status=model_status), None, synthetic=False))
    assert list(row) == ALLOWLIST
    assert row["skippy"] == {"status": "unmeasured"}
    assert row["llama_server"] == {"status": "unmeasured"}
    assert row["benchmark_prompt_token_count"] is None and row["use_case"] is None
    assert row["notes"] == NOTES_INCOMPLETE


def test_a_package_only_row_reports_its_unavailable_baseline_and_lands_in_the_package_table(
    tmp_path: Path,
) -> None:
    passed = CorrectnessObservation(
        status="completed", planned_topologies=("package-stage1",), topologies=(topology(),)
    )
    unavailable = ArmObservation(
        arm="native-serial",
        planned="unavailable",
        status="unavailable",
        reason="package-only model: no full GGUF, so no monolithic baseline",
    )
    package = brief(
        case="deepseek3",
        family="DeepSeek3",
        model_id="deepseek/DeepSeek-V3:Q4",
        stage_load_mode="layer-package",
        resident_kv_bytes_per_token=None,
    )
    row = published(
        project_row(
            package,
            receipt(status="completed", correctness=passed, observations=(unavailable,)),
            synthetic=False,
        )
    )
    assert list(row) == ALLOWLIST
    assert row["llama_server"] == {
        "status": "unavailable",
        "reason": "package-only model: no full GGUF, so no monolithic baseline",
    }
    assert row["stage_load_mode"] == "layer-package"
    path = tmp_path / PRODUCTION_JSON
    path.write_text(json.dumps([row]))
    text = build_report([str(path)])
    package_table = text.split("### Package-Only Giant Models")[1]
    assert "| DeepSeek3 | `deepseek/DeepSeek-V3:Q4` | `ResidentKv` | pass |" in package_table
    assert "Skippy stage recompute" in package_table


def test_a_synthetic_row_carries_the_label_the_report_shows_as_plumbing() -> None:
    projected = project_row(brief(), None, synthetic=True)
    row = published(projected)
    assert list(row) == [*ALLOWLIST, "synthetic", "evidence_class"]
    assert row["synthetic"] is True and row["evidence_class"] == SYNTHETIC_EVIDENCE_CLASS
    rows = read_rows_of(encode_production((projected,)))
    assert rows[0].plumbing


def read_rows_of(data: bytes) -> list[ReportRow]:
    refusals = Refusals()
    rows = rows_from_bytes(PRODUCTION_JSON, data, refusals)
    refusals.raise_any()
    return rows


def test_the_md_is_the_renderers_producer_variant_of_the_json(tmp_path: Path) -> None:
    briefs = (
        brief(0),
        brief(
            1,
            use_case="text_to_sql",
            use_case_label="Text-to-SQL",
            use_case_source=UseCaseSourceBrief(
                dataset="gretelai/synthetic_text_to_sql", config="default", split="test", row_idx=0
            ),
        ),
    )
    data = encode_production(tuple(project_row(b, None, synthetic=False) for b in briefs))
    path = tmp_path / PRODUCTION_JSON
    path.write_bytes(data)
    refusals = Refusals()
    rows = read_rows([str(path)], refusals)
    expected = render_report(rows, producer_sources(briefs), "", refusals, producer=True)
    text = render_producer_report(data, briefs).decode()
    assert text == expected
    assert "each row's owning plan and profile" in text
    assert "owning plan's selected corpus" in text and "checked in at" not in text
    assert "| Text-to-SQL | `gretelai/synthetic_text_to_sql` | `default` | `test` | 0 |" in text
    # The combined report's wording differs exactly in those lines.
    combined = render_report(rows, producer_sources(briefs), "corpus.json", refusals)
    changed = [a for a, b in zip(text.splitlines(), combined.splitlines(), strict=True) if a != b]
    assert len(changed) == 3


def test_a_run_publishes_both_files_one_row_per_planned_row_and_the_matrix_names_them(
    tmp_path: Path,
) -> None:
    """Two planned rows, one journaled with its model missing and one never reached: both
    files are published, each row unmeasured, and the matrix carries the report members."""

    async def main() -> None:
        writer = JournalWriter(journal_path(str(tmp_path)))
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            await writer.append(
                RunStarted(
                    run_id="run-test",
                    request_sha256="1" * 64,
                    catalog_sha256="2" * 64,
                    planned_rows=(brief(0, model_status="missing-model"), brief(1)),
                )
            )
            await writer.append(
                row_records(0, [ArmPlan(arm="native-serial")], model_status="missing-model")
            )
            await finish_run(writer, str(tmp_path))
            await writer.aclose()

    trio.run(main)
    rows = json.loads((tmp_path / PRODUCTION_JSON).read_bytes())
    assert [list(row) for row in rows] == [ALLOWLIST, ALLOWLIST]
    assert [row["skippy"] for row in rows] == [{"status": "unmeasured"}] * 2
    assert not (tmp_path / PRODUCTION_JSON).read_bytes().endswith(b"\n")
    matrix = json.loads((tmp_path / MATRIX_FILENAME).read_bytes())
    assert matrix["schema_version"] == 1
    assert matrix["report"] == PRODUCTION_MD and matrix["report_input"] == PRODUCTION_JSON
    assert matrix["report_error"] is None
    assert matrix["terminal_refusal"] is None  # written as null, never dropped
    read = read_journal((tmp_path / "journal.jsonl").read_bytes())
    [md] = [
        line.record
        for line in read.lines
        if isinstance(line.record, ReceiptPublished) and line.record.path == PRODUCTION_MD
    ]
    index = JournalIndex(read.lines)
    assert (tmp_path / PRODUCTION_MD).read_bytes() == production_md(index, md.through_seq)
