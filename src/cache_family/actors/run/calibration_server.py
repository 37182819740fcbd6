"""The calibration server: known TTFT and inter-token interval, and the exact times it kept them.

It binds 127.0.0.1 only. It stamps its clock when a request's headers are complete and just
before each event is written, so every client timestamp has a server truth (``GET /stamps``);
the llama.cpp final event's ``timings`` are these stamps, never the configuration.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import h11
import trio

MAX_BODY = 4 * 1024 * 1024
READ_SIZE = 64 * 1024
MODEL_NAME = "calibration"
#: The vocabulary the server claims (a trained model's size: 262,144 is Gemma 3's).
CALIBRATION_VOCAB = 262_144


@dataclass(frozen=True, slots=True)
class Pace:
    """The schedule every answer keeps: first content at ``ttft_ms``, then one per ``itl_ms``."""

    ttft_ms: float = 20.0
    itl_ms: float = 5.0
    tokens: int = 16


@dataclass(slots=True)
class Stamps:
    """One request as the server lived it; times are the server's ``clock_ns``."""

    seq: int
    path: str
    stream: bool
    tokens: int
    prompt_tokens: int
    received_ns: int
    received_wall_ns: int
    body_ns: int = 0
    events_ns: list[int] = field(default_factory=list)
    first_content_ns: int | None = None
    final_ns: int | None = None
    peer_port: int = 0
    status: int = 200

    def truth(self) -> dict[str, float | None]:
        """TTFT, TPOT and end-to-end latency in ms as the server wrote them."""
        if self.first_content_ns is None or self.final_ns is None:
            return {"ttft_ms": None, "tpot_ms": None, "latency_ms": None}
        ttft = (self.first_content_ns - self.received_ns) / 1e6
        latency = (self.final_ns - self.received_ns) / 1e6
        tpot = (latency - ttft) / max(self.tokens - 1, 1)
        return {"ttft_ms": ttft, "tpot_ms": tpot, "latency_ms": latency}


class CalibrationServer:
    def __init__(
        self,
        pace: Pace,
        *,
        stamps_file: Path | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        """``clock_ns``: the stamps' clock; a client in the same process passes its own."""
        self.pace = pace
        self.clock_ns = clock_ns
        self.stamps: list[Stamps] = []
        self._stamps_file = stamps_file.open("a") if stamps_file is not None else None
        self._seq = 0
        self.port = 0

    def __repr__(self) -> str:
        return f"<CalibrationServer port={self.port} {self.pace} finished={len(self.stamps)}>"

    async def serve(self, port: int = 0, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1", backlog=1024)
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        peer_port = stream.socket.getpeername()[1]
        try:
            while True:
                event = await _next_event(conn, stream)
                if not isinstance(event, h11.Request):
                    return
                target = event_target(event)
                # Headers are complete the moment h11 yields the Request: that is the receipt.
                received = self.clock_ns()
                received_trio = trio.current_time()
                received_wall = time.time_ns()
                body = bytearray()
                while True:
                    event = await _next_event(conn, stream)
                    if isinstance(event, h11.Data):
                        body += event.data
                        if len(body) > MAX_BODY:
                            return
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:
                        return
                await self._answer(
                    conn,
                    stream,
                    target,
                    bytes(body),
                    received,
                    received_trio,
                    received_wall,
                    peer_port,
                )
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        finally:
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                await stream.aclose()

    async def _answer(
        self,
        conn: h11.Connection,
        stream: trio.SocketStream,
        target: tuple[str, str],
        body: bytes,
        received: int,
        received_trio: float,
        received_wall: int,
        peer_port: int,
    ) -> None:
        method, path = target
        path = path.split("?", 1)[0]
        if method == "GET" and path in ("/health", "/v1/health"):
            await _send_json(conn, stream, 200, {"status": "ok"})
        elif method == "GET" and path == "/v1/models":
            # ``meta.n_vocab`` as llama-server gives it: token-id prompts are drawn below it.
            model = {"id": MODEL_NAME, "object": "model", "meta": {"n_vocab": CALIBRATION_VOCAB}}
            models = {"object": "list", "data": [model]}
            await _send_json(conn, stream, 200, models)
        elif method == "GET" and path == "/stamps":
            requests = [asdict(s) | s.truth() for s in self.stamps]
            await _send_json(conn, stream, 200, {"pace": asdict(self.pace), "requests": requests})
        elif method == "DELETE" and path == "/stamps":
            self.stamps.clear()
            await _send_json(conn, stream, 200, {"cleared": True})
        elif method == "POST" and path in ("/completion", "/v1/chat/completions"):
            try:
                request = json.loads(body)
            except ValueError as exc:
                await _send_json(conn, stream, 400, {"error": f"bad JSON body: {exc}"})
                return
            if not isinstance(request, dict):
                await _send_json(conn, stream, 400, {"error": "bad JSON body: not an object"})
                return
            chat = path == "/v1/chat/completions"
            self._seq += 1
            stamps = Stamps(
                seq=self._seq,
                path=path,
                stream=bool(request.get("stream", False)),
                tokens=_token_count(request, self.pace.tokens),
                prompt_tokens=_prompt_tokens(request, chat=chat),
                received_ns=received,
                received_wall_ns=received_wall,
                body_ns=self.clock_ns(),
                peer_port=peer_port,
            )
            writer = _ChatWriter(stamps) if chat else _CompletionWriter(stamps)
            try:
                await self._paced(conn, stream, stamps, writer, received_trio)
            finally:
                self._finish(stamps)
        else:
            await _send_json(conn, stream, 404, {"error": f"no route {method} {path}"})

    async def _paced(
        self,
        conn: h11.Connection,
        stream: trio.SocketStream,
        stamps: Stamps,
        writer: _Writer,
        received_trio: float,
    ) -> None:
        first_at = received_trio + self.pace.ttft_ms / 1000
        itl = self.pace.itl_ms / 1000
        if not stamps.stream:
            await trio.sleep_until(first_at + itl * (stamps.tokens - 1))
            now = self.clock_ns()
            stamps.first_content_ns = stamps.final_ns = now
            stamps.events_ns.append(now)
            await _send_json(conn, stream, 200, writer.whole(now))
            return
        headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
        await _send(conn, stream, h11.Response(status_code=200, headers=headers))
        for index in range(stamps.tokens):
            await trio.sleep_until(first_at + itl * index)
            now = self.clock_ns()
            if index == 0:
                stamps.first_content_ns = now
            stamps.events_ns.append(now)
            await _send(conn, stream, h11.Data(data=writer.token(index)))
        now = self.clock_ns()
        stamps.final_ns = now
        stamps.events_ns.append(now)
        await _send(conn, stream, h11.Data(data=writer.final(now)))
        await _send(conn, stream, h11.EndOfMessage())

    def _finish(self, stamps: Stamps) -> None:
        self.stamps.append(stamps)
        if self._stamps_file is not None:
            self._stamps_file.write(json.dumps(asdict(stamps) | stamps.truth()) + "\n")
            self._stamps_file.flush()


class _Writer:
    def __init__(self, stamps: Stamps) -> None:
        self.stamps = stamps

    def text(self, index: int) -> str:
        # The first token names the request, so a client's exported text can be matched to it.
        return f"<{self.stamps.seq}>" if index == 0 else " tok"

    def token(self, index: int) -> bytes:
        raise NotImplementedError

    def final(self, now: int) -> bytes:
        raise NotImplementedError

    def whole(self, now: int) -> dict[str, Any]:
        raise NotImplementedError


class _CompletionWriter(_Writer):
    """llama.cpp ``/completion``: ``stop: false`` token events, then a ``stop: true`` summary."""

    def token(self, index: int) -> bytes:
        event = {"content": self.text(index), "tokens": [index + 1], "stop": False}
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    def summary(self, now: int, content: str) -> dict[str, Any]:
        s = self.stamps
        first = s.first_content_ns if s.first_content_ns is not None else now
        return {
            "content": content,
            "tokens": [],
            "stop": True,
            "model": MODEL_NAME,
            "tokens_predicted": s.tokens,
            "tokens_evaluated": s.prompt_tokens,
            "truncated": False,
            "stop_type": "limit",
            "timings": {
                "prompt_n": s.prompt_tokens,
                "prompt_ms": (first - s.received_ns) / 1e6,
                "predicted_n": s.tokens,
                "predicted_ms": (now - first) / 1e6,
                "cache_n": 0,
            },
        }

    def final(self, now: int) -> bytes:
        return b"data: " + json.dumps(self.summary(now, "")).encode() + b"\n\n"

    def whole(self, now: int) -> dict[str, Any]:
        text = "".join(self.text(i) for i in range(self.stamps.tokens))
        return self.summary(now, text)


class _ChatWriter(_Writer):
    """OpenAI chat: one delta chunk per token, a finish chunk with usage, then ``[DONE]``."""

    def chunk(self, delta: dict[str, str], finish: str | None) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{self.stamps.seq}",
            "object": "chat.completion.chunk",
            "created": self.stamps.received_wall_ns // 1_000_000_000,
            "model": MODEL_NAME,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    def usage(self) -> dict[str, int]:
        s = self.stamps
        return {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.tokens,
            "total_tokens": s.prompt_tokens + s.tokens,
        }

    def token(self, index: int) -> bytes:
        delta = {"content": self.text(index)}
        if index == 0:
            delta["role"] = "assistant"
        return b"data: " + json.dumps(self.chunk(delta, None)).encode() + b"\n\n"

    def final(self, now: int) -> bytes:
        last = self.chunk({}, "length") | {"usage": self.usage()}
        return b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n"

    def whole(self, now: int) -> dict[str, Any]:
        text = "".join(self.text(i) for i in range(self.stamps.tokens))
        return {
            "id": f"chatcmpl-{self.stamps.seq}",
            "object": "chat.completion",
            "created": self.stamps.received_wall_ns // 1_000_000_000,
            "model": MODEL_NAME,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
            ],
            "usage": self.usage(),
        }


def event_target(request: h11.Request) -> tuple[str, str]:
    return request.method.decode(), request.target.decode()


def _token_count(request: dict[str, Any], default: int) -> int:
    for key in ("n_predict", "max_completion_tokens", "max_tokens"):
        value = request.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return min(value, 100_000)
    return default


def _prompt_tokens(request: dict[str, Any], *, chat: bool) -> int:
    if chat:
        messages = request.get("messages")
        text = json.dumps(messages) if isinstance(messages, list) else ""
    else:
        prompt = request.get("prompt", "")
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return max(1, len(prompt))  # token ids: one token each, as llama-server counts
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    return max(1, math.ceil(len(text) / 4))


async def _next_event(conn: h11.Connection, stream: trio.SocketStream) -> Any:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        if conn.their_state is h11.DONE:
            return event
        data = await stream.receive_some(READ_SIZE)
        conn.receive_data(data)


async def _send(conn: h11.Connection, stream: trio.SocketStream, event: Any) -> None:
    data = conn.send(event)
    if data:
        await stream.send_all(data)


async def _send_json(
    conn: h11.Connection, stream: trio.SocketStream, status: int, value: dict[str, Any]
) -> None:
    data = json.dumps(value).encode()
    headers = [("content-type", "application/json"), ("content-length", str(len(data)))]
    await _send(conn, stream, h11.Response(status_code=status, headers=headers))
    await _send(conn, stream, h11.Data(data=data))
    await _send(conn, stream, h11.EndOfMessage())
