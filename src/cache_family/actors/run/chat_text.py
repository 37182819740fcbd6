"""What a chat dialect's workload writes its messages with: the model's text pieces, read
off its GGUF (``states/chat_pieces.py`` chooses them), and the template the host wraps a
message in, rendered and tokenized by the host itself where it serves llama-server's
``/apply-template`` and ``/tokenize``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Final

import trio

from cache_family.errors import Refused
from cache_family.schemas.gguf_header import read_gguf_header
from cache_family.states.chat_pieces import (
    BYTE_ALPHABET,
    WORD_PIECE_TOKENIZERS,
    ChatPieces,
    check_round_trip,
    word_pieces,
)
from cache_family.states.workloads import WORKLOAD_VERDICT_CODES
from cache_family.system.http import HttpError, LoopbackHttp

#: The GGUF arrays a SentencePiece vocabulary's pieces are chosen from.
VOCABULARY_ARRAYS: Final = frozenset(
    {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"}
)
#: The key of the model's own chat template; without it llama-server applies ChatML.
TEMPLATE_KEY: Final = "tokenizer.chat_template"
_BODY_LIMIT: Final = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ModelText:
    """The pieces a model's chat messages are written in, and whose template wraps them."""

    pieces: ChatPieces
    # model: the GGUF carries a chat template; server-fallback: it does not (the server's
    # own applies); unknown: no model file was given to read.
    template_source: str


@lru_cache(maxsize=4)
def _model_text(path: str, _identity: tuple[int, int, int]) -> ModelText:
    header = read_gguf_header(path, keep_arrays=VOCABULARY_ARRAYS)
    has_template = TEMPLATE_KEY in header.metadata or TEMPLATE_KEY in header.arrays
    source = "model" if has_template else "server-fallback"
    if header.text("tokenizer.ggml.model") not in WORD_PIECE_TOKENIZERS:
        # A byte-level vocabulary (the zoo's): one character per token, checked by the
        # calibration's counts; any other is refused there if it merges the characters.
        return ModelText(BYTE_ALPHABET, source)
    kept = header.kept
    pieces = word_pieces(
        [str(t) for t in kept.get("tokenizer.ggml.tokens", ())],
        [float(s) for s in kept.get("tokenizer.ggml.scores", ())],
        [int(t) for t in kept.get("tokenizer.ggml.token_type", ())],
    )
    return ModelText(pieces, source)


def model_text(model_path: str) -> ModelText:
    """The chat text of the GGUF at ``model_path`` (blocking: a vocabulary is read and
    searched; the same file, unchanged, is read once). No path: the byte alphabet."""
    if not model_path:
        return ModelText(BYTE_ALPHABET, "unknown")
    # The hub snapshot's name is a link to its blob: read the file itself.
    real = os.path.realpath(model_path)
    info = os.stat(real)
    return _model_text(real, (info.st_dev, info.st_ino, info.st_mtime_ns))


async def read_model_text(model_path: str) -> ModelText:
    return await trio.to_thread.run_sync(model_text, model_path)


@dataclass(frozen=True, slots=True)
class RenderedWrapper:
    """One user message as the host renders and tokenizes it: the text before and after the
    message and their tokens, and the whole prompt's tokens."""

    head: str
    tail: str
    head_tokens: int
    tail_tokens: int
    prompt_tokens: int


async def _post(http: LoopbackHttp, url: str, body: dict[str, Any]) -> dict[str, Any] | str:
    """The JSON object a llama-server extension answered, or why there is none."""
    try:
        async with http.request("POST", url, json_body=body) as response:
            data = await response.read(_BODY_LIMIT)
    except (HttpError, OSError) as exc:
        return f"{url}: {type(exc).__name__}: {exc}"
    if response.status_code != 200:
        return f"{url} answered HTTP {response.status_code}"
    try:
        found = json.loads(data)
    except ValueError:
        return f"{url} answered no JSON"
    return found if isinstance(found, dict) else f"{url} answered no JSON object"


async def _tokens(http: LoopbackHttp, base: str, text: str, *, special: bool) -> list[int] | str:
    # As the server tokenizes a chat prompt: control texts parsed, BOS added at its start.
    answer = await _post(
        http,
        f"{base}/tokenize",
        {"content": text, "add_special": special, "parse_special": True},
    )
    if isinstance(answer, str):
        return answer
    tokens = answer.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        return f"{base}/tokenize answered no token list"
    return tokens


async def render_wrapper(
    http: LoopbackHttp,
    base_url: str,
    text: str,
    pieces: ChatPieces,
    ids: list[int],
    where: str,
) -> RenderedWrapper | str:
    """The host's template around one user message carrying design ids ``ids``, checked
    token for token: the rendered prompt must tokenize into the head's tokens, the message's
    designed tokens and the tail's, nothing merged where they meet (refused
    ``workload.chat.not_token_exact`` otherwise). A host that serves no ``/apply-template`` or
    ``/tokenize`` answers why, as a string."""
    base = base_url.rstrip("/")
    rendered = await _post(
        http, f"{base}/apply-template", {"messages": [{"role": "user", "content": text}]}
    )
    if isinstance(rendered, str):
        return rendered
    prompt = rendered.get("prompt")
    if not isinstance(prompt, str) or text not in prompt:
        return f"{base}/apply-template answered no prompt holding the message"
    head, tail = prompt.split(text, 1)
    designed = pieces.tokens(ids)
    if designed is None:
        # The byte alphabet's token ids are the server's to say: one per character.
        found = await _tokens(http, base, text, special=False)
        if isinstance(found, str):
            return found
        if len(found) != len(ids):
            code = "workload.chat.text_not_one_token_per_character"
            raise Refused.one(
                code,
                where,
                f"{len(ids)} characters were {len(found)} tokens by the server's /tokenize",
                WORKLOAD_VERDICT_CODES[code].hint,
            )
        designed = found
    parts = [
        await _tokens(http, base, head, special=True),
        await _tokens(http, base, tail, special=False),
        await _tokens(http, base, prompt, special=True),
    ]
    for part in parts:
        if isinstance(part, str):
            return part
    head_tokens, tail_tokens, whole = (p for p in parts if not isinstance(p, str))
    check_round_trip([*head_tokens, *designed, *tail_tokens], whole, where)
    return RenderedWrapper(
        head=head,
        tail=tail,
        head_tokens=len(head_tokens),
        tail_tokens=len(tail_tokens),
        prompt_tokens=len(whole),
    )


@dataclass(frozen=True, slots=True)
class ConversationOverheads:
    """What the host's template adds to a session's prompts beyond the pieces and answers it
    carries, by its own rendering and tokenizing of probe conversations: a first turn's
    (the system and user messages' wrappers, the generation prompt), and each later turn's
    (the answer's close, the next user message's wrapper and generation prompt)."""

    first: int
    later: int


async def _rendered_tokens(
    http: LoopbackHttp, base: str, messages: list[dict[str, str]]
) -> int | str:
    rendered = await _post(http, f"{base}/apply-template", {"messages": messages})
    if isinstance(rendered, str):
        return rendered
    prompt = rendered.get("prompt")
    if not isinstance(prompt, str):
        return f"{base}/apply-template answered no prompt"
    tokens = await _tokens(http, base, prompt, special=True)
    return tokens if isinstance(tokens, str) else len(tokens)


async def conversation_overheads(
    http: LoopbackHttp, base_url: str, pieces: ChatPieces, *, system: bool
) -> ConversationOverheads | str:
    """A session's template overheads (``system``: its first turn has a system message), or
    why the host cannot say (it serves no ``/apply-template`` or ``/tokenize``)."""
    base = base_url.rstrip("/")
    words = list(range(12))
    # The answer as a session's answers are: pieces its grammar allows.
    letters = [i for i, text in enumerate(pieces.pieces) if len(text.strip()) == 1][:4]
    first: list[dict[str, str]] = [{"role": "user", "content": pieces.text(words[4:8])}]
    if system:
        first.insert(0, {"role": "system", "content": pieces.text(words[:4])})
    later = [
        *first,
        {"role": "assistant", "content": pieces.text(letters)},
        {"role": "user", "content": pieces.text(words[8:])},
    ]
    counted = [await _rendered_tokens(http, base, first), await _rendered_tokens(http, base, later)]
    for count in counted:
        if isinstance(count, str):
            return count
    n_first, n_later = (c for c in counted if not isinstance(c, str))
    return ConversationOverheads(
        first=n_first - 4 * len(first), later=n_later - n_first - len(letters) - 4
    )


@dataclass(frozen=True, slots=True)
class WrappedPrompt:
    """A prompt sent as one user message, as the chat host renders and tokenizes it: the
    prompt tokens it counts, and the tokens lost where the message meets its template (a
    message token merged with the template's: 0 when the message's own tokens are intact)."""

    prompt_tokens: int
    message_tokens: int
    merged_tokens: int


async def wrapped_prompt(http: LoopbackHttp, base_url: str, text: str) -> WrappedPrompt | str:
    """``text`` as one user message in the host's template, counted by the host's own
    ``/apply-template`` and ``/tokenize``; or why the host cannot say (it serves neither)."""
    base = base_url.rstrip("/")
    rendered = await _post(
        http, f"{base}/apply-template", {"messages": [{"role": "user", "content": text}]}
    )
    if isinstance(rendered, str):
        return rendered
    prompt = rendered.get("prompt")
    if not isinstance(prompt, str) or text not in prompt:
        return f"{base}/apply-template answered no prompt holding the message"
    head, tail = prompt.split(text, 1)
    parts = [
        await _tokens(http, base, head, special=True),
        await _tokens(http, base, text, special=False),
        await _tokens(http, base, tail, special=False),
        await _tokens(http, base, prompt, special=True),
    ]
    counts = [p if isinstance(p, str) else len(p) for p in parts]
    for count in counts:
        if isinstance(count, str):
            return count
    head_tokens, message_tokens, tail_tokens, whole = (c for c in counts if not isinstance(c, str))
    return WrappedPrompt(
        prompt_tokens=whole,
        message_tokens=message_tokens,
        merged_tokens=head_tokens + message_tokens + tail_tokens - whole,
    )


def refuse_count(where: str, designed: int, counted: int, what: str) -> Refused:
    """``workload.prompt.token_count_mismatch`` at the calibration: the server's own count of
    a prompt is not what its /tokenize gave."""
    code = "workload.prompt.token_count_mismatch"
    return Refused.one(
        code,
        where,
        f"{what}: the server counted {counted} prompt tokens, the design {designed}",
        WORKLOAD_VERDICT_CODES[code].hint,
    )
