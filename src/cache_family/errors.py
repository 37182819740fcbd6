"""Typed refusals: every way the tool says no has a stable dotted code, a JSON path and a hint.

Foreign exceptions (OSError, pydantic.ValidationError, msgspec errors) are translated into
refusals at the edge where they occur, so the CLI never prints a traceback for bad input.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

_CODE = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z0-9_]+)+$")


@dataclass(frozen=True, slots=True)
class Refusal:
    """One reason a document, file or action was refused."""

    code: str
    path: str
    message: str
    hint: str

    def __post_init__(self) -> None:
        if not _CODE.match(self.code):
            raise ValueError(f"refusal code {self.code!r} is not a dotted lowercase code")

    def as_dict(self) -> dict[str, str]:
        return {"code": self.code, "path": self.path, "message": self.message, "hint": self.hint}

    def line(self) -> str:
        where = self.path or "$"
        return f"{self.code} at {where}: {self.message} (hint: {self.hint})"


@dataclass(slots=True)
class Refused(Exception):
    """Raised with every refusal found in one document or action, never only the first."""

    refusals: Sequence[Refusal] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.refusals:
            raise ValueError("Refused needs at least one refusal")
        Exception.__init__(self, self.refusals[0].line())

    @classmethod
    def one(cls, code: str, path: str, message: str, hint: str) -> Refused:
        return cls((Refusal(code, path, message, hint),))

    @property
    def codes(self) -> list[str]:
        return [r.code for r in self.refusals]

    def __str__(self) -> str:
        return "\n".join(r.line() for r in self.refusals)


#: Refusals of one code in one group (e.g. one top-level member) that are listed; the rest
#: are counted. A hostile document can repeat one mistake a hundred thousand times, and the
#: first few say what to fix.
LISTED_PER_GROUP: Final = 8
#: Refusals listed in all, whatever their groups; past it every refusal is only counted.
LISTED_IN_ALL: Final = 100


class RefusalCap:
    """Collects refusals in order, listing at most ``per_group`` of each (code, group) and
    ``in_all`` in all, and counting the rest; its memory is bounded by what it lists.

    ``more_code`` and ``more_hint`` make the closing count refusals: one per (code, group)
    with unlisted refusals, naming how many, and one for those past ``in_all``.
    """

    def __init__(
        self,
        more_code: str,
        more_hint: str,
        *,
        per_group: int = LISTED_PER_GROUP,
        in_all: int = LISTED_IN_ALL,
    ) -> None:
        self.more_code = more_code
        self.more_hint = more_hint
        self.per_group = per_group
        self.in_all = in_all
        self.listed: list[Refusal] = []
        # Keys are only ever (code, group) pairs that have a listed refusal: bounded too.
        self._per_key: dict[tuple[str, str], int] = {}
        self._unlisted: dict[tuple[str, str], int] = {}
        self._past_all = 0

    def add(self, refusal: Refusal, group: str) -> None:
        key = (refusal.code, group)
        shown = self._per_key.get(key, 0)
        if shown >= self.per_group:
            self._unlisted[key] = self._unlisted.get(key, 0) + 1
        elif len(self.listed) >= self.in_all:
            self._past_all += 1
        else:
            self._per_key[key] = shown + 1
            self.listed.append(refusal)

    @property
    def unlisted(self) -> int:
        return sum(self._unlisted.values()) + self._past_all

    def refusals(self) -> tuple[Refusal, ...]:
        """The listed refusals, then one count refusal per group with unlisted ones."""
        counts = [
            Refusal(
                self.more_code,
                group,
                f"{count} more {code} refusal(s) under {group} not listed "
                f"(the first {self.per_group} are)",
                self.more_hint,
            )
            for (code, group), count in self._unlisted.items()
        ]
        if self._past_all:
            counts.append(
                Refusal(
                    self.more_code,
                    "$",
                    f"{self._past_all} more refusal(s) not listed (the first {self.in_all} are)",
                    self.more_hint,
                )
            )
        return (*self.listed, *counts)


def json_path(parts: Iterable[str | int]) -> str:
    """Render a location as a JSON path: ``$.plan.concurrency[2]``."""
    out = "$"
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part):
            out += f".{part}"
        else:
            out += "[" + repr(part).replace("'", '"') + "]"
    return out
