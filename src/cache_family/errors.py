"""Typed refusals: every way the tool says no has a stable dotted code, a JSON path and a hint.

Foreign exceptions (OSError, pydantic.ValidationError, msgspec errors) are translated into
refusals at the edge where they occur, so the CLI never prints a traceback for bad input.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

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
