"""A FAKE llama-server HTTP endpoint for load-actor fault injection (never a real server).

It runs in the test's own trio run on a real 127.0.0.1 socket, so trio's autojump clock makes
its scripted delays exact. It speaks just enough HTTP/1.1 for ``/completion`` (plain and
streamed, in llama-server's field layout), ``/tokenize`` and ``/detokenize`` (one token per
character), and closes every connection after one answer, as llama-server does after a stream.

Each ``/completion`` is answered by ``script(index, body)`` (index = arrival order), which
returns a ``Reply`` naming a behaviour, so a test can break exactly one request. A streamed
``/completion`` asking for ``timings_per_token`` gets llama-server's ``timings`` on every
event, stamped with the (test's) clock when the token is made; so does every chat chunk of a
server made with ``chat_timings`` (what the reference stage-server oracle relays).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

BEHAVIOURS = (
    "ok",
    "http_500",
    "malformed_json",
    "no_final",
    "too_many_tokens",
    "predicted_mismatch",
    "truncated",
    "bad_stop_type",
    "cache_exceeds_evaluated",
    "infinite_timing",
    "nan_timing",
    "error_event",
    "hang",
    "oversized_line",
    "oversized_body",
    "data_after_final",
    "not_json_object",
    # llama-server with tokens that render no text: every token event has empty content.
    "empty_content_tokens",
    # ... or holds them all back (an incomplete character): nothing before the final event.
    "final_only",
    # ... or its events reach the client in one write with the final event (a burst).
    "one_write",
    # Its token events reach the client in one write after the last token was made, the final
    # event a token later: what a client that was not scheduled while the server streamed
    # reads (the server's per-event timings still say when each token was made).
    "burst_before_final",
    # Its first token event reaches the client with the second one, the final event two token
    # delays after the last token: a first token read late, the tokens after it on time.
    "first_token_held",
    # Chat chunks carry a ``timings`` object that is not llama-server's.
    "foreign_chat_timings",
)


@dataclass(frozen=True)
class Reply:
    behaviour: str = "ok"
    first_token_delay: float = 0.1
    token_delay: float = 0.01
    prompt_tokens: int = 17
    cache_n: int = 0


Script = Callable[[int, dict[str, Any]], Reply]


def always_ok(_index: int, _body: dict[str, Any]) -> Reply:
    return Reply()


@dataclass
class FakeLlamaHttp:
    script: Script = always_ok
    port: int = 0
    connections: int = 0
    completions: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    # Token-id prompts (the workloads'): what each slot holds, as llama-server keeps it.
    slots: dict[int, list[int]] = field(default_factory=dict)
    n_vocab: int = 4096
    # Put llama-server's per-event ``timings`` on every streamed chat chunk.
    chat_timings: bool = False

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._connection, listeners)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        try:
            method, path, headers, body = await _read_request(stream)
            if (method, path) == ("POST", "/completion"):
                await self._completion(stream, headers, json.loads(body))
            elif (method, path) == ("POST", "/v1/chat/completions"):
                chat = json.loads(body)
                self.completions.append(chat)
                await self._chat(stream, self.script(len(self.completions) - 1, chat), chat)
            elif (method, path) == ("POST", "/tokenize"):
                text = json.loads(body)["content"]
                await _send_json(stream, 200, {"tokens": [ord(c) for c in text]})
            elif (method, path) == ("POST", "/detokenize"):
                tokens = json.loads(body)["tokens"]
                await _send_json(stream, 200, {"content": "".join(chr(t) for t in tokens)})
            elif (method, path) == ("GET", "/v1/models"):
                meta = {"n_vocab": self.n_vocab}
                await _send_json(stream, 200, {"data": [{"id": "fake", "meta": meta}]})
            elif (method, path) == ("GET", "/health"):
                await _send_json(stream, 200, {"status": "ok"})
            else:
                await _send_json(stream, 404, {"error": {"code": 404, "message": "not found"}})
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await stream.aclose()

    async def _completion(
        self, stream: trio.SocketStream, headers: dict[str, str], body: dict[str, Any]
    ) -> None:
        index = len(self.completions)
        self.completions.append(body)
        self.headers.append(headers)
        reply = self.script(index, body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if reply.behaviour == "http_500":
                await _send_json(stream, 500, {"error": {"code": 500, "message": "boom"}})
                return
            if reply.behaviour == "hang":
                await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
                await trio.sleep_forever()
            n_predict = int(body["n_predict"])
            if body.get("stream"):
                await self._stream(stream, reply, n_predict, bool(body.get("timings_per_token")))
            else:
                await trio.sleep(reply.first_token_delay)
                final = _final(reply, n_predict, content="t" * n_predict)
                if isinstance(body.get("prompt"), list):
                    self._slot_reuse(final, body, n_predict)
                if reply.behaviour == "not_json_object":
                    await _send_raw(stream, 200, b"[1, 2]")
                else:
                    await _send_raw(stream, 200, _encode_final(final, reply))
        finally:
            self.in_flight -= 1

    def _slot_reuse(self, final: dict[str, Any], body: dict[str, Any], n_predict: int) -> None:
        """A token-id prompt as llama-server's slots serve it: the named slot (``id_slot``),
        else the slot sharing the longest prefix with the prompt (else the first free one),
        reuses the common prefix it holds (never the whole prompt); the slot then holds the
        prompt and the answer less its last token (sampled, never evaluated)."""
        prompt = [int(t) for t in body["prompt"]]
        slot = int(body.get("id_slot", -1))
        if slot < 0:
            shared = {s: _common(held, prompt) for s, held in self.slots.items()}
            best = max(shared, key=lambda s: (shared[s], -s), default=None)
            slot = best if best is not None and shared[best] else len(self.slots)
        cached = min(_common(self.slots.get(slot, []), prompt), len(prompt) - 1)
        answer = [(sum(prompt) + i) % self.n_vocab for i in range(n_predict)]
        self.slots[slot] = prompt + answer[:-1]
        final["id_slot"] = slot
        final["tokens_evaluated"] = len(prompt)
        final["timings"]["cache_n"] = cached
        final["timings"]["prompt_n"] = len(prompt) - cached
        if body.get("return_tokens"):
            final["tokens"] = answer

    async def _stream(
        self, stream: trio.SocketStream, reply: Reply, n_predict: int, per_event: bool
    ) -> None:
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        )
        await trio.sleep(reply.first_token_delay)
        clock = _ServerClock(reply)
        held = b""
        for token in range(0 if reply.behaviour == "final_only" else n_predict):
            if token:
                await trio.sleep(reply.token_delay)
            event: dict[str, Any] = {
                "index": 0,
                "content": "" if reply.behaviour == "empty_content_tokens" else f"t{token} ",
                "tokens": [token],
                "stop": False,
                "id_slot": -1,
                "tokens_predicted": token + 1,
                "tokens_evaluated": reply.prompt_tokens,
            }
            if per_event:
                event["timings"] = clock.timings(token + 1)
            line = b"data: " + json.dumps(event).encode() + b"\n\n"
            if reply.behaviour == "malformed_json" and token == 1:
                line = b'data: {"content": "t1", "stop": fal\n\n'
            if reply.behaviour == "error_event" and token == 1:
                line = b'data: {"error": {"code": 500, "message": "slot crashed"}}\n\n'
            if reply.behaviour == "oversized_line" and token == 1:
                event["content"] = "x" * (70 * 1024)
                line = b"data: " + json.dumps(event).encode() + b"\n\n"
            if reply.behaviour == "oversized_body":
                event["content"] = "y" * (60 * 1024)
                line = b"data: " + json.dumps(event).encode() + b"\n\n"
            if reply.behaviour in ("one_write", "burst_before_final") or (
                reply.behaviour == "first_token_held" and token == 0
            ):
                held += line
            elif reply.behaviour == "first_token_held":
                await stream.send_all(held + line)
                held = b""
            else:
                await stream.send_all(line)
        if reply.behaviour == "no_final":
            return
        if reply.behaviour == "final_only":
            await trio.sleep(reply.token_delay * (n_predict - 1))
        if reply.behaviour == "burst_before_final":
            await stream.send_all(held)
            held = b""
            await trio.sleep(reply.token_delay)
        if reply.behaviour == "first_token_held":
            await trio.sleep(2 * reply.token_delay)
        answer = _final(reply, n_predict)
        if per_event:
            answer["timings"]["predicted_ms"] = clock.last_ms
        final = b"data: " + _encode_final(answer, reply) + b"\n\n"
        await stream.send_all(held + final)
        if reply.behaviour == "data_after_final":
            await stream.send_all(b'data: {"content": "late", "stop": false}\n\n')

    async def _chat(self, stream: trio.SocketStream, reply: Reply, body: dict[str, Any]) -> None:
        """The OpenAI chat dialect, streamed: a delta per token, a finish chunk with usage,
        ``[DONE]``; ``final_only`` puts every token's text in the finish chunk."""
        tokens = int(body["max_tokens"])
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        )
        await trio.sleep(reply.first_token_delay)
        clock = _ServerClock(reply)

        def chunk(delta: dict[str, Any], finish: str | None, n: int, **extra: Any) -> bytes:
            event = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
            if self.chat_timings:
                # The finish chunk carries the last token's timings (the totals).
                event["timings"] = clock.timings(n, made=not finish or text != "")
            if reply.behaviour == "foreign_chat_timings":
                event["timings"] = {"queue": "short", "predicted_ms": "soon"}
            return b"data: " + json.dumps(event).encode() + b"\n\n"

        text = ""
        held = b""
        for token in range(tokens):
            if token:
                await trio.sleep(reply.token_delay)
            if reply.behaviour == "final_only":
                text += f"t{token} "
            elif reply.behaviour == "burst_before_final":
                held += chunk({"content": f"t{token} "}, None, token + 1)
            else:
                await stream.send_all(chunk({"content": f"t{token} "}, None, token + 1))
        if held:
            await stream.send_all(held)
            await trio.sleep(reply.token_delay)
        usage = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": tokens}
        finish = chunk({"content": text} if text else {}, "length", tokens, usage=usage)
        await stream.send_all(finish + b"data: [DONE]\n\n")


class _ServerClock:
    """llama-server's per-event ``timings``: the final answer's prompt figures, and the
    generation time from the first token as the (test's) clock says."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.first_at = trio.current_time()
        # The last token's generation time: the final answer's (its totals).
        self.last_ms = 0.0

    def timings(self, predicted: int, *, made: bool = True) -> dict[str, Any]:
        """The timings of an event; ``made``: it carries a token made now (else the last
        token's time stands)."""
        reply = self.reply
        if made:
            self.last_ms = (trio.current_time() - self.first_at) * 1000
        return {
            "cache_n": reply.cache_n,
            "prompt_n": reply.prompt_tokens - reply.cache_n,
            "prompt_ms": _PROMPT_MS,
            "predicted_n": predicted,
            "predicted_ms": self.last_ms,
        }


def _common(held: list[int], prompt: list[int]) -> int:
    """How many leading tokens two token lists share."""
    count = 0
    for a, b in zip(held, prompt, strict=False):
        if a != b:
            break
        count += 1
    return count


_PROMPT_MS = 5.5


def _final(reply: Reply, n_predict: int, content: str = "") -> dict[str, Any]:
    predicted = n_predict + 1 if reply.behaviour == "too_many_tokens" else n_predict
    timings: dict[str, Any] = {
        "cache_n": reply.cache_n,
        "prompt_n": reply.prompt_tokens - reply.cache_n,
        "prompt_ms": _PROMPT_MS,
        "prompt_per_token_ms": 0.3,
        "prompt_per_second": 3000.0,
        "predicted_n": predicted + (1 if reply.behaviour == "predicted_mismatch" else 0),
        "predicted_ms": 12.25,
        "predicted_per_token_ms": 0.1,
        "predicted_per_second": None,
    }
    if reply.behaviour == "cache_exceeds_evaluated":
        timings["cache_n"] = reply.prompt_tokens + 1
    return {
        "index": 0,
        "content": content,
        "tokens": [],
        "id_slot": 0,
        "stop": True,
        "model": "fake",
        "tokens_predicted": predicted,
        "tokens_evaluated": reply.prompt_tokens,
        "prompt": "(echo)",
        "has_new_line": False,
        "truncated": reply.behaviour == "truncated",
        "stop_type": "none" if reply.behaviour == "bad_stop_type" else "limit",
        "stopping_word": "",
        "tokens_cached": reply.prompt_tokens + predicted,
        "timings": timings,
    }


def _encode_final(final: dict[str, Any], reply: Reply) -> bytes:
    data = json.dumps(final).encode()
    if reply.behaviour == "infinite_timing":
        data = data.replace(b'"prompt_ms": 5.5', b'"prompt_ms": 1e999')
    if reply.behaviour == "nan_timing":
        data = data.replace(b'"prompt_ms": 5.5', b'"prompt_ms": NaN')
    return data


async def _read_request(stream: trio.SocketStream) -> tuple[str, str, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise trio.BrokenResourceError("client closed before its request ended")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _version = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise trio.BrokenResourceError("client closed inside its request body")
        body += chunk
    return method, path, headers, body


async def _send_json(stream: trio.SocketStream, status: int, value: Any) -> None:
    await _send_raw(stream, status, json.dumps(value).encode())


async def _send_raw(stream: trio.SocketStream, status: int, data: bytes) -> None:
    reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}[status]
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    await stream.send_all(head.encode() + data)
