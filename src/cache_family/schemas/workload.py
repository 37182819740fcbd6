"""The workload file (schema_version 1): which cache traffic a run adds to its rows.

Pinned by SHA-256 in the prepared input; an operator input without one prepares and runs exactly
as before. Strict like the operator input: every refusal of the document at once, each with a
``workload.*`` code, a JSON path and a hint.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from types import MappingProxyType
from typing import Annotated, Any, Final, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from cache_family.errors import Refusal, Refused, json_path
from cache_family.schemas.bounded import KIB, read_bounded
from cache_family.schemas.json_shape import containers
from cache_family.schemas.refusal_codes import RefusalCode

WORKLOAD_SCHEMA_VERSION: Final = 1
WORKLOAD_MAX_BYTES: Final = 64 * KIB
WORKLOAD_MAX_DEPTH: Final = 8
WORKLOAD_MAX_ENTRIES: Final = 64
#: The ratios SGLang's prefix-cache hit-rate benchmark designs (percent of the prompt).
DEFAULT_HIT_RATIOS_PCT: Final = (0, 30, 50, 70, 90)
PROMPT_TOKENS_MAX: Final = 131_072
REQUESTS_MAX: Final = 100_000
RATE_MAX_PER_S: Final = 100_000.0


def _codes(*codes: RefusalCode) -> Mapping[str, RefusalCode]:
    table = {c.code: c for c in codes}
    if len(table) != len(codes):
        raise ValueError("a workload refusal code is registered twice")
    return MappingProxyType(table)


WORKLOAD_REFUSAL_CODES: Final = _codes(
    RefusalCode(
        "workload.json.decode",
        "the workload file is not UTF-8 JSON (or repeats a member, or uses NaN/Infinity)",
        "write one UTF-8 JSON object, each member once",
    ),
    RefusalCode(
        "workload.json.shape",
        f"the document nests deeper than {WORKLOAD_MAX_DEPTH} levels or a list or object "
        f"has more than {WORKLOAD_MAX_ENTRIES} entries",
        "a workload file nests 3 levels and lists at most a few dozen values",
    ),
    RefusalCode(
        "workload.type",
        'a value has the wrong JSON type (no coercion: `"8"` is not 8)',
        "use the JSON type the workload file reference gives",
    ),
    RefusalCode(
        "workload.unknown_field",
        "a member the schema does not define",
        "remove the member or correct its spelling; unknown members are refused",
    ),
    RefusalCode("workload.missing_field", "a required member is absent", "add the member"),
    RefusalCode(
        "workload.schema_version",
        "the workload `schema_version` is not 1",
        "set schema_version to 1",
    ),
    RefusalCode(
        "workload.out_of_range", "a number is outside its allowed range", "use a value in range"
    ),
    RefusalCode(
        "workload.empty", "the file chooses no workload", "give at least one workload section"
    ),
    RefusalCode(
        "workload.overlap.requests_not_multiple",
        "prefix_overlap.requests is not a multiple of prefix_overlap.groups",
        "give every prefix group the same number of requests",
    ),
    RefusalCode(
        "workload.overlap.hit_ratios",
        "hit ratios repeat or are not ascending",
        "list each designed hit ratio once, ascending (default 0, 30, 50, 70, 90)",
    ),
    RefusalCode(
        "workload.arrivals.rates_or_sweep",
        "open_loop gives both or neither of `rates_per_s` and `sweep`",
        "give explicit target rates or a sweep, not both",
    ),
    RefusalCode(
        "workload.arrivals.duration_or_requests",
        "open_loop gives both or neither of `duration_s` and `requests`",
        "bound each rate by a duration or by a request count, not both",
    ),
    RefusalCode(
        "workload.arrivals.burstiness",
        "burstiness is given for a pattern other than gamma, or missing for gamma",
        "give burstiness (the gamma shape; 1 is Poisson) only with pattern gamma",
    ),
    RefusalCode(
        "workload.arrivals.rates",
        "target rates repeat or are not ascending",
        "list each target rate once, ascending",
    ),
    RefusalCode(
        "workload.trace.window",
        "trace gives both `first` and a time range (`from_ms`/`until_ms`), or a time range "
        "that ends before it starts",
        "replay the first N requests or a time range of the trace, not both",
    ),
    RefusalCode(
        "workload.arrivals.too_many_sends",
        f"a target rate times `duration_s` schedules more than {REQUESTS_MAX} sends",
        f"shorten duration_s or lower the rate so that each rate sends at most {REQUESTS_MAX} "
        "requests (or bound it by `requests`)",
    ),
)


def workload_hint(code: str) -> str:
    return WORKLOAD_REFUSAL_CODES[code].hint


def _fail(code: str, message: str) -> PydanticCustomError:
    return PydanticCustomError(code, "{message}", {"message": message})


@dataclass(frozen=True, slots=True)
class Between:
    """A number within ``low..=high``."""

    low: float
    high: float

    def __call__(self, value: float) -> float:
        if not self.low <= value <= self.high:
            raise _fail(
                "workload.out_of_range", f"{value!r} is outside {self.low:g}..={self.high:g}"
            )
        return value


Seed = Annotated[int, AfterValidator(Between(0, 2**63 - 1))]
Percent = Annotated[int, AfterValidator(Between(0, 99))]
Tokens = Annotated[int, AfterValidator(Between(1, PROMPT_TOKENS_MAX))]
TokensOrZero = Annotated[int, AfterValidator(Between(0, PROMPT_TOKENS_MAX))]
OutputTokens = Annotated[int, AfterValidator(Between(1, 4096))]
Count = Annotated[int, AfterValidator(Between(1, REQUESTS_MAX))]
Small = Annotated[int, AfterValidator(Between(1, 1024))]
Window = Annotated[int, AfterValidator(Between(4, REQUESTS_MAX))]
SweepPoints = Annotated[int, AfterValidator(Between(1, 64))]
# A JSON integer is a number too: strict mode still accepts 5 for a float member.
Rate = Annotated[float, AfterValidator(Between(1e-3, RATE_MAX_PER_S))]
Milliseconds = Annotated[float, AfterValidator(Between(0, 3_600_000))]
PositiveMilliseconds = Annotated[float, AfterValidator(Between(1e-3, 3_600_000))]
Share = Annotated[float, AfterValidator(Between(1e-3, 1.0))]
Shape = Annotated[float, AfterValidator(Between(1e-3, 1000.0))]
Seconds = Annotated[float, AfterValidator(Between(1e-3, 86_400))]
BlockTokens = Annotated[int, AfterValidator(Between(1, 65_536))]
TimeScale = Annotated[float, AfterValidator(Between(1e-6, 1000.0))]
TraceMilliseconds = Annotated[float, AfterValidator(Between(0, 1e12))]

_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True, hide_input_in_errors=True)


class _Strict(BaseModel):
    model_config = _STRICT


class PrefixOverlap(_Strict):
    """SGLang's generated-shared-prefix design: G prefix groups, N requests (N/G per group),
    one priming request per group, then the measured ones in a seeded order."""

    prompt_tokens: Tokens
    hit_ratios_pct: list[Percent] = list(DEFAULT_HIT_RATIOS_PCT)
    groups: Small
    requests: Count
    output_tokens: OutputTokens = 1
    seed: Seed = 0

    @model_validator(mode="after")
    def _related(self) -> Self:
        if self.requests % self.groups:
            raise _fail(
                "workload.overlap.requests_not_multiple",
                f"requests {self.requests} is not a multiple of groups {self.groups}",
            )
        if not self.hit_ratios_pct or any(b <= a for a, b in pairwise(self.hit_ratios_pct)):
            raise _fail(
                "workload.overlap.hit_ratios",
                f"hit_ratios_pct {self.hit_ratios_pct} must be non-empty and strictly ascending",
            )
        return self


class MultiTurn(_Strict):
    """U users x T turns: a shared system prompt, a per-user context, then a question and an
    answer per turn; each turn's prompt is the session so far."""

    users: Small
    turns: Small
    system_prompt_tokens: TokensOrZero = 256
    user_context_tokens: TokensOrZero = 128
    question_tokens: Tokens = 32
    answer_tokens: OutputTokens = 32
    think_time_ms: Milliseconds = 0.0
    seed: Seed = 0


class OverSaturation(_Strict):
    """When an open-loop rate stops: the queue grows without bound, or the sender itself fell
    ``max_lateness_ms`` behind its schedule. Growth, judged once the first answer has ended:
    over the last ``window`` sends the mean in-flight count rises quarter by quarter, every
    count of the last quarter is above every count of the first, the count rose by at least
    ``min_growth_per_send`` a send on average (answers lag sends by that share), and at least
    ``min_in_flight`` are in flight; or more than ``max_in_flight`` are in flight at all."""

    window: Window = 128
    min_in_flight: Count = 8
    min_growth_per_send: Share = 0.1
    max_lateness_ms: PositiveMilliseconds = 1000.0
    max_in_flight: Count = 4096


class RateSweep(_Strict):
    """GuideLLM's sweep: one request at a time, then as fast as possible, then ``points``
    rates evenly between the two measured rates."""

    points: SweepPoints
    # The as-fast-as-possible stage: this many requests in flight at once, closed loop.
    throughput_concurrency: Small = 64


class OpenLoop(_Strict):
    """Requests sent on a drawn schedule whether or not earlier ones have finished."""

    pattern: Literal["constant", "poisson", "gamma"]
    burstiness: Shape | None = None
    rates_per_s: list[Rate] | None = None
    sweep: RateSweep | None = None
    duration_s: Seconds | None = None
    requests: Count | None = None
    output_tokens: OutputTokens = 16
    seed: Seed = 0
    over_saturation: OverSaturation = OverSaturation()

    @model_validator(mode="after")
    def _related(self) -> Self:
        if (self.rates_per_s is None) == (self.sweep is None):
            raise _fail(
                "workload.arrivals.rates_or_sweep", "give exactly one of rates_per_s and sweep"
            )
        if (self.duration_s is None) == (self.requests is None):
            raise _fail(
                "workload.arrivals.duration_or_requests",
                "give exactly one of duration_s and requests",
            )
        if (self.burstiness is not None) != (self.pattern == "gamma"):
            raise _fail(
                "workload.arrivals.burstiness",
                f"pattern {self.pattern} "
                + ("needs a burstiness" if self.pattern == "gamma" else "takes no burstiness"),
            )
        rates = self.rates_per_s
        if rates is not None and (not rates or any(b <= a for a, b in pairwise(rates))):
            raise _fail(
                "workload.arrivals.rates",
                f"rates_per_s {rates} must be non-empty and strictly ascending",
            )
        # Checked here, before a run holds a host: a day at 100,000/s is 8.64e9 sends.
        if rates is not None and self.duration_s is not None:
            sends = max(rates) * self.duration_s
            if sends > REQUESTS_MAX:
                raise _fail(
                    "workload.arrivals.too_many_sends",
                    f"rate {max(rates):g}/s for duration_s {self.duration_s:g} schedules "
                    f"{sends:.3g} sends, more than {REQUESTS_MAX}",
                )
        return self


def _sha256_hex(value: str) -> str:
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise _fail("workload.type", "sha256 is not 64 lowercase hex characters")
    return value


class TraceReplay(_Strict):
    """A recorded trace replayed open-loop on its own timestamps (``states/trace.py``): the
    file (absolute; preparation pins its SHA-256 here when not given, and the run refuses
    other bytes), its format and the block size its hash ids were written with, a window
    (the ``first`` requests, or ``from_ms``..<``until_ms``; neither: the whole trace) and
    the scaling: ``tokens_per_block`` tokens a block, replay seconds = trace seconds x
    ``time_scale``, each answer capped at ``output_tokens_cap``. ``lru_capacity_tokens``:
    the cache size the LRU design assumes (default: the host's slots x slot context)."""

    path: str
    sha256: Annotated[str, AfterValidator(_sha256_hex)] | None = None
    format: Literal["mooncake"] = "mooncake"
    block_tokens: BlockTokens = 512
    first: Count | None = None
    from_ms: TraceMilliseconds | None = None
    until_ms: TraceMilliseconds | None = None
    tokens_per_block: BlockTokens = 16
    time_scale: TimeScale = 1.0
    output_tokens_cap: OutputTokens = 16
    lru_capacity_tokens: Annotated[int, AfterValidator(Between(1, 2**40))] | None = None
    over_saturation: OverSaturation = OverSaturation()

    @model_validator(mode="after")
    def _related(self) -> Self:
        ranged = self.from_ms is not None or self.until_ms is not None
        if self.first is not None and ranged:
            raise _fail("workload.trace.window", "give `first` or a time range, not both")
        if (
            self.from_ms is not None
            and self.until_ms is not None
            and not self.from_ms < self.until_ms
        ):
            raise _fail(
                "workload.trace.window",
                f"until_ms {self.until_ms:g} is not after from_ms {self.from_ms:g}",
            )
        return self


class SchemaVersion:
    def __call__(self, value: int) -> int:
        if value != WORKLOAD_SCHEMA_VERSION:
            raise _fail(
                "workload.schema_version",
                f"schema_version {value} is not {WORKLOAD_SCHEMA_VERSION}",
            )
        return value


class WorkloadFile(_Strict):
    """The whole workload file; at least one workload section."""

    schema_version: Annotated[int, AfterValidator(SchemaVersion())]
    prefix_overlap: PrefixOverlap | None = None
    multi_turn: MultiTurn | None = None
    open_loop: OpenLoop | None = None
    trace: TraceReplay | None = None

    @model_validator(mode="after")
    def _chooses_one(self) -> Self:
        chosen = (self.prefix_overlap, self.multi_turn, self.open_loop, self.trace)
        if all(section is None for section in chosen):
            raise _fail(
                "workload.empty",
                "choose prefix_overlap, multi_turn, open_loop or trace (or several)",
            )
        return self

    @model_serializer(mode="wrap")
    def _without_absent_trace(self, handler: SerializerFunctionWrapHandler) -> Any:
        # A file without a trace pins to the same bytes as before the section existed.
        data = handler(self)
        if isinstance(data, dict) and self.trace is None:
            data.pop("trace", None)
        return data


class WorkloadsPin(_Strict):
    """What the prepared input records of a workload file: where it was, the SHA-256 of the
    exact bytes read, and what they said (the run never reads the file again)."""

    path: str
    sha256: Annotated[str, AfterValidator(_sha256_hex)]
    workloads: WorkloadFile
    # The distinct hash ids of the trace's window, counted as preparation pinned the trace:
    # what a chat dialect's replay draws first characters for, known to the plan without
    # reading the trace (None: no trace, or pinned before the count was kept).
    trace_distinct_ids: Annotated[int, AfterValidator(Between(1, 2**40))] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_count(self, handler: SerializerFunctionWrapHandler) -> Any:
        # A pin without the count encodes to the same bytes as before the member existed.
        data = handler(self)
        if isinstance(data, dict) and self.trace_distinct_ids is None:
            data.pop("trace_distinct_ids", None)
        return data


# --- decoding ----------------------------------------------------------------------------------

_EXPECTED: Final = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "a boolean",
    "list_type": "an array",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "literal_error": "one of the listed values",
}


def _refusal(code: str, loc: Sequence[str | int], message: str) -> Refusal:
    return Refusal(code, json_path(loc), message, workload_hint(code))


def _translate(error: ErrorDetails) -> Refusal:
    kind = error["type"]
    loc = tuple(p for p in error["loc"] if isinstance(p, str | int))
    ctx: Mapping[str, Any] = error.get("ctx") or {}
    name = str(loc[-1]) if loc else "document"
    if kind in WORKLOAD_REFUSAL_CODES:  # raised by a rule above
        return _refusal(kind, loc, str(ctx.get("message", error["msg"])))
    if kind == "missing":
        return _refusal("workload.missing_field", loc, f"required member {name!r} is missing")
    if kind == "extra_forbidden":
        return _refusal("workload.unknown_field", loc, f"unknown member {name!r}")
    expected = _EXPECTED.get(kind)
    what = f"expected {expected}" if expected else error["msg"]
    return _refusal("workload.type", loc, what)


def validate_workload_object(obj: object) -> WorkloadFile:
    """Validate decoded JSON; raise :class:`Refused` with every refusal found."""
    if not isinstance(obj, dict):
        raise Refused((_refusal("workload.type", (), "the workload file is not an object"),))
    for node, loc, depth in containers(
        obj, (), max_depth=WORKLOAD_MAX_DEPTH, max_entries=WORKLOAD_MAX_ENTRIES
    ):
        if depth > WORKLOAD_MAX_DEPTH or len(node) > WORKLOAD_MAX_ENTRIES:
            raise Refused((_refusal("workload.json.shape", loc, "too deep or too long here"),))
    try:
        return WorkloadFile.model_validate(obj, strict=True)
    except ValidationError as exc:
        found = [_translate(error) for error in exc.errors()]
        raise Refused(tuple(dict.fromkeys(found))) from None


def _members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError("a member name is repeated in one object")
    return dict(pairs)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def validate_workload_document(data: bytes) -> WorkloadFile:
    """Decode strict UTF-8 JSON bytes (each member once, no NaN) and validate them."""
    try:
        obj = json.loads(
            data.decode("utf-8"), object_pairs_hook=_members, parse_constant=_no_constant
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Refused(
            (_refusal("workload.json.decode", (), f"the workload file is not strict JSON: {exc}"),)
        ) from None
    return validate_workload_object(obj)


def read_workload_file(path: str) -> WorkloadsPin:
    """Read a workload file (absolute, regular, bounded) and pin the bytes that were parsed."""
    raw = read_bounded(path, WORKLOAD_MAX_BYTES, what="workload file", json_path="$.workloads")
    return WorkloadsPin(
        path=raw.path, sha256=raw.sha256, workloads=validate_workload_document(raw.data)
    )


__all__ = [
    "DEFAULT_HIT_RATIOS_PCT",
    "WORKLOAD_REFUSAL_CODES",
    "WORKLOAD_SCHEMA_VERSION",
    "MultiTurn",
    "OpenLoop",
    "OverSaturation",
    "PrefixOverlap",
    "RateSweep",
    "TraceReplay",
    "WorkloadFile",
    "WorkloadsPin",
    "read_workload_file",
    "validate_workload_document",
    "validate_workload_object",
]
