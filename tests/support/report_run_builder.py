"""Builds small run directories of receipts for the run-report tests (tests only).

The receipts are the real structs of ``schemas/receipts.py`` and ``schemas/matrix.py``,
encoded by their own encoders; only their figures are chosen by the test.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from cache_family.schemas.matrix import (
    MATRIX_FILENAME,
    MatrixCatalog,
    MatrixReceipt,
    MatrixRow,
    MatrixRowResult,
    encode_matrix,
)
from cache_family.schemas.measurement import RequestRow, RungSummary, ServerTimings
from cache_family.schemas.production import ProducerRow
from cache_family.schemas.receipts import (
    ArmObservation,
    CellReceipt,
    Measurement,
    Readiness,
    RowReceipt,
    RungBrief,
    RungReceipt,
    encode_receipt,
)
from cache_family.schemas.workload_records import (
    WORKLOAD_RECEIPT_NAME,
    OpenLoopStageMeasured,
    OverlapPointReceipt,
    WorkloadReceipt,
    encode_workload_receipt,
)

RUN_ID = "run-test-0001"
SHA = "0" * 64


def requests(ttfts: Sequence[float], *, elapsed_extra: float = 100.0) -> tuple[RequestRow, ...]:
    return tuple(
        RequestRow(
            request_id=i,
            status="completed",
            elapsed_ms=t + elapsed_extra,
            ttft_ms=t,
            tpot_ms=1.0,
            tokens_predicted=16,
            timings=ServerTimings(cache_n=0 if i == 0 else 32),
        )
        for i, t in enumerate(ttfts)
    )


def rung(index: int, concurrency: int, ttfts: Sequence[float], **extra: Any) -> RungReceipt:
    ordered = sorted(ttfts)
    summary = RungSummary(
        concurrency=concurrency,
        requested_requests=len(ttfts),
        measured_requests=len(ttfts),
        makespan_seconds=1.0,
        throughput_requests_per_sec=10.0 * concurrency + 0.125,
        output_tokens_per_sec=100.0,
        goodput_requests_per_sec=9.0 * concurrency + 0.25,
        observed_completion_tokens=16 * len(ttfts),
        ttft_p50_ms=ordered[len(ordered) // 2],
        ttft_p99_ms=ordered[-1],
        tpot_p50_ms=1.0,
        tpot_p99_ms=1.5,
        complete=True,
    )
    return RungReceipt(
        rung_index=index,
        concurrency=concurrency,
        requested_requests=len(ttfts),
        status="completed",
        rows=requests(ttfts),
        rung_summary=summary,
        **extra,
    )


def serial_rung(elapsed: Sequence[float], server: Sequence[tuple[float, float]]) -> RungReceipt:
    """A serial baseline's rung: request 0 excluded, each warm request's client time and the
    server's own (``timings.prompt_ms``, ``predicted_ms``)."""
    rows = tuple(
        RequestRow(
            request_id=i,
            status="completed",
            excluded_warmup=i == 0,
            elapsed_ms=e,
            tokens_predicted=16,
            timings=ServerTimings(prompt_ms=p, predicted_ms=d, cache_n=32),
        )
        for i, (e, (p, d)) in enumerate(zip(elapsed, server, strict=True))
    )
    return RungReceipt(
        rung_index=0,
        concurrency=1,
        requested_requests=len(rows),
        status="completed",
        output_tokens=16,
        rows=rows,
    )


def cell(
    row: int, arm: str, rungs: Sequence[RungReceipt], *, synthetic: bool, kind: str | None = None
) -> CellReceipt:
    """``kind``: the measurement's (a workload cell's is its workload's); default serial for
    the serial baseline, concurrent for every other arm."""
    return CellReceipt(
        run_id=RUN_ID,
        request_sha256=SHA,
        catalog_sha256=SHA,
        cell_id=f"cell-{row:04d}/{arm}",
        row_index=row,
        row_key=f"fam{row}-p32",
        arm=arm,
        cohort="native",
        cell_dir=f"cell-{row:04d}/sweep-{arm}",
        host=None,
        status="completed",
        terminal_refusal=None,
        accepted_for_parity=True,
        faults=(),
        lifecycle=("launch", "ladder", "finalize"),
        final_state="finalize",
        readiness=Readiness(),
        before_identity=(),
        after_identity=(),
        pins_drifted=False,
        cleanup=None,
        measurement=Measurement(
            kind=kind or ("serial" if arm == "native-serial" else "concurrent"),
            complete=True,
            rungs=tuple(rungs),
        ),
        journal_through_seq=1,
        synthetic=synthetic,
    )


def write_run(
    root: Path,
    arms_per_row: Sequence[dict[str, Sequence[RungReceipt]]],
    *,
    synthetic: bool = True,
    verdicts: dict[tuple[int, str, int], Any] | None = None,
    producers: dict[int, ProducerRow] | None = None,
    statuses: dict[tuple[int, str], tuple[str, str]] | None = None,
    workloads: dict[tuple[int, str], WorkloadReceipt] | None = None,
) -> Path:
    """``producers``: a row's production entry (``row.json``'s ``producer_report_row``);
    ``statuses``: (row, arm) -> (observation status, reason) for an arm that did not
    complete; ``workloads``: (row, arm) -> the ``workload.json`` of a workload arm's cell."""
    """A run directory with one row per mapping (arm name -> its rungs)."""
    root.mkdir(parents=True)
    entries = []
    for index, arms in enumerate(arms_per_row):
        row_dir = root / f"cell-{index:04d}"
        observations = []
        for arm, rungs in arms.items():
            workload = (workloads or {}).get((index, arm))
            kind = None if workload is None else workload.kind
            receipt = cell(index, arm, rungs, synthetic=synthetic, kind=kind)
            cell_dir = root / str(receipt.cell_dir)
            cell_dir.mkdir(parents=True)
            if workload is not None:
                (cell_dir / WORKLOAD_RECEIPT_NAME).write_bytes(encode_workload_receipt(workload))
            data = encode_receipt(receipt)
            wanted = {k[2]: v for k, v in (verdicts or {}).items() if k[:2] == (index, arm)}
            if wanted:
                document = json.loads(data)
                for k, value in wanted.items():
                    document["measurement"]["rungs"][k]["cache_verdict"] = value
                data = json.dumps(document, indent=2).encode() + b"\n"
            (cell_dir / "cell.json").write_bytes(data)
            status, reason = (statuses or {}).get((index, arm), ("completed", None))
            observations.append(
                ArmObservation(
                    arm=arm,
                    planned="planned",
                    status=status,  # type: ignore[arg-type]
                    reason=reason,
                    cell_id=receipt.cell_id,
                    cell_dir=receipt.cell_dir,
                    rungs=tuple(
                        RungBrief(
                            rung_index=r.rung_index,
                            concurrency=r.concurrency,
                            status=r.status,
                            rung_summary=r.rung_summary,
                        )
                        for r in rungs
                    ),
                )
            )
        row = RowReceipt(
            run_id=RUN_ID,
            request_sha256=SHA,
            catalog_sha256=SHA,
            row_index=index,
            row_key=f"fam{index}-p32",
            case_key=f"fam{index}",
            prefix_tokens=32,
            use_case=None,
            row_dir=row_dir.name,
            model_status="present",
            status="completed",
            reason=None,
            terminal_refusal=None,
            lifecycle=("finalize",),
            final_state="finalize",
            observations=tuple(observations),
            journal_through_seq=2,
            synthetic=synthetic,
            producer_report_row=(producers or {}).get(index),
        )
        row_dir.mkdir(exist_ok=True)
        (row_dir / "row.json").write_bytes(encode_receipt(row))
        entries.append(
            MatrixRow(
                index=index,
                case=f"fam{index}",
                prefix_tokens=32,
                use_case=None,
                result=MatrixRowResult(status="completed", evidence=f"{row_dir.name}/row.json"),
                synthetic=synthetic,
            )
        )
    matrix = MatrixReceipt(
        status="completed",
        scope="test scope",
        request_sha256=SHA,
        catalog_sha256=SHA,
        planned_cells=len(entries),
        rows=tuple(entries),
        promotion=None,
        journal_through_seq=3,
        catalog=MatrixCatalog(
            path="/x/catalog.json", sha256=SHA, synthetic=synthetic, packaged=False
        ),
    )
    (root / MATRIX_FILENAME).write_bytes(encode_matrix(matrix))
    return root


def to_builtins(value: object) -> Any:
    return msgspec.to_builtins(value)


def stage(kind: str, **figures: Any) -> OpenLoopStageMeasured:
    """One open-loop stage of cell-0000's open-loop workload (Poisson unless said)."""
    figures.setdefault("pattern", "poisson")
    return OpenLoopStageMeasured(cell_id="cell-0000/native-open-loop", stage=kind, **figures)


def open_loop_receipt(
    row: int, arm: str, stages: Sequence[OpenLoopStageMeasured]
) -> WorkloadReceipt:
    return WorkloadReceipt(
        cell_id=f"cell-{row:04d}/{arm}",
        arm=arm,
        kind="open-loop",
        status="accepted",
        synthetic=True,
        architecture="llama",
        rule="exact-prefix",
        open_loop=tuple(stages),
    )


def overlap_receipt(row: int, arm: str) -> WorkloadReceipt:
    """Five overlap points, each reused as designed."""
    points = tuple(
        OverlapPointReceipt(
            hit_ratio_pct=pct,
            prompt_tokens=1024,
            shared_prefix_tokens=1024 * pct // 100,
            reusable_tokens=1024 * pct // 100,
            designed_ratio_pct=100.0 * (1024 * pct // 100) / 1024,
            achieved_ratio_pct=100.0 * (1024 * pct // 100) / 1024,
            band_pp=0.5,
            measured_requests=4,
            failed_requests=0,
            accepted=True,
            prompt_ms_p50=700.0 - 6 * pct,
        )
        for pct in (0, 30, 50, 70, 90)
    )
    return WorkloadReceipt(
        cell_id=f"cell-{row:04d}/{arm}",
        arm=arm,
        kind="prefix-overlap",
        status="accepted",
        synthetic=True,
        architecture="llama",
        rule="exact-prefix",
        overlap=points,
    )


def demo_like_stages() -> list[OpenLoopStageMeasured]:
    """A sweep as the demo's used to run it: closed-loop ends, then two rates of 24 sends
    each at offered rates that print long (300.141/s, 340.351/s), the second one stopped."""
    return [
        stage("synchronous", measured_rate_per_s=42.4, completed=24),
        stage("throughput", measured_rate_per_s=380.2, completed=24),
        stage(
            "rate",
            target_rate_per_s=300.141,
            scheduled=24,
            launched=24,
            completed=24,
            achieved_rate_per_s=225.3,
            lateness_p50_ms=0.4,
            lateness_p99_ms=2.5,
            fit_statistic="kolmogorov-smirnov",
            fit_value=0.14,
            fit_p_value=0.45,
            completed_per_s=210.0,
        ),
        stage(
            "rate",
            target_rate_per_s=340.351,
            scheduled=24,
            launched=24,
            completed=23,
            achieved_rate_per_s=330.0,
            lateness_p50_ms=0.5,
            lateness_p99_ms=3.5,
            fit_statistic="kolmogorov-smirnov",
            fit_value=0.1,
            fit_p_value=0.8,
            completed_per_s=300.0,
        ),
    ]
