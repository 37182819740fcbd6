"""The loopback HTTP client (h11 over trio streams) against a scripted FAKE server that writes
fixed bytes, so each protocol fault is exact; on trio's autojump clock."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from cache_family.system.http import ConnectError, HttpError, LoopbackHttp, loopback_target

Script = Callable[[trio.SocketStream], Awaitable[None]]


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def _serve(nursery: trio.Nursery, script: Script, heads: list[bytes]) -> int:
    async def handler(stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            data = await stream.receive_some(65536)
            if not data:
                return
            head += data
        heads.append(head)
        try:
            await script(stream)
        finally:
            await stream.aclose()

    listeners = await nursery.start(trio.serve_tcp, handler, 0)
    port: int = listeners[0].socket.getsockname()[1]
    return port


def written(*parts: bytes, pause: float = 0.01) -> Script:
    async def script(stream: trio.SocketStream) -> None:
        for part in parts:
            await stream.send_all(part)
            await trio.sleep(pause)

    return script


CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


async def test_chunked_body_arrives_per_read_with_the_coding_removed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    heads: list[bytes] = []
    http = LoopbackHttp()
    async with trio.open_nursery() as nursery:
        port = await _serve(
            nursery, written(CHUNKED, b"3\r\nabc\r\n2\r\nde\r\n", b"1\r\nf\r\n0\r\n\r\n"), heads
        )
        async with http.request(
            "POST", f"http://127.0.0.1:{port}/completion", json_body={"a": 1}
        ) as response:
            chunks = [chunk async for chunk in response.chunks()]
        nursery.cancel_scope.cancel()
    assert response.status_code == 200
    # Two chunks written together arrive as one item: they were one read.
    assert chunks == [b"abcde", b"f"]
    head = heads[0].lower()
    assert head.startswith(b"post /completion http/1.1\r\n")
    assert b"connection: close\r\n" in head and f"host: 127.0.0.1:{port}".encode() in head
    assert b"content-type: application/json\r\n" in head and b"content-length: 8\r\n" in head


async def test_a_body_cut_short_is_an_http_error(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        script = written(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        port = await _serve(nursery, script, [])
        with pytest.raises(HttpError, match="malformed response"):
            async with LoopbackHttp().request("GET", f"http://127.0.0.1:{port}/health") as response:
                await response.read(1024)
        nursery.cancel_scope.cancel()


async def test_a_garbled_head_and_a_close_before_any_answer_are_http_errors(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        garbled = await _serve(nursery, written(b"NOT HTTP AT ALL\r\n\r\n"), [])
        silent = await _serve(nursery, written(), [])
        for port in (garbled, silent):
            with pytest.raises(HttpError):
                async with LoopbackHttp().request("GET", f"http://127.0.0.1:{port}/health"):
                    pass
        nursery.cancel_scope.cancel()


async def test_read_refuses_a_body_past_its_limit(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        script = written(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 100)
        port = await _serve(nursery, script, [])
        async with LoopbackHttp().request("GET", f"http://127.0.0.1:{port}/") as response:
            with pytest.raises(HttpError, match="exceeded 64 bytes"):
                await response.read(64)
        nursery.cancel_scope.cancel()


async def test_nothing_listening_is_a_connect_error() -> None:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # bound once, never listening: nothing accepts on it now
    with pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
        async with LoopbackHttp().request("GET", f"http://127.0.0.1:{port}/health"):
            pass


def test_only_plain_loopback_urls_are_addressed() -> None:
    assert loopback_target("http://127.0.0.1:8080/v1/models?x=1") == (8080, "/v1/models?x=1")
    assert loopback_target("http://127.0.0.1:8080") == (8080, "/")
    for url in ("https://127.0.0.1:8080/", "http://localhost:8080/", "http://10.0.0.1:80/"):
        with pytest.raises(ValueError, match="not a plain loopback URL"):
            loopback_target(url)
