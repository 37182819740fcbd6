"""The load actor: serial baselines and closed-loop concurrency rungs against llama-server."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, NamedTuple, Protocol

import trio

from cache_family.errors import Refused
from cache_family.schemas.host_kinds import RequestDialect
from cache_family.schemas.measurement import (
    CacheExpectation,
    LoadOutcome,
    LoadRequest,
    LoadStatus,
    RequestRow,
    ServerTimings,
)
from cache_family.states.first_token import FirstToken, client_first_token, server_tpot_ms
from cache_family.states.tally import MAKESPAN_MISSING, RungTally
from cache_family.system.http import HttpError, LoopbackHttp, Response

KIB = 1024
MIB = 1024 * KIB
BODY_LIMIT = 1 * MIB
SSE_LINE_LIMIT = 64 * KIB
STOP_TYPES = ("limit", "word", "eos")
_LOOPBACK_BASE = re.compile(r"http://127\.0\.0\.1:[1-9][0-9]{0,4}/?")

Clock = Callable[[], float]


class ProtocolError(Exception):
    """The server answered, but not as llama-server's /completion contract says."""


class BenchmarkPrompt(NamedTuple):
    text: str
    token_count: int
    sha256: str


def completion_body(
    prompt: str, n_predict: int, *, stream: bool, ignore_eos: bool = False
) -> dict[str, Any]:
    """The reference's exact /completion request (greedy, cached prefix); ``ignore_eos`` is
    added only for a synthetic catalog, whose random-weight models often end at once. A
    streamed one asks llama-server for its ``timings`` on every event
    (``timings_per_token``): its own time of each token, which a client's reads are checked
    against (``states/first_token.py``); it changes nothing else of the answer."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0,
        "top_k": 1,
        "cache_prompt": True,
        "stream": stream,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if stream:
        body["timings_per_token"] = True
    return body


class CacheAccounting(NamedTuple):
    """The server's prompt accounting of one answer, in either dialect."""

    prompt_tokens: int
    cached_tokens: int
    slot_id: int | None = None


def native_cache_accounting(final: Mapping[str, Any], timings: ServerTimings) -> CacheAccounting:
    """/completion: prompt tokens evaluated, ``timings.cache_n`` of them cached, ``id_slot``."""
    slot = final.get("id_slot")
    return CacheAccounting(
        prompt_tokens=_integer(final, "tokens_evaluated"),
        cached_tokens=timings.cache_n if timings.cache_n is not None else 0,
        slot_id=slot
        if isinstance(slot, int) and not isinstance(slot, bool) and slot >= 0
        else None,
    )


def openai_cache_accounting(usage: Mapping[str, Any]) -> CacheAccounting:
    """OpenAI ``usage``: ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens`` (absent
    details: nothing cached), checked as the reference does (0 < prompt, cached <= prompt)."""
    prompt = _integer(usage, "usage.prompt_tokens", key="prompt_tokens")
    details = usage.get("prompt_tokens_details")
    cached = 0
    if details is not None:
        if not isinstance(details, dict):
            raise ProtocolError("usage.prompt_tokens_details is not an object")
        if details.get("cached_tokens") is not None:
            cached = _integer(
                details, "usage.prompt_tokens_details.cached_tokens", key="cached_tokens"
            )
    if prompt <= 0:
        raise ProtocolError(f"usage.prompt_tokens {prompt} is not positive")
    if not 0 <= cached <= prompt:
        raise ProtocolError(f"usage cached_tokens {cached} is outside 0..{prompt}")
    return CacheAccounting(prompt_tokens=prompt, cached_tokens=cached)


@dataclass(slots=True)
class _Exchange:
    """What one request observed; turned into a RequestRow."""

    started: float
    ttft: float | None = None
    ended: float | None = None
    content: list[str] = field(default_factory=list)
    first_chunk: str | None = None
    # Which read of the body brought the first token and the end (``read_sse_lines``): a
    # first token read together with the end arrived with it.
    ttft_read: int | None = None
    ended_read: int | None = None
    # The server's timings on the first token's event, when it times every event, and how
    # much later than they allow the client read that event (``timed``).
    first_timings: ServerTimings | None = None
    first_late_ms: float = 0.0
    # The final event's timings (the server's totals), once read.
    final: ServerTimings | None = None

    def timed(self, timings: ServerTimings, arrived: Arrival, *, first: bool) -> None:
        """An event the server timed: the first token's (``first``), or a later one, whose
        server time since the first token, less the client's time between reading the two,
        is how late the first was read, at least."""
        if first:
            self.first_timings = timings
            return
        start = self.first_timings
        if start is None or self.ttft is None:
            return
        if timings.predicted_ms is None or start.predicted_ms is None:
            return
        server_ms = timings.predicted_ms - start.predicted_ms
        client_ms = (arrived.at - self.ttft) * 1000
        self.first_late_ms = max(self.first_late_ms, server_ms - client_ms)

    def first_token(self, elapsed_ms: float, tokens: int, lag_ms: float | None) -> FirstToken:
        """The request's TTFT and TPOT by the one rule (``client_first_token``)."""
        first = self.first_timings
        return client_first_token(
            elapsed_ms=elapsed_ms,
            first_read_ms=None if self.ttft is None else (self.ttft - self.started) * 1000,
            read_with_final=self.ttft_read == self.ended_read,
            tokens=tokens,
            late_ms=None if first is None else self.first_late_ms,
            server_tpot_ms=None if first is None else server_tpot_ms(first, self.final, tokens),
            client_lag_ms=lag_ms,
        )

    def per_event(self) -> dict[str, Any]:
        """The row's fields of the server's per-event timings (none without them)."""
        if self.first_timings is None:
            return {}
        return {
            "first_token_timings": self.first_timings,
            "first_token_late_ms": self.first_late_ms,
        }


class RowSink(Protocol):
    """Where a run's rows go as their requests end (each planned id exactly once)."""

    def add(self, row: RequestRow) -> None: ...


@dataclass(slots=True)
class RowList:
    """The default sink: keeps every row (a calibration run, a test); the outcome lists them."""

    rows: list[RequestRow] = field(default_factory=list)

    def add(self, row: RequestRow) -> None:
        self.rows.append(row)


class LoadRun:
    """One serial baseline (``request.stream`` false) or one ladder rung (true).

    Each row goes to ``rows`` as its request ends (the cell gives a sink that streams it to
    the cell's rows file) and into the rung's tally; the run itself keeps one byte per
    planned id (the roster) and what the tally needs, never the rows.
    """

    def __init__(
        self,
        request: LoadRequest,
        *,
        deadline: float | None = None,
        clock: Clock = trio.current_time,
        stop_on_failure: bool = True,
        client: LoopbackHttp | None = None,
        sent: Sequence[RequestRow] = (),
        rows: RowSink | None = None,
        expectation: CacheExpectation | None = None,
        client_lag_ms: float | None = None,
    ) -> None:
        """``sent``: the rung's leading requests, already sent and already in ``rows`` (the
        cell's warmup state sends a serial rung's excluded request 0); the run sends the rest
        and tallies the whole roster. ``expectation``: what the cell's cache verdicts are
        judged by (tallied with the rows). ``client_lag_ms``: the client's measured lag on
        this host (the run's self-calibration); a first token read later than the server's
        own timings allow by more than it is not observable (``states/first_token.py``)."""
        _check_request(request)
        self.request = request
        self.client_lag_ms = client_lag_ms
        self.deadline = math.inf if deadline is None else deadline
        self.clock = clock
        self.stop_on_failure = stop_on_failure
        self._client = client
        self._sink: RowSink = rows if rows is not None else RowList(list(sent))
        self._tally = RungTally(
            request.requests,
            serial=not request.stream,
            ttft_slo_ms=request.ttft_slo_ms,
            tpot_slo_ms=request.tpot_slo_ms,
            expectation=expectation,
            digests=self.parity_digests,
        )
        # One byte per planned id: 1 once its row was tallied (and given to the sink).
        self._ended = bytearray(request.requests)
        self._finished = self._completed = self._failed = self._timed_out = 0
        for row in sent:
            self._tally_row(row)
        # Ids below this were launched (sent ones included): launching goes in id order.
        self._first_unsent = self._next_launch = len(sent)
        self._first_launch: float | None = None
        self._last_end: float | None = None
        self._stop_reason: str | None = None
        self._outcome: LoadOutcome | None = None
        self.prompt_sha256 = hashlib.sha256(request.prompt.encode()).hexdigest()

    # Whether the rung's tally keeps each request's digests for old/new parity.
    parity_digests: ClassVar[bool] = False

    def __repr__(self) -> str:
        kind = "rung" if self.request.stream else "serial"
        return (
            f"<LoadRun {kind} c={self.request.concurrency} launched={self._next_launch}"
            f"/{self.request.requests} finished={self._finished} stop={self._stop_reason}>"
        )

    def _tally_row(self, row: RequestRow) -> None:
        self._ended[row.request_id] = 1
        self._finished += 1
        self._completed += row.status == "completed"
        self._failed += row.status == "failed"
        self._timed_out += row.status == "incomplete" and "timeout" in (row.error or "")
        self._tally.add(row)

    def _end(self, row: RequestRow) -> None:
        """A request ended: its row goes to the sink and the tally, once, unless the roster
        was already closed (a cancelled run's in-flight request was recorded by then)."""
        if self._outcome is not None or self._ended[row.request_id]:
            return
        self._sink.add(row)
        self._tally_row(row)

    def excluded_warmup(self, request_id: int) -> bool:
        if not self.request.stream:
            return request_id == 0
        return request_id < self.request.warmup_requests

    async def run(self) -> LoadOutcome:
        """Run every request (closed loop), then return the outcome with its summary."""
        await self._closed_loop(self._client or LoopbackHttp())
        return self.outcome()

    async def _closed_loop(self, client: LoopbackHttp) -> None:
        # Every request's own cancel scope ends at the cell deadline, so in-flight requests
        # are cut (and recorded) by it; the loop only has to stop launching.
        slots = trio.Semaphore(self.request.concurrency)
        async with trio.open_nursery() as nursery:
            for request_id in range(self._first_unsent, self.request.requests):
                await slots.acquire()
                if self._stop_reason is None and trio.current_time() >= self.deadline:
                    self._stop_reason = "load.deadline"
                if self._stop_reason is not None:
                    slots.release()
                    break
                self._next_launch = request_id + 1
                if self._first_launch is None:
                    self._first_launch = self.clock()
                nursery.start_soon(self._one, client, request_id, slots)

    async def _one(self, client: LoopbackHttp, request_id: int, slots: trio.Semaphore) -> None:
        try:
            row = await self._exchange(client, request_id)
            self._end(row)
            if row.status == "completed":
                self._last_end = max(self._last_end or -math.inf, self.clock())
            elif self._stop_reason is None and trio.current_time() >= self.deadline:
                self._stop_reason = "load.deadline"
            elif self.stop_on_failure and self._stop_reason is None:
                self._stop_reason = f"load.request_{row.status}"
        finally:
            slots.release()

    async def send_one(self, client: LoopbackHttp, request_id: int) -> RequestRow:
        """One request of this run's dialect, outside the closed loop (the open-loop sender's
        sends): the same request code and row, which goes to neither the sink nor the tally;
        any number may run at once."""
        return await self._exchange(client, request_id)

    async def _exchange(self, client: LoopbackHttp, request_id: int) -> RequestRow:
        return await self._guarded(request_id, client, self._completion)

    async def _completion(
        self, client: LoopbackHttp, request_id: int, warmup: bool, exchange: _Exchange
    ) -> RequestRow:
        """llama.cpp's ``/completion``, streamed or plain, as the request asks."""
        request = self.request
        body = completion_body(
            request.prompt,
            request.output_tokens,
            stream=request.stream,
            ignore_eos=request.ignore_eos,
        )
        url = request.base_url.rstrip("/") + "/completion"
        final = await (
            self._streamed(client, url, body, exchange)
            if request.stream
            else self._plain(client, url, body, exchange)
        )
        return self._completed_row(request_id, warmup, exchange, final)

    async def _guarded(
        self,
        request_id: int,
        client: LoopbackHttp,
        send: Callable[[LoopbackHttp, int, bool, _Exchange], Awaitable[RequestRow]],
    ) -> RequestRow:
        """One request of either dialect under its own timeout and the cell budget: protocol
        and transport errors become a failed row, a cut becomes an incomplete one."""
        request = self.request
        started = self.clock()
        own_deadline = started + request.request_timeout_ms / 1000
        exchange = _Exchange(started=started)
        warmup = self.excluded_warmup(request_id)
        with trio.move_on_at(min(own_deadline, self.deadline)) as cap:
            try:
                return await send(client, request_id, warmup, exchange)
            except ProtocolError as exc:
                return self._failed_row(request_id, warmup, exchange, str(exc))
            except HttpError as exc:
                return self._failed_row(
                    request_id, warmup, exchange, f"{type(exc).__name__}: {exc}"
                )
        assert cap.cancelled_caught
        cut_by = "its own timeout" if own_deadline <= self.deadline else "the cell budget"
        return RequestRow(
            request_id=request_id,
            status="incomplete",
            excluded_warmup=warmup,
            elapsed_ms=(self.clock() - started) * 1000,
            error=f"cut by {cut_by} ({request.request_timeout_ms} ms request timeout)",
        )

    async def _plain(
        self, client: LoopbackHttp, url: str, body: dict[str, Any], exchange: _Exchange
    ) -> dict[str, Any]:
        async with client.request("POST", url, json_body=body) as response:
            data = await _read_bounded(response)
            exchange.ended = self.clock()
        _require_ok(response, data)
        answer = _parse_json(data, "response body")
        content = answer.get("content")
        if not isinstance(content, str):
            raise ProtocolError("response has no text content")
        exchange.content.append(content)
        return answer

    async def _streamed(
        self, client: LoopbackHttp, url: str, body: dict[str, Any], exchange: _Exchange
    ) -> dict[str, Any]:
        final: dict[str, Any] | None = None

        def take(line: bytes, arrived: Arrival) -> None:
            nonlocal final
            event = _sse_event(line)
            if event is None:
                return
            if final is not None:
                raise ProtocolError("data after the final event")
            if event.get("stop") is True:
                final = event
                exchange.ended, exchange.ended_read = arrived
                _take_content(event, exchange, arrived, final=True)
                raw = event.get("timings")
                if isinstance(raw, dict):
                    # Its timings are validated with the answer (``_validate_final``).
                    exchange.final = _server_timings(raw)
                    exchange.timed(exchange.final, arrived, first=False)
            elif event.get("stop") is False:
                _take_content(event, exchange, arrived, final=False)
            else:
                raise ProtocolError("event without a boolean stop field")

        async with client.request("POST", url, json_body=body) as response:
            if response.status_code != 200:
                _require_ok(response, await _read_bounded(response))
            tail = await read_sse_lines(response, self.clock, take)
        if tail.strip() and _sse_event(tail) is not None:
            raise ProtocolError("stream ended inside an event")
        if final is None:
            raise ProtocolError("stream ended without a final stop event")
        return final

    def _completed_row(
        self, request_id: int, warmup: bool, exchange: _Exchange, final: dict[str, Any]
    ) -> RequestRow:
        checked = _validate_final(final, self.request.output_tokens)
        assert exchange.ended is not None
        elapsed_ms = (exchange.ended - exchange.started) * 1000
        first = FirstToken(None, None)
        if self.request.stream:
            first = exchange.first_token(elapsed_ms, checked.tokens_predicted, self.client_lag_ms)
        content = "".join(exchange.content)
        cache = native_cache_accounting(final, checked.timings)
        return RequestRow(
            request_id=request_id,
            status="completed",
            excluded_warmup=warmup,
            elapsed_ms=elapsed_ms,
            ttft_ms=first.ttft_ms,
            tpot_ms=first.tpot_ms,
            tokens_predicted=checked.tokens_predicted,
            tokens_evaluated=checked.tokens_evaluated,
            timings=checked.timings,
            stop_type=checked.stop_type,  # type: ignore[arg-type]
            content_sha256=hashlib.sha256(content.encode()).hexdigest(),
            first_chunk_sha256=(
                hashlib.sha256(exchange.first_chunk.encode()).hexdigest()
                if exchange.first_chunk is not None
                else None
            ),
            prompt_tokens=cache.prompt_tokens,
            cached_tokens=cache.cached_tokens,
            slot_id=cache.slot_id,
            ttft_unobserved=first.unobserved,
            **exchange.per_event(),
        )

    def _failed_row(
        self, request_id: int, warmup: bool, exchange: _Exchange, error: str
    ) -> RequestRow:
        return RequestRow(
            request_id=request_id,
            status="failed",
            excluded_warmup=warmup,
            elapsed_ms=(self.clock() - exchange.started) * 1000,
            error=error[:1000],
        )

    def outcome(self, stop_reason: str | None = None) -> LoadOutcome:
        """Close the roster (a row for every planned id not ended yet: in flight or never
        launched) and give the status and the tally. Idempotent: the first call decides."""
        if self._outcome is not None:
            return self._outcome
        reason = self._stop_reason or stop_reason
        ended, launched = self._ended, self._next_launch
        request_id = ended.find(0)
        while request_id != -1:
            warmup = self.excluded_warmup(request_id)
            if request_id < launched:
                row = RequestRow(
                    request_id=request_id,
                    status="incomplete",
                    excluded_warmup=warmup,
                    error=f"still in flight when the run stopped ({reason or 'stopped'})",
                )
            else:
                row = RequestRow(
                    request_id=request_id, status="not-launched", excluded_warmup=warmup
                )
            self._sink.add(row)
            self._tally_row(row)
            request_id = ended.find(0, request_id + 1)
        makespan = None
        if self._first_launch is not None and self._last_end is not None:
            makespan = self._last_end - self._first_launch
        status: LoadStatus
        if not launched:
            status = "not-launched"
        elif self._completed == self.request.requests:
            status = "completed"
        elif self._failed:
            status = "failed"
        else:
            status = "incomplete"
        facts = self._tally.facts(concurrency=self.request.concurrency, makespan_seconds=makespan)
        refusals = [code for code in facts.summary_refusals if code != MAKESPAN_MISSING]
        if refusals:
            reason = reason or ",".join(refusals)
            if status == "completed":
                status = "incomplete"
        kept = self._sink.rows if isinstance(self._sink, RowList) else []
        self._outcome = LoadOutcome(
            request=self.request,
            prompt_sha256=self.prompt_sha256,
            status=status,
            rows=tuple(sorted(kept, key=lambda row: row.request_id)),
            makespan_seconds=makespan,
            rung_summary=facts.rung_summary,
            serial_summary=facts.serial_summary,
            stop_reason=reason,
            facts=facts,
            timed_out=self._timed_out,
        )
        return self._outcome


async def run_load(
    request: LoadRequest,
    *,
    deadline: float | None = None,
    clock: Clock = trio.current_time,
    stop_on_failure: bool = True,
) -> LoadOutcome:
    """Run one serial baseline or rung to the end (or the deadline) and return its outcome."""
    return await LoadRun(
        request, deadline=deadline, clock=clock, stop_on_failure=stop_on_failure
    ).run()


class _Checked(NamedTuple):
    tokens_predicted: int
    tokens_evaluated: int
    timings: ServerTimings
    stop_type: str


def _validate_final(final: Mapping[str, Any], n_predict: int) -> _Checked:
    """The reference's acceptance rules for a llama-server final answer."""
    if final.get("stop") is not True:
        raise ProtocolError("final answer does not say stop: true")
    if final.get("truncated") is not False:
        raise ProtocolError(f"final answer is truncated ({final.get('truncated')!r})")
    predicted = _integer(final, "tokens_predicted")
    evaluated = _integer(final, "tokens_evaluated")
    if not 1 <= predicted <= n_predict:
        raise ProtocolError(f"tokens_predicted {predicted} is outside 1..{n_predict}")
    if evaluated <= 0:
        raise ProtocolError(f"tokens_evaluated {evaluated} is not positive")
    raw = final.get("timings")
    if not isinstance(raw, dict):
        raise ProtocolError("final answer has no timings object")
    timings = _server_timings(raw)
    if timings.predicted_n != predicted:
        raise ProtocolError(
            f"timings.predicted_n {timings.predicted_n} differs from tokens_predicted {predicted}"
        )
    for name, value in (("prompt_n", timings.prompt_n), ("cache_n", timings.cache_n)):
        if value is not None and not 0 <= value <= evaluated:
            raise ProtocolError(f"timings.{name} {value} is outside 0..{evaluated}")
    stop_type = final.get("stop_type")
    if stop_type not in STOP_TYPES:
        raise ProtocolError(f"stop_type {stop_type!r} is not one of {', '.join(STOP_TYPES)}")
    return _Checked(predicted, evaluated, timings, str(stop_type))


def _server_timings(raw: Mapping[str, Any]) -> ServerTimings:
    """llama-server's ``timings`` object, of a final answer or (``timings_per_token``) of any
    streamed event: every field a number of its kind."""
    return ServerTimings(
        prompt_n=_integer(raw, "timings.prompt_n", key="prompt_n"),
        prompt_ms=_finite(raw, "timings.prompt_ms", key="prompt_ms"),
        predicted_n=_integer(raw, "timings.predicted_n", key="predicted_n"),
        predicted_ms=_finite(raw, "timings.predicted_ms", key="predicted_ms"),
        cache_n=_integer(raw, "timings.cache_n", key="cache_n"),
    )


def _event_timings(event: Mapping[str, Any]) -> ServerTimings | None:
    """A streamed event's own ``timings``, when the server times every event."""
    raw = event.get("timings")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ProtocolError("an event's timings is not an object")
    return _server_timings(raw)


def _integer(mapping: Mapping[str, Any], name: str, *, key: str | None = None) -> int:
    value = mapping.get(key or name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{name} is not an integer ({value!r})")
    return value


def _finite(mapping: Mapping[str, Any], name: str, *, key: str | None = None) -> float:
    value = mapping.get(key or name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"{name} is not a number ({value!r})")
    if not math.isfinite(value) or value < 0:
        raise ProtocolError(f"{name} is not a finite non-negative number ({value!r})")
    return float(value)


def _take_content(
    event: Mapping[str, Any], exchange: _Exchange, arrived: Arrival, *, final: bool
) -> None:
    """One ``/completion`` event's text; the first event before the final one that carries a
    generated token (``tokens``, ``tokens_predicted`` or text: llama-server streams a token
    whose text is empty or an incomplete character with ``tokens`` and empty content) is the
    first token. A token that only arrives with the final event leaves TTFT unobserved."""
    content = event.get("content", "")
    if not isinstance(content, str):
        raise ProtocolError("event content is not text")
    tokens = event.get("tokens", [])
    if not isinstance(tokens, list):
        raise ProtocolError("event tokens is not a list")
    predicted = event.get("tokens_predicted")
    generated = bool(
        content
        or tokens
        or (isinstance(predicted, int) and not isinstance(predicted, bool) and predicted > 0)
    )
    if not final and generated:
        timings = _event_timings(event)
        first = exchange.ttft is None
        if first:
            exchange.ttft, exchange.ttft_read = arrived
            exchange.first_chunk = content
        if timings is not None:
            exchange.timed(timings, arrived, first=first)
    if content or tokens:
        exchange.content.append(content)


class Arrival(NamedTuple):
    """When a line arrived: the clock at the read that completed it, and that read's number
    (lines of one read arrived together, whatever the clock says)."""

    at: float
    read: int


async def read_sse_lines(
    response: Response, clock: Clock, take: Callable[[bytes, Arrival], None]
) -> bytes:
    """The one server-sent-events line reader of both dialects: gives ``take`` every complete
    line (CR LF or LF) with the arrival of the read that completed it, stamped before the
    line is parsed; refuses a body over ``BODY_LIMIT`` or a line over ``SSE_LINE_LIMIT``;
    returns what followed the last newline (the caller judges it)."""
    received = reads = 0
    pending = bytearray()
    async for chunk in response.chunks():
        arrived = Arrival(clock(), reads)
        reads += 1
        received += len(chunk)
        if received > BODY_LIMIT:
            raise ProtocolError(f"stream exceeded {BODY_LIMIT} bytes")
        pending += chunk
        while (newline := pending.find(b"\n")) >= 0:
            line = bytes(pending[:newline]).rstrip(b"\r")
            del pending[: newline + 1]
            if len(line) > SSE_LINE_LIMIT:
                raise ProtocolError(f"stream line longer than {SSE_LINE_LIMIT} bytes")
            take(line, arrived)
        if len(pending) > SSE_LINE_LIMIT:
            raise ProtocolError(f"stream line longer than {SSE_LINE_LIMIT} bytes")
    return bytes(pending).rstrip(b"\r")


def _sse_event(line: bytes) -> dict[str, Any] | None:
    """The JSON of a ``data:`` line; None for blank lines, comments and other fields."""
    if not line or line.startswith(b":"):
        return None
    name, _, value = line.partition(b":")
    if name != b"data":
        return None
    value = value.removeprefix(b" ")
    event = _parse_json(value, "stream event")
    if "error" in event:
        raise ProtocolError(f"server error event: {json.dumps(event['error'])[:300]}")
    return event


class _NonJsonConstant(Exception):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NonJsonConstant(name)


# Built once: ``json.loads`` with a keyword builds a decoder per call, once per stream event.
_JSON: Final = json.JSONDecoder(parse_constant=_refuse_constant)


def _parse_json(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = _JSON.decode(data.decode())
    except _NonJsonConstant as exc:
        raise ProtocolError(f"{what} holds the non-JSON constant {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} is not a JSON object")
    return value


async def _read_bounded(response: Response, limit: int = BODY_LIMIT) -> bytes:
    data = bytearray()
    async for chunk in response.chunks():
        data += chunk
        if len(data) > limit:
            raise ProtocolError(f"response body exceeded {limit} bytes")
    return bytes(data)


def _require_ok(response: Response, data: bytes) -> None:
    if response.status_code != 200:
        snippet = data[:300].decode("utf-8", "replace")
        raise ProtocolError(f"HTTP {response.status_code}: {snippet}")


def _check_request(request: LoadRequest) -> None:
    problems = []
    if not _LOOPBACK_BASE.fullmatch(request.base_url):
        problems.append("base_url must be http://127.0.0.1:PORT")
    if request.requests < 1:
        problems.append("requests must be at least 1")
    if request.concurrency < 1:
        problems.append("concurrency must be at least 1")
    if not request.stream and request.concurrency != 1:
        problems.append("a serial baseline runs at concurrency 1")
    if request.output_tokens < 1:
        problems.append("output_tokens must be at least 1")
    if request.request_timeout_ms < 1:
        problems.append("request_timeout_ms must be positive")
    if not 0 <= request.warmup_requests < request.requests:
        problems.append("warmup_requests must leave at least one measured request")
    if problems:
        raise Refused.one(
            "load.bad_request",
            "$",
            "; ".join(problems),
            "fix the load request built by the cell actor",
        )


async def build_benchmark_prompt(
    base_url: str,
    source_text: str,
    prefix_tokens: int,
    *,
    client: LoopbackHttp | None = None,
    attempts: int = 16,
) -> BenchmarkPrompt:
    """A prompt of exactly ``prefix_tokens + 1`` tokens by the server's own tokenizer.

    The source text is repeated until it is long enough, cut at prefix_tokens + 1 tokens with
    ``/tokenize`` and ``/detokenize``, and the cut is re-tokenized: detokenizing and tokenizing
    again can merge tokens at the cut, so the cut moves until the count is exact.
    """
    if prefix_tokens < 1:
        raise Refused.one(
            "load.prompt_prefix", "$.prefix_tokens", "prefix_tokens must be positive", "use >= 1"
        )
    if not source_text.strip():
        raise Refused.one(
            "load.prompt_source",
            "$.source_text",
            "the prompt source text is empty",
            "give a non-empty corpus text",
        )
    want = prefix_tokens + 1
    http = client or LoopbackHttp()
    base = base_url.rstrip("/")
    source_tokens = await _tokenize(http, base, source_text)
    if not source_tokens:
        raise Refused.one(
            "load.prompt_source",
            "$.source_text",
            "the source text has no tokens",
            "give a corpus text the model can tokenize",
        )
    repeats = -(-want // len(source_tokens)) + 1
    tokens = await _tokenize(http, base, (source_text + " ") * repeats)
    cut = want
    for _ in range(attempts):
        text = await _detokenize(http, base, tokens[:cut])
        count = len(await _tokenize(http, base, text))
        if count == want:
            return BenchmarkPrompt(text, count, hashlib.sha256(text.encode()).hexdigest())
        cut += 1 if count < want else -1
        if not 1 <= cut <= len(tokens):
            break
    raise Refused.one(
        "load.prompt_token_count",
        "$.prefix_tokens",
        f"could not cut the source text to exactly {want} tokens",
        "use another source text or prefix length",
    )


@dataclass(slots=True)
class PromptCuts:
    """The prompts one row has cut, by (source text, prefix tokens): every arm of a row serves
    the same model, so its tokenizer cuts the same text the same way and the row cuts once."""

    cuts: dict[tuple[str, int], BenchmarkPrompt] = field(default_factory=dict)

    async def cut(
        self, http: LoopbackHttp, base_url: str, source_text: str, prefix_tokens: int
    ) -> BenchmarkPrompt:
        key = (source_text, prefix_tokens)
        found = self.cuts.get(key)
        if found is None:
            found = await build_benchmark_prompt(base_url, source_text, prefix_tokens, client=http)
            self.cuts[key] = found
        return found


async def _tokenize(client: LoopbackHttp, base: str, text: str) -> list[int]:
    answer = await _post_json(client, f"{base}/tokenize", {"content": text, "add_special": False})
    tokens = answer.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise Refused.one(
            "load.tokenize",
            "$.tokens",
            "/tokenize did not answer a token list",
            "check that the host is llama-server",
        )
    return tokens


async def _detokenize(client: LoopbackHttp, base: str, tokens: list[int]) -> str:
    answer = await _post_json(client, f"{base}/detokenize", {"tokens": tokens})
    content = answer.get("content")
    if not isinstance(content, str):
        raise Refused.one(
            "load.tokenize",
            "$.content",
            "/detokenize did not answer text",
            "check that the host is llama-server",
        )
    return content


async def _post_json(client: LoopbackHttp, url: str, body: dict[str, Any]) -> dict[str, Any]:
    try:
        async with client.request("POST", url, json_body=body) as response:
            data = await _read_bounded(response, 16 * MIB)
        _require_ok(response, data)
        return _parse_json(data, url)
    except (ProtocolError, HttpError) as exc:
        raise Refused.one(
            "load.tokenize",
            "$",
            f"{url} failed: {exc}",
            "check that the host is ready",
        ) from None


# --- the OpenAI chat dialect (Skippy stage servers) -------------------------------------------


def openai_chat_body(
    model_id: str, prompt: str, max_tokens: int, *, ignore_eos: bool = False
) -> dict[str, Any]:
    """The reference's exact streamed chat request (greedy, seeded, usage included);
    ``ignore_eos`` (a synthetic catalog's tiny random models only) is llama-server's own
    extension, passed through by a stage server, as on the /completion body: without it a
    random model may end its answer before any content and the request fails."""
    body: dict[str, Any] = {
        "model": model_id,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


OPENAI_AUTHORIZATION = "Bearer EMPTY"


def _compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def openai_content_sha256(
    content: str, reasoning: str | None, tool_calls: Sequence[Mapping[str, Any]] | None
) -> str:
    """SHA-256 of the compact JSON of everything generated; absent parts are left out."""
    document: dict[str, Any] = {"content": content}
    if reasoning is not None:
        document["reasoning_content"] = reasoning
    if tool_calls is not None:
        document["tool_calls"] = list(tool_calls)
    return hashlib.sha256(_compact(document)).hexdigest()


def openai_first_generated_sha256(delta: Mapping[str, Any]) -> str:
    """SHA-256 of the first generating delta as ``{content, reasoning_content, tool_calls}``
    with nulls kept: the same text split into other deltas changes this, not the content."""
    document = {
        "content": delta.get("content"),
        "reasoning_content": delta.get("reasoning_content"),
        "tool_calls": delta.get("tool_calls"),
    }
    return hashlib.sha256(_compact(document)).hexdigest()


def _generates(delta: Mapping[str, Any]) -> bool:
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


@dataclass(slots=True)
class _ChatStream:
    """What one streamed chat answer carried."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] | None = None
    tools: dict[int, dict[str, Any]] = field(default_factory=dict)
    first_delta: dict[str, Any] | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    done: bool = False
    # A chunk's ``timings`` was not llama-server's: no chunk's counts (an extension the
    # request never asked for cannot fail it).
    untimed: bool = False

    def take(self, event: Mapping[str, Any], exchange: _Exchange, arrived: Arrival) -> None:
        usage = event.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        # A server that times every event (llama-server's ``timings_per_token``, which the
        # reference stage-server oracle asks for and relays) puts them on the chunk.
        timings: ServerTimings | None = None
        try:
            timings = _event_timings(event)
        except ProtocolError:
            self.untimed = True
        first = self.first_delta is None
        choices = event.get("choices") or []
        if not isinstance(choices, list):
            raise ProtocolError("choices is not a list")
        for choice in choices:
            if not isinstance(choice, dict):
                raise ProtocolError("a choice is not an object")
            delta = choice.get("delta") or {}
            text = choice.get("text")
            if "delta" not in choice and isinstance(text, str):
                # An OpenAI completions chunk: its text is what a chat delta's content is.
                delta = {"content": text}
            if not isinstance(delta, dict):
                raise ProtocolError("a delta is not an object")
            if _generates(delta) and self.first_delta is None:
                self.first_delta = dict(delta)
                # A first token that comes with the finish reason came with the end.
                if not isinstance(choice.get("finish_reason"), str):
                    exchange.ttft, exchange.ttft_read = arrived
            content = delta.get("content")
            if isinstance(content, str):
                self.content.append(content)
            reasoning = delta.get("reasoning_content")
            if isinstance(reasoning, str):
                self.reasoning = [*(self.reasoning or []), reasoning]
            for call in delta.get("tool_calls") or []:
                self._tool(call)
            reason = choice.get("finish_reason")
            if isinstance(reason, str):
                self.finish_reason = reason
        if timings is not None:
            # The last timings of the stream are the server's totals.
            exchange.final = timings
            exchange.timed(timings, arrived, first=first and self.first_delta is not None)

    def _tool(self, call: Any) -> None:
        if not isinstance(call, dict) or not isinstance(call.get("index"), int):
            raise ProtocolError("a tool call delta has no index")
        entry = self.tools.setdefault(call["index"], {})
        if isinstance(call.get("type"), str):
            entry["type"] = call["type"]
        function = call.get("function") or {}
        target = entry.setdefault("function", {})
        for key in ("name", "arguments"):
            if isinstance(function.get(key), str):
                target[key] = target.get(key, "") + function[key]

    def tool_calls(self) -> list[dict[str, Any]] | None:
        return [self.tools[i] for i in sorted(self.tools)] if self.tools else None


class OpenAIChatRun(LoadRun):
    """A ladder rung against a stage server's OpenAI API: ``POST /v1/chat/completions``,
    streamed with usage, ``Authorization: Bearer EMPTY``. Each row's digests are the
    reference's: the content digest over everything generated, the first-generated digest
    over the first generating delta (``first_chunk_sha256``)."""

    parity_digests: ClassVar[bool] = True

    def __init__(self, request: LoadRequest, model_id: str, **kwargs: Any) -> None:
        super().__init__(request, **kwargs)
        self.model_id = model_id

    # Where the rung's requests go; a subclass sends another OpenAI endpoint's body there.
    endpoint: ClassVar[str] = "/v1/chat/completions"

    def _body(self) -> dict[str, Any]:
        return openai_chat_body(
            self.model_id,
            self.request.prompt,
            self.request.output_tokens,
            ignore_eos=self.request.ignore_eos,
        )

    async def _exchange(self, client: LoopbackHttp, request_id: int) -> RequestRow:
        return await self._guarded(request_id, client, self._chat_completion)

    async def _chat_completion(
        self, client: LoopbackHttp, request_id: int, warmup: bool, exchange: _Exchange
    ) -> RequestRow:
        """The OpenAI endpoint's request, streamed with usage."""
        url = self.request.base_url.rstrip("/") + self.endpoint
        stream = await self._chat(client, url, self._body(), exchange)
        return self._chat_row(request_id, warmup, exchange, stream)

    async def _chat(
        self, client: LoopbackHttp, url: str, body: dict[str, Any], exchange: _Exchange
    ) -> _ChatStream:
        stream = _ChatStream()

        def take(line: bytes, arrived: Arrival) -> None:
            if line.strip() == b"data: [DONE]":
                stream.done = True
                exchange.ended, exchange.ended_read = arrived
                return
            event = _sse_event(line)
            if event is None:
                return
            if stream.done:
                raise ProtocolError("data after [DONE]")
            stream.take(event, exchange, arrived)

        headers = [("authorization", OPENAI_AUTHORIZATION)]
        async with client.request("POST", url, json_body=body, headers=headers) as response:
            if response.status_code != 200:
                _require_ok(response, await _read_bounded(response))
            await read_sse_lines(response, self.clock, take)
        if not stream.done:
            raise ProtocolError("stream ended without [DONE]")
        return stream

    def _chat_row(
        self, request_id: int, warmup: bool, exchange: _Exchange, stream: _ChatStream
    ) -> RequestRow:
        usage = stream.usage
        if usage is None:
            raise ProtocolError("stream carried no usage")
        cache = openai_cache_accounting(usage)
        completion = _integer(usage, "usage.completion_tokens", key="completion_tokens")
        if not 0 < completion <= self.request.output_tokens:
            raise ProtocolError(
                f"usage.completion_tokens {completion} is outside 1..{self.request.output_tokens}"
            )
        if stream.finish_reason is None:
            raise ProtocolError("no choice gave a finish_reason")
        if stream.first_delta is None:
            raise ProtocolError("no delta generated any content")
        assert exchange.ended is not None
        elapsed_ms = (exchange.ended - exchange.started) * 1000
        if stream.untimed:
            exchange.first_timings = exchange.final = None
        first = exchange.first_token(elapsed_ms, completion, self.client_lag_ms)
        reasoning = "".join(stream.reasoning) if stream.reasoning is not None else None
        return RequestRow(
            request_id=request_id,
            status="completed",
            excluded_warmup=warmup,
            elapsed_ms=elapsed_ms,
            ttft_ms=first.ttft_ms,
            tpot_ms=first.tpot_ms,
            tokens_predicted=completion,
            tokens_evaluated=cache.prompt_tokens,
            # The server's totals, where it relayed llama-server's timings.
            timings=exchange.final,
            stop_type="limit" if stream.finish_reason == "length" else "eos",
            content_sha256=openai_content_sha256(
                "".join(stream.content), reasoning, stream.tool_calls()
            ),
            first_chunk_sha256=openai_first_generated_sha256(stream.first_delta),
            prompt_tokens=cache.prompt_tokens,
            cached_tokens=cache.cached_tokens,
            ttft_unobserved=first.unobserved,
            **exchange.per_event(),
        )


# --- one load client per request dialect -------------------------------------------------------


def _completion_run(request: LoadRequest, _model_id: str, **load: Any) -> LoadRun:
    # llama-server's ``/completion`` serves its one model to any request: no model id.
    return LoadRun(request, **load)


#: A request dialect's streamed load client: (the request, the host's model id, ``LoadRun``'s
#: keyword arguments) -> the run that sends it.
LoadDialect = Callable[..., LoadRun]

LOAD_DIALECTS: Final[Mapping[RequestDialect, LoadDialect]] = {
    "completion": _completion_run,
    "chat": OpenAIChatRun,
}
