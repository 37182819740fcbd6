"""The load actor against a scripted FAKE llama HTTP server, on trio's autojump clock."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from fake_hosts.fake_llama_http import FakeLlamaHttp, Reply

from cache_family.actors.run.load import (
    CacheAccounting,
    LoadRun,
    OpenAIChatRun,
    PromptCuts,
    ProtocolError,
    build_benchmark_prompt,
    completion_body,
    native_cache_accounting,
    openai_cache_accounting,
    openai_chat_body,
    run_load,
)
from cache_family.errors import Refused
from cache_family.schemas.measurement import LoadRequest, RequestRow, ServerTimings
from cache_family.states.metrics import rung_summary
from cache_family.system.http import LoopbackHttp

PROMPT = "the quick brown fox"


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def load_request(server: FakeLlamaHttp, **overrides: Any) -> LoadRequest:
    values: dict[str, Any] = {
        "base_url": server.base_url,
        "prompt": PROMPT,
        "requests": 6,
        "concurrency": 2,
        "output_tokens": 8,
        "stream": True,
        "request_timeout_ms": 60_000,
    }
    values.update(overrides)
    return LoadRequest(**values)


async def start(nursery: trio.Nursery, server: FakeLlamaHttp) -> FakeLlamaHttp:
    await nursery.start(server.serve)
    return server


async def test_serial_baseline_sends_the_exact_body_and_excludes_request_zero(
    autojump_clock: trio.testing.MockClock,
) -> None:
    def warm_after_first(index: int, _body: dict[str, Any]) -> Reply:
        return Reply(first_token_delay=0.5 if index == 0 else 0.02, cache_n=0 if index == 0 else 16)

    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp(warm_after_first))
        request = load_request(server, requests=4, concurrency=1, output_tokens=1, stream=False)
        outcome = await run_load(request)
        nursery.cancel_scope.cancel()
    assert (
        server.completions
        == [
            {
                "prompt": PROMPT,
                "n_predict": 1,
                "temperature": 0,
                "top_k": 1,
                "cache_prompt": True,
                "stream": False,
            }
        ]
        * 4
    )
    assert outcome.status == "completed"
    assert [row.excluded_warmup for row in outcome.rows] == [True, False, False, False]
    assert all(row.ttft_ms is None and row.tpot_ms is None for row in outcome.rows)
    assert outcome.rows[0].elapsed_ms == pytest.approx(500, abs=1)
    summary = outcome.serial_summary
    assert summary is not None
    assert summary.excluded_runs == 1
    assert summary.warm_median_ms == pytest.approx(20, abs=1)
    assert summary.warm_cache_n == (16, 16, 16)
    assert summary.warm_cache_n_min == 16
    assert outcome.rows[1].content_sha256 == hashlib.sha256(b"t").hexdigest()
    assert outcome.prompt_sha256 == hashlib.sha256(PROMPT.encode()).hexdigest()


async def test_rung_keeps_concurrency_in_flight_on_fresh_connections(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp())
        outcome = await run_load(load_request(server, requests=6, concurrency=2))
        nursery.cancel_scope.cancel()
    assert outcome.status == "completed"
    assert server.connections == 6
    assert server.max_in_flight == 2
    assert all(body["stream"] is True and body["n_predict"] == 8 for body in server.completions)
    assert all(h.get("connection") == "close" for h in server.headers)
    for row in outcome.rows:
        assert row.status == "completed"
        assert row.ttft_ms == pytest.approx(100, abs=0.5)
        assert row.elapsed_ms == pytest.approx(100 + 7 * 10, abs=0.5)
        assert row.tpot_ms == pytest.approx(10, abs=0.1)
        assert row.tokens_predicted == 8
        assert row.timings is not None and row.timings.prompt_n == 17
        assert row.first_chunk_sha256 == hashlib.sha256(b"t0 ").hexdigest()
        content = "".join(f"t{i} " for i in range(8))
        assert row.content_sha256 == hashlib.sha256(content.encode()).hexdigest()
    summary = outcome.rung_summary
    assert summary is not None and summary.complete
    # Three waves of two 170 ms requests.
    assert outcome.makespan_seconds == pytest.approx(0.51, abs=0.005)
    assert summary.throughput_requests_per_sec == pytest.approx(6 / 0.51, rel=0.01)
    assert summary.output_tokens_per_sec == pytest.approx(48 / 0.51, rel=0.01)


async def test_rung_warmup_requests_are_excluded_from_the_metrics(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp())
        request = load_request(server, requests=4, concurrency=2, warmup_requests=2)
        outcome = await run_load(request)
        nursery.cancel_scope.cancel()
    assert [row.excluded_warmup for row in outcome.rows] == [True, True, False, False]
    summary = outcome.rung_summary
    assert summary is not None
    assert summary.measured_requests == 2
    assert summary.observed_completion_tokens == 16


async def test_goodput_uses_both_objectives(autojump_clock: trio.testing.MockClock) -> None:
    def alternate(index: int, _body: dict[str, Any]) -> Reply:
        return Reply(first_token_delay=0.05 if index % 2 else 0.5)

    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp(alternate))
        request = load_request(
            server, requests=4, concurrency=1, ttft_slo_ms=100.0, tpot_slo_ms=20.0
        )
        outcome = await run_load(request)
        nursery.cancel_scope.cancel()
    summary = outcome.rung_summary
    assert summary is not None
    assert outcome.makespan_seconds is not None
    assert summary.goodput_requests_per_sec == pytest.approx(2 / outcome.makespan_seconds)


async def test_first_token_time_comes_from_the_first_event_with_a_token_even_without_text(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Tokens that render no text still stream (``tokens``, empty content): the first one
    is the first token, not the end of the response."""
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp(lambda *_: Reply("empty_content_tokens")))
        outcome = await run_load(load_request(server, requests=2, concurrency=1))
        nursery.cancel_scope.cancel()
    assert outcome.status == "completed"
    for row in outcome.rows:
        assert row.ttft_unobserved is msgspec.UNSET
        assert row.ttft_ms == pytest.approx(100, abs=0.5)
        assert row.elapsed_ms == pytest.approx(170, abs=0.5)
        assert row.tpot_ms == pytest.approx(10, abs=0.1)
    assert outcome.facts is not None and outcome.facts.first_content_with_final_ids == ()


async def test_a_stream_with_nothing_before_its_final_event_has_no_first_token_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """llama-server holding every token back until the final event: TTFT and TPOT are None
    with a typed reason, never the elapsed time; the percentiles and goodput leave them out."""
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp(lambda *_: Reply("final_only")))
        request = load_request(server, requests=3, concurrency=1, ttft_slo_ms=500.0)
        outcome = await run_load(request)
        nursery.cancel_scope.cancel()
    assert outcome.status == "completed"
    for row in outcome.rows:
        assert row.status == "completed" and row.tokens_predicted == 8
        assert row.elapsed_ms == pytest.approx(170, abs=0.5)
        assert row.ttft_ms is None and row.tpot_ms is None
        assert row.ttft_unobserved == "first_token_with_final"
    summary = outcome.rung_summary
    assert summary is not None and summary.complete
    assert summary.ttft_unobserved_requests == 3
    assert summary.ttft_p50_ms is None and summary.tpot_p50_ms is None
    assert summary.goodput_requests_per_sec is None
    assert summary.latency_p50_ms == pytest.approx(170, abs=0.5)
    assert outcome.facts is not None and outcome.facts.first_content_with_final_ids == (0, 1, 2)


async def test_a_first_token_read_together_with_the_final_event_is_not_observable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Token events that reach the client in the same read as the final event (a burst)
    arrived with it: no first-token time, whatever text they carry."""
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp(lambda *_: Reply("one_write")))
        outcome = await run_load(load_request(server, requests=2, concurrency=1))
        nursery.cancel_scope.cancel()
    assert outcome.status == "completed"
    for row in outcome.rows:
        assert row.ttft_ms is None and row.tpot_ms is None
        assert row.ttft_unobserved == "first_token_with_final"
        content = "".join(f"t{i} " for i in range(8))
        assert row.content_sha256 == hashlib.sha256(content.encode()).hexdigest()


async def test_a_stream_with_text_times_its_first_content_event(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp())
        outcome = await run_load(load_request(server, requests=2, concurrency=1))
        nursery.cancel_scope.cancel()
    for row in outcome.rows:
        assert row.ttft_unobserved is msgspec.UNSET
        assert row.ttft_ms == pytest.approx(100, abs=0.5)
        assert row.ttft_ms is not None and row.elapsed_ms is not None
        assert row.ttft_ms < row.elapsed_ms
        assert row.first_chunk_sha256 == hashlib.sha256(b"t0 ").hexdigest()
    assert outcome.rung_summary is not None
    assert outcome.rung_summary.ttft_unobserved_requests is msgspec.UNSET


@pytest.mark.parametrize(("behaviour", "observed"), [("ok", True), ("final_only", False)])
async def test_chat_first_token_time_is_the_first_generating_delta_before_the_finish(
    behaviour: str, observed: bool, autojump_clock: trio.testing.MockClock
) -> None:
    """The chat API: the first delta with content is the first token; content that only
    comes in the finish chunk came with the end (TTFT and TPOT null, typed reason)."""
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp(lambda *_: Reply(behaviour)))
        request = load_request(server, requests=2, concurrency=1)
        outcome = await OpenAIChatRun(request, "fake-model").run()
        nursery.cancel_scope.cancel()
    assert outcome.status == "completed"
    for row in outcome.rows:
        assert row.elapsed_ms == pytest.approx(170, abs=0.5)
        content = "".join(f"t{i} " for i in range(8))
        assert row.content_sha256 is not None and row.tokens_predicted == 8
        if observed:
            assert row.ttft_ms == pytest.approx(100, abs=0.5)
            assert row.tpot_ms == pytest.approx(10, abs=0.1)
            assert row.ttft_unobserved is msgspec.UNSET
        else:
            assert row.ttft_ms is None and row.tpot_ms is None
            assert row.ttft_unobserved == "first_token_with_final"
        assert len(content) == 24


async def test_per_event_server_timings_are_kept_beside_the_client_stamps(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A server timing every event: each row keeps its first token's timings and how late the
    client read it (0: on time); the summary gives the server's own TTFT and TPOT beside the
    client's."""
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp())
        outcome = await run_load(load_request(server, requests=3, concurrency=1))
        nursery.cancel_scope.cancel()
    assert all(body["timings_per_token"] is True for body in server.completions)
    for row in outcome.rows:
        first = row.first_token_timings
        assert isinstance(first, ServerTimings)
        assert (first.predicted_n, first.predicted_ms, first.prompt_ms) == (1, 0.0, 5.5)
        assert row.first_token_late_ms == 0.0
        assert row.ttft_unobserved is msgspec.UNSET
        assert row.ttft_ms == pytest.approx(100, abs=0.5)
        assert row.tpot_ms == pytest.approx(10, abs=0.1)
        assert row.timings is not None and row.timings.predicted_ms == pytest.approx(70)
    summary = outcome.rung_summary
    assert summary is not None
    # The server's first-token time starts at its prompt (5.5 ms), not at the client's send.
    assert summary.server_ttft_p50_ms == summary.server_ttft_p99_ms == 5.5
    assert summary.server_tpot_p50_ms == pytest.approx(10)
    assert summary.ttft_p50_ms == pytest.approx(100, abs=0.5)


@pytest.mark.parametrize("dialect", ["completion", "chat"])
async def test_tokens_read_in_a_burst_after_the_server_streamed_them_are_client_stalled(
    dialect: str, autojump_clock: trio.testing.MockClock
) -> None:
    """The client read all 8 tokens in one burst 70 ms after the server made the first (then
    the final event): its TTFT would be the whole stream and its TPOT below the server's own,
    so both are null with ``client_stalled``, and no goodput; the server's own figures stand.
    No lag was measured: a TPOT below the server's is enough."""

    def burst(*_: Any) -> Reply:
        return Reply("burst_before_final")

    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp(burst, chat_timings=True))
        request = load_request(
            server, requests=3, concurrency=1, ttft_slo_ms=500.0, tpot_slo_ms=50.0
        )
        run = LoadRun(request) if dialect == "completion" else OpenAIChatRun(request, "m")
        outcome = await run.run()
        nursery.cancel_scope.cancel()
    assert outcome.status == "completed"
    for row in outcome.rows:
        assert row.elapsed_ms == pytest.approx(180, abs=0.5)
        assert row.ttft_ms is None and row.tpot_ms is None
        assert row.ttft_unobserved == "client_stalled"
        assert row.first_token_late_ms == pytest.approx(70)
        assert row.timings is not None and row.timings.predicted_ms == pytest.approx(70)
    summary = outcome.rung_summary
    assert summary is not None and summary.complete
    assert summary.ttft_unobserved_requests == 3
    assert summary.ttft_p50_ms is None and summary.tpot_p50_ms is None
    assert summary.goodput_requests_per_sec is None
    assert summary.server_ttft_p50_ms == 5.5
    assert summary.server_tpot_p50_ms == pytest.approx(10)
    # Not the with-final rule: the tokens came before the final event.
    assert outcome.facts is not None and outcome.facts.first_content_with_final_ids == ()


@pytest.mark.parametrize("behaviour", ["burst_before_final", "foreign_chat_timings"])
async def test_without_per_event_timings_the_earlier_rules_stand(
    behaviour: str, autojump_clock: trio.testing.MockClock
) -> None:
    """A chat server that times no event (or puts a ``timings`` of its own on its chunks,
    which the request never asked for and which fails nothing): a burst cannot be told from a
    fast server, so the client's figures stand (the rule of the with-final case only)."""
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp(lambda *_: Reply(behaviour)))
        request = load_request(server, requests=2, concurrency=1)
        outcome = await OpenAIChatRun(request, "m").run()
        nursery.cancel_scope.cancel()
    assert outcome.status == "completed"
    for row in outcome.rows:
        assert row.ttft_unobserved is msgspec.UNSET
        assert row.first_token_timings is msgspec.UNSET
        assert row.first_token_late_ms is msgspec.UNSET
        assert row.ttft_ms == pytest.approx(170 if behaviour == "burst_before_final" else 100)
        assert row.timings is None
    summary = outcome.rung_summary
    assert summary is not None and summary.server_ttft_p50_ms is msgspec.UNSET


@pytest.mark.parametrize(("lag_ms", "observed"), [(None, True), (20.0, True), (5.0, False)])
async def test_a_first_token_read_later_than_the_measured_client_lag_is_client_stalled(
    lag_ms: float | None, observed: bool, autojump_clock: trio.testing.MockClock
) -> None:
    """The first token reached the client with the second, 10 ms after the server made it;
    the tokens after it came on time (the TPOT is not below the server's). Within a client lag
    of 20 ms the client's TTFT stands (it is off by no more than that); beyond a lag of 5 ms
    it is not observable; with no lag measured, only the TPOT rule is applied."""
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp(lambda *_: Reply("first_token_held")))
        request = load_request(server, requests=2, concurrency=1)
        outcome = await LoadRun(request, client_lag_ms=lag_ms).run()
        nursery.cancel_scope.cancel()
    for row in outcome.rows:
        assert row.first_token_late_ms == pytest.approx(10)
        assert row.elapsed_ms == pytest.approx(190, abs=0.5)
        if observed:
            assert row.ttft_unobserved is msgspec.UNSET
            assert row.ttft_ms == pytest.approx(110, abs=0.5)
            assert row.tpot_ms == pytest.approx(80 / 7, abs=0.1)
        else:
            assert row.ttft_ms is None and row.tpot_ms is None
            assert row.ttft_unobserved == "client_stalled"


MALFORMED = {
    "http_500": "HTTP 500",
    "malformed_json": "not valid JSON",
    "no_final": "without a final stop event",
    "too_many_tokens": "outside 1..8",
    "predicted_mismatch": "differs from tokens_predicted",
    "truncated": "truncated",
    "bad_stop_type": "stop_type 'none'",
    "cache_exceeds_evaluated": "timings.cache_n 18 is outside 0..17",
    "infinite_timing": "timings.prompt_ms is not a finite",
    "nan_timing": "non-JSON constant NaN",
    "error_event": "slot crashed",
    "oversized_line": "longer than 65536 bytes",
    "oversized_body": "exceeded 1048576 bytes",
    "data_after_final": "data after the final event",
}


@pytest.mark.parametrize("behaviour", sorted(MALFORMED))
async def test_malformed_answer_fails_only_its_request(
    behaviour: str, autojump_clock: trio.testing.MockClock
) -> None:
    def break_second(index: int, _body: dict[str, Any]) -> Reply:
        return Reply(behaviour if index == 1 else "ok")

    output_tokens = 20 if behaviour == "oversized_body" else 8
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp(break_second))
        request = load_request(server, requests=4, concurrency=1, output_tokens=output_tokens)
        outcome = await LoadRun(request, stop_on_failure=False).run()
        nursery.cancel_scope.cancel()
    statuses = [row.status for row in outcome.rows]
    assert statuses == ["completed", "failed", "completed", "completed"]
    failed = outcome.rows[1]
    assert failed.error is not None and MALFORMED[behaviour] in failed.error
    assert outcome.status == "failed"
    summary = outcome.rung_summary
    assert summary is not None
    assert summary.complete is False
    assert summary.measured_requests == 3
    assert summary.failed_or_unlaunched_requests == 1
    if behaviour == "too_many_tokens":
        assert "outside 1..8" in failed.error


async def test_malformed_plain_answer_fails_the_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp(lambda i, b: Reply("not_json_object")))
        request = load_request(server, requests=2, concurrency=1, output_tokens=1, stream=False)
        outcome = await LoadRun(request, stop_on_failure=False).run()
        nursery.cancel_scope.cancel()
    assert [row.status for row in outcome.rows] == ["failed", "failed"]
    assert all("not a JSON object" in (row.error or "") for row in outcome.rows)
    assert outcome.serial_summary is not None
    assert outcome.serial_summary.warm_mean_ms is None
    assert outcome.serial_summary.complete is False


async def test_first_failure_stops_launching_and_keeps_a_full_roster(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        server = await start(
            nursery, FakeLlamaHttp(lambda i, b: Reply("http_500" if i == 1 else "ok"))
        )
        outcome = await run_load(load_request(server, requests=5, concurrency=1))
        nursery.cancel_scope.cancel()
    assert [row.status for row in outcome.rows] == [
        "completed",
        "failed",
        "not-launched",
        "not-launched",
        "not-launched",
    ]
    assert [row.request_id for row in outcome.rows] == [0, 1, 2, 3, 4]
    assert len(server.completions) == 2
    assert outcome.stop_reason == "load.request_failed"
    assert outcome.rung_summary is not None and not outcome.rung_summary.complete


async def test_hung_request_is_cut_by_its_own_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp(lambda i, b: Reply("hang" if i == 0 else "ok")))
        request = load_request(server, requests=3, concurrency=1, request_timeout_ms=750)
        outcome = await LoadRun(request, stop_on_failure=False).run()
        nursery.cancel_scope.cancel()
    hung = outcome.rows[0]
    assert hung.status == "incomplete"
    assert hung.elapsed_ms == pytest.approx(750, abs=1)
    assert hung.error is not None and "its own timeout" in hung.error
    assert [row.status for row in outcome.rows[1:]] == ["completed", "completed"]


async def test_cell_budget_ends_the_rung_with_a_full_roster(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp(lambda i, b: Reply(first_token_delay=0.4)))
        request = load_request(server, requests=10, concurrency=1, output_tokens=1)
        deadline = trio.current_time() + 1.0
        outcome = await run_load(request, deadline=deadline)
        nursery.cancel_scope.cancel()
    statuses = [row.status for row in outcome.rows]
    assert statuses == ["completed", "completed", "incomplete"] + ["not-launched"] * 7
    assert outcome.rows[2].error is not None and "cell budget" in outcome.rows[2].error
    assert outcome.stop_reason == "load.deadline"
    assert outcome.status == "incomplete"


async def test_outside_cancellation_still_yields_a_roster(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp(lambda i, b: Reply(first_token_delay=1.0)))
        run = LoadRun(load_request(server, requests=5, concurrency=2, output_tokens=1))
        with trio.move_on_after(1.5):
            await run.run()
        outcome = run.outcome(stop_reason="cancelled")
        nursery.cancel_scope.cancel()
    assert [row.status for row in outcome.rows] == [
        "completed",
        "completed",
        "incomplete",
        "incomplete",
        "not-launched",
    ]
    assert "cancelled" in (outcome.rows[2].error or "")
    assert outcome.status == "incomplete"


class CountingSink:
    """A row sink that keeps only what it was given, by id (what a rows file would hold)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.statuses: list[str] = []

    def add(self, row: RequestRow) -> None:
        self.ids.append(row.request_id)
        self.statuses.append(row.status)


def held_rows(value: object, seen: set[int] | None = None) -> int:
    """Request rows reachable from ``value``'s attributes and containers (not the sink)."""
    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, CountingSink | str | bytes | bytearray):
        return 0
    seen.add(id(value))
    if isinstance(value, RequestRow):
        return 1
    if isinstance(value, dict):
        return sum(held_rows(v, seen) for v in (*value.keys(), *value.values()))
    if isinstance(value, list | tuple | set | frozenset):
        return sum(held_rows(v, seen) for v in value)
    slots = [
        getattr(value, name)
        for name in getattr(type(value), "__slots__", ())
        if hasattr(value, name)
    ]
    attributes = getattr(value, "__dict__", {})
    if not slots and not attributes:
        return 0
    return sum(held_rows(v, seen) for v in (*slots, *attributes.values()))


async def test_a_run_streams_each_row_to_its_sink_and_keeps_none(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Every planned id reaches the sink exactly once (cut and unlaunched ones when the run
    is cancelled); the run holds no row itself, only its tally, and the outcome lists none."""
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp(lambda i, b: Reply(first_token_delay=1.0)))
        sink = CountingSink()
        run = LoadRun(load_request(server, requests=7, concurrency=2, output_tokens=1), rows=sink)
        with trio.move_on_after(2.5):
            await run.run()
        assert len(sink.ids) == 4 and held_rows(run) == 0
        outcome = run.outcome(stop_reason="cancelled")
        nursery.cancel_scope.cancel()
    assert sorted(sink.ids) == list(range(7)) and held_rows(run) == 0
    assert sink.statuses == ["completed"] * 4 + ["incomplete"] * 2 + ["not-launched"]
    assert outcome.rows == () and outcome.status == "incomplete"
    assert outcome.facts is not None and outcome.facts.rows == 7
    assert outcome.facts.completed == 4
    assert run.outcome() is outcome  # the roster closes once


async def test_unreachable_server_fails_requests_not_the_process(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp())
        port = server.port
        nursery.cancel_scope.cancel()
    request = LoadRequest(
        base_url=f"http://127.0.0.1:{port}",
        prompt=PROMPT,
        requests=3,
        concurrency=1,
        output_tokens=4,
        stream=True,
        request_timeout_ms=1000,
    )
    outcome = await run_load(request)
    assert [row.status for row in outcome.rows] == ["failed", "not-launched", "not-launched"]
    assert "ConnectError" in (outcome.rows[0].error or "")
    assert outcome.rung_summary is None  # nothing completed: no makespan


async def test_bad_load_requests_are_refused() -> None:
    with pytest.raises(Refused) as caught:
        LoadRun(
            LoadRequest(
                base_url="http://example.com:80",
                prompt=PROMPT,
                requests=0,
                concurrency=2,
                output_tokens=0,
                stream=False,
                request_timeout_ms=0,
            )
        )
    assert caught.value.codes == ["load.bad_request"]
    message = str(caught.value)
    for expected in ("base_url", "requests", "serial baseline", "output_tokens", "timeout"):
        assert expected in message
    for base_url in ("http://127.0.0.1:8080/v1", "http://localhost:8080", "https://127.0.0.1:1"):
        with pytest.raises(Refused):
            LoadRun(
                LoadRequest(
                    base_url=base_url,
                    prompt=PROMPT,
                    requests=1,
                    concurrency=1,
                    output_tokens=1,
                    stream=False,
                    request_timeout_ms=1,
                )
            )


async def test_benchmark_prompt_is_cut_to_prefix_plus_one_tokens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp())
        prompt = await build_benchmark_prompt(server.base_url, "abc", 10)
        with pytest.raises(Refused) as caught:
            await build_benchmark_prompt(server.base_url, "   ", 10)
        nursery.cancel_scope.cancel()
    assert prompt.text == "abc abc abc"
    assert prompt.token_count == 11
    assert prompt.sha256 == hashlib.sha256(b"abc abc abc").hexdigest()
    assert caught.value.codes == ["load.prompt_source"]


def test_completion_body_is_the_reference_body_and_streamed_asks_for_per_event_timings() -> None:
    reference = {
        "prompt": "p",
        "n_predict": 128,
        "temperature": 0,
        "top_k": 1,
        "cache_prompt": True,
        "stream": False,
    }
    body = completion_body("p", 128, stream=False)
    assert body == reference
    assert list(body) == list(reference)
    assert not math.isnan(body["temperature"])
    # A streamed request asks llama-server for its own timings on every event, after the
    # reference's fields; ignore_eos only when asked.
    streamed = {**reference, "stream": True, "timings_per_token": True}
    assert completion_body("p", 128, stream=True) == streamed
    assert list(completion_body("p", 128, stream=True)) == list(streamed)
    assert completion_body("p", 128, stream=True, ignore_eos=True) == {
        **reference,
        "stream": True,
        "ignore_eos": True,
        "timings_per_token": True,
    }


def test_the_chat_body_is_the_reference_unless_a_synthetic_catalog_asks_for_ignore_eos() -> None:
    # A random-weight zoo model may end its chat answer before any content (the stage
    # server's use-case rows then failed with "no delta generated any content").
    reference = openai_chat_body("m", "p", 16)
    assert "ignore_eos" not in reference
    assert openai_chat_body("m", "p", 16, ignore_eos=True) == {**reference, "ignore_eos": True}


async def test_a_synthetic_request_sends_ignore_eos_and_rows_keep_the_cache_accounting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp(lambda _i, _b: Reply(cache_n=9)))
        outcome = await run_load(load_request(server, requests=2, concurrency=1, ignore_eos=True))
        nursery.cancel_scope.cancel()
    assert [body.get("ignore_eos") for body in server.completions] == [True, True]
    for row in outcome.rows:
        assert row.cached_tokens == 9
        assert row.prompt_tokens == row.tokens_evaluated == 17
        assert row.slot_id == 0


def test_openai_usage_gives_prompt_and_cached_tokens() -> None:
    usage = {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 36}}
    assert openai_cache_accounting(usage) == CacheAccounting(40, 36, None)
    assert openai_cache_accounting({"prompt_tokens": 40}).cached_tokens == 0
    for bad in (
        {"prompt_tokens": 0},
        {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": 5}},
        {"prompt_tokens": 4, "prompt_tokens_details": []},
        {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": "1"}},
    ):
        with pytest.raises(ProtocolError):
            openai_cache_accounting(bad)


def test_native_answer_gives_slot_and_cached_tokens() -> None:
    final = {"tokens_evaluated": 129, "id_slot": 1}
    assert native_cache_accounting(final, ServerTimings(cache_n=125)) == CacheAccounting(
        129, 125, 1
    )
    # llama-server says id_slot -1 in partial events; no slot is not slot -1.
    assert native_cache_accounting({"tokens_evaluated": 3, "id_slot": -1}, ServerTimings()) == (
        CacheAccounting(3, 0, None)
    )


async def test_a_row_cuts_its_prompt_once_for_every_arm(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cuts = PromptCuts()
    http = LoopbackHttp()
    async with trio.open_nursery() as nursery:
        server = await start(nursery, FakeLlamaHttp())
        first = await cuts.cut(http, server.base_url, "abc", 10)
        after_first = server.connections
        again = await cuts.cut(http, server.base_url, "abc", 10)
        longer = await cuts.cut(http, server.base_url, "abc", 12)
        nursery.cancel_scope.cancel()
    assert again is first
    # The second arm asked nothing of its host; another prefix is another cut.
    assert after_first == 4
    assert server.connections == 8
    assert (first.token_count, longer.token_count) == (11, 13)
    assert http.requests == 8


def test_rows_and_summaries_without_an_unobserved_first_token_encode_as_before() -> None:
    """The new members are written only when something was not observable, so the rows,
    summaries and receipts of every other request (and of older runs, re-folded by replay)
    keep their bytes; an older row decodes without them."""
    row = RequestRow(request_id=0, status="completed", elapsed_ms=5.0, ttft_ms=1.0)
    assert b"ttft_unobserved" not in msgspec.json.encode(row)
    old_line = b'{"request_id":0,"status":"completed","ttft_ms":5.0,"elapsed_ms":5.0}'
    older = msgspec.json.decode(old_line, type=RequestRow)
    assert older.ttft_unobserved is msgspec.UNSET
    summary = rung_summary([older], concurrency=1, requested_requests=1, makespan_seconds=1.0)
    assert b"ttft_unobserved" not in msgspec.json.encode(summary)
    assert summary.ttft_p50_ms == 5.0  # an older run's stand-in re-tallies as it was
    unobserved = RequestRow(
        request_id=0, status="completed", elapsed_ms=5.0, ttft_unobserved="first_token_with_final"
    )
    assert b'"ttft_unobserved":"first_token_with_final"' in msgspec.json.encode(unobserved)
