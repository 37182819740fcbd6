"""Old/new parity per rung (``states/parity.py``) and the OpenAI digests it compares."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from cache_family.actors.run.load import openai_content_sha256, openai_first_generated_sha256
from cache_family.schemas.measurement import RequestRow
from cache_family.schemas.receipts import (
    ArmObservation,
    CellReceipt,
    Measurement,
    Readiness,
    RungBrief,
    RungReceipt,
)
from cache_family.states.parity import observation_order, row_parity, rung_parity


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def rows(content: list[str], first: list[str] | None = None) -> tuple[RequestRow, ...]:
    first = first or content
    return tuple(
        RequestRow(
            request_id=i,
            status="completed",
            content_sha256=digest(c),
            first_chunk_sha256=digest(f),
        )
        for i, (c, f) in enumerate(zip(content, first, strict=True))
    )


def cell(arm: str, *rungs: tuple[RequestRow, ...], accepted: bool = True, **extra: Any) -> Any:
    receipts = tuple(
        RungReceipt(
            rung_index=i,
            concurrency=i + 1,
            requested_requests=len(r),
            status="completed",
            prompt_sha256="p" * 64,
            output_tokens=8,
            rows=r,
        )
        for i, r in enumerate(rungs)
    )
    return CellReceipt(
        run_id="r",
        request_sha256="0" * 64,
        catalog_sha256="0" * 64,
        cell_id=f"cell-0000/{arm}",
        row_index=0,
        row_key="k",
        arm=arm,
        cohort="openai",
        cell_dir=None,
        host=None,
        status="completed" if accepted else "incomplete",
        terminal_refusal=None,
        accepted_for_parity=accepted,
        faults=(),
        lifecycle=(),
        final_state="done",
        readiness=Readiness(),
        before_identity=(),
        after_identity=(),
        pins_drifted=not accepted,
        cleanup=None,
        measurement=Measurement(kind="concurrent", complete=True, rungs=receipts),
        journal_through_seq=1,
        **extra,
    )


def test_the_same_answers_match_at_every_rung() -> None:
    old = cell("skippy-old", rows(["a", "b"]), rows(["a", "b", "c"]))
    new = cell("skippy-new", rows(["a", "b"]), rows(["a", "b", "c"]))
    verdicts = row_parity([1, 2], old, new)
    assert [(v.concurrency, v.matches, v.complete) for v in verdicts] == [
        (1, True, True),
        (2, True, True),
    ]
    assert verdicts[1].comparable_requests == 3 and verdicts[1].unavailable_reason is None


def test_a_different_answer_or_first_delta_is_a_mismatch_of_that_request() -> None:
    old = cell("skippy-old", rows(["a", "b", "c"], ["a", "b", "c"]))
    new = cell("skippy-new", rows(["a", "X", "c"], ["a", "b", "Y"]))
    verdict = rung_parity(old, new, 0, 1)
    assert verdict.complete and not verdict.matches
    assert verdict.mismatch_request_ids == (1,)
    assert verdict.first_generated_mismatch_request_ids == (2,)


def test_a_request_that_did_not_complete_on_one_side_is_unavailable() -> None:
    failed = msgspec.structs.replace(rows(["b"])[0], request_id=1, status="failed")
    old = cell("skippy-old", rows(["a", "b"]))
    new = cell("skippy-new", (rows(["a"])[0], failed))
    verdict = rung_parity(old, new, 0, 1)
    assert verdict.unavailable_request_ids == (1,) and not verdict.complete
    assert not verdict.matches and verdict.comparable_requests == 1


def test_a_cell_not_fully_accepted_refuses_parity_and_keeps_nothing_else() -> None:
    old = cell("skippy-old", rows(["a"]))
    drifted = cell("skippy-new", rows(["a"]), accepted=False)
    verdict = rung_parity(old, drifted, 0, 1)
    assert (verdict.matches, verdict.complete) == (False, False)
    assert verdict.unavailable_reason == "custody_or_lifecycle_failure"
    # A rung the other arm never reached (a cancelled new arm) is refused the same way.
    assert rung_parity(old, None, 0, 1).unavailable_reason == "custody_or_lifecycle_failure"


def test_rosters_that_cannot_be_compared_are_an_error() -> None:
    old = cell("skippy-old", rows(["a", "b"]))
    new = cell("skippy-new", rows(["a"]))
    verdict = rung_parity(old, new, 0, 1)
    assert verdict.error == "the two rosters hold different request ids" and not verdict.matches


def test_the_observation_order_is_serial_then_per_rung_native_old_new_parity() -> None:
    def arm(name: str, *concurrency: int) -> ArmObservation:
        return ArmObservation(
            arm=name,
            planned="planned",
            status="completed",
            rungs=tuple(
                RungBrief(rung_index=i, concurrency=c, status="completed")
                for i, c in enumerate(concurrency)
            ),
        )

    observations = [
        arm("native-serial", 1),
        arm("native-concurrent", 1, 2),
        arm("skippy-old", 1, 2),
        arm("skippy-new", 1, 2),
    ]
    old = cell("skippy-old", rows(["a"]), rows(["a", "b"]))
    parity = row_parity([1, 2], old, old)
    order = [(e.cohort, e.concurrency) for e in observation_order(observations, parity)]
    assert len(order) == 9 and order[:5] == [
        ("native-serial", 1),
        ("native-concurrent", 1),
        ("skippy-old", 1),
        ("skippy-new", 1),
        ("old-new-parity", 1),
    ]
    # Without paired serving: the serial baseline, then one native entry per rung.
    native_only = observation_order(observations[:2], ())
    assert [(e.cohort, e.concurrency) for e in native_only] == [
        ("native-serial", 1),
        ("native-concurrent", 1),
        ("native-concurrent", 2),
    ]


def test_openai_digests_follow_the_reference() -> None:
    # The same text split into other deltas keeps the content digest, not the first one.
    whole = openai_content_sha256("hello world", None, None)
    assert whole == digest('{"content":"hello world"}')
    assert openai_first_generated_sha256({"content": "hello"}) != openai_first_generated_sha256(
        {"content": "hello world"}
    )
    assert openai_first_generated_sha256({"content": "hi"}) == digest(
        '{"content":"hi","reasoning_content":null,"tool_calls":null}'
    )
    calls = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert openai_content_sha256("", "think", calls) == digest(
        '{"content":"","reasoning_content":"think","tool_calls":'
        '[{"type":"function","function":{"name":"f","arguments":"{}"}}]}'
    )
