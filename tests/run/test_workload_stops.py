"""Workload cells stopped part way, as ordinary cells are: a signal during an overlap point, a
session or an open-loop rate keeps every point measured so far, journals the stopped point as
far as it went and names it (``workload_stopped``), lowers ``workload.json`` and ``cell.json``
to incomplete, ends the host and closes the journal so that replay is identical; a host gone
mid-point is a fault of the cell. Every user's turns reuse their own session on the
slot-aware FAKE host. All against the in-process FAKE llama-server on trio's fake clock."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from fake_hosts.fake_custody import FakeHostScript, fake_child_runner, fake_opener, hasher
from fake_hosts.fake_llama_http import Reply
from run_harness import (  # noqa: F401
    autojump_clock,
    cell,
    make_prepared,
    records,
    row,
    run,
    thread_aware_autojump,
)
from workload_harness import prepared_with, workload

from cache_family.actors.audit.replay import replay
from cache_family.actors.run import resume
from cache_family.actors.run.context import HostSettings
from cache_family.actors.run.matrix import supervise
from cache_family.schemas.journal import Cancellation, DeadlineExpired, Fault, JournalSealed
from cache_family.schemas.workload import validate_workload_object
from cache_family.schemas.workload_records import (
    OpenLoopStageMeasured,
    OverlapPointMeasured,
    SessionsMeasured,
    WorkloadStopped,
    decode_workload_receipt,
)
from cache_family.states.cache_reuse import probe_shapes
from cache_family.states.sessions import session_plan

OVERLAP = {
    "prompt_tokens": 64,
    "hit_ratios_pct": [0, 50, 90],
    "groups": 2,
    "requests": 4,
    "seed": 7,
}
SESSIONS = {
    "users": 2,
    "turns": 3,
    "system_prompt_tokens": 32,
    "user_context_tokens": 16,
    "question_tokens": 8,
    "answer_tokens": 4,
    "seed": 3,
}
OPEN_LOOP = {"pattern": "constant", "rates_per_s": [5, 10], "requests": 6, "output_tokens": 2}
# One priming request per group, then the measured ones: what one overlap point sends.
PER_POINT = OVERLAP["groups"] + OVERLAP["requests"]  # type: ignore[operator]
# The reuse probe's requests, sent as a native workload opens (before any point or turn).
PROBE = len(probe_shapes("exact-prefix", 64))


def hang_at(
    count: int, arrived: trio.Event, script: FakeHostScript | None = None
) -> Callable[..., Reply]:
    """Answer the workload's requests at once (token-id prompts; with ``script``: every
    request to the last host launched, once it is a workload's), and hang from the
    ``count``-th one (1-based) on, saying when it arrived."""
    seen = 0

    def reply(_index: int, body: dict[str, Any]) -> Reply:
        nonlocal seen
        if script is not None:
            ours = script.launched[-1].startswith("workload-")
        else:
            ours = isinstance(body.get("prompt"), list)
        if not ours:
            return Reply(first_token_delay=0.01)
        seen += 1
        if seen >= count:
            arrived.set()
            return Reply(behaviour="hang")
        return Reply(first_token_delay=0.01, token_delay=0.0)

    return reply


async def signal_when(arrived: trio.Event) -> None:
    await arrived.wait()
    os.kill(os.getpid(), signal.SIGTERM)  # caught by the run's signal receiver


def closed_cleanly(out: Path, script: FakeHostScript) -> None:
    """What every cancelled run guarantees: hosts ended, journal sealed, replay identical."""
    assert script.cleaned == script.launched
    [seal] = records(out, JournalSealed)
    assert seal.terminal_refusal == "cancelled"
    report = replay(str(out))
    assert report.exit_code == 0, report.lines


async def test_a_signal_mid_overlap_point_keeps_the_points_so_far_and_names_the_stopped_one(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,  # noqa: F811
) -> None:
    arrived = trio.Event()
    # The second point's third request hangs: two of its requests were answered.
    script = FakeHostScript(reply=hang_at(PROBE + PER_POINT + 3, arrived))
    out = tmp_path / "out"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(signal_when, arrived)
        outcome = await run(prepared_with(tmp_path / "p", prefix_overlap=OVERLAP), out, script)
    assert outcome.interrupted and outcome.status == "incomplete"
    points = records(out, OverlapPointMeasured)
    assert [(p.hit_ratio_pct, len(p.requests)) for p in points] == [(0, PER_POINT), (50, 2)]
    [stopped] = records(out, WorkloadStopped)
    assert (stopped.reason, stopped.point_index, stopped.sent) == ("cancelled", 1, 2)
    receipt = workload(out, "native-overlap")
    assert receipt.status == "incomplete"
    control, cut = receipt.overlap
    assert control.accepted and control.achieved_ratio_pct == 0.0
    assert not cut.accepted and cut.refusal == "workload.stopped"
    assert cut.measured_requests == 2 - OVERLAP["groups"]  # type: ignore[operator]
    overlap_cell = cell(out, "workload-native-overlap")
    assert overlap_cell.status == "incomplete" and overlap_cell.terminal_refusal == "cancelled"
    # The cell's own stop follows what the workload journaled of it.
    cancelled = [r for r in records(out, Cancellation) if r.cell_id == stopped.cell_id]
    assert len(cancelled) == 1
    assert row(out).status == "incomplete"
    closed_cleanly(out, script)


async def test_a_signal_mid_session_keeps_the_turns_sent(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,  # noqa: F811
) -> None:
    arrived = trio.Event()
    script = FakeHostScript(reply=hang_at(PROBE + 4, arrived))
    out = tmp_path / "out"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(signal_when, arrived)
        await run(prepared_with(tmp_path / "p", multi_turn=SESSIONS), out, script)
    [measured] = records(out, SessionsMeasured)
    assert [r.position for r in measured.requests] == [0, 1, 2]
    [stopped] = records(out, WorkloadStopped)
    assert (stopped.reason, stopped.point_index, stopped.sent) == ("cancelled", None, 3)
    receipt = workload(out, "native-sessions")
    assert receipt.status == "incomplete" and receipt.sessions is not None
    assert sum(t.requests for t in receipt.sessions.by_turn) == 3
    assert cell(out, "workload-native-sessions").status == "incomplete"
    closed_cleanly(out, script)


async def test_a_signal_mid_rate_keeps_the_rates_before_and_what_the_cut_rate_sent(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,  # noqa: F811
) -> None:
    arrived = trio.Event()
    # The first rate sends 6; the second rate's third send hangs.
    script = FakeHostScript()
    script.reply = hang_at(6 + 3, arrived, script)
    out = tmp_path / "out"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(signal_when, arrived)
        await run(prepared_with(tmp_path / "p", open_loop=OPEN_LOOP), out, script)
    stages = records(out, OpenLoopStageMeasured)
    assert [(s.target_rate_per_s, s.completed) for s in stages] == [(5, 6), (10, 2)]
    assert stages[1].stop_reason is None  # not over-saturated: cut from outside
    [stopped] = records(out, WorkloadStopped)
    assert (stopped.reason, stopped.point_index) == ("cancelled", 1)
    assert stopped.sent == stages[1].launched >= 3
    receipt = workload(out, "native-open-loop")
    assert receipt.status == "incomplete" and receipt.over_saturated_at_per_s is None
    closed_cleanly(out, script)


async def test_a_host_gone_mid_point_is_a_fault_of_the_cell_with_the_point_kept(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,  # noqa: F811
) -> None:
    seen = 0
    script = FakeHostScript()

    def exit_at_the_third(_index: int, body: dict[str, Any]) -> Reply:
        nonlocal seen
        if not isinstance(body.get("prompt"), list):
            return Reply(first_token_delay=0.01)
        seen += 1
        if seen == PROBE + 3:
            script.exited = True  # the host is gone: its request fails
            return Reply(behaviour="http_500")
        return Reply(first_token_delay=0.01)

    script.reply = exit_at_the_third
    out = tmp_path / "out"
    outcome = await run(prepared_with(tmp_path / "p", prefix_overlap=OVERLAP), out, script)
    assert not outcome.interrupted
    [point] = records(out, OverlapPointMeasured)
    assert [r.status for r in point.requests] == ["completed", "completed", "failed"]
    [stopped] = records(out, WorkloadStopped)
    assert (stopped.reason, stopped.point_index, stopped.sent) == ("host-exited", 0, 3)
    faults = [f for f in records(out, Fault) if f.cell_id == stopped.cell_id]
    assert [f.kind for f in faults] == ["child_exited"]
    assert workload(out, "native-overlap").status == "incomplete"
    assert cell(out, "workload-native-overlap").status == "incomplete"
    assert replay(str(out)).exit_code == 0


async def test_the_cells_work_deadline_mid_point_keeps_the_points_so_far(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,  # noqa: F811
) -> None:
    """Each workload request takes 4 s and the cell has 60 after its probe's: the third point
    is cut by the cell's work deadline, journaled as far as it went and named, as a ladder
    cut there."""

    def slow_workload(_index: int, body: dict[str, Any]) -> Reply:
        slow = isinstance(body.get("prompt"), list)
        return Reply(first_token_delay=4.0 if slow else 0.01, token_delay=0.0)

    script = FakeHostScript(reply=slow_workload)
    out = tmp_path / "out"
    prepared = prepared_with(
        tmp_path / "p",
        top={"cell_seconds": 60 + 4 * PROBE, "request_timeout_ms": 600_000},
        prefix_overlap=OVERLAP,
    )
    outcome = await run(prepared, out, script)
    assert not outcome.interrupted
    points = records(out, OverlapPointMeasured)
    assert [len(p.requests) for p in points[:2]] == [PER_POINT, PER_POINT]
    [stopped] = records(out, WorkloadStopped)
    assert (stopped.reason, stopped.point_index) == ("deadline", 2)
    assert stopped.sent == len(points[2].requests) < PER_POINT
    expired = [r for r in records(out, DeadlineExpired) if r.cell_id == stopped.cell_id]
    assert len(expired) == 1
    receipt = workload(out, "native-overlap")
    assert receipt.status == "incomplete"
    assert [p.refusal for p in receipt.overlap][2] == "workload.stopped"
    overlap_cell = cell(out, "workload-native-overlap")
    assert overlap_cell.status == "incomplete"
    assert overlap_cell.terminal_refusal == "deadline_expired"
    assert script.cleaned == script.launched
    assert replay(str(out)).exit_code == 0


async def test_every_users_turns_reuse_their_own_session(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,  # noqa: F811
) -> None:
    """The FAKE host keeps a slot per ``id_slot`` as llama-server does, and a request that
    names none lands on the slot sharing the most with it (the shared system prompt: the
    other user's slot). Each user's turns name the user's slot, so every turn reuses the
    whole session so far, less the last answer token."""
    script = FakeHostScript()
    out = tmp_path / "out"
    outcome = await run(prepared_with(tmp_path / "p", multi_turn=SESSIONS), out, script)
    assert outcome.status == "completed"
    [measured] = records(out, SessionsMeasured)
    plan = session_plan(validate_workload_object({"schema_version": 1, "multi_turn": SESSIONS})
                        .multi_turn, "exact-prefix")  # type: ignore[arg-type]  # fmt: skip
    assert [(r.group, r.turn) for r in measured.requests] == [(t.user, t.turn) for t in plan]
    for request, planned in zip(measured.requests, plan, strict=True):
        assert request.slot_id == planned.user
        assert request.cached_tokens == planned.expected_reused_tokens > 0 or planned.turn == 0
        assert request.prompt_tokens == planned.prompt_tokens
    receipt = workload(out, "native-sessions")
    assert receipt.status == "accepted" and receipt.sessions is not None
    assert receipt.sessions.eviction_turn is None
    assert all(
        t.achieved_reused_tokens == t.expected_reused_tokens for t in receipt.sessions.by_turn
    )
    assert not records(out, WorkloadStopped)


# --- resume ----------------------------------------------------------------------------------


def fake_hosts(script: FakeHostScript) -> HostSettings:
    return HostSettings(
        host_opener=fake_opener(script),
        pin_hasher=hasher(),
        row_pins=None,
        child_runner=fake_child_runner(),
    )


@pytest.mark.parametrize("where", ["in-workload", "before-workload"])
def test_resume_of_a_run_stopped_in_or_before_its_workloads_measures_them_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The run is stopped mid overlap point (or in the concurrent cell's ladder, before any
    workload), then resumed: the row runs again afresh, every workload completes with each
    point's plan sent once (the interrupted attempt's requests are not counted), the stopped
    attempt's receipts move to ``superseded/`` and replay finds every receipt identical."""
    prepared = prepared_with(tmp_path / "p", prefix_overlap=OVERLAP, multi_turn=SESSIONS)
    out = tmp_path / "out"

    async def stopped_run() -> None:
        arrived = trio.Event()
        script = FakeHostScript()
        if where == "in-workload":
            script.reply = hang_at(PROBE + PER_POINT + 3, arrived)
        else:

            def hang_in_the_ladder(_index: int, body: dict[str, Any]) -> Reply:
                if script.launched[-1] == "sweep-native-concurrent" and body.get("stream"):
                    arrived.set()
                    return Reply(behaviour="hang")
                return Reply(first_token_delay=0.01)

            script.reply = hang_in_the_ladder
        async with trio.open_nursery() as nursery:
            nursery.start_soon(signal_when, arrived)
            outcome = await run(prepared, out, script)
        assert outcome.interrupted

    with thread_aware_autojump() as clock:
        trio.run(stopped_run, clock=clock)
    stopped_points = len(records(out, OverlapPointMeasured))
    assert stopped_points == (2 if where == "in-workload" else 0)
    # In-process, the runner that wrote the journal is this very process, alive.
    monkeypatch.setattr(resume, "refuse_while_runner_lives", lambda _lines: None)
    admitted, resumption, _notes = resume.plan_resumption(str(out))
    assert resumption.record.rerun_rows == (0,)
    script = FakeHostScript()
    with thread_aware_autojump() as clock:
        outcome = trio.run(supervise, admitted, fake_hosts(script), None, resumption, clock=clock)
    assert outcome.status == "completed" and not outcome.interrupted
    overlap = workload(out, "native-overlap")
    assert overlap.status == "accepted"
    assert [p.hit_ratio_pct for p in overlap.overlap] == OVERLAP["hit_ratios_pct"]
    assert all(p.accepted and p.measured_requests == OVERLAP["requests"] for p in overlap.overlap)
    sessions = workload(out, "native-sessions")
    assert sessions.status == "accepted" and sessions.sessions is not None
    assert sum(t.requests for t in sessions.sessions.by_turn) == 2 * 3
    # The new attempt journaled every point once more, after the stopped attempt's.
    assert len(records(out, OverlapPointMeasured)) == stopped_points + 3
    assert row(out).status == "completed"
    superseded = out / resumption.record.superseded_dir
    if where == "in-workload":
        old = superseded / "cell-0000" / "workload-native-overlap" / "workload.json"
        assert decode_workload_receipt(old.read_bytes()).status == "incomplete"
    report = replay(str(out))
    assert report.exit_code == 0, report.lines
    assert "cell-0000/workload-native-overlap/workload.json" in report.identical
    if where == "in-workload":
        assert (
            f"{resumption.record.superseded_dir}/cell-0000/workload-native-overlap/workload.json"
            in report.identical
        )
