"""The cache reuse rule and the per-rung verdicts, on constructed numbers and through the fold."""

from __future__ import annotations

import json
from collections.abc import Sequence

import msgspec
import pytest
from cell_journal_builder import CellScript, completed_row, run_started
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_family.schemas.journal import JournalLine, Record
from cache_family.schemas.measurement import CacheExpectation, RequestRow, ReuseRule, ServerTimings
from cache_family.schemas.receipts import CacheVerdict, encode_receipt
from cache_family.states.cache_reuse import (
    ProbeShape,
    accounting,
    cache_expectation,
    checkpoints,
    expected_cached_tokens,
    priming_prompt_tokens,
    probe_expected,
    probe_shapes,
    probed_rule,
    reuse_rule,
    rule_text,
    rung_verdicts,
)
from cache_family.states.cell import CellEvent
from cache_family.states.fold import fold_cell


def test_the_rule_follows_the_architecture() -> None:
    for arch in ("llama", "qwen3", "deepseek2", "glm4", "olmo", "minimax-m2"):
        assert reuse_rule(arch) == "exact-prefix"
    for arch in ("qwen3next", "falcon-h1", "mamba", "mamba2"):
        assert reuse_rule(arch) == "checkpoint"
    for arch in ("gemma2", "gemma3", "gemma4"):
        assert reuse_rule(arch) == "checkpoint-swa"
    assert reuse_rule("no-such-arch") is None and reuse_rule(None) is None
    assert cache_expectation("qwen3next", 4) == CacheExpectation(
        architecture="qwen3next", rule="checkpoint", n_ubatch=512, lanes=4
    )


def test_plain_attention_reuses_the_common_prefix_but_the_last_token() -> None:
    assert expected_cached_tokens("exact-prefix", prompt_tokens=129, common_prefix=129) == 128
    assert expected_cached_tokens("exact-prefix", prompt_tokens=129, common_prefix=100) == 100
    assert expected_cached_tokens("exact-prefix", prompt_tokens=1, common_prefix=1) == 0


def test_checkpoint_models_reuse_the_last_checkpoint_inside_the_common_prefix() -> None:
    assert checkpoints(129) == (125,)
    assert checkpoints(1273) == (757, 1269)
    assert checkpoints(4) == ()
    # The same prompt again: all but its last 4 tokens (sliding window: one fewer).
    assert expected_cached_tokens("checkpoint", prompt_tokens=129, common_prefix=129) == 125
    assert expected_cached_tokens("checkpoint-swa", prompt_tokens=129, common_prefix=129) == 124
    # The facts' example: 1181 tokens shared with a 1273-token prompt reuse 757.
    assert (
        expected_cached_tokens(
            "checkpoint", prompt_tokens=1300, common_prefix=1181, previous_prompt_tokens=1273
        )
        == 757
    )
    # A short partial overlap reaches no checkpoint: nothing is reused.
    assert (
        expected_cached_tokens(
            "checkpoint", prompt_tokens=200, common_prefix=100, previous_prompt_tokens=129
        )
        == 0
    )
    # n_ubatch places the earlier checkpoint.
    assert (
        expected_cached_tokens(
            "checkpoint",
            prompt_tokens=300,
            common_prefix=250,
            previous_prompt_tokens=300,
            n_ubatch=64,
        )
        == 232
    )


def row(request_id: int, cached: int, slot: int | None, *, prompt: int = 129) -> RequestRow:
    return msgspec.structs.replace(
        completed_row(request_id),
        tokens_evaluated=prompt,
        timings=ServerTimings(cache_n=cached, prompt_n=prompt - cached, predicted_n=8),
        prompt_tokens=prompt,
        cached_tokens=cached,
        slot_id=slot,
    )


LLAMA = cache_expectation("llama", 2)
QWEN3NEXT = cache_expectation("qwen3next", 2)


def test_each_new_slot_gets_one_cold_request_across_the_whole_ladder() -> None:
    rungs = [
        [row(0, 0, 1), row(1, 128, 1), row(2, 128, 1)],
        [row(3, 128, 1), row(4, 0, 0), row(5, 128, 0), row(6, 128, 1)],
        [row(7, 128, 0), row(8, 128, 1)],
    ]
    verdicts = rung_verdicts(LLAMA, rungs)
    assert [(v.expected_hits, v.observed_hits, v.shortfall) for v in verdicts] == [
        (2, 2, False),
        (3, 3, False),
        (2, 2, False),
    ]
    assert verdicts[0].expected_cached_tokens == 128
    assert verdicts[0].observed_cached_tokens_min == 128
    assert verdicts[0].rule is not None and verdicts[0].rule.startswith("exact-prefix (llama")


def test_a_warm_request_below_the_rule_is_a_shortfall() -> None:
    # qwen3next expects 125 of 129; a warm request that got 100 falls short.
    rungs = [[row(0, 0, 1), row(1, 125, 1), row(2, 100, 1)]]
    (verdict,) = rung_verdicts(QWEN3NEXT, rungs)
    assert verdict == CacheVerdict(
        expected_hits=2,
        observed_hits=1,
        expected_cached_tokens=125,
        observed_cached_tokens_min=100,
        shortfall=True,
        rule=verdict.rule,
    )
    assert verdict.rule is not None and "n_ubatch 512" in verdict.rule
    # A slot seen before the rung has no cold allowance left: its miss is a shortfall.
    (_, second) = rung_verdicts(LLAMA, [[row(0, 0, 0)], [row(1, 0, 0)]])
    assert second.shortfall is True and second.expected_hits == 1


def test_a_cold_slot_served_from_the_ram_cache_is_a_hit_not_a_problem() -> None:
    (verdict,) = rung_verdicts(LLAMA, [[row(0, 128, 0), row(1, 128, 1)]])
    assert (verdict.expected_hits, verdict.observed_hits, verdict.shortfall) == (0, 2, False)


def test_without_slot_ids_the_first_lanes_requests_may_be_cold() -> None:
    rungs = [[row(0, 0, None)], [row(1, 0, None), row(2, 128, None), row(3, 128, None)]]
    verdicts = rung_verdicts(LLAMA, rungs)
    assert [(v.expected_hits, v.observed_hits, v.shortfall) for v in verdicts] == [
        (0, 0, False),
        (2, 2, False),
    ]
    unknown_lanes = msgspec.structs.replace(LLAMA, lanes=None)
    assert rung_verdicts(unknown_lanes, rungs)[0].expected_hits is None


def test_unknown_architectures_and_unaccounted_requests_are_not_judged() -> None:
    (verdict,) = rung_verdicts(cache_expectation("mystery", 1), [[row(0, 5, 0)]])
    assert verdict.shortfall is None and verdict.expected_hits is None
    assert verdict.rule == "no reuse rule for architecture mystery: hits not judged"
    failed = RequestRow(request_id=0, status="failed", error="boom")
    (empty,) = rung_verdicts(LLAMA, [[failed]])
    assert empty.expected_hits is None and empty.observed_hits is None
    # A journal from before the neutral fields: cache_n and tokens_evaluated still count.
    older = RequestRow(
        request_id=1, status="completed", tokens_evaluated=129, timings=ServerTimings(cache_n=128)
    )
    (judged,) = rung_verdicts(cache_expectation("llama", 1), [[older, older]])
    assert judged.observed_hits == 2 and judged.expected_hits == 1


def lines(records: Sequence[Record]) -> list[JournalLine]:
    return [
        JournalLine(seq=i + 1, mono_ns=i, wall_ns=i, prev="0" * 64, record=r)
        for i, r in enumerate(records)
    ]


def script_with(expectation: CacheExpectation | None, rungs: list[list[RequestRow]]) -> CellScript:
    script = CellScript(rungs=tuple((1, len(r)) for r in rungs))
    script.open()
    opened = script.records[-1]
    script.records[-1] = msgspec.structs.replace(
        opened, cache_expectation=expectation, ignore_eos=False
    )
    script.launch()
    script.become_ready()
    script.warmup()
    for index, rung in enumerate(rungs):
        for request in rung:
            script.request(index, request.request_id, request)
        script.rung_done(index)
    script.fire(CellEvent.LADDER_DONE)
    script.pins("after")
    script.fire(CellEvent.PINS_VERIFIED)
    script.cleanup()
    return script


@pytest.mark.parametrize("short", [False, True])
def test_the_fold_writes_each_rungs_verdict_into_cell_json(short: bool) -> None:
    rungs = [[row(0, 0, 0), row(1, 125, 0)], [row(0, 90 if short else 125, 0)]]
    script = script_with(QWEN3NEXT, rungs)
    receipt = fold_cell(lines([run_started(), *script.records]), script.cell_id)
    verdicts = [r.cache_verdict for r in receipt.measurement.rungs]
    assert [(v.expected_hits, v.observed_hits) for v in verdicts if v] == [
        (1, 1),
        (1, 0 if short else 1),
    ]
    assert receipt.measurement.cache_shortfall_rungs == ((1,) if short else ())
    assert receipt.measurement.ignore_eos is False
    # A shortfall is flagged, never a downgrade by itself.
    assert receipt.status == "completed"
    published = json.loads(encode_receipt(receipt))
    verdict = published["measurement"]["rungs"][1]["cache_verdict"]
    assert set(verdict) == {
        "expected_hits",
        "observed_hits",
        "expected_cached_tokens",
        "observed_cached_tokens_min",
        "shortfall",
        "rule",
    }
    assert verdict["shortfall"] is short


def test_a_cell_opened_without_an_expectation_has_no_verdicts() -> None:
    script = script_with(None, [[row(0, 0, 0)]])
    receipt = fold_cell(lines([run_started(), *script.records]), script.cell_id)
    assert receipt.measurement.rungs[0].cache_verdict is None
    assert receipt.measurement.cache_shortfall_rungs == ()


def verdicts_by_sorting(
    expectation: CacheExpectation, rungs: Sequence[Sequence[RequestRow]]
) -> list[CacheVerdict]:
    """The verdicts as defined before they were tallied: every judged request of a rung
    sorted, each new slot's first one cold (without slots, the first ``lanes`` of the cell)."""
    text, rule = rule_text(expectation), expectation.rule
    used: set[int] = set()
    cold_left = expectation.lanes
    verdicts = []
    for rows in rungs:
        seen = [a for a in (accounting(r) for r in rows) if a is not None]
        if rule is None or not seen:
            verdicts.append(CacheVerdict(rule=text))
            continue
        judged = sorted(
            (
                (
                    c,
                    expected_cached_tokens(
                        rule, prompt_tokens=p, common_prefix=p, n_ubatch=expectation.n_ubatch
                    ),
                    s,
                )
                for p, c, s in seen
            ),
            key=lambda entry: (entry[0], entry[1], -1 if entry[2] is None else entry[2]),
        )
        if all(s is not None for _, _, s in judged):
            cold = set()
            for index, (_, _, s) in enumerate(judged):
                if s not in used:
                    used.add(s)  # type: ignore[arg-type]
                    cold.add(index)
        elif cold_left is not None:
            take = min(cold_left, len(judged))
            cold_left -= take
            cold = set(range(take))
        else:
            verdicts.append(CacheVerdict(rule=text))
            continue
        warm = [e for i, e in enumerate(judged) if i not in cold]
        hits = sum(1 for c, e, _ in judged if c >= e)
        verdicts.append(
            CacheVerdict(
                expected_hits=len(warm),
                observed_hits=hits,
                expected_cached_tokens=min(e for _, e, _ in judged),
                observed_cached_tokens_min=min((c for c, _, _ in warm), default=None),
                shortfall=hits < len(warm),
                rule=text,
            )
        )
    return verdicts


@settings(max_examples=300, deadline=None)
@given(
    rule=st.sampled_from(["llama", "mamba", "gemma3", "unknown-arch"]),
    lanes=st.one_of(st.none(), st.integers(0, 4)),
    slotted=st.booleans(),
    rungs=st.lists(
        st.lists(
            st.tuples(
                st.integers(0, 140),
                st.one_of(st.none(), st.integers(0, 5)),
                st.integers(100, 700),
                st.booleans(),
            ),
            max_size=12,
        ),
        max_size=4,
    ),
)
def test_tallied_verdicts_are_the_sorted_definitions(
    rule: str,
    lanes: int | None,
    slotted: bool,
    rungs: list[list[tuple[int, int | None, int, bool]]],
) -> None:
    """The verdicts from per-rung tallies (what the journal holds) equal the definition over
    every row, for any rows, slots, lanes and rule."""
    expectation = cache_expectation(rule, lanes)
    rosters = [
        [
            row(i, cached, (slot or 0) if slotted else slot, prompt=prompt)
            if completed
            else RequestRow(request_id=i, status="failed")
            for i, (cached, slot, prompt, completed) in enumerate(rung)
        ]
        for rung in rungs
    ]
    assert rung_verdicts(expectation, rosters) == verdicts_by_sorting(expectation, rosters)


# --- the rule to the token, with the model's sliding window ------------------------------------

GEMMA3_WINDOW = 512


def again(prompt: int) -> int:
    """The same prompt sent again to a sliding-window slot of window 512."""
    return expected_cached_tokens(
        "checkpoint-swa", prompt_tokens=prompt, common_prefix=prompt, sliding_window=GEMMA3_WINDOW
    )


def test_a_sliding_window_reuses_a_checkpoint_within_it_and_the_prefix_past_it() -> None:
    # Gemma 3 270M on llama-server (the real-model facts): 513 tokens again reused 508,
    # 1,025 reused 1,024 and 2,049 reused 2,048.
    assert again(513) == 508
    assert again(1025) == 1024
    assert again(2049) == 2048
    # At the window itself the server restores the checkpoint len - 4, a token before it.
    assert again(512) == 507
    assert again(514) == 513
    # Without the window the cautious rule judges as runs journaled before it did.
    assert expected_cached_tokens("checkpoint-swa", prompt_tokens=1025, common_prefix=1025) == 1020


def test_a_checkpoint_is_usable_while_it_ends_inside_the_common_prefix() -> None:
    # A priming prompt of 261 tokens is checkpointed after 257 (positions 0..256): a prompt
    # sharing 256 tokens reuses them all, a token before the checkpoint.
    assert priming_prompt_tokens("checkpoint-swa", 256, 512) == 261
    assert (
        expected_cached_tokens(
            "checkpoint-swa",
            prompt_tokens=512,
            common_prefix=256,
            previous_prompt_tokens=261,
            sliding_window=GEMMA3_WINDOW,
        )
        == 256
    )
    # A recurrent checkpoint after 256 tokens is its state at 256: usable at 256 exactly.
    assert priming_prompt_tokens("checkpoint", 256, 512) == 260
    assert (
        expected_cached_tokens(
            "checkpoint", prompt_tokens=512, common_prefix=256, previous_prompt_tokens=260
        )
        == 256
    )
    assert priming_prompt_tokens("exact-prefix", 256, 512) == 512
    assert priming_prompt_tokens("checkpoint-swa", 0, 512) == 512


def test_the_expectation_carries_a_sliding_window_only_for_its_family() -> None:
    gemma = cache_expectation("gemma3", 1, 512)
    assert gemma.sliding_window == 512
    assert cache_expectation("llama", 1, 512).sliding_window is None
    text = rule_text(gemma)
    assert "sliding-window of 512 tokens" in text and "header" in text
    # A ladder's warm request past the window: all but the last token.
    (verdict,) = rung_verdicts(gemma, [[row(0, 0, 0, prompt=1025), row(1, 1024, 0, prompt=1025)]])
    assert verdict.expected_cached_tokens == 1024 and not verdict.shortfall
    (short,) = rung_verdicts(gemma, [[row(0, 0, 0, prompt=1025), row(1, 1020, 0, prompt=1025)]])
    assert short.shortfall


def observed_by(
    rule: ReuseRule, header: ReuseRule, prompt: int, window: int | None = None
) -> list[tuple[ProbeShape, int | None]]:
    """A server that reuses as ``rule`` does, probed as ``header``'s cell probes."""
    return [
        (shape, probe_expected(rule, shape, n_ubatch=512, sliding_window=window))
        for shape in probe_shapes(header, prompt)
    ]


@pytest.mark.parametrize("prompt", [256, 512, 513, 1024, 2048])
def test_the_probe_confirms_the_header_rule_when_the_server_follows_it(prompt: int) -> None:
    for rule, window in (
        ("exact-prefix", None),
        ("checkpoint", None),
        ("checkpoint-swa", GEMMA3_WINDOW),
    ):
        observed = observed_by(rule, rule, prompt, window)
        # Cold, then the families' own warm figure, then the designed half reused whole.
        assert observed[0][1] == 0 and observed[2][1] == 0
        assert observed[3][1] == prompt // 2
        assert probed_rule(rule, observed, sliding_window=window) == rule


def test_the_probe_finds_the_rule_the_server_follows_and_refuses_an_unknown_one() -> None:
    # A sliding-window model served with a full-size window cache reuses as plain attention.
    observed = observed_by("exact-prefix", "checkpoint-swa", 256)
    assert probed_rule("checkpoint-swa", observed, sliding_window=512) == "exact-prefix"
    # A server that reuses nothing past the cold prompt follows no rule.
    nothing = [(shape, 0) for shape, _ in observed]
    assert probed_rule("checkpoint-swa", nothing, sliding_window=512) is None
    # A failed probe request checks nothing: the header's rule stands.
    failed = [*observed[:3], (observed[3][0], None)]
    assert probed_rule("checkpoint-swa", failed, sliding_window=512) == "checkpoint-swa"
    assert probed_rule(None, observed) is None
