"""The fold of a workload cell's records into ``workload.json``: the verdicts are the fold's,
from the server's figures the records carry, so replay reproduces them from the journal."""

from __future__ import annotations

from cache_family.actors.audit.replay import REFOLDERS
from cache_family.schemas.journal import JournalLine, Record
from cache_family.schemas.workload_records import (
    OpenLoopStageMeasured,
    OverlapPointMeasured,
    SessionsMeasured,
    WorkloadOpened,
    WorkloadRequest,
    decode_workload_receipt,
    encode_workload_receipt,
)
from cache_family.states.fold import JournalIndex, refold
from cache_family.states.workload_fold import SCOPE_WORKLOAD, fold_workload

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
