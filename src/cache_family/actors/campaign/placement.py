"""Reading the placement file for a plan: its pin, and each row's requirement."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from cache_family.errors import Refusal, Refused
from cache_family.schemas.bounded import read_bounded
from cache_family.schemas.journal import PlannedRowBrief
from cache_family.schemas.placement import (
    PLACEMENT_MAX_BYTES,
    PlacementFile,
    PlacementRule,
    decode_placement,
)
from cache_family.states.selection import row_key


def brief_key(brief: PlannedRowBrief) -> str:
    return row_key(brief.case, brief.use_case, brief.prefix_tokens)


@dataclass(frozen=True, slots=True)
class Placement:
    """The placement file a campaign was driven with, and what it asked of each row key."""

    path: str
    sha256: str
    rules: Mapping[str, str] = field(default_factory=dict)  # row key -> requirement text


@dataclass(frozen=True, slots=True)
class LoadedPlacement:
    document: PlacementFile
    pin: Placement
    # Row key -> its rule (rows no rule names are absent: they run anywhere).
    by_row: dict[str, PlacementRule]


def load_placement(path: str, plan: Sequence[PlannedRowBrief]) -> LoadedPlacement:
    """Read, pin and check the placement file against the plan; raises ``Refused`` (every
    rule naming a row, preset or family the plan does not have is refused)."""
    raw = read_bounded(path, PLACEMENT_MAX_BYTES, what="placement file")
    document = decode_placement(raw.data, raw.path)
    known = {
        "row": {brief_key(b) for b in plan},
        "preset": {b.case for b in plan},
        "family": {b.family for b in plan},
    }
    problems = [
        Refusal(
            "placement.unknown_target",
            f"$.rules[{position}]",
            f"{raw.path}: no row of the plan has the {rule.target[0]} {rule.target[1]!r}",
            "name row keys (`cache-family run --input PREPARED --dry-run` lists them), "
            "catalog case keys or families of this prepared input",
        )
        for position, rule in enumerate(document.rules)
        if rule.target[1] not in known[rule.target[0]]
    ]
    if problems:
        raise Refused(tuple(problems))
    by_row: dict[str, PlacementRule] = {}
    for brief in plan:
        rule = document.rule_for(brief_key(brief), brief.case, brief.family)
        if rule is not None:
            by_row[brief_key(brief)] = rule
    pin = Placement(
        path=raw.path,
        sha256=raw.sha256,
        rules={key: rule.describe() for key, rule in by_row.items()},
    )
    return LoadedPlacement(document=document, pin=pin, by_row=by_row)
