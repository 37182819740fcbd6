"""The workload file: strict (every refusal typed, at once), pinned by preparation, and absent
from the prepared input's bytes when not given (an operator input without one prepares
exactly as before)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from hub_fixture import build_toolbox, operator_document
from run_harness import _SilentEvents

from cache_family.actors.prepare.admission import admit
from cache_family.actors.prepare.worker import observe
from cache_family.errors import Refused
from cache_family.schemas.prepared import (
    PreparationRequest,
    PreparedInput,
    decode_document,
    encode_document,
)
from cache_family.schemas.workload import (
    DEFAULT_HIT_RATIOS_PCT,
    WORKLOAD_REFUSAL_CODES,
    WorkloadsPin,
    validate_workload_document,
    validate_workload_object,
)
from cache_family.system.pins import Budget

FULL: dict[str, Any] = {
    "schema_version": 1,
    "prefix_overlap": {"prompt_tokens": 1024, "groups": 4, "requests": 32, "seed": 7},
    "multi_turn": {"users": 3, "turns": 5, "think_time_ms": 250, "seed": 2},
    "open_loop": {
        "pattern": "gamma",
        "burstiness": 0.5,
        "rates_per_s": [5, 10.5, 20],
        "duration_s": 30,
        "seed": 3,
        "over_saturation": {"window": 16, "min_in_flight": 4},
    },
}


def with_change(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    document = json.loads(json.dumps(FULL))
    node = document
    for part in path[:-1]:
        node = node[part]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return document


_DELETE = object()

# (what changes, the code, the JSON path it is reported at)
CASES: list[tuple[dict[str, Any], str, str]] = [
    (with_change(("schema_version",), 2), "workload.schema_version", "$.schema_version"),
    (with_change(("prefix_overlap", "groups"), "4"), "workload.type", "$.prefix_overlap.groups"),
    (with_change(("multi_turn", "mood"), 1), "workload.unknown_field", "$.multi_turn.mood"),
    (
        with_change(("prefix_overlap", "prompt_tokens"), _DELETE),
        "workload.missing_field",
        "$.prefix_overlap.prompt_tokens",
    ),
    (
        with_change(("prefix_overlap", "hit_ratios_pct"), [0, 100]),
        "workload.out_of_range",
        "$.prefix_overlap.hit_ratios_pct[1]",
    ),
    ({"schema_version": 1}, "workload.empty", "$"),
    (
        with_change(("prefix_overlap", "requests"), 30),
        "workload.overlap.requests_not_multiple",
        "$.prefix_overlap",
    ),
    (
        with_change(("prefix_overlap", "hit_ratios_pct"), [50, 30]),
        "workload.overlap.hit_ratios",
        "$.prefix_overlap",
    ),
    (
        with_change(("open_loop", "sweep"), {"points": 4}),
        "workload.arrivals.rates_or_sweep",
        "$.open_loop",
    ),
    (
        with_change(("open_loop", "requests"), 100),
        "workload.arrivals.duration_or_requests",
        "$.open_loop",
    ),
    (
        with_change(("open_loop", "pattern"), "poisson"),
        "workload.arrivals.burstiness",
        "$.open_loop",
    ),
    (
        with_change(("open_loop", "rates_per_s"), [5, 5]),
        "workload.arrivals.rates",
        "$.open_loop",
    ),
    (
        {"schema_version": 1, "trace": {"path": "/t.jsonl", "first": 3, "until_ms": 10}},
        "workload.trace.window",
        "$.trace",
    ),
    (
        {"schema_version": 1, "trace": {"path": "/t.jsonl", "from_ms": 10, "until_ms": 10}},
        "workload.trace.window",
        "$.trace",
    ),
    # The attack run's file: prepared (exit 0) and then 8.64e9 send times built at run time.
    (
        {
            "schema_version": 1,
            "open_loop": {"pattern": "constant", "rates_per_s": [100000.0], "duration_s": 86400},
        },
        "workload.arrivals.too_many_sends",
        "$.open_loop",
    ),
]


def test_a_full_document_is_read_with_its_defaults() -> None:
    workloads = validate_workload_object(FULL)
    assert workloads.prefix_overlap is not None
    assert workloads.prefix_overlap.hit_ratios_pct == list(DEFAULT_HIT_RATIOS_PCT)
    assert workloads.open_loop is not None and workloads.open_loop.rates_per_s == [5, 10.5, 20]
    assert workloads.open_loop.over_saturation.min_growth_per_send == 0.1


@pytest.mark.parametrize(("document", "code", "path"), CASES)
def test_each_mistake_is_refused_with_its_code_and_path(
    document: dict[str, Any], code: str, path: str
) -> None:
    with pytest.raises(Refused) as caught:
        validate_workload_object(document)
    assert (code, path) in [(r.code, r.path) for r in caught.value.refusals]
    for refusal in caught.value.refusals:
        assert refusal.hint == WORKLOAD_REFUSAL_CODES[refusal.code].hint


def test_every_code_is_exercised_and_decoding_is_strict() -> None:
    exercised = {code for _, code, _ in CASES} | {"workload.json.decode", "workload.json.shape"}
    assert exercised == set(WORKLOAD_REFUSAL_CODES)
    for bad in (b'{"schema_version": 1, "schema_version": 1}', b"\xff", b"[NaN]"):
        with pytest.raises(Refused) as caught:
            validate_workload_document(bad)
        assert caught.value.codes == ["workload.json.decode"]
    deep: Any = 1
    for _ in range(12):
        deep = [deep]
    with pytest.raises(Refused) as caught:
        validate_workload_object({"schema_version": 1, "x": deep})
    assert caught.value.codes == ["workload.json.shape"]


def test_several_mistakes_are_refused_together() -> None:
    document = with_change(("multi_turn", "mood"), 1)
    document["prefix_overlap"]["groups"] = 0
    with pytest.raises(Refused) as caught:
        validate_workload_object(document)
    assert set(caught.value.codes) == {"workload.unknown_field", "workload.out_of_range"}


def prepared_with(root: Path, overrides: list[str]) -> PreparedInput:
    root.mkdir(parents=True, exist_ok=True)
    box = build_toolbox(root, ["qwen3_dense"])
    operator = root / "operator.json"
    operator.write_text(json.dumps(operator_document(box)))
    admission = admit(
        "prepare-full",
        str(operator),
        str(root / "out"),
        overrides,
        environ={"PATH": "/usr/bin:/bin"},
    )
    request = PreparationRequest(
        schema_version=1,
        mode=admission.mode,
        operator=admission.operator,
        corpus_source=admission.corpus_source,
        worker_budget_ms=60_000,
        workloads=admission.workloads,
    )
    if admission.workloads is None:  # the worker's request, too, is as before
        assert "workloads" not in json.loads(encode_document(request))
    return observe(request, Budget.seconds(60), _SilentEvents())  # type: ignore[arg-type]


def test_preparation_pins_the_workload_file_and_leaves_it_out_when_absent(
    tmp_path: Path,
) -> None:
    without = prepared_with(tmp_path / "a", [])
    encoded = encode_document(without)
    assert "workloads" not in json.loads(encoded)
    # An input prepared before the member existed decodes and encodes to the same bytes.
    again = decode_document(encoded, PreparedInput, what="prepared input")
    assert again.workloads is None and encode_document(again) == encoded

    workload_file = tmp_path / "workloads.json"
    workload_file.write_text(json.dumps(FULL))
    pinned = prepared_with(tmp_path / "b", ["--workloads", str(workload_file)])
    assert pinned.workloads is not None
    assert pinned.workloads.sha256 == hashlib.sha256(workload_file.read_bytes()).hexdigest()
    assert pinned.workloads.workloads == validate_workload_object(FULL)
    encoded = encode_document(pinned)
    assert decode_document(encoded, PreparedInput, what="prepared input") == pinned


def test_a_bad_workload_file_refuses_admission_with_its_own_codes(tmp_path: Path) -> None:
    workload_file = tmp_path / "workloads.json"
    workload_file.write_text(json.dumps(with_change(("schema_version",), 3)))
    with pytest.raises(Refused) as caught:
        prepared_with(tmp_path / "c", ["--workloads", str(workload_file)])
    assert "workload.schema_version" in caught.value.codes
    with pytest.raises(Refused) as caught:
        prepared_with(tmp_path / "d", ["--workloads", "relative.json"])
    assert caught.value.codes == ["preparation.override.not_absolute"]


TRACE_LINES = (
    b'{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}\n'
    b'{"timestamp": 10, "input_length": 100, "output_length": 5, "hash_ids": [0]}\n'
)


def test_preparation_pins_the_trace_and_a_file_without_one_encodes_as_before(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(TRACE_LINES)
    document = {"schema_version": 1, "trace": {"path": str(trace), "first": 2}}
    workload_file = tmp_path / "workloads.json"
    workload_file.write_text(json.dumps(document))
    pinned = prepared_with(tmp_path / "p", ["--workloads", str(workload_file)])
    assert pinned.workloads is not None and pinned.workloads.workloads.trace is not None
    assert pinned.workloads.workloads.trace.sha256 == hashlib.sha256(TRACE_LINES).hexdigest()
    assert pinned.workloads.workloads.trace.block_tokens == 512  # the default, recorded
    # The window's distinct hash ids (0 and 1), counted as it was pinned, for the plan.
    assert pinned.workloads.trace_distinct_ids == 2
    assert "trace" not in validate_workload_object(FULL).model_dump()
    unpinned = WorkloadsPin(
        path="/w.json", sha256="a" * 64, workloads=validate_workload_object(FULL)
    )
    assert "trace_distinct_ids" not in unpinned.model_dump()

    document["trace"]["sha256"] = "0" * 64  # type: ignore[index]
    workload_file.write_text(json.dumps(document))
    with pytest.raises(Refused) as caught:
        prepared_with(tmp_path / "q", ["--workloads", str(workload_file)])
    assert caught.value.codes == ["trace.pin_mismatch"]
    trace.write_bytes(
        TRACE_LINES + b'{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [2]}\n'
    )
    document["trace"].pop("sha256")  # type: ignore[attr-defined]
    workload_file.write_text(json.dumps(document))
    with pytest.raises(Refused) as caught:
        prepared_with(tmp_path / "r", ["--workloads", str(workload_file)])
    assert caught.value.codes == ["trace.timestamp.decreasing"]
    assert caught.value.refusals[0].message.startswith("line 3: ")
