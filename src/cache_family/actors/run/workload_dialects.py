"""The two request dialects a workload speaks to its host (``WorkloadHost.dialect``):
llama-server's ``/completion`` of token ids, and OpenAI chat (text in the model's pieces, to the
host's model id). Both send one non-streamed request through one POST cut at the request timeout
or the cell's deadline (``post_by_deadline``); each dialect is one ``WorkloadDialect`` (a request
of token ids, the sessions' turns), and its open-loop requests go through its load client
(``LOAD_DIALECTS``)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import trio

from cache_family.actors.run.chat_text import ConversationOverheads
from cache_family.actors.run.server_metrics import MetricsWatch
from cache_family.schemas.host_kinds import RequestDialect
from cache_family.schemas.journal import Record
from cache_family.schemas.workload import MultiTurn, WorkloadFile
from cache_family.schemas.workload_records import WorkloadRequest
from cache_family.states.cache_reuse import reuse_rule
from cache_family.states.chat_pieces import BYTE_ALPHABET, ChatPieces
from cache_family.states.sessions import SessionTokens, SessionTurn, turn_reuse
from cache_family.system.http import HttpError, LoopbackHttp

#: An answer body this large is not a /completion reply of a few tokens.
ANSWER_BODY_LIMIT: Final = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class WorkloadHost:
    """What a runner needs of its cell: the host, the journal and the budgets."""

    cell_id: str
    base_url: str
    http: LoopbackHttp
    journal: Callable[[Record], Awaitable[object]]
    deadline: float
    request_timeout_ms: int
    architecture: str | None
    workloads: WorkloadFile
    workloads_sha256: str
    # The row's benchmark prompt text (the open-loop workload sends it).
    prompt_text: str
    ignore_eos: bool
    # Whether the host is still the one spawned (asked after a request failed: a host gone
    # mid-point is a fault of the cell, not a refused point).
    host_alive: Callable[[], bool] = lambda: True
    # The host's dialect: llama-server's ``/completion`` of token ids, or a stage server's
    # OpenAI chat (text messages, to ``model_id``).
    chat: bool = False
    model_id: str = ""
    # The model file the host serves (pinned): a chat dialect writes its messages in pieces
    # of its vocabulary (``actors/run/chat_text.py``); empty: the byte alphabet.
    model_path: str = ""
    # The model header's sliding window (a sliding-window family's; None: none or unknown).
    sliding_window: int | None = None
    # The host's slots and each slot's context (tokens): what its cache can hold.
    slots: int | None = None
    slot_context_tokens: int | None = None
    # The host's metrics, read around every point (None: not read).
    metrics: MetricsWatch | None = None

    @property
    def dialect(self) -> RequestDialect:
        """The request dialect its workloads are sent in."""
        return "chat" if self.chat else "completion"

    @property
    def speaks(self) -> WorkloadDialect:
        """What its workloads send, in its dialect."""
        return WORKLOAD_DIALECTS[self.dialect]


class WorkloadHostLost(Exception):
    """The host was gone when a workload request failed (the stopped point is journaled)."""


def check_host(host: WorkloadHost, answer: Answer) -> None:
    if answer.reply is None and not host.host_alive():
        raise WorkloadHostLost(f"the host was gone when a request failed: {answer.error}")


async def vocabulary_size(host: WorkloadHost) -> int:
    """The ids prompts are drawn from: the host's ``n_vocab`` less its top sixty-fourth (at
    least 4), where GGUF vocabularies keep their control tokens."""
    async with host.http.request("GET", host.base_url.rstrip("/") + "/v1/models") as response:
        data = json.loads(await response.read(ANSWER_BODY_LIMIT))
    n_vocab = int(data["data"][0]["meta"]["n_vocab"])
    return n_vocab - max(4, n_vocab // 64)


class Answer:
    def __init__(self, reply: Mapping[str, Any] | None, elapsed_ms: float, error: str | None):
        self.reply = reply
        self.elapsed_ms = elapsed_ms
        self.error = error

    def request(self, position: int, **plan: Any) -> WorkloadRequest:
        reply = self.reply
        if reply is None:
            return WorkloadRequest(
                position=position,
                status="failed",
                elapsed_ms=self.elapsed_ms,
                error=self.error,
                **plan,
            )
        timings = reply.get("timings") or {}
        slot = reply.get("id_slot")
        return WorkloadRequest(
            position=position,
            status="completed",
            prompt_tokens=reply.get("tokens_evaluated"),
            cached_tokens=timings.get("cache_n", 0),
            prompt_ms=timings.get("prompt_ms"),
            elapsed_ms=self.elapsed_ms,
            slot_id=slot if isinstance(slot, int) and slot >= 0 else None,
            **plan,
        )

    @property
    def tokens(self) -> list[int]:
        found = (self.reply or {}).get("tokens") or []
        return [int(t) for t in found]


AnswerT = TypeVar("AnswerT", bound=Answer)


async def post_by_deadline(
    host: WorkloadHost, path: str, body: Mapping[str, Any], answer: type[AnswerT]
) -> AnswerT:
    """One non-streamed POST of ``body`` to the host's ``path``, cut at the request timeout or
    the cell's deadline, whichever comes first: its reply, or why there is none (a failure is
    the point's to record, never raised)."""
    start = trio.current_time()
    url = host.base_url.rstrip("/") + path
    timeout = min(host.request_timeout_ms / 1000, max(0.0, host.deadline - start))
    error: str | None = "request timed out"
    reply: Mapping[str, Any] | None = None
    with trio.move_on_after(timeout):
        try:
            async with host.http.request("POST", url, json_body=body) as response:
                data = await response.read(ANSWER_BODY_LIMIT)
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {data[:200]!r}"
            else:
                reply, error = json.loads(data), None
        except (HttpError, OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    return answer(reply, (trio.current_time() - start) * 1000, error)


async def send_completion(
    host: WorkloadHost, prompt: list[int], n_predict: int, slot: int, *, exact: bool
) -> Answer:
    """One non-streamed ``/completion`` of token ids on ``slot`` (greedy; ``exact``: exactly
    ``n_predict`` tokens, with the answer's token ids returned)."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0,
        "top_k": 1,
        "stream": False,
        "id_slot": slot,
    }
    if exact or host.ignore_eos:
        body["ignore_eos"] = True
    if exact:
        body["return_tokens"] = True
    return await post_by_deadline(host, "/completion", body, Answer)


class ChatAnswer(Answer):
    """An OpenAI chat reply: the server's counts from ``usage`` (its prompt tokens, the
    template's included, and ``prompt_tokens_details.cached_tokens``), its prompt time from
    llama.cpp's ``timings`` when the server passes them on."""

    def request(self, position: int, **plan: Any) -> WorkloadRequest:
        reply = self.reply
        if reply is None:
            return super().request(position, **plan)
        usage = reply.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        timings = reply.get("timings") or {}
        return WorkloadRequest(
            position=position,
            status="completed",
            prompt_tokens=usage.get("prompt_tokens"),
            cached_tokens=details.get("cached_tokens"),
            prompt_ms=timings.get("prompt_ms"),
            elapsed_ms=self.elapsed_ms,
            **plan,
        )

    @property
    def content(self) -> str:
        """The answer's text (``choices[0].message.content``)."""
        choices = (self.reply or {}).get("choices") or [{}]
        return str((choices[0].get("message") or {}).get("content") or "")

    @property
    def completion_tokens(self) -> int | None:
        found = ((self.reply or {}).get("usage") or {}).get("completion_tokens")
        return found if isinstance(found, int) else None


async def send_chat(
    host: WorkloadHost,
    messages: str | list[dict[str, str]],
    max_tokens: int,
    slot: int,
    *,
    exact: bool = False,
    pieces: ChatPieces = BYTE_ALPHABET,
) -> ChatAnswer:
    """One non-streamed chat completion on ``slot`` (greedy) of one user message, or of a
    conversation; ``exact``: exactly ``max_tokens`` answer tokens, held to ``pieces``' answer
    grammar (and off the tokens it bans), so that the answer's text tokenizes back."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    body: dict[str, Any] = {
        "model": host.model_id,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": False,
        # llama.cpp's slot choice, passed on by the stage server: a group keeps its slot.
        "id_slot": slot,
    }
    if exact or host.ignore_eos:
        body["ignore_eos"] = True
    if exact:
        body["grammar"] = pieces.answer_grammar
        if pieces.answer_banned_ids:
            body["logit_bias"] = [[token, False] for token in pieces.answer_banned_ids]
    return await post_by_deadline(host, "/v1/chat/completions", body, ChatAnswer)


# One session turn sent in a dialect: its answer (a failed one ends the workload if the host
# is gone) and its request as journaled.
SessionTurnSender = Callable[[SessionTurn], Awaitable[tuple[Answer, WorkloadRequest]]]


def completion_turns(
    host: WorkloadHost,
    spec: MultiTurn,
    tokens: SessionTokens,
    _pieces: ChatPieces | None,
    _overheads: ConversationOverheads | None,
) -> SessionTurnSender:
    """Sessions of token ids: each turn's prompt is the session so far (its prompts and the
    answers' token ids as generated) and the next question."""
    sessions: dict[int, list[int]] = {}

    async def turn(item: SessionTurn) -> tuple[Answer, WorkloadRequest]:
        question = list(tokens.questions[item.user][item.turn])
        if item.turn == 0:
            prompt = tokens.first_prompt(item.user)
        else:
            prompt = [*sessions.get(item.user, ()), *question]
        # Each user's turns on the user's own slot: a turn finds its session there.
        answer = await send_completion(host, prompt, spec.answer_tokens, item.user, exact=True)
        sessions[item.user] = [*prompt, *answer.tokens]
        request = answer.request(
            item.position,
            group=item.user,
            turn=item.turn,
            expected_reused_tokens=item.expected_reused_tokens,
            designed_prompt_tokens=len(prompt),
        )
        return answer, request

    return turn


def chat_turns(
    host: WorkloadHost,
    spec: MultiTurn,
    tokens: SessionTokens,
    pieces: ChatPieces | None,
    overheads: ConversationOverheads | None,
) -> SessionTurnSender:
    """Sessions as chat conversations: a system message, the user's context and first
    question, then per turn the answer as the server gave it and the next question. Each
    turn should reuse the previous turn's prompt and answer as the server counted them (its
    answer's last token, sampled, never evaluated): the answers are held to the design's
    pieces, so their text is the tokens the server generated. With the template's
    ``overheads`` known, each turn is designed to a count: a first turn, its pieces and the
    template's; a later one, the turn before as counted, its answer, the question's pieces
    and the template's (an answer that did not tokenize back would miss it)."""
    assert pieces is not None  # a chat host's text is in its model's pieces
    rule = reuse_rule(host.architecture)
    conversations: dict[int, list[dict[str, str]]] = {}
    counted: dict[int, tuple[int, int]] = {}

    async def turn(item: SessionTurn) -> tuple[Answer, WorkloadRequest]:
        question = pieces.text(tokens.questions[item.user][item.turn])
        if item.turn == 0:
            first = pieces.text([*tokens.contexts[item.user], *tokens.questions[item.user][0]])
            system = pieces.text(tokens.system)
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": first})
        else:
            messages = [
                *conversations.get(item.user, ()),
                {"role": "user", "content": question},
            ]
        answer = await send_chat(
            host, messages, spec.answer_tokens, item.user, exact=True, pieces=pieces
        )
        conversations[item.user] = [
            *messages,
            {"role": "assistant", "content": answer.content},
        ]
        earlier = counted.get(item.user)
        expected = 0
        if item.expected_reused_tokens and earlier is not None and rule is not None:
            expected = turn_reuse(rule, earlier[0], earlier[1], sliding_window=host.sliding_window)
        designed: int | None = None
        if overheads is not None and item.turn == 0:
            designed = overheads.first + len(tokens.first_prompt(item.user))
        elif overheads is not None and earlier is not None:
            designed = sum(earlier) + overheads.later + spec.question_tokens
        request = answer.request(
            item.position,
            group=item.user,
            turn=item.turn,
            expected_reused_tokens=expected,
            designed_prompt_tokens=designed,
        )
        counted.pop(item.user, None)
        if request.prompt_tokens is not None and answer.completion_tokens:
            counted[item.user] = (request.prompt_tokens, answer.completion_tokens)
        return answer, request

    return turn


async def _completion_of_ids(
    host: WorkloadHost, prompt: list[int], output_tokens: int, slot: int, _: ChatPieces | None
) -> Answer:
    return await send_completion(host, prompt, output_tokens, slot, exact=False)


async def _chat_of_ids(
    host: WorkloadHost, prompt: list[int], output_tokens: int, slot: int, pieces: ChatPieces | None
) -> Answer:
    assert pieces is not None  # a chat host's text is in its model's pieces
    return await send_chat(host, pieces.text(prompt), output_tokens, slot)


@dataclass(frozen=True, slots=True)
class WorkloadDialect:
    """What a workload sends in one request dialect (``WorkloadHost.dialect``); its open-loop
    requests go through the dialect's load client (``LOAD_DIALECTS``)."""

    # One greedy request of a prompt of token ids on ``slot`` (a chat host gets their text in
    # the model's pieces), as long an answer as the server gives up to ``output_tokens``.
    send: Callable[[WorkloadHost, list[int], int, int, ChatPieces | None], Awaitable[Answer]]
    # The sessions' turns: (host, spec, tokens, the model's pieces, the template's overheads).
    turns: Callable[
        [WorkloadHost, MultiTurn, SessionTokens, ChatPieces | None, ConversationOverheads | None],
        SessionTurnSender,
    ]
    # Its prompts go as text in the pieces of the host's model (``actors/run/chat_text.py``):
    # none is cut to a token count, so its reuse rule is the model header's, unprobed.
    writes_text: bool


WORKLOAD_DIALECTS: Final[Mapping[RequestDialect, WorkloadDialect]] = {
    "completion": WorkloadDialect(_completion_of_ids, completion_turns, writes_text=False),
    "chat": WorkloadDialect(_chat_of_ids, chat_turns, writes_text=True),
}
