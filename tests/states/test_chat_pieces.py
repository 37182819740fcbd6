"""The text pieces a chat dialect writes its prompts in, their pure parts: which word tokens of
a SentencePiece vocabulary are taken (whole by the merges, no join that could merge, no text the
tokenizer splits out first), the answers' grammar and banned tokens, the round-trip refusal,
and the fold refusing a point or sessions the server counted otherwise than designed. The same
rules on the real Gemma 3 vocabulary, against the real server: tests/run/test_chat_pieces_real.py.
"""

from __future__ import annotations

import string
from itertools import product

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache_family.errors import Refused
from cache_family.schemas.journal import CellOpened, JournalLine, Record
from cache_family.schemas.workload_records import (
    ChatTemplateMeasured,
    OverlapPointMeasured,
    SessionsMeasured,
    WorkloadRequest,
    encode_workload_receipt,
)
from cache_family.states.chat_pieces import (
    BYTE_ALPHABET,
    CHAT_ALPHABET,
    MIN_WORD_PIECES,
    NORMAL_TOKEN,
    SPM_SPACE,
    check_round_trip,
    spm_merge,
    word_pieces,
)
from cache_family.states.workload_fold import fold_workload
from cache_family.states.workloads import chat_template

CONTROL, USER_DEFINED = 3, 4
S = SPM_SPACE


def _vocabulary(
    extra: list[tuple[str, float, int]], *, three_letter: int = 400
) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-like vocabulary: control tokens, the bare ``▁``, single letters,
    ``▁x``, ``▁xy`` and some ``▁xyz`` (each reached by merging ``▁`` in front first), then
    ``extra``."""
    rows: list[tuple[str, float, int]] = [
        ("<pad>", 0.0, CONTROL),
        ("<bos>", 0.0, CONTROL),
        (S, -1.0, NORMAL_TOKEN),
    ]
    rows += [(c, -2.0, NORMAL_TOKEN) for c in string.ascii_lowercase]
    rows += [(S + c, -3.0, NORMAL_TOKEN) for c in string.ascii_lowercase]
    rows += [(S + a + b, -4.0, NORMAL_TOKEN) for a, b in product(string.ascii_lowercase, repeat=2)]
    triples = list(product(string.ascii_lowercase, repeat=3))[:three_letter]
    rows += [(S + "".join(t), -5.0, NORMAL_TOKEN) for t in triples]
    rows += extra
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def test_the_merges_join_the_best_scoring_pair_first_and_the_leftmost_of_equals() -> None:
    scores = {"ab": -1.0, "bc": -0.5, "aa": -1.0}
    assert spm_merge("abc", scores) == ["a", "bc"]  # bc scores higher than ab
    assert spm_merge("aaa", scores) == ["aa", "a"]  # equal pairs: the leftmost first
    assert spm_merge("xyz", scores) == ["x", "y", "z"]


def test_word_pieces_are_the_whole_word_tokens_with_safe_ends() -> None:
    tokens, scores, types = _vocabulary(
        [
            # "q" stands before a space inside a token: no piece may end in q.
            ("q" + S + "the", -9.0, NORMAL_TOKEN),
            # A user-defined text the tokenizer splits out first: pieces holding it are out.
            ("zz", 0.0, USER_DEFINED),
            # A word token the merges never reach: "bc" joins first, then "▁z", and neither
            # "▁zbc" nor "bcd" is a token: "▁zbcd" stays three symbols.
            ("bc", -0.5, NORMAL_TOKEN),
            (S + "zbcd", -6.0, NORMAL_TOKEN),
        ]
    )
    pieces = word_pieces(tokens, scores, types)
    texts = set(pieces.pieces)
    assert pieces.source == "word-pieces"
    assert " a" in texts and " ab" in texts and " abc" in texts
    assert not any(text.endswith("q") for text in texts)
    assert not any("zz" in text for text in texts)
    assert spm_merge(S + "zbcd", dict(zip(tokens, scores, strict=True))) == [S + "z", "bc", "d"]
    assert " zbcd" not in texts
    # Every piece is its token's text with the space spelled out, in token id order.
    assert all(
        tokens[i].replace(S, " ") == t for i, t in zip(pieces.token_ids, pieces.pieces, strict=True)
    )
    assert list(pieces.token_ids) == sorted(pieces.token_ids)
    # Answers: single-letter pieces, the bare "▁" (a proper start of each) banned.
    assert pieces.answer_banned_ids == (tokens.index(S),)
    assert pieces.answer_grammar.startswith('root ::= (" a" | " b"')
    assert '" q"' not in pieces.answer_grammar


@given(st.lists(st.integers(min_value=0, max_value=MIN_WORD_PIECES - 1), max_size=40))
def test_joined_pieces_merge_back_into_exactly_their_tokens(ids: list[int]) -> None:
    tokens, scores, types = _vocabulary([])
    pieces = word_pieces(tokens, scores, types)
    score_of = dict(zip(tokens, scores, strict=True))
    text = pieces.text(ids).replace(" ", S)
    assert [tokens.index(s) for s in spm_merge(text, score_of)] == pieces.tokens(ids)


def test_too_few_stable_pieces_are_refused() -> None:
    tokens, scores, types = _vocabulary([], three_letter=0)
    # 26 + 676 word pieces: fewer than a workload may need.
    with pytest.raises(Refused) as refused:
        word_pieces(tokens, scores, types)
    assert refused.value.refusals[0].code == "workload.chat.no_stable_pieces"


def test_the_byte_alphabet_is_one_character_per_design_id() -> None:
    assert BYTE_ALPHABET.text([0, 1, len(CHAT_ALPHABET) - 1]) == "AB~"
    assert BYTE_ALPHABET.size == len(CHAT_ALPHABET)
    assert BYTE_ALPHABET.tokens([0]) is None


def test_a_text_that_does_not_come_back_as_its_tokens_is_refused_where_they_part() -> None:
    check_round_trip([5, 6, 7], [5, 6, 7], "$.x")
    with pytest.raises(Refused) as refused:
        check_round_trip([5, 6, 7], [5, 67], "$.x")
    assert refused.value.refusals[0].code == "workload.chat.not_token_exact"
    assert "part at 1" in refused.value.refusals[0].message


def test_word_pieces_counted_otherwise_at_the_calibration_are_not_token_exact() -> None:
    with pytest.raises(Refused) as refused:
        chat_template(
            (16, 40), (32, 60), short_characters=16, reused_tokens=0, source="word-pieces"
        )
    assert refused.value.refusals[0].code == "workload.chat.not_token_exact"
    found = chat_template((16, 26), (32, 42), short_characters=16, reused_tokens=0)
    assert found.tokens == 10


# --- the fold: every designed prompt against the server's count --------------------------------


def _lines(*records: Record) -> list[JournalLine]:
    return [
        JournalLine(seq=seq, mono_ns=0, wall_ns=0, prev="", record=record)
        for seq, record in enumerate(records, start=1)
    ]


def _opened(cell: str) -> CellOpened:
    return CellOpened(
        cell_id=cell,
        row_index=0,
        row_key="gemma3",
        arm="new-overlap",
        cohort="openai",
        cell_dir=cell,
    )


def _request(position: int, counted: int, designed: int | None, **kw: object) -> WorkloadRequest:
    return WorkloadRequest(
        position=position,
        status="completed",
        prompt_tokens=counted,
        cached_tokens=0,
        designed_prompt_tokens=designed,
        **kw,  # type: ignore[arg-type]
    )


def _point(cell: str, requests: tuple[WorkloadRequest, ...]) -> OverlapPointMeasured:
    return OverlapPointMeasured(
        cell_id=cell,
        hit_ratio_pct=0,
        prompt_tokens=100,
        rule="exact-prefix",
        requested_prefix_tokens=0,
        shared_prefix_tokens=0,
        reusable_tokens=0,
        groups=1,
        seed=1,
        requests=requests,
        template_tokens=9,
    )


def test_a_point_whose_prompt_the_server_counted_otherwise_is_refused_naming_it() -> None:
    cell = "cell-0000/new-overlap"
    exact = _point(cell, (_request(0, 109, 109, priming=True, turn=-1), _request(1, 109, 109)))
    # The priming request merged two tokens: the point is refused though its measured one
    # alone would pass.
    merged = _point(cell, (_request(0, 108, 109, priming=True, turn=-1), _request(1, 109, 109)))
    receipt = fold_workload(_lines(_opened(cell), exact, merged), cell)
    good, bad = receipt.overlap
    assert good.accepted and good.refusal is None
    assert not bad.accepted and bad.refusal == "workload.prompt.token_count_mismatch"
    assert bad.token_count_mismatches == (0,)
    assert receipt.status == "refused"
    # A receipt without a mismatch keeps its bytes (the field is left out).
    assert b"token_count_mismatches" not in encode_workload_receipt(
        fold_workload(_lines(_opened(cell), exact), cell)
    )


def test_requests_not_designed_to_a_count_are_not_judged_by_it() -> None:
    cell = "cell-0000/new-overlap"
    point = _point(cell, (_request(0, 108, None, priming=True, turn=-1), _request(1, 109, None)))
    assert fold_workload(_lines(_opened(cell), point), cell).overlap[0].accepted


def test_sessions_whose_turn_the_server_counted_otherwise_are_refused() -> None:
    cell = "cell-0000/native-sessions"
    sessions = SessionsMeasured(
        cell_id=cell,
        users=1,
        turns=2,
        seed=1,
        requests=(
            _request(0, 40, 40, group=0, turn=0, expected_reused_tokens=0),
            _request(1, 61, 60, group=0, turn=1, expected_reused_tokens=43),
        ),
    )
    receipt = fold_workload(_lines(_opened(cell), sessions), cell)
    assert receipt.sessions is not None
    assert receipt.sessions.token_count_mismatches == (1,)
    assert receipt.status == "refused"


def test_the_chat_template_record_is_shown_in_the_receipt() -> None:
    cell = "cell-0000/new-overlap"
    template = ChatTemplateMeasured(
        cell_id=cell,
        pieces="word-pieces",
        piece_count=51935,
        template_source="server-fallback",
        template_tokens=10,
        template_reused_tokens=0,
        rendered_head="<|im_start|>user\n",
        rendered_tail="<|im_end|>\n<|im_start|>assistant\n",
        head_tokens=6,
        tail_tokens=4,
        checked_by="tokenize",
    )
    receipt = fold_workload(_lines(_opened(cell), template), cell)
    assert receipt.chat_template == template
    assert b'"rendered_head": "<|im_start|>user\\n"' in encode_workload_receipt(receipt)
