"""The placement file: strict, versioned, one rule per target, row key over preset over family."""

from __future__ import annotations

import json

import pytest

from cache_family.errors import Refused
from cache_family.schemas.placement import decode_placement


def placement(*rules: dict[str, object], **top: object) -> bytes:
    return json.dumps({"schema_version": 1, "rules": list(rules), **top}).encode()


def test_the_row_key_wins_over_the_preset_over_the_family() -> None:
    document = decode_placement(
        placement(
            {"family": "qwen3", "labels": {"h": "f"}},
            {"preset": "qwen3_dense", "labels": {"h": "p"}, "cpus": 2},
            {"row": "qwen3_dense/none/16", "labels": {"h": "r"}, "gpus": 1},
        ),
        "p.json",
    )
    assert document.rule_for("qwen3_dense/none/16", "qwen3_dense", "qwen3").labels == {"h": "r"}
    assert document.rule_for("qwen3_dense/none/32", "qwen3_dense", "qwen3").cpus == 2
    assert document.rule_for("x/none/1", "x", "qwen3").labels == {"h": "f"}
    assert document.rule_for("x/none/1", "x", "llama") is None


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (placement(extra=1), "placement.invalid"),
        (json.dumps({"schema_version": 2, "rules": []}).encode(), "placement.invalid"),
        (placement({"family": "a", "gpus": "1"}), "placement.invalid"),
        (placement({"family": "a", "gpus": -1}), "placement.invalid"),
        (placement({"family": "a", "colour": "red"}), "placement.invalid"),
        (placement({"labels": {"a": "b"}}), "placement.rule_target"),
        (placement({"family": "a", "preset": "b"}), "placement.rule_target"),
        (placement({"family": "a"}, {"family": "a", "gpus": 1}), "placement.duplicate"),
    ],
)
def test_a_placement_file_out_of_its_schema_is_refused(data: bytes, code: str) -> None:
    with pytest.raises(Refused) as refused:
        decode_placement(data, "p.json")
    assert refused.value.codes == [code]
