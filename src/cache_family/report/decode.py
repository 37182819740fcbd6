"""Lenient, typed reading of JSON values for the report's inputs.

Missing members take defaults and unknown members are ignored, so rich rows from other
producers parse; a member that is present must have the documented type. Every problem is
collected as a refusal naming the file and the JSON path, up to a cap.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from typing import Any, Final

from cache_family.errors import Refusal, Refused, json_path
from cache_family.schemas.bounded import read_bounded
from cache_family.schemas.refusal_codes import report_hint

#: Integers are unsigned 64-bit in the reference's rows.
U64_MAX: Final = 2**64 - 1
#: A broken file can hold a refusal per row; the first ones say what to fix.
LISTED_REFUSALS: Final = 32

Where = Sequence[str | int]


class _Members(dict[str, Any]):
    """A JSON object that remembers which member names it saw more than once."""

    __slots__ = ("repeated",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        seen: set[str] = set()
        repeated: set[str] = set()
        for name, _ in pairs:
            (repeated if name in seen else seen).add(name)
        self.repeated = frozenset(repeated)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Repeats are rare: only an object that has one pays for remembering them.
    plain = dict(pairs)
    return plain if len(plain) == len(pairs) else _Members(pairs)


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class _NotANumber(ValueError):
    """NaN, Infinity or -Infinity where a document must hold only JSON numbers."""


def _no_constant(name: str) -> object:
    raise _NotANumber(name)


class Reader:
    """Reads one file's values and collects its refusals (``file`` names it in each).

    ``finite`` refuses NaN, Infinity and -Infinity anywhere in the file (they are not JSON,
    and no receipt the run writes holds one); without it they are read as floats, so a
    producer's row refuses them at the timing that holds one, with its path.
    """

    def __init__(self, file: str, *, what: str, sink: Refusals, finite: bool = False) -> None:
        self.file = file
        self.what = what
        self.sink = sink
        self.finite = finite

    def refuse(self, code: str, where: Where, message: str) -> None:
        self.sink.add(Refusal(code, json_path(where), f"{self.file}: {message}", report_hint(code)))

    def load(self, limit: int) -> tuple[bool, Any]:
        """``(True, value)``, or ``(False, None)`` after a refusal; bounded, UTF-8 JSON."""
        try:
            raw = read_bounded(self.file, limit, what=self.what)
        except Refused as refused:
            for refusal in refused.refusals:
                self.sink.add(refusal)
            return False, None
        return self.parse(raw.data)

    def parse(self, data: bytes) -> tuple[bool, Any]:
        """``(True, value)`` of UTF-8 JSON bytes, or ``(False, None)`` after a refusal."""
        constant = _no_constant if self.finite else None
        try:
            text = data.decode("utf-8")
            return True, json.loads(text, object_pairs_hook=_object, parse_constant=constant)
        except UnicodeDecodeError as exc:
            self.refuse("report.json", [], f"{self.what} is not UTF-8 (byte {exc.start})")
        except json.JSONDecodeError as exc:
            self.refuse(
                "report.json",
                [],
                f"{self.what} is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            )
        except RecursionError:
            self.refuse("report.json", [], f"{self.what} nests too deeply")
        except _NotANumber as exc:
            self.refuse("report.json", [], f"{self.what} holds {exc}, which is not a JSON number")
        except ValueError:
            # The one other ValueError of the parser: an integer literal longer than the
            # interpreter converts (CPython's guard against quadratic int parsing).
            self.refuse(
                "report.json",
                [],
                f"{self.what} holds an integer literal of more than "
                f"{sys.get_int_max_str_digits()} digits",
            )
        return False, None

    def member(self, obj: dict[str, Any], name: str, where: Where) -> tuple[bool, Any]:
        """``(present, value)`` of a member; a repeated member is refused."""
        if name not in obj:
            return False, None
        if isinstance(obj, _Members) and name in obj.repeated:
            self.refuse("report.duplicate_field", [*where, name], f"member {name!r} appears twice")
        return True, obj[name]

    def wrong(self, where: Where, expected: str, value: object) -> None:
        """Refuse a value of the wrong JSON type."""
        self.refuse("report.type", where, f"expected {expected}, got {_kind(value)}")

    def obj(self, obj: dict[str, Any], name: str, where: Where) -> dict[str, Any]:
        """An object member: missing is empty; null or another type is refused."""
        present, value = self.member(obj, name, where)
        if not present:
            return {}
        if isinstance(value, dict):
            return value
        self.wrong([*where, name], "an object", value)
        return {}

    def text(self, obj: dict[str, Any], name: str, where: Where) -> str:
        """A plain string member: missing is ""; null is refused."""
        present, value = self.member(obj, name, where)
        if not present:
            return ""
        return self._string([*where, name], value) or ""

    def opt_text(self, obj: dict[str, Any], name: str, where: Where) -> str | None:
        present, value = self.member(obj, name, where)
        if not present or value is None:
            return None
        return self._string([*where, name], value)

    def _string(self, where: Where, value: object) -> str | None:
        if not isinstance(value, str):
            self.wrong(where, "a string", value)
            return None
        if _has_surrogate(value):
            self.refuse("report.bad_text", where, "the string holds an unpaired surrogate")
            return None
        return value

    def opt_flag(self, obj: dict[str, Any], name: str, where: Where) -> bool | None:
        present, value = self.member(obj, name, where)
        if not present or value is None:
            return None
        if isinstance(value, bool):
            return value
        self.wrong([*where, name], "a boolean", value)
        return None

    def opt_count(self, obj: dict[str, Any], name: str, where: Where) -> int | None:
        """An unsigned 64-bit integer member or null; ``128.0`` is not an integer."""
        present, value = self.member(obj, name, where)
        if not present or value is None:
            return None
        at = [*where, name]
        if isinstance(value, bool) or not isinstance(value, int):
            self.wrong(at, "an integer", value)
            return None
        if not 0 <= value <= U64_MAX:
            self.refuse("report.out_of_range", at, f"{value} is not an integer in 0..=2^64-1")
            return None
        return value

    def opt_ms(self, obj: dict[str, Any], name: str, where: Where) -> float | None:
        """A timing in milliseconds or null: finite and >= 0."""
        present, value = self.member(obj, name, where)
        if not present:
            return None
        return self._ms([*where, name], value)

    def _ms(self, where: Where, value: object) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.wrong(where, "a number", value)
            return None
        try:
            number = float(value)
        except OverflowError:  # an integer literal beyond the float range
            number = math.inf
        if not math.isfinite(number):
            self.refuse("report.timing.non_finite", where, f"timing {value} is not finite")
            return None
        if number < 0:
            self.refuse("report.timing.negative", where, f"timing {value} is negative")
            return None
        return number

    def opt_series(
        self, obj: dict[str, Any], name: str, where: Where, *, limit: int
    ) -> tuple[float | None, ...] | None:
        """An array of timings (each null, or finite and >= 0), or null."""
        present, value = self.member(obj, name, where)
        if not present or value is None:
            return None
        at = [*where, name]
        if not isinstance(value, list):
            self.wrong(at, "an array", value)
            return None
        if len(value) > limit:
            self.refuse(
                "report.timing.series_too_long",
                at,
                f"{len(value)} samples, more than {limit}",
            )
            return None
        return tuple(self._ms([*at, i], item) for i, item in enumerate(value))


class Refusals:
    """Every refusal of one report invocation, listing at most ``LISTED_REFUSALS``."""

    def __init__(self) -> None:
        self.listed: list[Refusal] = []
        self.unlisted = 0

    def add(self, refusal: Refusal) -> None:
        if len(self.listed) < LISTED_REFUSALS:
            self.listed.append(refusal)
        else:
            self.unlisted += 1

    def __bool__(self) -> bool:
        return bool(self.listed)

    def raise_any(self) -> None:
        if not self.listed:
            return
        refusals = list(self.listed)
        if self.unlisted:
            refusals.append(
                Refusal(
                    "report.more_refusals",
                    "$",
                    f"{self.unlisted} more refusal(s) not listed",
                    report_hint("report.more_refusals"),
                )
            )
        raise Refused(tuple(refusals))
