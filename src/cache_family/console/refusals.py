"""How a refusal and a failing exit reach the operator: one line per refusal, then the three
closing lines (what failed, where its evidence is, what to do next)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TextIO

from cache_family.errors import Refusal


def print_refusals(refusals: Sequence[Refusal], stream: TextIO) -> None:
    """One ``refused: CODE ...`` line per refusal, flushed."""
    for refusal in refusals:
        print(f"refused: {refusal.line()}", file=stream)
    stream.flush()


def print_refusals_json(refusals: Sequence[Refusal], stream: TextIO) -> None:
    """The ``--json`` form: one document naming every refusal."""
    document = {"valid": False, "refusals": [refusal.as_dict() for refusal in refusals]}
    print(json.dumps(document, indent=2), file=stream, flush=True)


def say_failed(stream: TextIO, who: str, what: str, evidence: str, next_step: str) -> None:
    """How every failing exit ends: what failed, where its evidence is, what to do next."""
    print(f"{who}: failed: {what}", file=stream)
    print(f"{who}: evidence: {evidence}", file=stream)
    print(f"{who}: next: {next_step}", file=stream, flush=True)
