"""The bounded read of a host's ``/metrics`` against real sockets on 127.0.0.1: each way it can
fail is a typed outcome (never an exception out of the cell), on trio's fake clock."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
import trio.testing

from cache_family.actors.run.server_metrics import (
    READ_SECONDS,
    Exposition,
    NoMetrics,
    read_exposition,
)
from cache_family.system.http import LoopbackHttp

Answer = Callable[[trio.SocketStream], Awaitable[None]]


async def _read_from(answer: Answer) -> NoMetrics | Exposition:
    """Serve one connection with ``answer`` and read /metrics from it."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, answer, listeners)
        reading = await read_exposition(LoopbackHttp(), f"http://127.0.0.1:{port}/metrics")
        nursery.cancel_scope.cancel()
    return reading


def _responding(status: str, body: bytes) -> Answer:
    async def answer(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        head = f"HTTP/1.1 {status}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
        await stream.send_all(head.encode() + body)
        await stream.aclose()

    return answer


async def test_a_counter_exposition_reads_as_its_counters() -> None:
    body = b"# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 23\n"
    reading = await _read_from(_responding("200 OK", body))
    assert isinstance(reading, Exposition) and reading.size == len(body)
    assert reading.counters == {("llamacpp:prompt_tokens_total", ()): 23.0}


async def test_404_and_501_are_a_host_without_metrics() -> None:
    for status in ("404 Not Found", "501 Not Implemented"):
        reading = await _read_from(_responding(status, b"no metrics"))
        assert reading == NoMetrics("none", f"the host answered {status.split()[0]}")


async def test_another_status_is_unreachable() -> None:
    reading = await _read_from(_responding("500 Internal Server Error", b"oops"))
    assert isinstance(reading, NoMetrics) and reading.status == "refused"
    assert reading.refusal_code == "server_metrics.unreachable"


async def test_nothing_listening_is_unreachable() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    await listeners[0].aclose()  # the port is free: nothing accepts
    reading = await read_exposition(LoopbackHttp(), f"http://127.0.0.1:{port}/metrics")
    assert isinstance(reading, NoMetrics) and reading.refusal_code == "server_metrics.unreachable"


async def test_a_host_that_never_answers_times_out_at_the_cap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def silent(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        await trio.sleep_forever()

    start = trio.current_time()
    reading = await _read_from(silent)
    assert isinstance(reading, NoMetrics) and reading.refusal_code == "server_metrics.timeout"
    assert trio.current_time() - start >= READ_SECONDS


async def test_the_cells_deadline_shortens_the_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def silent(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        await trio.sleep_forever()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, silent, listeners)
        start = trio.current_time()
        reading = await read_exposition(
            LoopbackHttp(), f"http://127.0.0.1:{port}/metrics", deadline=start + 2
        )
        nursery.cancel_scope.cancel()
    assert isinstance(reading, NoMetrics) and reading.refusal_code == "server_metrics.timeout"
    assert trio.current_time() - start < READ_SECONDS
    assert reading.reason == "no whole answer within 2 s"
