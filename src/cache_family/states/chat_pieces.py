"""The text a chat dialect's prompts are written in, chosen so that the server's tokenizer
gives back exactly the designed tokens: one piece of text per design id, joined without
merging where two pieces meet.

Two sources. A byte-token vocabulary (the zoo's byte-level BPE) writes each design id as one
character of ``CHAT_ALPHABET``. A SentencePiece vocabulary (``tokenizer.ggml.model`` llama,
Gemma's among them) writes each as one of its own word tokens, ``▁`` and lowercase letters,
picked from the GGUF's vocabulary so that no join can merge: SentencePiece merges only pairs
whose text is a token, so a join of a piece ending in ``c`` and one starting with ``▁`` can
merge only if some token holds ``c▁``; pieces ending in such a character are left out, and each
piece must come out of the merges whole when tokenized alone. The server's own counts check
the result on every prompt (``states/workloads.py``)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from itertools import pairwise
from types import MappingProxyType
from typing import Final, Literal

import msgspec

from cache_family.errors import Refused
from cache_family.schemas.refusal_codes import RefusalCode

PiecesSource = Literal["byte-alphabet", "word-pieces"]

#: The characters a chat-dialect prompt is written in on a byte-token vocabulary: each one
#: prompt token of its own (no merges among them; the calibration checks it on the server).
CHAT_ALPHABET: Final = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&()*+,-./:;=?@[]^_~"
#: A byte-alphabet session's answers: characters of ``CHAT_ALPHABET`` only (a llama.cpp
#: grammar), so the answer's text, sent back in the next turn, is the tokens generated.
CHAT_ANSWER_GRAMMAR: Final = "root ::= [A-Z0-9]+"
#: SentencePiece's word boundary mark, and the space it stands for in text.
SPM_SPACE: Final = "\u2581"
#: GGUF ``tokenizer.ggml.token_type`` of an ordinary token (the others are control,
#: user-defined, unknown, unused and byte tokens).
NORMAL_TOKEN: Final = 1
#: The GGUF tokenizer models whose vocabulary this module designs word pieces for.
WORD_PIECE_TOKENIZERS: Final = frozenset({"llama"})
#: Fewer stable pieces than this cannot start every prompt of a workload differently.
MIN_WORD_PIECES: Final = 1024
#: Longest word piece taken: long rare words are the likeliest to be split by the merges.
MAX_PIECE_CHARACTERS: Final = 12
_WORD: Final = re.compile(f"{SPM_SPACE}[a-z]{{1,{MAX_PIECE_CHARACTERS - 1}}}")

CHAT_PIECES_CODES: Final[Mapping[str, RefusalCode]] = MappingProxyType(
    {
        c.code: c
        for c in (
            RefusalCode(
                "workload.chat.no_stable_pieces",
                "the model's vocabulary has too few word tokens that tokenize back to "
                "themselves when joined",
                "run the chat workloads on the native arm (token ids) for this model",
            ),
            RefusalCode(
                "workload.chat.not_token_exact",
                "the server tokenized a designed chat text into other tokens than the design's",
                "the tokenizer merged where pieces or the template meet: report the model and "
                "the pieces named",
            ),
        )
    }
)


class ChatPieces(msgspec.Struct, frozen=True, kw_only=True):
    """The text of every design id, and how a session's answers are held to it."""

    source: PiecesSource
    # The text that carries each design id (ids index this tuple).
    pieces: tuple[str, ...]
    # Word pieces: the model's token id of each piece; the byte alphabet: unknown (empty).
    token_ids: tuple[int, ...] = ()
    # A llama.cpp grammar the answers of a session follow, and the tokens they must not use
    # (a piece's text split otherwise than the piece: the answer would not tokenize back).
    answer_grammar: str = CHAT_ANSWER_GRAMMAR
    answer_banned_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return f"<ChatPieces {self.source} x{len(self.pieces)}>"

    @property
    def size(self) -> int:
        return len(self.pieces)

    def text(self, ids: Sequence[int]) -> str:
        """The message text that carries the design ids ``ids``."""
        return "".join(self.pieces[i] for i in ids)

    def tokens(self, ids: Sequence[int]) -> list[int] | None:
        """The model's tokens of ``ids``, where the pieces know them."""
        if not self.token_ids:
            return None
        return [self.token_ids[i] for i in ids]


BYTE_ALPHABET: Final = ChatPieces(source="byte-alphabet", pieces=tuple(CHAT_ALPHABET))


def spm_merge(text: str, scores: Mapping[str, float]) -> list[str]:
    """The symbols SentencePiece's merges leave of ``text`` (spaces already ``▁``): from
    single characters, repeatedly join the adjacent pair whose text is the best-scoring token
    (the leftmost of equals) until no pair is a token."""
    symbols = list(text)
    while len(symbols) > 1:
        best: tuple[float, int] | None = None
        for index in range(len(symbols) - 1):
            score = scores.get(symbols[index] + symbols[index + 1])
            if score is not None and (best is None or score > best[0]):
                best = (score, index)
        if best is None:
            break
        at = best[1]
        symbols[at : at + 2] = [symbols[at] + symbols[at + 1]]
    return symbols


def _glued_before_space(tokens: Sequence[str]) -> frozenset[str]:
    """Characters some token holds right before a space: a piece ending in one could merge
    with the ``▁`` that starts the next piece."""
    glued: set[str] = set()
    for token in tokens:
        for before, after in pairwise(token):
            if after in (SPM_SPACE, " ") and before not in (SPM_SPACE, " "):
                glued.add(before)
    return frozenset(glued)


def word_pieces(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> ChatPieces:
    """The stable word pieces of a SentencePiece vocabulary (its GGUF ``tokenizer.ggml.*``
    arrays), by token id; refused when fewer than ``MIN_WORD_PIECES`` are."""
    if not len(tokens) == len(scores) == len(types):
        raise ValueError("tokens, scores and types of one vocabulary")
    # The merges look every pair up among all tokens, whatever their type.
    score_of = {text: float(scores[i]) for i, text in enumerate(tokens)}
    glued = _glued_before_space(tokens)
    # Texts the tokenizer splits out before any merge (control and user-defined tokens): a
    # piece that holds one would not come back whole.
    special = [
        text.replace(SPM_SPACE, " ")
        for i, text in enumerate(tokens)
        if types[i] != NORMAL_TOKEN and text and set(text) <= set("abcdefghijklmnopqrstuvwxyz ▁")
    ]
    chosen: list[tuple[int, str]] = []
    for token_id, text in enumerate(tokens):
        if types[token_id] != NORMAL_TOKEN or not _WORD.fullmatch(text) or text[-1] in glued:
            continue
        spaced = text.replace(SPM_SPACE, " ")
        if any(s in spaced for s in special):
            continue
        if spm_merge(text, score_of) != [text]:
            continue
        chosen.append((token_id, spaced))
    if len(chosen) < MIN_WORD_PIECES:
        raise Refused.one(
            "workload.chat.no_stable_pieces",
            "$.vocabulary",
            f"{len(chosen)} stable word pieces in a vocabulary of {len(tokens)} "
            f"(at least {MIN_WORD_PIECES} needed)",
            CHAT_PIECES_CODES["workload.chat.no_stable_pieces"].hint,
        )
    letters = [(i, text) for i, text in chosen if len(text) == 2]
    if len(letters) < 2:
        raise Refused.one(
            "workload.chat.no_stable_pieces",
            "$.vocabulary",
            f"{len(letters)} single-letter word pieces: a session's answers need two",
            CHAT_PIECES_CODES["workload.chat.no_stable_pieces"].hint,
        )
    # An answer is single-letter pieces only; a token that is a proper start of one (the bare
    # ``▁``) is banned, so every answer token is one whole piece and comes back as itself.
    token_of = {text: i for i, text in enumerate(tokens)}
    banned = sorted(
        {
            token_of[text.replace(" ", SPM_SPACE)[:cut]]
            for _, text in letters
            for cut in range(1, len(text))
            if text.replace(" ", SPM_SPACE)[:cut] in token_of
        }
    )
    grammar = "root ::= (" + " | ".join(f'"{text}"' for _, text in letters) + ")+"
    return ChatPieces(
        source="word-pieces",
        pieces=tuple(text for _, text in chosen),
        token_ids=tuple(i for i, _ in chosen),
        answer_grammar=grammar,
        answer_banned_ids=tuple(banned),
    )


def check_round_trip(designed: Sequence[int], tokenized: Sequence[int], where: str) -> None:
    """Refused (``workload.chat.not_token_exact``) unless the server's tokens of a designed
    text are the designed tokens; the refusal names the first place they part."""
    if list(designed) == list(tokenized):
        return
    at = next(
        (i for i, (a, b) in enumerate(zip(designed, tokenized, strict=False)) if a != b),
        min(len(designed), len(tokenized)),
    )
    raise Refused.one(
        "workload.chat.not_token_exact",
        where,
        f"{len(designed)} designed tokens came back as {len(tokenized)}; they part at "
        f"{at}: designed {list(designed[at : at + 3])}, tokenized {list(tokenized[at : at + 3])}",
        CHAT_PIECES_CODES["workload.chat.not_token_exact"].hint,
    )
