"""The chat dialect's sessions runner stopped part way, as the token-id runner is: a cancel
while a turn is in flight journals the turns already answered, then ``workload_stopped``
(``cancelled``, the turns sent); the cell's work deadline passing between turns journals the
same with ``deadline``. Against an in-process FAKE chat server that answers ``count`` turns
(non-streamed, with the usage a stage server relays) and then holds every request."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import trio
import trio.testing
from fake_hosts.fake_llama_http import _read_request, _send_json
from run_harness import autojump_clock  # noqa: F401

from cache_family.actors.run.workload_dialects import WorkloadHost
from cache_family.actors.run.workloads import run_sessions
from cache_family.schemas.journal import Record
from cache_family.schemas.workload import validate_workload_object
from cache_family.schemas.workload_records import (
    ChatTemplateMeasured,
    SessionsMeasured,
    WorkloadOpened,
    WorkloadStopped,
)
from cache_family.system.http import LoopbackHttp

SESSIONS = {
    "users": 2,
    "turns": 3,
    "system_prompt_tokens": 8,
    "user_context_tokens": 8,
    "question_tokens": 4,
    "answer_tokens": 2,
    "seed": 3,
}


class FakeChatAnswering:
    """FAKE: answers the first ``count`` chat requests, one token per character, and holds
    the rest until cancelled; ``arrived`` is set when the first held request comes in."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.answered = 0
        self.arrived = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            _method, path, _headers, body = await _read_request(stream)
            if path != "/v1/chat/completions":
                # As a stage server without llama-server's text endpoints (/apply-template).
                await _send_json(stream, 404, {"error": f"no route {path}"})
                return
            chat: dict[str, Any] = json.loads(body)
            if self.answered >= self.count:
                self.arrived.set()
                await trio.sleep_forever()
            self.answered += 1
            prompt = sum(len(m["content"]) for m in chat["messages"])
            tokens = int(chat["max_tokens"])
            await _send_json(
                stream,
                200,
                {
                    "choices": [{"message": {"role": "assistant", "content": "A" * tokens}}],
                    "usage": {
                        "prompt_tokens": prompt,
                        "completion_tokens": tokens,
                        "prompt_tokens_details": {"cached_tokens": 0},
                    },
                },
            )


def host_for(port: int, journaled: list[Record], deadline: float) -> WorkloadHost:
    async def journal(record: Record) -> None:
        journaled.append(record)

    return WorkloadHost(
        cell_id="cell-0000/new-sessions",
        base_url=f"http://127.0.0.1:{port}",
        http=LoopbackHttp(),
        journal=journal,
        deadline=deadline,
        request_timeout_ms=600_000,
        architecture="llama",
        workloads=validate_workload_object({"schema_version": 1, "multi_turn": SESSIONS}),
        workloads_sha256="",
        prompt_text="",
        ignore_eos=True,
        chat=True,
        model_id="fake",
    )


async def test_a_cancel_mid_turn_keeps_the_turns_answered_and_names_the_stop(
    autojump_clock: trio.testing.MockClock,  # noqa: F811
) -> None:
    server = FakeChatAnswering(count=3)
    journaled: list[Record] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)
        host = host_for(port, journaled, trio.current_time() + 3600)
        with trio.CancelScope() as scope:
            nursery.start_soon(run_sessions, host)
            await server.arrived.wait()
            scope.cancel()
        nursery.cancel_scope.cancel()
    sessions = [r for r in journaled if isinstance(r, SessionsMeasured)]
    stopped = [r for r in journaled if isinstance(r, WorkloadStopped)]
    assert len(sessions) == 1 and len(sessions[0].requests) == 3
    assert all(r.status == "completed" for r in sessions[0].requests)
    assert len(stopped) == 1
    assert (stopped[0].reason, stopped[0].sent, stopped[0].point_index) == ("cancelled", 3, None)
    assert journaled.index(sessions[0]) < journaled.index(stopped[0])
    # A stage server without llama-server's text endpoints: the template is recorded as not
    # rendered, with why, and the turns are not designed to a count (nothing to check them by).
    (template,) = [r for r in journaled if isinstance(r, ChatTemplateMeasured)]
    assert template.checked_by == "counts" and template.pieces == "byte-alphabet"
    assert template.unrendered_reason is not None and "404" in template.unrendered_reason
    assert template.session_first_turn_tokens is None
    assert all(r.designed_prompt_tokens is None for r in sessions[0].requests)


async def test_the_work_deadline_between_turns_stops_with_the_turns_sent(
    autojump_clock: trio.testing.MockClock,  # noqa: F811
) -> None:
    server = FakeChatAnswering(count=100)
    journaled: list[Record] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)
        # Already past: the first turn is never sent.
        finished = await run_sessions(host_for(port, journaled, trio.current_time() - 1))
        nursery.cancel_scope.cancel()
    assert finished is False
    stopped = [r for r in journaled if isinstance(r, WorkloadStopped)]
    assert [(s.reason, s.sent) for s in stopped] == [("deadline", 0)]


async def test_a_cancel_while_the_workload_opens_is_journaled_with_nothing_sent(
    autojump_clock: trio.testing.MockClock,  # noqa: F811
) -> None:
    """The stop lands while ``workload_opened`` is being made durable, before any turn."""
    journaled: list[Record] = []
    opening = trio.Event()

    async def journal(record: Record) -> None:
        journaled.append(record)
        if isinstance(record, WorkloadOpened):
            opening.set()
            await trio.sleep_forever()  # an fsync that does not return before the stop

    server = FakeChatAnswering(count=100)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)
        host = replace(host_for(port, [], trio.current_time() + 3600), journal=journal)
        with trio.CancelScope() as scope:
            nursery.start_soon(run_sessions, host)
            await opening.wait()
            scope.cancel()
        nursery.cancel_scope.cancel()
    assert server.answered == 0
    assert [type(r) for r in journaled] == [WorkloadOpened, WorkloadStopped]
    stopped = journaled[-1]
    assert isinstance(stopped, WorkloadStopped)
    assert (stopped.reason, stopped.point_index, stopped.sent) == ("cancelled", None, 0)
