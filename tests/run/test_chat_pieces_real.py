"""Chat text on a real tokenizer: the trained Gemma 3 270M (262k SentencePiece vocabulary, no
chat template of its own) served by the real llama-server. Random sequences of the word pieces
read off its GGUF detokenize to their text and tokenize back to exactly their ids, alone and
inside the template the server applies (its ChatML fallback); the server's own prompt count
of a chat message is that tokenization's; a sequence whose pieces merge is refused
``workload.chat.not_token_exact``; a session's answers, held to the pieces' grammar, tokenize
back to the tokens generated; the overlap workload in the chat dialect journals the template
it measured and sends only prompts the server counts as designed."""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_family.actors.run.chat_text import (
    ModelText,
    RenderedWrapper,
    WrappedPrompt,
    model_text,
    render_wrapper,
    wrapped_prompt,
)
from cache_family.actors.run.workload_dialects import WorkloadHost, send_chat
from cache_family.actors.run.workloads import run_overlap, run_sessions
from cache_family.errors import Refused
from cache_family.oracles.native_parts import Parts, RunningServer, serve
from cache_family.oracles.real_model import ensure_real_model
from cache_family.schemas.gguf_header import read_gguf_header
from cache_family.schemas.journal import JournalLine, Record
from cache_family.schemas.workload import validate_workload_object
from cache_family.schemas.workload_records import (
    ChatTemplateMeasured,
    OverlapPointMeasured,
    SessionsMeasured,
)
from cache_family.states.chat_pieces import SPM_SPACE, ChatPieces, check_round_trip, spm_merge
from cache_family.states.workload_fold import fold_workload
from cache_family.system.http import LoopbackHttp

pytestmark = pytest.mark.native

CHATML_HEAD = "<|im_start|>user\n"
CHATML_TAIL = "<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def real_model_path() -> Path:
    """The registry's Gemma 3 270M, assembled once under ~/.cache/cache-family/real (its
    SHA-256 checked on every call: about a second)."""
    return ensure_real_model(io.StringIO()).model


@pytest.fixture(scope="module")
def real_server(native_parts: Parts, real_model_path: Path) -> Iterator[RunningServer]:
    with serve(native_parts.llama_server, real_model_path, ctx_size=2048, threads=2) as server:
        yield server


@pytest.fixture(scope="module")
def real_text(real_model_path: Path) -> ModelText:
    return model_text(str(real_model_path))


@functools.cache
def _scores(model: Path) -> dict[str, float]:
    kept = read_gguf_header(
        os.path.realpath(model),
        keep_arrays=frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.scores"}),
    ).kept
    return {
        str(t): float(s)
        for t, s in zip(kept["tokenizer.ggml.tokens"], kept["tokenizer.ggml.scores"], strict=True)
    }


def _tokenize(server: RunningServer, text: str, *, special: bool = False) -> list[int]:
    status, answer = server.request(
        "POST", "/tokenize", {"content": text, "add_special": special, "parse_special": True}
    )
    assert status == 200, answer
    return list(answer["tokens"])


def test_the_real_vocabulary_gives_tens_of_thousands_of_word_pieces(real_text: ModelText) -> None:
    pieces = real_text.pieces
    assert real_text.template_source == "server-fallback"  # the GGUF carries no template
    assert pieces.source == "word-pieces" and pieces.size > 10_000
    assert all(p.startswith(" ") and p[1:].isalpha() for p in pieces.pieces)
    assert len(set(pieces.token_ids)) == pieces.size


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_the_merges_read_off_the_gguf_give_random_piece_sequences_back(
    real_model_path: Path, real_text: ModelText, data: st.DataObject
) -> None:
    """Offline, the selection's own reasoning on the real vocabulary: the joined text of
    random pieces merges back into exactly their tokens (the server test below checks it
    against llama.cpp's tokenizer)."""
    vocabulary = _scores(real_model_path)
    pieces = real_text.pieces
    ids = data.draw(st.lists(st.integers(0, pieces.size - 1), min_size=1, max_size=24))
    merged = spm_merge(pieces.text(ids).replace(" ", SPM_SPACE), vocabulary)
    assert merged == [pieces.pieces[i].replace(" ", SPM_SPACE) for i in ids]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_piece_sequences_of_the_real_vocabulary_round_trip(
    real_server: RunningServer, real_text: ModelText, data: st.DataObject
) -> None:
    pieces = real_text.pieces
    ids = data.draw(st.lists(st.integers(0, pieces.size - 1), min_size=1, max_size=64))
    tokens = pieces.tokens(ids)
    assert tokens is not None
    status, answer = real_server.request("POST", "/detokenize", {"tokens": tokens})
    assert status == 200
    assert answer["content"] == pieces.text(ids)
    assert _tokenize(real_server, answer["content"]) == tokens


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_messages_round_trip_inside_the_servers_template(
    real_server: RunningServer, real_text: ModelText, data: st.DataObject
) -> None:
    pieces = real_text.pieces
    ids = data.draw(st.lists(st.integers(0, pieces.size - 1), min_size=1, max_size=48))
    wrapper = trio.run(
        render_wrapper, LoopbackHttp(), real_server.url, pieces.text(ids), pieces, ids, "$"
    )
    assert isinstance(wrapper, RenderedWrapper)
    assert (wrapper.head, wrapper.tail) == (CHATML_HEAD, CHATML_TAIL)
    assert wrapper.prompt_tokens == wrapper.head_tokens + len(ids) + wrapper.tail_tokens


def test_the_servers_count_of_a_chat_message_is_its_tokenization(
    real_server: RunningServer, real_text: ModelText
) -> None:
    pieces = real_text.pieces
    ids = list(range(0, 40 * 97, 97))
    wrapper = trio.run(
        render_wrapper, LoopbackHttp(), real_server.url, pieces.text(ids), pieces, ids, "$"
    )
    assert isinstance(wrapper, RenderedWrapper)
    status, reply = real_server.request(
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": pieces.text(ids)}], "max_tokens": 1},
    )
    assert status == 200
    assert reply["usage"]["prompt_tokens"] == wrapper.prompt_tokens


def test_a_ladder_prompt_is_counted_as_the_server_renders_it_and_a_merge_is_named(
    real_server: RunningServer,
) -> None:
    # Words end in a word: the message's tokens stay intact inside the template.
    text = "The cache keeps what the prompt shares with the one before"
    wrapped = trio.run(wrapped_prompt, LoopbackHttp(), real_server.url, text)
    assert isinstance(wrapped, WrappedPrompt) and wrapped.merged_tokens == 0
    status, reply = real_server.request(
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": text}], "max_tokens": 1},
    )
    assert status == 200
    assert reply["usage"]["prompt_tokens"] == wrapped.prompt_tokens
    assert wrapped.prompt_tokens == len(_tokenize(real_server, text)) + 24
    # The ChatML fallback's markers are plain text to this model: a message ending in a full
    # stop joins the tail's first "<" into one ".<" token, one message token lost.
    merged = trio.run(wrapped_prompt, LoopbackHttp(), real_server.url, text + ".")
    assert isinstance(merged, WrappedPrompt) and merged.merged_tokens == 1


def _merging(server: RunningServer, real_text: ModelText) -> ChatPieces:
    """Two real tokens whose text joins into a third: ``▁the`` + ``re`` is ``▁there``."""
    (the,) = _tokenize(server, " the")
    (re_,) = _tokenize(server, "re")
    assert _tokenize(server, " there") != [the, re_]
    return ChatPieces(source="word-pieces", pieces=(" the", "re"), token_ids=(the, re_))


def test_a_sequence_that_does_not_round_trip_is_refused(
    real_server: RunningServer, real_text: ModelText
) -> None:
    merging = _merging(real_server, real_text)
    designed = merging.tokens([0, 1])
    assert designed is not None
    with pytest.raises(Refused) as refused:
        check_round_trip(designed, _tokenize(real_server, merging.text([0, 1])), "$")
    assert refused.value.refusals[0].code == "workload.chat.not_token_exact"
    # Inside the template too: the wrapper's check refuses the message.
    with pytest.raises(Refused) as wrapped:
        trio.run(
            render_wrapper,
            LoopbackHttp(),
            real_server.url,
            merging.text([0, 1]),
            merging,
            [0, 1],
            "$.prefix_overlap",
        )
    assert wrapped.value.refusals[0].code == "workload.chat.not_token_exact"


def _host(
    server: RunningServer,
    model: Path,
    workloads: dict[str, object],
    journaled: list[Record],
    sliding_window: int | None = None,
) -> WorkloadHost:
    """A chat-dialect workload host on the real llama-server itself (its OpenAI chat, as a
    stage server relays it), journaling into ``journaled``."""

    async def journal(record: Record) -> None:
        journaled.append(record)

    return WorkloadHost(
        cell_id="cell-0000/new-overlap",
        base_url=server.url,
        http=LoopbackHttp(),
        journal=journal,
        deadline=trio.current_time() + 600,
        request_timeout_ms=120_000,
        architecture="gemma3",
        workloads=validate_workload_object({"schema_version": 1, **workloads}),
        workloads_sha256="",
        prompt_text="",
        ignore_eos=False,
        chat=True,
        model_id="gemma3",
        model_path=str(model),
        sliding_window=sliding_window,
    )


def test_session_answers_held_to_the_pieces_tokenize_back_to_the_tokens_generated(
    real_server: RunningServer, real_text: ModelText, real_model_path: Path
) -> None:
    pieces = real_text.pieces

    async def ask() -> tuple[str, int | None]:
        sessions = {"users": 1, "turns": 2, "question_tokens": 4, "answer_tokens": 12}
        host = _host(real_server, real_model_path, {"multi_turn": sessions}, [])
        answer = await send_chat(
            host, pieces.text([5, 9, 200, 4000]), 12, 0, exact=True, pieces=pieces
        )
        return answer.content, answer.completion_tokens

    content, generated = trio.run(ask)
    assert generated == 12
    tokens = _tokenize(real_server, content)
    assert len(tokens) == generated, content
    letters = {t for t, p in zip(pieces.token_ids, pieces.pieces, strict=True) if len(p) == 2}
    assert set(tokens) <= letters
    assert content.replace(" ", SPM_SPACE).count(SPM_SPACE) == generated


def test_the_chat_overlap_sends_only_prompts_the_server_counts_as_designed(
    real_server: RunningServer, real_model_path: Path
) -> None:
    spec = {
        "prefix_overlap": {
            "prompt_tokens": 96,
            "hit_ratios_pct": [0, 50],
            "groups": 1,
            "requests": 2,
            "output_tokens": 1,
            "seed": 5,
        }
    }

    journaled: list[Record] = []

    async def run() -> None:
        assert await run_overlap(_host(real_server, real_model_path, spec, journaled))

    trio.run(run)
    (template,) = [r for r in journaled if isinstance(r, ChatTemplateMeasured)]
    assert template.pieces == "word-pieces" and template.checked_by == "tokenize"
    assert template.template_source == "server-fallback"
    assert (template.rendered_head, template.rendered_tail) == (CHATML_HEAD, CHATML_TAIL)
    assert template.head_tokens is not None and template.tail_tokens is not None
    assert template.template_tokens == template.head_tokens + template.tail_tokens
    points = [r for r in journaled if isinstance(r, OverlapPointMeasured)]
    assert len(points) == 2
    # 48 shared tokens of a 96-token chat prompt are inside the sliding window, where the
    # chat design finds no checkpoint to reuse: that point is refused and never sent.
    sent = [p for p in points if p.design_refusal is None]
    assert [p.hit_ratio_pct for p in sent] == [0]
    for point in points:
        if point.design_refusal is not None:
            assert point.design_refusal == "workload.overlap.nothing_shared"
            assert not point.requests
            continue
        assert point.template_tokens == template.template_tokens
        for request in point.requests:
            assert request.status == "completed", request
            # The message's pieces and the template: the whole prompt the sweep asked for.
            assert request.designed_prompt_tokens == 96
            assert request.prompt_tokens == 96


def test_the_chat_overlap_reuses_its_design_inside_and_past_the_sliding_window(
    real_server: RunningServer, real_model_path: Path
) -> None:
    """768-token chat prompts on the model's 512-token window: 30 % shares 230 message tokens,
    inside the window, where a priming message puts the server's checkpoint on the head and
    the prefix; 70 % shares 520, past it, where the slot reuses the prefix itself. Each point
    is judged against its design and accepted."""
    spec = {
        "prefix_overlap": {
            "prompt_tokens": 768,
            "hit_ratios_pct": [30, 70],
            "groups": 1,
            "requests": 2,
            "output_tokens": 1,
            "seed": 7,
        }
    }
    journaled: list[Record] = []

    async def run() -> None:
        host = _host(real_server, real_model_path, spec, journaled, sliding_window=512)
        assert await run_overlap(host)

    trio.run(run)
    lines = [
        JournalLine(seq=seq, mono_ns=0, wall_ns=0, prev="", record=record)
        for seq, record in enumerate(journaled, start=1)
    ]
    receipt = fold_workload(lines, "cell-0000/new-overlap")
    points = {p.hit_ratio_pct: p for p in receipt.overlap}
    (template,) = [r for r in journaled if isinstance(r, ChatTemplateMeasured)]
    message = 768 - (template.template_tokens or 0)
    assert points[30].shared_prefix_tokens == message * 30 // 100
    assert points[70].shared_prefix_tokens == message * 70 // 100
    measured = [r for r in journaled if isinstance(r, OverlapPointMeasured)]
    assert [p.reprimed for p in measured] == [True, False]
    assert measured[0].priming_prompt_tokens > measured[0].shared_prefix_tokens
    for point in points.values():
        assert point.accepted, point
        assert point.achieved_ratio_pct == pytest.approx(point.designed_ratio_pct)


def test_chat_sessions_are_designed_to_the_servers_count_turn_by_turn(
    real_server: RunningServer, real_model_path: Path
) -> None:
    spec = {
        "multi_turn": {
            "users": 1,
            "turns": 3,
            "system_prompt_tokens": 8,
            "user_context_tokens": 8,
            "question_tokens": 4,
            "answer_tokens": 6,
            "seed": 2,
        }
    }
    journaled: list[Record] = []

    async def run() -> None:
        assert await run_sessions(_host(real_server, real_model_path, spec, journaled))

    trio.run(run)
    (template,) = [r for r in journaled if isinstance(r, ChatTemplateMeasured)]
    assert template.session_first_turn_tokens is not None
    assert template.session_later_turn_tokens is not None
    (sessions,) = [r for r in journaled if isinstance(r, SessionsMeasured)]
    assert [r.turn for r in sessions.requests] == [0, 1, 2]
    for request in sessions.requests:
        assert request.status == "completed", request
        # Each turn the sum of its parts: an answer that did not tokenize back would miss it.
        assert request.prompt_tokens == request.designed_prompt_tokens is not None, request
    assert sessions.requests[0].prompt_tokens == template.session_first_turn_tokens + 8 + 8 + 4
