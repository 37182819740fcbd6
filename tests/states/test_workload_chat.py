"""The overlap sweep in a chat dialect (a stage server), its pure parts: the template's
calibration from the server's counts, the design of the message, and the fold that judges
each request less what the template adds. A native receipt keeps its bytes (no samples)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_family.errors import Refused
from cache_family.schemas.journal import CellOpened, JournalLine, Record
from cache_family.schemas.measurement import ReuseRule
from cache_family.schemas.workload_records import (
    OverlapPointMeasured,
    WorkloadRequest,
    encode_workload_receipt,
)
from cache_family.states.cache_reuse import checkpoints, expected_cached_tokens
from cache_family.states.workload_fold import fold_workload
from cache_family.states.workloads import (
    CHAT_ALPHABET,
    ChatTemplate,
    chat_template,
    chat_text,
    design_chat_prefix,
    design_prefix,
)

TEMPLATE = ChatTemplate(tokens=37, reused_tokens=12)


def test_the_template_is_what_the_server_counted_beyond_the_characters() -> None:
    found = chat_template((16, 53), (32, 69), short_characters=16, reused_tokens=12)
    assert found == ChatTemplate(tokens=37, reused_tokens=12)


def test_text_the_server_counts_otherwise_than_a_token_per_character_is_refused() -> None:
    with pytest.raises(Refused) as refused:
        chat_template((16, 50), (32, 60), short_characters=16, reused_tokens=0)
    assert refused.value.refusals[0].code == "workload.chat.text_not_one_token_per_character"


def test_chat_text_writes_one_alphabet_character_per_design_id() -> None:
    assert chat_text([0, 1, len(CHAT_ALPHABET) - 1]) == "AB~"
    assert len(set(CHAT_ALPHABET)) == len(CHAT_ALPHABET)
    # None of them pairs with a neighbour in a byte-level BPE of letter pairs (the zoo's).
    assert not any(c.islower() or c.isspace() for c in CHAT_ALPHABET)


@pytest.mark.parametrize("ratio", [0, 30, 50, 70, 90])
def test_plain_attention_designs_the_message_beyond_the_template(ratio: int) -> None:
    design = design_chat_prefix("exact-prefix", 256, ratio, TEMPLATE)
    assert design == design_prefix("exact-prefix", 256 - 37, ratio)
    assert design.shared_prefix_tokens <= design.prompt_tokens - 1


@pytest.mark.parametrize("ratio", [0, 30, 50, 70, 90])
def test_a_checkpoint_rule_reuses_the_whole_prompts_checkpoint_put_in_the_message(
    ratio: int,
) -> None:
    template = ChatTemplate(tokens=37, reused_tokens=0)
    design = design_chat_prefix("checkpoint", 1024, ratio, template)
    whole = design_prefix("checkpoint", 1024, ratio)
    assert design.prompt_tokens == 1024 - 37
    assert design.shared_prefix_tokens == whole.shared_prefix_tokens
    # The head in front moves the common prefix past the checkpoint, short of the next one.
    head = 12
    assert design.reusable_tokens == expected_cached_tokens(
        "checkpoint", prompt_tokens=1024, common_prefix=head + design.shared_prefix_tokens
    )


# The real model's ChatML fallback as the server counted it: a 9-token head, a 15-token tail,
# and the one token two prompts sharing nothing still reuse.
REAL_TEMPLATE = ChatTemplate(tokens=24, reused_tokens=1, head_tokens=9)


def test_inside_the_window_the_priming_message_puts_its_earlier_checkpoint_on_the_prefix() -> None:
    design = design_chat_prefix("checkpoint-swa", 1024, 30, REAL_TEMPLATE, sliding_window=512)
    assert (design.prompt_tokens, design.shared_prefix_tokens) == (1000, 300)
    priming_whole = design.priming_prompt_tokens + REAL_TEMPLATE.tokens
    # The server checkpoints a prompt 4 and 4 + n_ubatch tokens before its end: the earlier
    # one ends a token past the 309 tokens both prompts share (the head and the prefix), the
    # window's reach; the later one lies in the tail, which nothing else shares.
    assert checkpoints(priming_whole, 512) == (309 + 1, 309 + 1 + 512)
    assert design.reusable_tokens == 309 - 1 and design.reprimed
    assert design.designed_ratio_pct == pytest.approx(30.8)


def test_a_point_that_shares_nothing_of_the_message_reuses_nothing_past_a_short_window() -> None:
    # Found by the property below: at 1 % of a 46-token message nothing is shared, and the
    # 17-token head alone lies past a 16-token window; its reuse is the template's.
    template = ChatTemplate(tokens=18, reused_tokens=0, head_tokens=17)
    design = design_chat_prefix("checkpoint-swa", 64, 1, template, sliding_window=16)
    assert design.shared_prefix_tokens == 0 and design.reusable_tokens == 0


def test_past_the_window_the_slot_reuses_the_common_prefix_itself_unprimed() -> None:
    design = design_chat_prefix("checkpoint-swa", 1024, 70, REAL_TEMPLATE, sliding_window=512)
    assert design.shared_prefix_tokens == 700 and design.priming_prompt_tokens == 0
    assert design.reusable_tokens == 9 + 700 - 1 and not design.reprimed


def test_a_priming_message_that_would_not_fit_falls_back_to_the_prompts_own_checkpoint() -> None:
    # 500 shared: the priming message would be 1,002 of a 1,000-token message. The whole
    # prompt's checkpoint at 508 carries the head past the window: all 517 tokens reused,
    # as the new stage server did on the real model.
    design = design_chat_prefix("checkpoint-swa", 1024, 50, REAL_TEMPLATE, sliding_window=512)
    assert design.shared_prefix_tokens == 508 and design.priming_prompt_tokens == 0
    assert design.reusable_tokens == 9 + 508 - 1


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.integers(min_value=64, max_value=4096),
    ratio=st.integers(min_value=1, max_value=99),
    head=st.integers(min_value=1, max_value=20),
    tail=st.integers(min_value=1, max_value=40),
    rule=st.sampled_from(["checkpoint", "checkpoint-swa"]),
    window=st.one_of(st.none(), st.integers(min_value=16, max_value=2048)),
)
def test_every_chat_design_is_what_the_servers_rule_gives_its_own_prompts(
    prompt: int, ratio: int, head: int, tail: int, rule: ReuseRule, window: int | None
) -> None:
    template = ChatTemplate(tokens=head + tail, reused_tokens=0, head_tokens=head)
    design = design_chat_prefix(rule, prompt, ratio, template, sliding_window=window)
    message = prompt - template.tokens
    assert design.prompt_tokens == message
    assert 0 <= design.shared_prefix_tokens < message
    common = head + design.shared_prefix_tokens
    # Never more than the prompts share, and nothing reused without sharing.
    assert design.reusable_tokens <= common
    assert design.shared_prefix_tokens or not design.reusable_tokens
    if design.priming_prompt_tokens:
        assert design.shared_prefix_tokens < design.priming_prompt_tokens <= message
        # The whole priming prompt's earlier checkpoint ends on the common prefix (a token
        # past it for a sliding window, which resumes a token before).
        early, _ = checkpoints(design.priming_prompt_tokens + template.tokens, 512)
        assert early == common + (1 if rule == "checkpoint-swa" else 0)
        assert design.reusable_tokens == common
        assert design.reprimed == (rule == "checkpoint-swa")
    elif rule == "checkpoint-swa" and window is not None and common > window:
        assert design.reusable_tokens == common


def _lines(*records: Record) -> list[JournalLine]:
    return [
        JournalLine(seq=seq, mono_ns=0, wall_ns=0, prev="", record=record)
        for seq, record in enumerate(records, start=1)
    ]


def _point(
    cell_id: str, ratio: int, cached: tuple[int, ...], template: ChatTemplate | None
) -> Record:
    tokens = template.tokens if template else 0
    requests = [
        WorkloadRequest(position=0, status="completed", priming=True, turn=-1,
                        prompt_tokens=100 + tokens, cached_tokens=0)
    ]  # fmt: skip
    for position, found in enumerate(cached, start=1):
        requests.append(
            WorkloadRequest(
                position=position,
                status="completed",
                prompt_tokens=100 + tokens,
                cached_tokens=found,
                prompt_ms=float(position),
            )
        )
    return OverlapPointMeasured(
        cell_id=cell_id,
        hit_ratio_pct=ratio,
        prompt_tokens=100,
        rule="exact-prefix",
        requested_prefix_tokens=ratio,
        shared_prefix_tokens=ratio,
        reusable_tokens=ratio,
        groups=1,
        seed=1,
        requests=tuple(requests),
        template_tokens=tokens,
        template_reused_tokens=template.reused_tokens if template else 0,
    )


def _opened(cell_id: str, arm: str) -> CellOpened:
    return CellOpened(
        cell_id=cell_id,
        row_index=0,
        row_key="llama",
        arm=arm,
        cohort="openai" if arm != "native-overlap" else "native",
        cell_dir=cell_id,
        synthetic=True,
    )


def test_a_stage_point_is_judged_less_the_template_and_lists_its_prompt_times() -> None:
    cell = "cell-0000/new-overlap"
    template = ChatTemplate(tokens=37, reused_tokens=12)
    control = _point(cell, 0, (12, 12), template)
    high = _point(cell, 90, (102, 102), template)
    receipt = fold_workload(_lines(_opened(cell, "new-overlap"), control, high), cell)
    zero, ninety = receipt.overlap
    assert zero.accepted and zero.achieved_ratio_pct == 0.0
    assert ninety.accepted and ninety.achieved_ratio_pct == 90.0
    assert ninety.prompt_ms == (1.0, 2.0)
    # Judged as the whole prompt, the template's head would break the control.
    unjudged = fold_workload(
        _lines(_opened(cell, "new-overlap"), _point(cell, 0, (12, 12), None)), cell
    )
    assert unjudged.overlap[0].refusal == "workload.overlap.control_reused"


def test_a_native_point_keeps_its_receipt_bytes_without_samples() -> None:
    cell = "cell-0000/native-overlap"
    receipt = fold_workload(
        _lines(_opened(cell, "native-overlap"), _point(cell, 0, (0,), None)), cell
    )
    assert b'prompt_ms"' not in encode_workload_receipt(receipt)
    assert b"prompt_ms_p50" in encode_workload_receipt(receipt)
