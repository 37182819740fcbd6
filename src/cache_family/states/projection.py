"""The native projection: a row's ``production-cache-bench.json`` entry from its receipt.

``skippy`` carries the first topology's figures only when the correctness arm completed (else
unmeasured), and the prompt text is never copied; ``llama_server`` the native serial summary's
warm mean and median.
"""

from __future__ import annotations

from cache_family.schemas.arms import NATIVE_SERIAL
from cache_family.schemas.journal import PlannedRowBrief, RunStarted
from cache_family.schemas.production import (
    NOTES_COMPLETED,
    NOTES_INCOMPLETE,
    Figure,
    ProducerRow,
)
from cache_family.schemas.receipts import RowReceipt, evidence_class

SERIAL_ARM = NATIVE_SERIAL.name
UNMEASURED: dict[str, Figure] = {"status": "unmeasured"}


def planned_row(run: RunStarted | None, row_index: int) -> PlannedRowBrief | None:
    """The row's brief as ``run_started`` planned it, if the journal has one."""
    if run is None:
        return None
    return next((brief for brief in run.planned_rows if brief.index == row_index), None)


def _skippy(receipt: RowReceipt | None) -> dict[str, Figure]:
    correctness = receipt.correctness if receipt is not None else None
    if correctness is None or correctness.status != "completed" or not correctness.topologies:
        return dict(UNMEASURED)
    first = correctness.topologies[0]
    return {
        "status": "pass",
        "cache_storage_bytes": first.cache_storage_bytes,
        "cache_hit_import_ms": first.cache_hit_import_ms or None,
        "cache_hit_decode_ms": first.cache_hit_decode_ms or None,
        "cache_hit_total_ms": first.cache_hit_total_ms,
        "recompute_total_ms": first.recompute_total_ms,
    }


def _llama_server(receipt: RowReceipt | None) -> dict[str, Figure]:
    observations = receipt.observations if receipt is not None else ()
    serial = next((o for o in observations if o.arm == SERIAL_ARM), None)
    if serial is None:
        return dict(UNMEASURED)
    if serial.status != "completed":
        return {"status": serial.status, "reason": serial.reason}
    summary = next((r.serial_summary for r in serial.rungs if r.serial_summary), None)
    return {
        "status": "ok",
        "warm_mean_ms": summary.warm_mean_ms if summary else None,
        "warm_median_ms": summary.warm_median_ms if summary else None,
    }


def project_row(
    brief: PlannedRowBrief | None,
    receipt: RowReceipt | None,
    *,
    synthetic: bool,
    real_evidence: str | None = None,
) -> ProducerRow:
    """The entry of one planned row; ``receipt`` None for a row that was never launched."""
    launched = receipt if receipt is not None and receipt.row_dir else None
    correctness = launched.correctness if launched is not None else None
    prompt_tokens = (
        correctness.topologies[0].benchmark_prompt_token_count
        if correctness is not None and correctness.topologies
        else None
    )
    completed = launched is not None and launched.status == "completed"
    prefix = brief.prefix_tokens if brief else receipt.prefix_tokens if receipt else None
    use_case = brief.use_case if brief else receipt.use_case if receipt else None
    return ProducerRow(
        family=brief.family if brief else "",
        model_id=brief.model_id if brief else "",
        payload=brief.payload if brief else "",
        stage_load_mode=brief.stage_load_mode if brief else "",
        use_case=use_case,
        use_case_label=brief.use_case_label if brief and use_case else None,
        prefix_tokens=prefix,
        benchmark_prompt_token_count=prompt_tokens,
        notes=NOTES_COMPLETED if completed else NOTES_INCOMPLETE,
        case={"resident_kv_bytes_per_token": brief.resident_kv_bytes_per_token if brief else None},
        skippy=_skippy(launched),
        llama_server=_llama_server(launched),
        synthetic=True if synthetic else None,
        evidence_class=evidence_class(synthetic) or real_evidence,
    )
