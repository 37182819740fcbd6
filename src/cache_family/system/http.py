"""Plain HTTP/1.1 to a host on 127.0.0.1: h11 over trio streams, one connection per request.

No TLS, no proxy lookup, no pool: every request opens its own connection and asks the server to
close it, because llama-server closes a connection after every streamed response and a reused
one fails intermittently. Failures surface as ``HttpError``; deadlines are the caller's cancel
scopes.
"""

from __future__ import annotations

import functools
import json
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final
from urllib.parse import urlsplit

import h11
import trio

READ_SIZE: Final = 64 * 1024
# The most a response's status line and headers may take (h11 refuses more).
HEAD_LIMIT: Final = 64 * 1024
LOOPBACK: Final = "127.0.0.1"


class HttpError(Exception):
    """The connection or the HTTP exchange failed (refused, reset, malformed, cut short)."""


class ConnectError(HttpError):
    """Nothing accepted the connection (the host is not listening, or is gone)."""


class Response:
    """One response: status and headers at once, the body as it arrives."""

    def __init__(self, conn: h11.Connection, stream: trio.SocketStream, head: h11.Response) -> None:
        self.status_code = head.status_code
        self.headers = head.headers
        self._conn = conn
        self._stream = stream

    def __repr__(self) -> str:
        return f"<Response {self.status_code} {self._conn.their_state}>"

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, transfer coding removed: all the data one socket read completed."""
        conn = self._conn
        while True:
            data = bytearray()
            while True:
                event = _next(conn)
                if isinstance(event, h11.Data):
                    data += event.data
                elif event is h11.NEED_DATA:
                    break
                elif isinstance(event, h11.EndOfMessage):
                    if data:
                        yield bytes(data)
                    return
                else:
                    raise HttpError(f"unexpected {type(event).__name__} in a response body")
            if data:
                yield bytes(data)
            conn.receive_data(await _receive(self._stream))

    async def read(self, limit: int) -> bytes:
        """The whole body, refused (``HttpError``) past ``limit`` bytes."""
        body = bytearray()
        async for data in self.chunks():
            body += data
            if len(body) > limit:
                raise HttpError(f"response body exceeded {limit} bytes")
        return bytes(body)


class LoopbackHttp:
    """The HTTP client of one host session (readiness, prompt cut and every rung)."""

    def __init__(self) -> None:
        self.requests = 0

    def __repr__(self) -> str:
        return f"<LoopbackHttp requests={self.requests}>"

    @asynccontextmanager
    async def request(
        self,
        method: str,
        url: str,
        *,
        json_body: Any = None,
        headers: Sequence[tuple[str, str]] = (),
    ) -> AsyncIterator[Response]:
        """Send one request on a new connection; the response's head is read before the
        block runs and the connection is closed when it ends."""
        port, target = loopback_target(url)
        body = b"" if json_body is None else json.dumps(json_body).encode()
        head = [("host", f"{LOOPBACK}:{port}"), ("connection", "close"), *headers]
        if json_body is not None:
            head += [("content-type", "application/json"), ("content-length", str(len(body)))]
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=HEAD_LIMIT)
        self.requests += 1
        stream = await _connect(port)
        try:
            try:
                out = conn.send(h11.Request(method=method, target=target, headers=head))
                if body:
                    out += conn.send(h11.Data(data=body))
                out += conn.send(h11.EndOfMessage())
            except h11.LocalProtocolError as exc:
                raise HttpError(f"could not form the request: {exc}") from None
            await _send(stream, out)
            yield Response(conn, stream, await _head(conn, stream))
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()


async def _connect(port: int) -> trio.SocketStream:
    """A TCP connection to ``127.0.0.1:port``: one socket and its connect, without
    ``trio.open_tcp_stream``'s name lookup and happy-eyeballs nursery (a literal loopback
    address has one candidate), which cost a tenth of an open-loop client's CPU a request."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        await sock.connect((LOOPBACK, port))
    except OSError as exc:
        sock.close()
        raise ConnectError(f"{LOOPBACK}:{port}: {exc}") from None
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


@functools.lru_cache(maxsize=64)
def loopback_target(url: str) -> tuple[int, str]:
    """(port, path with query) of an ``http://127.0.0.1:PORT/...`` URL; anything else is a
    programming error (hosts are only ever addressed on loopback). A host session asks the
    same few URLs thousands of times: each is parsed once."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname != LOOPBACK or parts.port is None:
        raise ValueError(f"not a plain loopback URL: {url!r}")
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return parts.port, target


def _next(conn: h11.Connection) -> Any:
    try:
        return conn.next_event()
    except h11.RemoteProtocolError as exc:
        raise HttpError(f"malformed response: {exc}") from None


async def _receive(stream: trio.SocketStream) -> bytes:
    # b"" (the peer closed) is handed to h11, which then reports the cut as it sees it.
    try:
        return await stream.receive_some(READ_SIZE)
    except (trio.BrokenResourceError, OSError) as exc:
        raise HttpError(f"connection lost: {exc}") from None


async def _send(stream: trio.SocketStream, data: bytes) -> None:
    try:
        await stream.send_all(data)
    except (trio.BrokenResourceError, OSError) as exc:
        raise HttpError(f"connection lost while sending: {exc}") from None


async def _head(conn: h11.Connection, stream: trio.SocketStream) -> h11.Response:
    while True:
        event = _next(conn)
        if isinstance(event, h11.Response):
            return event
        if event is h11.NEED_DATA:
            conn.receive_data(await _receive(stream))
        elif isinstance(event, h11.InformationalResponse):
            continue
        else:
            raise HttpError(f"connection ended before a response ({type(event).__name__})")
