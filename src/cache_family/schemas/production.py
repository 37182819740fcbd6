"""``production-cache-bench.json``: one row per planned row, in the native producer's schema.

The members are exactly the reference's native projection, so the combined report reads our rows
as the reference's; a synthetic row also carries ``synthetic`` and its evidence class. The
prompt text is never part of a row.
"""

from __future__ import annotations

from typing import Final, TypeAlias

import msgspec

from cache_family.schemas.bounded import MIB

PRODUCTION_JSON: Final = "production-cache-bench.json"
PRODUCTION_MD: Final = "production-cache-bench.md"
PRODUCTION_MAX_BYTES: Final = 16 * MIB

NOTES_COMPLETED: Final = (
    "Native owned producer observations; supplied source/build provenance, no automatic promotion"
)
NOTES_INCOMPLETE: Final = (
    "Incomplete/unmeasured producer row; see typed cell evidence; no promotion"
)

Figure: TypeAlias = str | int | float | tuple[float, ...] | None


class ProducerRow(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    # Required members are always written (null included); only the synthetic label is left
    # out when it does not apply.
    family: str
    model_id: str
    payload: str
    stage_load_mode: str
    use_case: str | None
    use_case_label: str | None
    prefix_tokens: int | None
    benchmark_prompt_token_count: int | None
    notes: str
    case: dict[str, int | None]
    skippy: dict[str, Figure]
    llama_server: dict[str, Figure]
    synthetic: bool | None = None
    evidence_class: str | None = None


_ENCODER: Final = msgspec.json.Encoder(order="deterministic")


def encode_production(rows: tuple[ProducerRow, ...]) -> bytes:
    return msgspec.json.format(_ENCODER.encode(rows), indent=2)
