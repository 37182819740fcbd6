"""The open-loop sender: requests go out on a drawn schedule whether or not earlier ones ended."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from itertools import pairwise
from typing import Literal

import msgspec
import trio

from cache_family.actors.run.load import LOAD_DIALECTS, LoadRun
from cache_family.schemas.host_kinds import RequestDialect
from cache_family.schemas.measurement import LoadRequest, RequestRow
from cache_family.schemas.workload import OpenLoop
from cache_family.states.arrivals import (
    ArrivalPattern,
    GoodnessOfFit,
    Lateness,
    Saturation,
    SaturationCode,
    SaturationWatch,
    achieved_rate,
    arrival_schedule,
    goodness_of_fit,
    lateness,
    sweep_rates,
)
from cache_family.system.http import LoopbackHttp
from cache_family.system.wake import PreciseWake

Exchange = Callable[[int], Awaitable[RequestRow]]
#: How long before a send the sender stops sleeping and watches the time (see ``_until``):
#: off by default, since on a shared host the spin's CPU costs more than the millisecond.
DEFAULT_SPIN_S = 0.0
StopReason = SaturationCode | Literal["load.deadline"]


class SendStamp(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One send as it happened: seconds from the run's start (scheduled and actual) and the
    requests in flight once it was sent (itself included)."""

    index: int
    scheduled_s: float
    sent_s: float
    in_flight: int


class OpenLoopEvent(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """What the sender reports as it goes (the run journals these)."""

    kind: Literal["started", "stopped", "finished"]
    scheduled: int
    launched: int
    target_rate_per_s: float
    stop_reason: StopReason | None = None
    saturation: Saturation | None = None


class OpenLoopOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """One open-loop rate, measured."""

    target_rate_per_s: float
    # None: a recorded schedule (a trace's timestamps), drawn from no pattern.
    pattern: ArrivalPattern | None
    scheduled: int
    launched: int
    sends: tuple[SendStamp, ...]
    # The complete roster, one row per scheduled index, by index.
    rows: tuple[RequestRow, ...]
    # Sends per second between the first send and the last one.
    achieved_rate_per_s: float | None
    lateness: Lateness | None
    fit: GoodnessOfFit | None
    # Completed requests per second, from the first send to the last completed answer.
    completed_per_s: float | None
    stop_reason: StopReason | None = None
    saturation: Saturation | None = None

    @property
    def rate_error(self) -> float | None:
        """Achieved rate relative to the target (0.01: one percent too fast)."""
        if self.achieved_rate_per_s is None:
            return None
        return self.achieved_rate_per_s / self.target_rate_per_s - 1.0


class OpenLoopSender:
    """Sends ``schedule`` (offsets in seconds, ascending, from the run's start): a sequence,
    or a finite iterator drawn one send at a time (what is left of it when the sender stops
    is counted, not kept)."""

    def __init__(
        self,
        schedule: Iterable[float],
        exchange: Exchange,
        *,
        target_rate_per_s: float,
        pattern: ArrivalPattern | None,
        burstiness: float | None = None,
        watch: SaturationWatch | None = None,
        deadline: float | None = None,
        events: Callable[[OpenLoopEvent], None] | None = None,
        spin_s: float = DEFAULT_SPIN_S,
    ) -> None:
        self._scheduled: int | None = None
        if isinstance(schedule, Sequence):
            if any(b < a for a, b in pairwise(schedule)):
                raise ValueError("the schedule must be ascending")
            self._scheduled = len(schedule)
        self._schedule: Iterator[float] = iter(schedule)
        self.exchange = exchange
        self.target_rate_per_s = target_rate_per_s
        self.pattern: ArrivalPattern | None = pattern
        self.burstiness = burstiness
        self.watch = watch
        self.deadline = math.inf if deadline is None else deadline
        self._events = events
        self.spin_s = spin_s
        self._start = 0.0
        self._drawn = 0
        self._launched = 0
        self._in_flight = 0
        self._stamps: list[SendStamp] = []
        self._rows: dict[int, RequestRow] = {}
        self._last_completed: float | None = None
        self._stop_reason: StopReason | None = None
        self._saturation: Saturation | None = None
        self._scope: trio.CancelScope | None = None
        # The sends' own timers (one per send waiting at once), kept for the next sends.
        self._idle_wakes: list[PreciseWake] = []
        self._wakes: ExitStack | None = None  # closes them when the run ends

    def __repr__(self) -> str:
        of = "?" if self._scheduled is None else self._scheduled
        return (
            f"<OpenLoopSender rate={self.target_rate_per_s:g}/s launched={self._launched}"
            f"/{of} in_flight={self._in_flight} stop={self._stop_reason}>"
        )

    @property
    def scheduled(self) -> int:
        """The schedule's length: known from the start for a sequence; for an iterator, the
        sends drawn so far until the sender ends, then all of them."""
        return self._drawn if self._scheduled is None else self._scheduled

    def _emit(self, kind: Literal["started", "stopped", "finished"]) -> None:
        if self._events is not None:
            self._events(
                OpenLoopEvent(
                    kind=kind,
                    scheduled=self.scheduled,
                    launched=self._launched,
                    target_rate_per_s=self.target_rate_per_s,
                    stop_reason=self._stop_reason,
                    saturation=self._saturation,
                )
            )

    async def run(self) -> OpenLoopOutcome:
        self._start = trio.current_time()
        self._emit("started")
        exhausted = descending = False
        with trio.CancelScope(deadline=self.deadline) as scope, ExitStack() as wakes:
            self._scope, self._wakes = scope, wakes
            async with trio.open_nursery() as nursery:
                previous = -math.inf
                went: trio.Event | None = None
                for index, offset in enumerate(self._schedule):
                    if offset < previous:
                        descending = True
                        nursery.cancel_scope.cancel()
                        break
                    previous, self._drawn = offset, index + 1
                    at = self._start + offset
                    if at >= self.deadline:
                        break
                    # Each send's task starts as the one before it goes and waits out the
                    # rest itself on its precise timer: no pass of the event loop lies
                    # between its wake and its request, and the sender itself never sleeps
                    # (a trio sleep ends in a cancellation, whose delivery costs more).
                    if went is not None:
                        await went.wait()
                    went = trio.Event()
                    nursery.start_soon(self._one, index, offset, went)
                else:
                    exhausted = True
        if descending:
            raise ValueError("the schedule must be ascending")
        if scope.cancelled_caught and self._stop_reason is None:
            self._stop_reason = "load.deadline"
        elif not exhausted and self._stop_reason is None:
            self._stop_reason = "load.deadline"  # the next send lay past the deadline
        if self._stop_reason is not None:
            self._emit("stopped")
        outcome = self.outcome()
        self._emit("finished")
        return outcome

    async def _until(self, at: float) -> None:
        """Sleep until ``at`` on the kernel's high-resolution timer (``PreciseWake``: the
        event loop's own poll wakes on whole milliseconds); at once when ``at`` has passed.
        With ``spin_s``, the last ``spin_s`` before a send are spent in checkpoints, which
        still run every other task while the time is watched (it needs a clock that moves by
        itself: not an autojump clock, which never goes idle)."""
        if trio.current_time() >= at:
            return
        if self._idle_wakes:
            wake = self._idle_wakes.pop()
        else:
            assert self._wakes is not None  # only the run's sends wait
            wake = self._wakes.enter_context(PreciseWake())
        try:
            await wake.sleep_until(at - self.spin_s if self.spin_s > 0 else at)
        finally:
            self._idle_wakes.append(wake)
        while trio.current_time() < at:
            await trio.lowlevel.checkpoint()

    async def _one(self, index: int, offset: float, went: trio.Event) -> None:
        try:
            await self._until(self._start + offset)
        finally:
            went.set()
        sent = trio.current_time()
        self._launched += 1
        self._in_flight += 1
        self._stamps.append(
            SendStamp(
                index=index,
                scheduled_s=offset,
                sent_s=sent - self._start,
                in_flight=self._in_flight,
            )
        )
        try:
            if self.watch is not None and self._saturation is None:
                found = self.watch.observe(self._in_flight, sent - (self._start + offset))
                if found is not None:
                    self._stop(found)
                    return
            row = await self.exchange(index)
            self._rows[index] = row
            if self.watch is not None:
                self.watch.answered()
            if row.status == "completed":
                self._last_completed = trio.current_time()
        finally:
            self._in_flight -= 1

    def _stop(self, saturation: Saturation) -> None:
        """Over-saturated: send nothing more and cut what is in flight."""
        self._saturation = saturation
        self._stop_reason = saturation.code
        assert self._scope is not None
        self._scope.cancel()

    def outcome(self) -> OpenLoopOutcome:
        if self._scheduled is None:
            # What the sender did not draw is counted (every index gets its row), not kept.
            self._scheduled = self._drawn + sum(1 for _ in self._schedule)
        rows: list[RequestRow] = []
        reason = self._stop_reason or "stopped"
        launched = {stamp.index for stamp in self._stamps}
        for index in range(self._scheduled):
            row = self._rows.get(index)
            if row is None:
                row = (
                    RequestRow(
                        request_id=index,
                        status="incomplete",
                        error=f"still in flight when the sender stopped ({reason})",
                    )
                    if index in launched
                    else RequestRow(request_id=index, status="not-launched")
                )
            rows.append(row)
        stamps = sorted(self._stamps, key=lambda s: s.index)
        sent = [s.sent_s for s in stamps]
        completed = sum(1 for row in rows if row.status == "completed")
        completed_per_s = None
        if completed and self._last_completed is not None and stamps:
            span = self._last_completed - self._start - stamps[0].sent_s
            completed_per_s = completed / span if span > 0 else None
        return OpenLoopOutcome(
            target_rate_per_s=self.target_rate_per_s,
            pattern=self.pattern,
            scheduled=self._scheduled,
            launched=self._launched,
            sends=tuple(stamps),
            rows=tuple(rows),
            achieved_rate_per_s=achieved_rate(sent),
            lateness=lateness([s.scheduled_s for s in stamps], sent),
            fit=None
            if self.pattern is None
            else goodness_of_fit(self.pattern, self.target_rate_per_s, sent, self.burstiness),
            completed_per_s=completed_per_s,
            stop_reason=self._stop_reason,
            saturation=self._saturation,
        )


def load_exchange(
    base_url: str,
    prompt: Callable[[int], str] | str,
    *,
    output_tokens: int,
    request_timeout_ms: int,
    dialect: RequestDialect = "completion",
    model_id: str = "",
    client: LoopbackHttp | None = None,
    ignore_eos: bool = False,
) -> Exchange:
    """One streamed request per send in ``dialect`` (llama.cpp's ``/completion``, or OpenAI
    chat to ``model_id``), through its ladder load client (``LOAD_DIALECTS``: the closed
    loop's request code, its protocol checks, its timeout, its row)."""
    http = client or LoopbackHttp()
    run_for = LOAD_DIALECTS[dialect]

    def load_run(text: str) -> LoadRun:
        request = LoadRequest(
            base_url=base_url,
            prompt=text,
            requests=1,
            concurrency=1,
            output_tokens=output_tokens,
            stream=True,
            request_timeout_ms=request_timeout_ms,
            ignore_eos=ignore_eos,
        )
        return run_for(request, model_id, client=http, stop_on_failure=False)

    # One prompt: one run sends every request (its setup is not paid per send).
    shared = None if callable(prompt) else load_run(prompt)

    async def exchange(index: int) -> RequestRow:
        run = shared if shared is not None else load_run(prompt(index))  # type: ignore[operator]
        row = await run.send_one(http, 0)
        return msgspec.structs.replace(row, request_id=index)

    return exchange


# --- a workload's rates: explicit, or GuideLLM's sweep -------------------------------------------


StageKind = Literal["synchronous", "throughput", "rate"]


class RateStage(msgspec.Struct, frozen=True, kw_only=True):
    """One stage of an open-loop workload: a closed-loop measurement of the rate the server
    sustains (one at a time, or as many as allowed at once), or one open-loop target rate,
    or a rate not run because a lower one already over-saturated the server."""

    kind: StageKind
    target_rate_per_s: float | None = None
    # Closed-loop stages: completed requests per second over the stage.
    measured_rate_per_s: float | None = None
    completed: int = 0
    outcome: OpenLoopOutcome | None = None
    skipped_because: str | None = None
    # The rate was cut short by a stop from outside (its outcome: what was sent until then).
    interrupted: bool = False


async def closed_loop_rate(
    exchange: Exchange,
    *,
    concurrency: int,
    requests: int | None = None,
    duration_s: float | None = None,
) -> tuple[float | None, int]:
    """Completed requests per second (and how many) of a closed loop: ``concurrency``
    requests in flight, each followed at once by the next, until ``requests`` were sent or
    ``duration_s`` passed."""
    if (requests is None) == (duration_s is None):
        raise ValueError("give requests or duration_s")
    start = trio.current_time()
    end = math.inf if duration_s is None else start + duration_s
    next_index = 0
    completed = 0
    last_end = start

    async def worker() -> None:
        nonlocal next_index, completed, last_end
        while trio.current_time() < end and (requests is None or next_index < requests):
            index = next_index
            next_index += 1
            row = await exchange(index)
            if row.status == "completed":
                completed += 1
                last_end = trio.current_time()

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    span = last_end - start
    return (completed / span if completed and span > 0 else None), completed


async def run_rates(
    spec: OpenLoop,
    exchange: Exchange,
    *,
    events: Callable[[OpenLoopEvent], None] | None = None,
    deadline: float | None = None,
    on_stage: Callable[[RateStage], Awaitable[None]] | None = None,
) -> tuple[RateStage, ...]:
    """Every rate of an open-loop workload, lowest first. A sweep first measures the rate
    one request at a time and the rate as fast as possible, then runs ``points`` rates
    evenly between. The first rate that over-saturates the server ends the workload: the
    rates above it are recorded as skipped, with the reason. Rate ``i`` draws its schedule
    from ``seed + i``. ``on_stage`` hears each stage as it ends, a rate cut short by a stop
    from outside too (``interrupted``, shielded, before the stop goes on)."""
    stages: list[RateStage] = []

    async def ended(stage: RateStage) -> None:
        stages.append(stage)
        if on_stage is not None:
            await on_stage(stage)

    rates: Sequence[float]
    if spec.rates_per_s is not None:
        rates = spec.rates_per_s
    else:
        assert spec.sweep is not None
        synchronous, done = await closed_loop_rate(
            exchange, concurrency=1, requests=spec.requests, duration_s=spec.duration_s
        )
        await ended(RateStage(kind="synchronous", measured_rate_per_s=synchronous, completed=done))
        throughput, done = await closed_loop_rate(
            exchange,
            concurrency=spec.sweep.throughput_concurrency,
            requests=spec.requests,
            duration_s=spec.duration_s,
        )
        await ended(RateStage(kind="throughput", measured_rate_per_s=throughput, completed=done))
        rates = (
            sweep_rates(synchronous, throughput, spec.sweep.points)
            if synchronous is not None and throughput is not None
            else ()
        )
    saturated: str | None = None
    for offset, rate in enumerate(rates):
        if saturated is not None:
            await ended(RateStage(kind="rate", target_rate_per_s=rate, skipped_because=saturated))
            continue
        schedule = arrival_schedule(
            spec.pattern,
            rate,
            seed=spec.seed + offset,
            requests=spec.requests,
            duration_s=spec.duration_s,
            burstiness=spec.burstiness,
        )
        sender = OpenLoopSender(
            schedule,
            exchange,
            target_rate_per_s=rate,
            pattern=spec.pattern,
            burstiness=spec.burstiness,
            watch=SaturationWatch(spec.over_saturation),
            deadline=deadline,
            events=events,
        )
        try:
            outcome = await sender.run()
        except BaseException:
            with trio.CancelScope(shield=True):
                await ended(
                    RateStage(
                        kind="rate",
                        target_rate_per_s=rate,
                        outcome=sender.outcome(),
                        interrupted=True,
                    )
                )
            raise
        await ended(RateStage(kind="rate", target_rate_per_s=rate, outcome=outcome))
        if outcome.saturation is not None:
            saturated = f"{outcome.saturation.code} at {rate:.1f}/s"
        elif outcome.stop_reason == "load.deadline":
            saturated = "load.deadline"
    return tuple(stages)
