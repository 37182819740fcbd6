"""The open-loop sender (actors/run/open_loop.py) on trio's autojump clock: sends keep their
schedule whatever earlier requests do, every index ends with one row, and the sender stops on
over-saturation (a queue that keeps growing, or a sender that fell behind) and on its deadline,
saying why. Then through the real request code against the calibration server."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import trio
import trio.abc
import trio.testing

from cache_family.actors.run.calibration_server import CalibrationServer, Pace
from cache_family.actors.run.open_loop import (
    Exchange,
    OpenLoopEvent,
    OpenLoopSender,
    load_exchange,
    run_rates,
)
from cache_family.schemas.measurement import RequestRow
from cache_family.schemas.workload import OpenLoop, OverSaturation, RateSweep
from cache_family.states.arrivals import SaturationWatch, arrival_schedule


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def served_in(seconds: float | None) -> Exchange:
    """A FAKE exchange: each request takes ``seconds`` of (fake) time; None: never ends."""

    async def exchange(index: int) -> RequestRow:
        await trio.sleep(math.inf if seconds is None else seconds)
        return RequestRow(request_id=index, status="completed", elapsed_ms=seconds)

    return exchange


async def test_sends_keep_their_schedule_while_earlier_requests_are_in_flight(
    autojump_clock: trio.testing.MockClock,
) -> None:
    schedule = arrival_schedule("constant", 10.0, seed=0, requests=20)
    events: list[OpenLoopEvent] = []
    sender = OpenLoopSender(
        schedule,
        served_in(0.5),
        target_rate_per_s=10.0,
        pattern="constant",
        watch=SaturationWatch(OverSaturation(window=8, min_in_flight=8)),
        events=events.append,
    )
    outcome = await sender.run()
    assert [row.request_id for row in outcome.rows] == list(range(20))
    assert all(row.status == "completed" for row in outcome.rows)
    # On the fake clock a send is stamped at the very time it was scheduled.
    assert [s.sent_s for s in outcome.sends] == list(schedule)
    assert outcome.lateness is not None and outcome.lateness.max_ms == 0.0
    # Five requests of 0.5 s at 10/s overlap: the sender never waited for an answer.
    assert 5 <= max(s.in_flight for s in outcome.sends) <= 6
    assert outcome.achieved_rate_per_s == pytest.approx(10.0)
    assert outcome.rate_error == pytest.approx(0.0, abs=1e-9)
    assert outcome.fit is not None and outcome.fit.value == pytest.approx(0.0, abs=1e-9)
    assert outcome.stop_reason is None and outcome.saturation is None
    assert outcome.completed_per_s == pytest.approx(20 / (1.9 + 0.5))
    assert [e.kind for e in events] == ["started", "finished"]


async def test_a_queue_that_drains_ever_slower_stops_as_over_saturated(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def ever_slower(index: int) -> RequestRow:
        await trio.sleep(0.02 * index)  # each answer takes longer: the queue grows
        return RequestRow(request_id=index, status="completed")

    schedule = arrival_schedule("poisson", 50.0, seed=3, requests=400)
    events: list[OpenLoopEvent] = []
    rule = OverSaturation(window=16, min_in_flight=8)
    sender = OpenLoopSender(
        schedule,
        ever_slower,
        target_rate_per_s=50.0,
        pattern="poisson",
        watch=SaturationWatch(rule),
        events=events.append,
    )
    outcome = await sender.run()
    assert outcome.stop_reason == "workload.arrivals.in_flight_growing"
    saturation = outcome.saturation
    assert saturation is not None and saturation.in_flight >= rule.min_in_flight
    assert rule.window <= saturation.send_index < outcome.launched < 400
    statuses = [row.status for row in outcome.rows]
    assert statuses[0] == "completed" and statuses[-1] == "not-launched"
    cut = [row for row in outcome.rows if row.status == "incomplete"]
    assert cut and all("workload.arrivals.in_flight_growing" in (r.error or "") for r in cut)
    assert [e.kind for e in events] == ["started", "stopped", "finished"]
    assert events[1].saturation == outcome.saturation


async def test_a_server_that_never_answers_stops_at_the_in_flight_cap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rule = OverSaturation(window=16, max_in_flight=40)
    sender = OpenLoopSender(
        arrival_schedule("constant", 100.0, seed=0, requests=400),
        served_in(None),
        target_rate_per_s=100.0,
        pattern="constant",
        watch=SaturationWatch(rule),
    )
    outcome = await sender.run()
    assert outcome.stop_reason == "workload.arrivals.in_flight_growing"
    assert outcome.saturation is not None and outcome.saturation.in_flight == 41
    assert outcome.launched == 41
    assert [r.status for r in outcome.rows[:41]] == ["incomplete"] * 41


async def test_a_sender_that_falls_behind_stops_as_late(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def stalls_the_process(index: int) -> RequestRow:
        if index == 3:
            # The whole process stood still for 2 s (a stopped VM, a swap storm): trio's
            # time moved on without any task running.
            autojump_clock.jump(2.0)
        return RequestRow(request_id=index, status="completed")

    sender = OpenLoopSender(
        arrival_schedule("constant", 100.0, seed=0, requests=50),
        stalls_the_process,
        target_rate_per_s=100.0,
        pattern="constant",
        watch=SaturationWatch(OverSaturation(max_lateness_ms=500)),
    )
    outcome = await sender.run()
    assert outcome.stop_reason == "workload.arrivals.sender_late"
    saturation = outcome.saturation
    assert saturation is not None
    # Sends 4, 5, ... were all overdue at once; whichever of them ran first stopped the run.
    assert 4 <= saturation.send_index < outcome.launched < 50
    assert saturation.lateness_ms == pytest.approx(2000.0 - 10 * (saturation.send_index - 3))
    assert [row.status for row in outcome.rows[:4]] == ["completed"] * 4
    assert outcome.rows[-1].status == "not-launched"


async def test_the_deadline_cuts_what_is_in_flight_and_sends_nothing_after_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    start = trio.current_time()
    sender = OpenLoopSender(
        arrival_schedule("constant", 10.0, seed=0, requests=30),
        served_in(0.35),
        target_rate_per_s=10.0,
        pattern="constant",
        deadline=start + 1.0,
    )
    outcome = await sender.run()
    assert outcome.stop_reason == "load.deadline"
    assert outcome.launched == 10  # sends at 0.0 .. 0.9
    statuses = [row.status for row in outcome.rows]
    # Requests sent by 0.6 ended by 0.95; those sent at 0.7 .. 0.9 were cut at 1.0.
    assert statuses[:7] == ["completed"] * 7
    assert statuses[7:10] == ["incomplete"] * 3
    assert statuses[10:] == ["not-launched"] * 20


class TickingClock(trio.abc.Clock):
    """A FAKE clock that moves by ``tick`` seconds at every reading, so a loop that watches
    the time (the sender's spin) sees it move without any real time passing; when nothing
    can run, it jumps to the next deadline at once, as the autojump clock does."""

    def __init__(self, tick: float) -> None:
        self.tick = tick
        self.now = 0.0
        self.readings = 0

    def start_clock(self) -> None:
        pass

    def current_time(self) -> float:
        self.readings += 1
        self.now += self.tick
        return self.now

    def deadline_to_sleep_time(self, deadline: float) -> float:
        if not math.isfinite(deadline):
            return math.inf
        self.now = max(self.now, deadline)
        return 0.0


def test_a_spinning_sender_never_sends_early() -> None:
    spin_s = 0.002
    spins: list[int] = []

    async def main() -> None:
        schedule = arrival_schedule("poisson", 200.0, seed=5, requests=20)
        sender = OpenLoopSender(
            schedule, served_in(0.01), target_rate_per_s=200.0, pattern="poisson", spin_s=spin_s
        )
        outcome = await sender.run()
        assert [row.status for row in outcome.rows] == ["completed"] * 20
        assert all(s.sent_s >= s.scheduled_s for s in outcome.sends)
        # The spin, not the sleep, reached each send time: within its window.
        assert all(s.sent_s - s.scheduled_s < spin_s for s in outcome.sends)
        spins.append(len(outcome.sends))

    clock = TickingClock(tick=1e-5)
    trio.run(main, clock=clock)
    assert spins == [20]
    # Each send watched the clock through (most of) its spin window; a sleep reads it a few
    # times only.
    assert clock.readings > 20 * (spin_s / clock.tick) / 2


def test_a_schedule_must_be_ascending() -> None:
    with pytest.raises(ValueError, match="ascending"):
        OpenLoopSender([0.0, 0.2, 0.1], served_in(0.1), target_rate_per_s=1.0, pattern="constant")


async def test_a_schedule_drawn_one_send_at_a_time_is_sent_as_the_whole_one_would_be(
    autojump_clock: trio.testing.MockClock,
) -> None:
    schedule = arrival_schedule("poisson", 20.0, seed=4, requests=30)
    drawn: list[float] = []

    def lazily() -> Iterator[float]:
        for at in schedule:
            drawn.append(at)
            yield at

    start = trio.current_time()
    # The deadline falls inside the schedule: the sender stops drawing at the send past it.
    deadline = start + schedule[19] + 1e-6
    whole = await OpenLoopSender(
        schedule, served_in(0.05), target_rate_per_s=20.0, pattern="poisson", deadline=deadline
    ).run()
    start = trio.current_time()
    deadline = start + schedule[19] + 1e-6
    sender = OpenLoopSender(
        lazily(), served_in(0.05), target_rate_per_s=20.0, pattern="poisson", deadline=deadline
    )
    assert sender.scheduled == 0
    lazy = await sender.run()
    assert lazy.scheduled == whole.scheduled == 30
    assert lazy.launched == whole.launched == 20
    assert [r.status for r in lazy.rows] == [r.status for r in whole.rows]
    assert lazy.stop_reason == whole.stop_reason == "load.deadline"
    assert [s.sent_s for s in lazy.sends] == pytest.approx([s.sent_s for s in whole.sends])
    # The rest of the schedule was drawn only to be counted: every index has its row.
    assert drawn == list(schedule)


async def test_a_drawn_schedule_that_goes_back_in_time_is_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sender = OpenLoopSender(
        iter([0.0, 0.2, 0.1]), served_in(0.01), target_rate_per_s=10.0, pattern="constant"
    )
    with pytest.raises(ValueError, match="ascending"):
        await sender.run()


@pytest.mark.parametrize("one_prompt", [False, True], ids=["prompt-per-send", "one-prompt"])
async def test_open_loop_through_the_real_request_code_against_the_calibration_server(
    autojump_clock: trio.testing.MockClock, one_prompt: bool
) -> None:
    # 20 ms to first token, then 5 ms per token, 8 tokens: 55 ms a request, sent every 10 ms.
    server = CalibrationServer(Pace(ttft_ms=20.0, itl_ms=5.0, tokens=8))
    schedule = arrival_schedule("poisson", 100.0, seed=11, requests=40)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, 0)
        exchange = load_exchange(
            f"http://127.0.0.1:{port}",
            "one prompt for every send" if one_prompt else (lambda index: f"prompt {index}"),
            output_tokens=8,
            request_timeout_ms=10_000,
        )
        outcome = await OpenLoopSender(
            schedule, exchange, target_rate_per_s=100.0, pattern="poisson"
        ).run()
        nursery.cancel_scope.cancel()
    assert [row.status for row in outcome.rows] == ["completed"] * 40, outcome.rows[0]
    assert [row.request_id for row in outcome.rows] == list(range(40))
    assert all(row.tokens_predicted == 8 and row.timings is not None for row in outcome.rows)
    assert len(server.stamps) == 40
    # Requests overlapped: the server held more than one at a time.
    assert max(s.in_flight for s in outcome.sends) > 1
    assert [s.sent_s for s in outcome.sends] == list(schedule)
    assert outcome.fit is not None and outcome.fit.statistic == "kolmogorov-smirnov"


def server_of_capacity(slots: int, service_s: float) -> Exchange:
    """A FAKE server: ``slots`` requests served at once, each in ``service_s``; the rest
    wait their turn (so it sustains ``slots / service_s`` requests a second)."""
    lanes = trio.Semaphore(slots)

    async def exchange(index: int) -> RequestRow:
        async with lanes:
            await trio.sleep(service_s)
        return RequestRow(request_id=index, status="completed")

    return exchange


async def test_a_sweep_measures_both_ends_then_runs_the_rates_between(
    autojump_clock: trio.testing.MockClock,
) -> None:
    spec = OpenLoop(
        pattern="constant",
        sweep=RateSweep(points=3, throughput_concurrency=16),
        requests=80,
        over_saturation=OverSaturation(window=16, min_in_flight=8),
    )
    stages = await run_rates(spec, server_of_capacity(4, 0.1))
    assert [s.kind for s in stages] == ["synchronous", "throughput", "rate", "rate", "rate"]
    assert stages[0].measured_rate_per_s == pytest.approx(10.0)  # one at a time: 1 / 0.1 s
    assert stages[1].measured_rate_per_s == pytest.approx(40.0)  # four lanes at once
    assert [s.target_rate_per_s for s in stages[2:]] == pytest.approx([17.5, 25.0, 32.5])
    for stage in stages[2:]:
        assert stage.outcome is not None and stage.outcome.stop_reason is None
        assert all(row.status == "completed" for row in stage.outcome.rows)


async def test_the_first_rate_that_over_saturates_ends_the_workload(
    autojump_clock: trio.testing.MockClock,
) -> None:
    spec = OpenLoop(
        pattern="poisson",
        rates_per_s=[10, 30, 60, 80],
        requests=600,
        seed=7,
    )  # the default rule: 128-send windows (a 32-send one takes 30/s of 40 for growth)
    events: list[OpenLoopEvent] = []
    stages = await run_rates(spec, server_of_capacity(4, 0.1), events=events.append)
    assert [s.target_rate_per_s for s in stages] == [10, 30, 60, 80]
    low, middle, high, skipped = stages
    for stage in (low, middle):
        assert stage.outcome is not None and stage.outcome.stop_reason is None
    assert high.outcome is not None
    assert high.outcome.stop_reason == "workload.arrivals.in_flight_growing"
    assert skipped.outcome is None
    assert skipped.skipped_because == "workload.arrivals.in_flight_growing at 60.0/s"
    assert [e.kind for e in events].count("stopped") == 1
