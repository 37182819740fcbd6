"""The placement file: which hosts may run which rows of a campaign (``--placement FILE``).

Each rule names exactly one of ``row``, ``preset`` or ``family`` and the host it asks for (Ray
``labels``, ``gpus``, ``cpus``); a row takes its row key's rule, else its preset's, else its
family's, and a row no rule names may run anywhere. Unknown members, wrong types and two rules
for one target are refused.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from cache_family.errors import Refusal, Refused

PLACEMENT_MAX_BYTES: Final = 1024 * 1024
PLACEMENT_MAX_RULES: Final = 1024

Count = Annotated[int, msgspec.Meta(ge=0, le=1024)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class PlacementRule(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    row: Name | None = None
    preset: Name | None = None
    family: Name | None = None
    labels: dict[Name, Name] = msgspec.field(default_factory=dict)
    gpus: Count = 0
    cpus: Count = 1

    @property
    def target(self) -> tuple[str, str]:
        for kind in ("row", "preset", "family"):
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return "", ""

    def describe(self) -> str:
        """The requirement in words, as the campaign journal records it."""
        kind, value = self.target
        labels = ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))
        return f"{kind} {value}: labels {{{labels}}}, gpus {self.gpus}, cpus {self.cpus}"


class PlacementFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    schema_version: Literal[1]
    rules: Annotated[tuple[PlacementRule, ...], msgspec.Meta(max_length=PLACEMENT_MAX_RULES)]

    def rule_for(self, row_key: str, preset: str, family: str) -> PlacementRule | None:
        """The rule of the row key, else of the preset, else of the family; None: anywhere."""
        by_target = {rule.target: rule for rule in self.rules}
        for target in (("row", row_key), ("preset", preset), ("family", family)):
            if target in by_target:
                return by_target[target]
        return None


_DECODER: Final = msgspec.json.Decoder(PlacementFile)


def decode_placement(data: bytes, where: str) -> PlacementFile:
    """The placement file from its bytes; every problem is a ``placement.*`` refusal."""
    try:
        placement = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise Refused.one(
            "placement.invalid",
            "$",
            f"{where}: {exc}",
            'write {"schema_version": 1, "rules": [...]} as the placement file\'s '
            "reference (README) shows",
        ) from None
    problems: list[Refusal] = []
    seen: set[tuple[str, str]] = set()
    for position, rule in enumerate(placement.rules):
        named = [k for k in ("row", "preset", "family") if getattr(rule, k) is not None]
        if len(named) != 1:
            problems.append(
                Refusal(
                    "placement.rule_target",
                    f"$.rules[{position}]",
                    f"{where}: a rule names {len(named)} of row, preset, family",
                    "name exactly one of row, preset or family in each rule",
                )
            )
        elif rule.target in seen:
            problems.append(
                Refusal(
                    "placement.duplicate",
                    f"$.rules[{position}]",
                    f"{where}: {rule.target[0]} {rule.target[1]!r} is named by two rules",
                    "give each row, preset or family one rule",
                )
            )
        seen.add(rule.target)
    if problems:
        raise Refused(tuple(problems))
    return placement
