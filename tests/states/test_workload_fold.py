"""The fold of a workload cell's records into ``workload.json``: the verdicts are the fold's,
from the server's figures the records carry, so replay reproduces them from the journal."""

from __future__ import annotations

import msgspec

from cache_family.actors.audit.replay import REFOLDERS
from cache_family.schemas.journal import JournalLine, Record
from cache_family.schemas.workload_records import (
    OpenLoopStageMeasured,
    OverlapPointMeasured,
    ReuseProbed,
    ReuseProbeStep,
    SessionsMeasured,
    WorkloadOpened,
    WorkloadRequest,
    decode_workload_receipt,
    encode_workload_receipt,
)
from cache_family.states.fold import JournalIndex, refold
from cache_family.states.workload_fold import SCOPE_WORKLOAD, fold_workload
from cache_family.states.workloads import WORKLOAD_VERDICT_CODES

CELL = "cell-0000/native-overlap"


def lines(*records: Record) -> list[JournalLine]:
    return [
        JournalLine(seq=seq, mono_ns=0, wall_ns=0, prev="", record=record)
        for seq, record in enumerate(records, start=1)
    ]


def point(ratio: int, reusable: int, *cached: int | None) -> OverlapPointMeasured:
    """A point of 100-token prompts: one priming request, then one measured per ``cached``
    (None: the request failed)."""
    requests = [WorkloadRequest(position=0, status="completed", priming=True, turn=-1,
                                prompt_tokens=100, cached_tokens=0)]  # fmt: skip
    for position, found in enumerate(cached, start=1):
        requests.append(
            WorkloadRequest(position=position, status="failed", error="boom")
            if found is None
            else WorkloadRequest(
                position=position, status="completed", prompt_tokens=100, cached_tokens=found
            )
        )
    return OverlapPointMeasured(
        cell_id=CELL,
        hit_ratio_pct=ratio,
        prompt_tokens=100,
        rule="exact-prefix",
        requested_prefix_tokens=reusable,
        shared_prefix_tokens=reusable,
        reusable_tokens=reusable,
        groups=1,
        seed=ratio,
        requests=tuple(requests),
    )


def test_points_are_judged_against_their_band_and_the_control_must_reuse_nothing() -> None:
    opened = WorkloadOpened(
        cell_id=CELL, kind="prefix-overlap", spec_json="{}", rule="exact-prefix"
    )
    receipt = fold_workload(
        lines(
            opened,
            point(0, 0, 0, 0),
            point(50, 50, 50, 50),
            point(90, 90, 90, 0),  # one request reused nothing: 45 % against 90 %
            point(30, 30, 1, 0),  # the priming request's reuse does not count
        ),
        CELL,
    )
    by_ratio = {p.hit_ratio_pct: p for p in receipt.overlap}
    assert by_ratio[0].accepted and by_ratio[50].accepted
    assert by_ratio[90].refusal == "workload.overlap.outside_band"
    assert by_ratio[90].achieved_ratio_pct == 45.0 and by_ratio[90].designed_ratio_pct == 90.0
    assert by_ratio[30].refusal == "workload.overlap.outside_band"
    assert receipt.status == "refused" and receipt.kind == "prefix-overlap"
    control = fold_workload(lines(opened, point(0, 0, 0, 3)), CELL).overlap[0]
    assert control.refusal == "workload.overlap.control_reused"


def test_a_point_with_a_failed_request_is_not_accepted() -> None:
    receipt = fold_workload(lines(point(50, 50, 50, None)), CELL)
    [only] = receipt.overlap
    assert not only.accepted and only.failed_requests == 1 and only.measured_requests == 1


def test_sessions_give_reuse_by_turn_and_name_the_turn_where_reuse_stops() -> None:
    def turn(position: int, user: int, index: int, expected: int, cached: int) -> WorkloadRequest:
        return WorkloadRequest(
            position=position,
            status="completed",
            group=user,
            turn=index,
            prompt_tokens=100 + 50 * index,
            cached_tokens=cached,
            expected_reused_tokens=expected,
            prompt_ms=10.0 - index,
        )

    record = SessionsMeasured(
        cell_id=CELL,
        users=2,
        turns=3,
        seed=1,
        requests=(
            turn(0, 0, 0, 0, 0),
            turn(1, 1, 0, 0, 0),
            turn(2, 0, 1, 99, 99),
            turn(3, 1, 1, 99, 99),
            turn(4, 0, 2, 149, 0),  # the server no longer held the session
            turn(5, 1, 2, 149, 149),
        ),
    )
    sessions = fold_workload(lines(record), CELL).sessions
    assert sessions is not None
    assert [
        (t.turn, t.expected_reused_tokens, t.achieved_reused_tokens) for t in sessions.by_turn
    ] == [
        (0, 0, 0),
        (1, 198, 198),
        (2, 298, 149),
    ]
    assert sessions.eviction_turn == 2 and sessions.by_turn[1].prompt_ms_p50 == 9.0


def test_the_first_rate_that_stopped_is_the_over_saturation_and_replay_refolds_the_bytes() -> None:
    from cache_family.schemas.journal import ReceiptPublished

    stages = (
        OpenLoopStageMeasured(cell_id=CELL, stage="rate", pattern="poisson", target_rate_per_s=5),
        OpenLoopStageMeasured(
            cell_id=CELL,
            stage="rate",
            pattern="poisson",
            target_rate_per_s=50,
            stop_reason="workload.arrivals.in_flight_growing",
        ),
        OpenLoopStageMeasured(
            cell_id=CELL,
            stage="rate",
            pattern="poisson",
            target_rate_per_s=500,
            skipped_because="workload.arrivals.in_flight_growing at 50/s",
        ),
    )
    folded = lines(*stages)
    receipt = fold_workload(folded, CELL, through_seq=3)
    assert receipt.over_saturated_at_per_s == 50 and receipt.status == "accepted"
    data = encode_workload_receipt(receipt)
    assert decode_workload_receipt(data) == receipt
    assert SCOPE_WORKLOAD in REFOLDERS
    published = ReceiptPublished(
        scope=SCOPE_WORKLOAD, cell_id=CELL, path="x/workload.json", sha256="", through_seq=3
    )
    assert refold(JournalIndex(folded), published, REFOLDERS) == data


def test_a_point_refused_as_designed_is_refused_with_its_code_and_nothing_measured() -> None:
    empty = msgspec.structs.replace(
        point(50, 0), requests=(), design_refusal="workload.overlap.nothing_shared"
    )
    receipt = fold_workload(lines(point(0, 0, 0, 0), empty), CELL)
    control, refused = receipt.overlap
    assert control.accepted
    assert not refused.accepted and refused.refusal == "workload.overlap.nothing_shared"
    assert refused.measured_requests == 0 and refused.achieved_ratio_pct is None
    assert receipt.status == "refused"
    assert refused.refusal in WORKLOAD_VERDICT_CODES


def test_the_probe_names_the_rule_and_a_server_following_none_is_refused() -> None:
    opened = WorkloadOpened(
        cell_id=CELL, kind="prefix-overlap", spec_json="{}", rule="checkpoint-swa"
    )
    step = ReuseProbeStep(prompt_tokens=512, previous_prompt_tokens=512, common_prefix=512,
                          cached_tokens=511)  # fmt: skip
    probe = ReuseProbed(cell_id=CELL, header_rule="checkpoint-swa", sliding_window=512,
                        n_ubatch=512, steps=(step,), rule="exact-prefix")  # fmt: skip
    receipt = fold_workload(lines(opened, probe, point(50, 50, 50)), CELL)
    assert receipt.rule == "exact-prefix" and receipt.reuse_probe == probe
    assert receipt.status == "accepted"
    lost = msgspec.structs.replace(probe, rule=None)
    refused = fold_workload(lines(opened, lost, point(50, 50, 50)), CELL)
    assert refused.status == "refused" and refused.rule is None
    # A receipt from before probes encodes no probe at all.
    assert b"reuse_probe" not in encode_workload_receipt(fold_workload(lines(opened), CELL))


def sessions_record(cached_at_turn_1: int, **cache: int) -> SessionsMeasured:
    """Two users, two turns of 112 then 136 tokens with 8-token answers (the real model's
    shape); turn 1 expects the sliding window's 107 each."""
    requests = tuple(
        WorkloadRequest(position=2 * turn + user, status="completed", group=user, turn=turn,
                        prompt_tokens=112 + 24 * turn,
                        cached_tokens=cached_at_turn_1 if turn else 0,
                        expected_reused_tokens=107 if turn else 0)
        for turn in (0, 1) for user in (0, 1)
    )  # fmt: skip
    return SessionsMeasured(
        cell_id=CELL, users=2, turns=2, seed=1, requests=requests, answer_tokens=8, **cache
    )


def test_a_short_session_turn_is_an_eviction_only_with_the_cache_full() -> None:
    # From before the cache's size was journaled: any shortfall reads as an eviction.
    old = fold_workload(lines(sessions_record(90)), CELL).sessions
    assert old is not None and old.eviction_turn == 1
    assert b"shortfall_turn" not in encode_workload_receipt(
        fold_workload(lines(sessions_record(90)), CELL)
    )
    # Each user on a slot of its own with room: the rule disagrees, nothing was evicted.
    roomy = fold_workload(lines(sessions_record(90, slots=2, slot_context_tokens=4096)), CELL)
    assert roomy.sessions is not None
    assert roomy.sessions.eviction_turn is None and roomy.sessions.shortfall_turn == 1
    assert roomy.sessions.refusal == "workload.sessions.reuse_short"
    assert roomy.status == "refused"
    # One slot for two users: the evidence of an eviction.
    shared = fold_workload(lines(sessions_record(90, slots=1, slot_context_tokens=4096)), CELL)
    assert shared.sessions is not None and shared.sessions.eviction_turn == 1
    assert shared.sessions.refusal is None and shared.status == "accepted"
    # The expected reuse, achieved: nothing to report.
    met = fold_workload(lines(sessions_record(107, slots=2, slot_context_tokens=4096)), CELL)
    assert met.sessions is not None and met.status == "accepted"
    assert met.sessions.eviction_turn is None and met.sessions.shortfall_turn is None
