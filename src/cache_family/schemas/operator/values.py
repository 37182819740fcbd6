"""The value rules: checks that stand on their own, run by pydantic per value (pass 1).

Each rule is a small frozen object whose ``rule`` text ``docs.py`` renders into the README, so
the documented bound and the enforced one are the same object.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

from cache_family.schemas.operator.limits import (
    I32_MAX,
    MAX_RUNG,
    PATH_MAX_BYTES,
    SCHEMA_VERSION,
    U32_MAX,
)
from cache_family.schemas.refusal_codes import default_hint
from cache_family.schemas.text import unsafe_character

_HEX = re.compile(r"[0-9a-f]+")


def _fail(code: str, message: str, hint: str | None = None) -> PydanticCustomError:
    # The message travels in ctx, not in the template: pydantic substitutes `{name}` in
    # templates, and a path may contain braces.
    return PydanticCustomError(
        code, "{message}", {"message": message, "hint": hint or default_hint(code)}
    )


def _show(value: str, limit: int = 120) -> str:
    """A path as it may appear in a message: quoted, escaped, cut to a readable length."""
    shown = value if len(value) <= limit else value[:limit] + "..."
    return ascii(shown) if not shown.isprintable() else repr(shown)


@dataclass(frozen=True, slots=True)
class Rule:
    """Documentation of a rule checked across entries (pass 2); docs.py renders it."""

    text: str


@dataclass(frozen=True, slots=True)
class AbsolutePath:
    rule: str = (
        "absolute, normal form (no `.`/`..`, `//` or trailing `/`), "
        f"≤ {PATH_MAX_BYTES} bytes, no control or invisible format characters"
    )

    def __call__(self, value: str) -> str:
        unsafe = unsafe_character(value)
        if unsafe in ("not-utf8", "control"):
            raise _fail("operator.path.bad_char", f"path {_show(value)} has a control character")
        if unsafe == "format":
            raise _fail(
                "operator.path.format_char",
                f"path {_show(value)} has an invisible format character",
            )
        if not posixpath.isabs(value):
            raise _fail("operator.path.not_absolute", f"path {_show(value)} is not absolute")
        if len(value.encode("utf-8")) > PATH_MAX_BYTES:
            raise _fail(
                "operator.path.too_long",
                f"path {_show(value)} is longer than {PATH_MAX_BYTES} bytes",
            )
        # normpath keeps a leading "//" (POSIX leaves its meaning to the system): refuse it too.
        normal = "/" + posixpath.normpath(value).lstrip("/")
        if value != normal:
            raise _fail(
                "operator.path.not_normalized",
                f"path {_show(value)} is not in normal form",
                f"write it as {_show(normal)}",
            )
        return value


@dataclass(frozen=True, slots=True)
class LowerHex:
    lengths: tuple[int, ...]
    code: str
    what: str
    # For a code outside the operator registry (a prepared document's): its own hint.
    hint: str | None = None

    @property
    def rule(self) -> str:
        sizes = " or ".join(str(n) for n in self.lengths)
        return f"{sizes} lowercase hex characters"

    def __call__(self, value: str) -> str:
        if len(value) not in self.lengths or not _HEX.fullmatch(value):
            raise _fail(self.code, f"{self.what} {_show(value, 80)} is not {self.rule}", self.hint)
        return value


@dataclass(frozen=True, slots=True)
class IntRange:
    low: int
    high: int
    code: str

    @property
    def rule(self) -> str:
        return f"{self.low}..={self.high}"

    def __call__(self, value: int) -> int:
        if not self.low <= value <= self.high:
            shown = str(value) if abs(value) < 10**30 else "a number that large"
            raise _fail(
                self.code,
                f"{shown} is outside {self.rule}",
                f"use a whole number from {self.low} to {self.high}",
            )
        return value


@dataclass(frozen=True, slots=True)
class SchemaVersion:
    code: str

    @property
    def rule(self) -> str:
        return f"must be {SCHEMA_VERSION}"

    def __call__(self, value: int) -> int:
        if value != SCHEMA_VERSION:
            shown = str(value) if abs(value) < 10**30 else "a number that large"
            raise _fail(self.code, f"schema_version {shown} is not {SCHEMA_VERSION}")
        return value


AbsPath = Annotated[str, AfterValidator(AbsolutePath())]
Sha256Hex = Annotated[str, AfterValidator(LowerHex((64,), "operator.sha256.bad_hex", "SHA-256"))]
CommitHex = Annotated[str, AfterValidator(LowerHex((40, 64), "operator.commit.bad_hex", "commit"))]

_BUDGET = "operator.budget.out_of_range"
_PLAN_RANGE = "plan.out_of_range"
PositiveU32 = Annotated[int, AfterValidator(IntRange(1, U32_MAX, _PLAN_RANGE))]
Count1024 = Annotated[int, AfterValidator(IntRange(1, 1024, _PLAN_RANGE))]
Count65536 = Annotated[int, AfterValidator(IntRange(1, 65536, _PLAN_RANGE))]
Rung = Annotated[int, AfterValidator(IntRange(1, MAX_RUNG, _PLAN_RANGE))]
GpuLayers = Annotated[int, AfterValidator(IntRange(-1, I32_MAX, _PLAN_RANGE))]
