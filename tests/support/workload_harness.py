"""Helpers of the workload tests that run the FAKE host (``tests/run``, ``tests/campaign``)."""

from __future__ import annotations

from pathlib import Path

from run_harness import make_prepared

from cache_family.schemas.prepared import encode_document, load_prepared_input
from cache_family.schemas.workload import WorkloadsPin, validate_workload_object
from cache_family.schemas.workload_records import WorkloadReceipt, decode_workload_receipt


def prepared_with(
    root: Path,
    *,
    keys: tuple[str, ...] = ("qwen3_dense",),
    plan: dict[str, object] | None = None,
    top: dict[str, object] | None = None,
    **workloads: object,
) -> Path:
    """The FAKE run's prepared input (``run_harness.make_prepared``), pinning a workload file
    that chooses ``workloads`` (the run never reads the file again: only the pin)."""
    path = make_prepared(root, keys=keys, top=top, **(plan or {}))
    prepared = load_prepared_input(str(path))
    chosen = validate_workload_object({"schema_version": 1, **workloads})
    pin = WorkloadsPin(path=str(root / "workloads.json"), sha256="a" * 64, workloads=chosen)
    path.write_bytes(encode_document(prepared.model_copy(update={"workloads": pin})))
    return path


def workload(out: Path, arm: str, row: int = 0) -> WorkloadReceipt:
    """The ``workload.json`` of the workload arm ``arm`` of row ``row``."""
    path = out / f"cell-{row:04d}" / f"workload-{arm}" / "workload.json"
    return decode_workload_receipt(path.read_bytes())
