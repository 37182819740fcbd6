"""``cache-family-matrix.json``: the run's receipt, one entry per planned row.

A synthetic catalog marks every row ``synthetic`` and adds the synthetic evidence class to
``scope``: such figures are never performance claims. Every member is written, null included
(only a row's ``result`` leaves out what its kind does not use); new fields get defaults and go
last.
"""

from __future__ import annotations

from typing import Final

import msgspec

from cache_family.schemas.measurement import ClientCalibration
from cache_family.schemas.receipts import SYNTHETIC_EVIDENCE_CLASS

MATRIX_SCHEMA_VERSION: Final = 1
MATRIX_FILENAME: Final = "cache-family-matrix.json"
MATRIX_SCOPE: Final = (
    "every present row: the correctness arm on each planned topology, the native arms "
    "(serial baseline and concurrent ladder) against llama-server and, when both are bound, "
    "the old and new stage servers with per-rung parity; pins describe observed local bytes, "
    "not build attestation"
)
MATRIX_SCOPE_SYNTHETIC: Final = (
    f"{MATRIX_SCOPE}; rows marked synthetic are evidence of class '{SYNTHETIC_EVIDENCE_CLASS}'"
)
PIPELINE_FAILED: Final = "owned_plan_or_matrix_execution_refused"


class MatrixRowResult(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    status: str
    evidence: str | None = None  # row.json, relative to the run directory
    launched: bool | None = None  # present only for rows kept without launch
    reason: str | None = None


class MatrixRow(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    case: str
    prefix_tokens: int | None
    use_case: str | None
    result: MatrixRowResult
    synthetic: bool = False


class MatrixCatalog(msgspec.Struct, frozen=True, kw_only=True):
    """The catalog that planned the rows, as ``run_started`` recorded it."""

    path: str
    sha256: str
    synthetic: bool
    packaged: bool


class MatrixReceipt(msgspec.Struct, frozen=True, kw_only=True):
    schema_version: int = MATRIX_SCHEMA_VERSION
    status: str
    scope: str
    request_sha256: str
    catalog_sha256: str
    planned_cells: int
    rows: tuple[MatrixRow, ...]
    promotion: None
    terminal_refusal: str | None = None
    journal_through_seq: int | None = None
    catalog: MatrixCatalog | None = None
    # The run's report files, relative to the run directory (None when not written), and why
    # they were not (None when they were).
    report_error: str | None = None
    report: str | None = None
    report_input: str | None = None
    # The run's own client overhead on this machine, timed against the calibration server
    # before the first ladder (None, with the reason, when it could not be measured).
    client_calibration: ClientCalibration | None = None
    client_calibration_error: str | None = None


class FailedMatrix(msgspec.Struct, frozen=True, kw_only=True):
    """The matrix when the pipeline itself failed (journal unwritable, a bug)."""

    schema_version: int = MATRIX_SCHEMA_VERSION
    status: str = "failed"
    reason: str = PIPELINE_FAILED
    detail: str = ""
    request_sha256: str


_ENCODER: Final = msgspec.json.Encoder(order="deterministic")
_DECODER: Final = msgspec.json.Decoder(MatrixReceipt)


def encode_matrix(receipt: MatrixReceipt | FailedMatrix) -> bytes:
    return msgspec.json.format(_ENCODER.encode(receipt), indent=2) + b"\n"


def decode_matrix(data: bytes) -> MatrixReceipt:
    return _DECODER.decode(data)
