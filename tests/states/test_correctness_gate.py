"""The state-handoff report gate (``states/handoff.py``): one accepted report, every rejection.

Each rejected case changes one member of an accepted report and checks that the gate refuses
it with that member's code and path; the accepted report proves each case is the only fault.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from cache_family.errors import Refused
from cache_family.states.handoff import (
    PACKAGE_LAYER_COUNT,
    HandoffExpectation,
    handoff_report_refusals,
    topology_of,
    topology_range,
)

EXPECT = HandoffExpectation(
    model_id="org/model:Q8_0",
    payload="resident-kv",
    topology="split-middle",
    layer_end=28,
    activation_width=1024,
    prefix_tokens=128,
    repeats=3,
)


def accepted() -> dict[str, Any]:
    imports, decodes = [0.25, 0.5, 0.125], [10.0, 12.5, 11.0]
    return {
        "mode": "state-handoff",
        "status": "pass",
        "matches": True,
        "predicted_token_matches": True,
        "cache_hit_matches": True,
        "model_identity": {"model_id": "org/model:Q8_0"},
        "state_payload_kind": "resident-kv",
        "stage_index": 1,
        "layer_start": 9,
        "layer_end": 18,
        "requested_prefix_token_count": 128,
        "benchmark_prompt_token_count": 129,
        "activation_width": 1024,
        "cache_hit_repeats": 3,
        "benchmark_prompt_text": "a prompt",
        "cache_hit_import_ms": imports,
        "cache_hit_decode_ms": decodes,
        "recompute_total_ms": 40.0,
        "cache_hit_total_ms": sum(i + d for i, d in zip(imports, decodes, strict=True)) / 3,
        "cache_storage_bytes": 4096,  # informative members are allowed
    }


def test_the_accepted_report_passes() -> None:
    assert handoff_report_refusals(accepted(), EXPECT) == []


@pytest.mark.parametrize(
    ("topology", "layers", "want"),
    [
        ("one-stage", 28, (0, 28, 0)),
        ("split-stage0", 28, (0, 9, 0)),
        ("split-middle", 28, (9, 18, 1)),  # s = 2*9 + (2*1)//3 = 18
        ("split-final", 28, (18, 28, 2)),
        ("split-middle", 29, (9, 19, 1)),  # 2*9 + (2*2)//3 = 19
        ("split-middle", 3, (1, 2, 1)),
        ("split-final", 4, (2, 4, 2)),
        ("package-stage1", 61, (3, 4, 1)),
    ],
)
def test_topology_ranges_follow_the_reference_formula(
    topology: str, layers: int, want: tuple[int, int, int]
) -> None:
    f = layers // 3
    s = 2 * (layers // 3) + (2 * (layers % 3)) // 3
    if topology.startswith("split"):
        assert want == {"split-stage0": (0, f, 0), "split-middle": (f, s, 1)}.get(
            topology, (s, layers, 2)
        )
    assert topology_range(topology, layers) == want


def test_split_needs_three_layers_and_names_are_known() -> None:
    with pytest.raises(Refused) as small:
        topology_range("split-final", 2)
    assert small.value.codes == ["handoff.split_too_small"]
    with pytest.raises(Refused) as unknown:
        topology_range("two-stage", 28)
    assert unknown.value.codes == ["handoff.topology"]
    assert topology_range("one-stage", 2) == (0, 2, 0)


def test_topology_of_inverts_the_ranges_per_load_mode() -> None:
    assert topology_of("runtime-slice", 28, 9, 18, 1) == "split-middle"
    assert topology_of("runtime-slice", 28, 0, 28, 0) == "one-stage"
    assert topology_of("runtime-slice", 28, 3, 4, 1) is None
    assert topology_of("layer-package", 61, 3, 4, 1) == "package-stage1"
    assert topology_of("layer-package", 61, 0, 61, 0) is None
    assert topology_of("runtime-slice", 2, 0, 2, 0) == "one-stage"
    assert topology_of("runtime-slice", 2, 0, 0, 0) is None


def _set(report: dict[str, Any], path: str, value: object) -> None:
    *parents, last = path.split(".")
    target = report
    for part in parents:
        target = target[part]
    if value is _DELETE:
        del target[last]
    else:
        target[last] = value


_DELETE = object()

REJECTED = [
    ("mode", "other", "handoff.mode", "$.mode"),
    ("status", "fail", "handoff.status", "$.status"),
    ("matches", False, "handoff.mismatch", "$.matches"),
    ("predicted_token_matches", False, "handoff.mismatch", "$.predicted_token_matches"),
    ("cache_hit_matches", False, "handoff.mismatch", "$.cache_hit_matches"),
    ("matches", 1, "handoff.type", "$.matches"),
    ("model_identity.model_id", "org/other", "handoff.model_id", "$.model_identity.model_id"),
    ("model_identity", {}, "handoff.type", "$.model_identity"),
    ("state_payload_kind", "kv-recurrent", "handoff.payload", "$.state_payload_kind"),
    ("layer_start", 8, "handoff.range", "$.layer_start"),
    ("layer_end", 19, "handoff.range", "$.layer_start"),
    ("stage_index", 2, "handoff.range", "$.layer_start"),
    ("stage_index", -1, "handoff.type", "$.stage_index"),
    ("activation_width", 2048, "handoff.activation_width", "$.activation_width"),
    ("activation_width", True, "handoff.type", "$.activation_width"),
    ("requested_prefix_token_count", 64, "handoff.prefix", "$.requested_prefix_token_count"),
    (
        "benchmark_prompt_token_count",
        128,
        "handoff.prompt_tokens",
        "$.benchmark_prompt_token_count",
    ),
    ("benchmark_prompt_text", "", "handoff.prompt_text", "$.benchmark_prompt_text"),
    ("benchmark_prompt_text", "x" * 65_537, "handoff.prompt_text", "$.benchmark_prompt_text"),
    ("benchmark_prompt_text", 7, "handoff.type", "$.benchmark_prompt_text"),
    ("cache_hit_repeats", 2, "handoff.repeats", "$.cache_hit_repeats"),
    ("cache_hit_import_ms", [0.25, 0.5], "handoff.samples", "$.cache_hit_import_ms"),
    ("cache_hit_decode_ms", [1.0, 2.0, 3.0, 4.0], "handoff.samples", "$.cache_hit_decode_ms"),
    ("cache_hit_decode_ms", [1.0, "2", 3.0], "handoff.type", "$.cache_hit_decode_ms"),
    ("cache_hit_import_ms", [0.25, -0.5, 0.125], "handoff.timing", "$.cache_hit_import_ms[1]"),
    (
        "cache_hit_decode_ms",
        [10.0, float("nan"), 1.0],
        "handoff.timing",
        "$.cache_hit_decode_ms[1]",
    ),
    ("recompute_total_ms", float("inf"), "handoff.timing", "$.recompute_total_ms"),
    ("recompute_total_ms", _DELETE, "handoff.type", "$.recompute_total_ms"),
    ("cache_hit_total_ms", 11.5, "handoff.total", "$.cache_hit_total_ms"),
    ("cache_hit_total_ms", -1.0, "handoff.timing", "$.cache_hit_total_ms"),
]


@pytest.mark.parametrize(("member", "value", "code", "path"), REJECTED)
def test_each_rejected_member_is_refused_with_its_code(
    member: str, value: object, code: str, path: str
) -> None:
    report = copy.deepcopy(accepted())
    _set(report, member, value)
    refusals = handoff_report_refusals(report, EXPECT)
    assert (code, path) in [(r.code, r.path) for r in refusals], refusals


def test_the_mean_tolerance_is_relative() -> None:
    report = accepted()
    mean = report["cache_hit_total_ms"]
    report["cache_hit_total_ms"] = mean * (1 + 5e-9)
    assert handoff_report_refusals(report, EXPECT) == []
    report["cache_hit_total_ms"] = mean * (1 + 5e-8)
    assert [r.code for r in handoff_report_refusals(report, EXPECT)] == ["handoff.total"]


def test_package_stage1_needs_the_61_layer_package() -> None:
    report = accepted()
    report.update(layer_start=3, layer_end=4, stage_index=1)
    package = dataclasses.replace(EXPECT, topology="package-stage1", layer_end=PACKAGE_LAYER_COUNT)
    assert handoff_report_refusals(report, package) == []
    too_few = dataclasses.replace(package, layer_end=4)
    assert [r.code for r in handoff_report_refusals(report, too_few)] == ["handoff.range"]
    synthetic = dataclasses.replace(too_few, package_layer_count=4)
    assert handoff_report_refusals(report, synthetic) == []


def test_zero_repeats_are_refused() -> None:
    report = accepted()
    report.update(cache_hit_repeats=0, cache_hit_import_ms=[], cache_hit_decode_ms=[])
    expect = dataclasses.replace(EXPECT, repeats=0)
    assert "handoff.repeats" in [r.code for r in handoff_report_refusals(report, expect)]
