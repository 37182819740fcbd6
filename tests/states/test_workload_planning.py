"""The pure planning of the cache workloads (states/workloads.py): designed prefixes against
each family's reuse rule, seeded orders and prompts, acceptance verdicts, session reuse,
arrival schedules and their goodness of fit, lateness and the over-saturation rule."""

from __future__ import annotations

import math
from itertools import combinations, islice, pairwise

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_family.errors import Refused
from cache_family.schemas.measurement import ReuseRule
from cache_family.schemas.workload import MultiTurn, OverSaturation
from cache_family.states.arrivals import (
    SENDS_MAX,
    ArrivalPattern,
    SaturationWatch,
    achieved_rate,
    arrival_schedule,
    arrival_times,
    gap_cdf,
    goodness_of_fit,
    inter_arrivals,
    ks_statistic,
    lateness,
    regularized_lower_gamma,
    sweep_rates,
)
from cache_family.states.cache_reuse import expected_cached_tokens
from cache_family.states.sessions import (
    SessionCapacity,
    SessionFindings,
    TurnReuse,
    eviction_turn,
    reuse_by_turn,
    session_findings,
    session_plan,
    session_prompt_tokens,
    session_tokens,
    turn_reuse,
)
from cache_family.states.workloads import (
    WORKLOAD_VERDICT_CODES,
    FreshStarts,
    acceptance_band_pp,
    design_prefix,
    nothing_shared,
    overlap_order,
    overlap_prompts,
    overlap_verdict,
)

RULE_NAMES: tuple[ReuseRule, ...] = ("exact-prefix", "checkpoint", "checkpoint-swa")
RULES = st.sampled_from(RULE_NAMES)


@given(rule=RULES, prompt=st.integers(2, 8192), ratio=st.integers(0, 99), ub=st.integers(1, 2048))
def test_the_prefix_never_exceeds_what_the_rule_can_reuse(
    rule: ReuseRule, prompt: int, ratio: int, ub: int
) -> None:
    design = design_prefix(rule, prompt, ratio, n_ubatch=ub)
    assert design.requested_prefix_tokens == prompt * ratio // 100
    assert design.shared_prefix_tokens <= min(design.requested_prefix_tokens, prompt - 1)
    # What the group's prompts share is what the rule reuses (a sliding window one token less)...
    assert design.reusable_tokens == expected_cached_tokens(
        rule,
        prompt_tokens=prompt,
        common_prefix=design.shared_prefix_tokens,
        previous_prompt_tokens=prompt,
        n_ubatch=ub,
    )
    slack = 1 if rule == "checkpoint-swa" and design.shared_prefix_tokens else 0
    assert design.shared_prefix_tokens - design.reusable_tokens == slack
    # ...and sharing all of the requested prefix would not have been reused any further.
    assert design.reusable_tokens == expected_cached_tokens(
        rule,
        prompt_tokens=prompt,
        common_prefix=design.requested_prefix_tokens,
        previous_prompt_tokens=prompt,
        n_ubatch=ub,
    )
    if rule == "exact-prefix":
        assert design.shared_prefix_tokens == min(design.requested_prefix_tokens, prompt - 1)
    assert 0 <= design.designed_ratio_pct <= ratio


def test_recurrent_families_report_the_checkpoint_their_rule_allows() -> None:
    attention = design_prefix("exact-prefix", 1024, 90)
    recurrent = design_prefix("checkpoint", 1024, 90)
    assert attention.reusable_tokens == 921
    # len - 4 - n_ubatch: the only checkpoint of a 1024-token prompt inside 921 tokens.
    assert recurrent.shared_prefix_tokens == recurrent.reusable_tokens == 1024 - 4 - 512
    assert design_prefix("checkpoint", 128, 90).reusable_tokens == 0
    with pytest.raises(Refused) as caught:
        design_prefix(None, 1024, 50)
    assert caught.value.codes == ["workload.overlap.no_rule"]


@given(groups=st.integers(1, 16), per_group=st.integers(1, 16), seed=st.integers(0, 2**32))
def test_the_order_primes_each_group_once_then_sends_n_over_g_per_group(
    groups: int, per_group: int, seed: int
) -> None:
    requests = groups * per_group
    order = overlap_order(groups, requests, seed)
    assert order == overlap_order(groups, requests, seed)
    assert [r.position for r in order] == list(range(groups + requests))
    assert [(r.group, r.priming) for r in order[:groups]] == [(g, True) for g in range(groups)]
    measured = order[groups:]
    assert not any(r.priming for r in measured)
    for group in range(groups):
        members = sorted(r.member for r in measured if r.group == group)
        assert members == list(range(per_group))


def test_another_seed_gives_another_order() -> None:
    orders = {tuple((r.group, r.member) for r in overlap_order(4, 64, seed)) for seed in range(5)}
    assert len(orders) == 5


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=40)
@given(
    rule=RULES,
    prompt=st.integers(2, 64),
    ratio=st.integers(0, 99),
    groups=st.integers(1, 4),
    per_group=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_prompts_share_exactly_their_group_prefix(
    rule: ReuseRule, prompt: int, ratio: int, groups: int, per_group: int, seed: int
) -> None:
    design = design_prefix(rule, prompt, ratio, n_ubatch=8)
    order = overlap_order(groups, groups * per_group, seed)
    starts = FreshStarts(500, seed)
    prompts = overlap_prompts(design, order, vocabulary_size=500, seed=seed, starts=starts)
    assert prompts == overlap_prompts(
        design, order, vocabulary_size=500, seed=seed, starts=FreshStarts(500, seed)
    )
    assert all(len(p) == prompt and all(0 <= t < 500 for t in p) for p in prompts)
    for (a, ra), (b, rb) in combinations(zip(prompts, order, strict=True), 2):
        same_group = ra.group == rb.group
        assert common_prefix(a, b) == (design.shared_prefix_tokens if same_group else 0)


def test_running_out_of_distinct_first_tokens_is_refused() -> None:
    starts = FreshStarts(3, 0)
    assert sorted(starts.take() for _ in range(3)) == [0, 1, 2]
    with pytest.raises(Refused) as caught:
        starts.take()
    assert caught.value.codes == ["workload.overlap.vocabulary"]


def test_the_band_is_half_a_point_or_one_page_of_the_mean_prompt() -> None:
    assert acceptance_band_pp(1024) == 0.5
    assert acceptance_band_pp(100) == 1.0
    assert acceptance_band_pp(100, page_tokens=16) == 16.0


def test_verdicts_accept_within_the_band_and_refuse_with_both_figures() -> None:
    design = design_prefix("exact-prefix", 1000, 90)
    exact = overlap_verdict(design, [(1000, 900)] * 4)
    assert exact.accepted and exact.achieved_ratio_pct == pytest.approx(90.0)
    assert exact.band_pp == 0.5
    near = overlap_verdict(design, [(1000, 896)] * 4)
    assert near.accepted
    far = overlap_verdict(design, [(1000, 880)] * 4)
    assert not far.accepted and far.refusal == "workload.overlap.outside_band"
    assert far.designed_ratio_pct == 90.0 and far.achieved_ratio_pct == pytest.approx(88.0)
    control = design_prefix("exact-prefix", 1000, 0)
    assert overlap_verdict(control, [(1000, 0)] * 4).accepted
    reused = overlap_verdict(control, [(1000, 0)] * 3 + [(1000, 1)])
    assert reused.refusal == "workload.overlap.control_reused"  # one token is too many
    nothing = overlap_verdict(design, [])
    assert nothing.refusal == "workload.overlap.nothing_measured"
    assert nothing.achieved_ratio_pct is None
    for verdict in (far, reused, nothing):
        assert verdict.refusal in WORKLOAD_VERDICT_CODES


def test_a_server_that_reuses_nothing_is_refused_at_every_non_zero_point() -> None:
    for ratio in (30, 50, 70, 90):
        verdict = overlap_verdict(design_prefix("exact-prefix", 512, ratio), [(512, 0)] * 8)
        assert verdict.refusal == "workload.overlap.outside_band"


SESSIONS = st.builds(
    MultiTurn,
    users=st.integers(1, 6),
    turns=st.integers(1, 6),
    system_prompt_tokens=st.integers(0, 64),
    user_context_tokens=st.integers(0, 64),
    question_tokens=st.integers(1, 16),
    answer_tokens=st.integers(1, 16),
    seed=st.integers(0, 2**16),
)


@given(spec=SESSIONS, rule=RULES)
def test_sessions_interleave_users_and_expect_their_earlier_tokens(
    spec: MultiTurn, rule: ReuseRule
) -> None:
    plan = session_plan(spec, rule)
    assert plan == session_plan(spec, rule)
    assert len(plan) == spec.users * spec.turns
    for user in range(spec.users):
        assert [t.turn for t in plan if t.user == user] == list(range(spec.turns))
    for item in plan:
        assert item.prompt_tokens == session_prompt_tokens(spec, item.turn)
        assert 0 <= item.expected_reused_tokens < item.prompt_tokens
        # The session so far, less the last answer token; a first turn is cold.
        earlier = session_prompt_tokens(spec, item.turn - 1) + spec.answer_tokens - 1
        assert item.expected_reused_tokens == (earlier if item.turn else 0)
    assert all(t.expected_reused_tokens == 0 for t in session_plan(spec, None))


@given(spec=SESSIONS, seed=st.integers(0, 2**16))
def test_session_tokens_share_exactly_the_system_prompt(spec: MultiTurn, seed: int) -> None:
    tokens = session_tokens(spec, vocabulary_size=900, starts=FreshStarts(900, seed))
    assert len(tokens.system) == spec.system_prompt_tokens
    assert [len(c) for c in tokens.contexts] == [spec.user_context_tokens] * spec.users
    firsts = [tokens.first_prompt(user) for user in range(spec.users)]
    assert all(len(p) == session_prompt_tokens(spec, 0) for p in firsts)
    if spec.user_context_tokens:
        for a, b in combinations(firsts, 2):
            assert common_prefix(a, b) == spec.system_prompt_tokens


def test_the_eviction_turn_is_the_first_whose_reuse_falls_short() -> None:
    spec = MultiTurn(users=2, turns=5, system_prompt_tokens=64, user_context_tokens=32)
    plan = session_plan(spec, "exact-prefix")
    full = {t.position: (t.prompt_tokens, t.expected_reused_tokens) for t in plan}
    assert eviction_turn(reuse_by_turn(plan, full)) is None
    evicted = {
        t.position: (t.prompt_tokens, t.expected_reused_tokens if t.turn < 3 else 0) for t in plan
    }
    by_turn = reuse_by_turn(plan, evicted)
    assert [t.turn for t in by_turn] == [0, 1, 2, 3, 4]
    assert eviction_turn(by_turn) == 3
    # A turn short by less than one token per prompt is within the band.
    assert (
        eviction_turn(
            (
                TurnReuse(
                    turn=1,
                    requests=2,
                    prompt_tokens=400,
                    expected_reused_tokens=300,
                    achieved_reused_tokens=299,
                ),
            )
        )
        is None
    )


# --- designs cut for llama-server's checkpoints; findings only with evidence -------------------


@given(
    rule=RULES,
    prompt=st.integers(2, 4096),
    ratio=st.integers(1, 99),
    window=st.one_of(st.none(), st.integers(1, 4096)),
)
def test_a_placed_checkpoint_makes_the_requested_prefix_reusable(
    rule: ReuseRule, prompt: int, ratio: int, window: int | None
) -> None:
    design = design_prefix(rule, prompt, ratio, place_checkpoint=True, sliding_window=window)
    assert design.shared_prefix_tokens <= min(design.requested_prefix_tokens, prompt - 1)
    # The priming prompt fits the prompt's length, and its checkpoint makes the prefix whole.
    assert design.priming_tokens <= prompt
    assert design.reusable_tokens == design.shared_prefix_tokens
    if rule != "exact-prefix" and design.shared_prefix_tokens:
        assert design.reusable_tokens == expected_cached_tokens(
            rule,
            prompt_tokens=prompt,
            common_prefix=design.shared_prefix_tokens,
            previous_prompt_tokens=design.priming_prompt_tokens,
            sliding_window=window if window is not None else prompt,
        )
        within = window is None or design.shared_prefix_tokens < window
        assert design.reprimed == (rule == "checkpoint-swa" and within)
    # Nothing is shared only where the prompt is too short to share anything.
    assert nothing_shared(design) == (design.shared_prefix_tokens == 0)
    if design.requested_prefix_tokens >= 6 and prompt >= 12:
        assert not nothing_shared(design)


def test_the_real_models_sweep_at_512_tokens_now_shares_what_it_asks() -> None:
    # Gemma 3 270M (window 512): the rounding design shared nothing at 30-90 %; cut for the
    # server's checkpoints, each point shares and reuses its ratio.
    for ratio, shared in ((30, 153), (50, 256), (70, 358), (90, 460)):
        rounded = design_prefix("checkpoint-swa", 512, ratio)
        assert rounded.shared_prefix_tokens == 0 and nothing_shared(rounded)
        placed = design_prefix(
            "checkpoint-swa", 512, ratio, place_checkpoint=True, sliding_window=512
        )
        assert placed.shared_prefix_tokens == placed.reusable_tokens == shared
        assert placed.priming_prompt_tokens == shared + 5 and placed.reprimed
        assert not nothing_shared(placed)
    # Past the window one priming serves the group: priming again would lose its checkpoint.
    long = design_prefix("checkpoint-swa", 1024, 50, place_checkpoint=True, sliding_window=512)
    assert long.shared_prefix_tokens == long.reusable_tokens == 512 and not long.reprimed
    control = design_prefix("checkpoint-swa", 512, 0, place_checkpoint=True, sliding_window=512)
    assert control.reusable_tokens == 0 and not nothing_shared(control)


@given(groups=st.integers(1, 6), per_group=st.integers(1, 6), seed=st.integers(0, 2**32))
def test_a_reprimed_order_sends_a_priming_request_before_each_measured_one(
    groups: int, per_group: int, seed: int
) -> None:
    plain = overlap_order(groups, groups * per_group, seed)
    order = overlap_order(groups, groups * per_group, seed, reprimed=True)
    assert [r.position for r in order] == list(range(2 * groups * per_group))
    for priming, measured in zip(order[::2], order[1::2], strict=True):
        assert priming.priming and not measured.priming and priming.group == measured.group
    # The measured requests keep the plain order's draw.
    assert [(r.group, r.member) for r in order if not r.priming] == [
        (r.group, r.member) for r in plain if not r.priming
    ]


def test_priming_prompts_are_cut_to_the_designed_length() -> None:
    design = design_prefix("checkpoint-swa", 64, 50, place_checkpoint=True, sliding_window=512)
    order = overlap_order(2, 4, 7, reprimed=True)
    prompts = overlap_prompts(
        design, order, vocabulary_size=500, seed=7, starts=FreshStarts(500, 7)
    )
    for request, prompt in zip(order, prompts, strict=True):
        assert len(prompt) == (37 if request.priming else 64)
    for (a, ra), (b, rb) in combinations(zip(prompts, order, strict=True), 2):
        assert common_prefix(a, b) == (32 if ra.group == rb.group else 0)


def test_a_sliding_window_session_reuses_its_checkpoint_within_the_window() -> None:
    # Gemma 3 270M: a 112-token first turn and an 8-token answer; the next turn reused 107.
    assert turn_reuse("checkpoint-swa", 112, 8, sliding_window=512) == 107
    assert turn_reuse("exact-prefix", 112, 8, sliding_window=512) == 119
    # Past the window the slot still holds the session: all of it.
    assert turn_reuse("checkpoint-swa", 600, 8, sliding_window=512) == 607
    # Without the window, the whole session as before.
    assert turn_reuse("checkpoint-swa", 112, 8) == 119
    spec = MultiTurn(
        users=2,
        turns=2,
        system_prompt_tokens=64,
        user_context_tokens=32,
        question_tokens=16,
        answer_tokens=8,
    )
    plan = session_plan(spec, "checkpoint-swa", sliding_window=512)
    assert sorted(t.expected_reused_tokens for t in plan if t.turn == 1) == [107, 107]


def test_a_short_turn_is_an_eviction_only_where_the_cache_was_full() -> None:
    short = (
        TurnReuse(turn=0, requests=2, prompt_tokens=224, expected_reused_tokens=0,
                  achieved_reused_tokens=0),
        TurnReuse(turn=1, requests=2, prompt_tokens=272, expected_reused_tokens=238,
                  achieved_reused_tokens=214),
    )  # fmt: skip
    roomy = SessionCapacity(slots=2, slot_context_tokens=4096)
    held = {0: 120, 1: 144}
    found = session_findings(short, users=2, capacity=roomy, held_tokens_by_turn=held)
    assert found == SessionFindings(eviction_turn=None, shortfall_turn=1)
    # Two users on one slot: the other user's turn evicted the session.
    shared = SessionCapacity(slots=1, slot_context_tokens=4096)
    found = session_findings(short, users=2, capacity=shared, held_tokens_by_turn=held)
    assert found == SessionFindings(eviction_turn=1, shortfall_turn=None)
    # A session past its slot's context.
    tight = SessionCapacity(slots=2, slot_context_tokens=128)
    found = session_findings(short, users=2, capacity=tight, held_tokens_by_turn=held)
    assert found == SessionFindings(eviction_turn=1, shortfall_turn=None)
    full = tuple(msgspec.structs.replace(t, achieved_reused_tokens=t.expected_reused_tokens)
                 for t in short)  # fmt: skip
    found = session_findings(full, users=2, capacity=shared, held_tokens_by_turn=held)
    assert found == SessionFindings(eviction_turn=None, shortfall_turn=None)


PATTERN_NAMES: tuple[ArrivalPattern, ...] = ("constant", "poisson", "gamma")
PATTERNS = st.sampled_from(PATTERN_NAMES)


@given(
    pattern=PATTERNS,
    rate=st.floats(0.5, 5000),
    seed=st.integers(0, 2**32),
    count=st.integers(1, 300),
    burstiness=st.floats(0.1, 8),
)
def test_a_seed_gives_the_same_schedule(
    pattern: ArrivalPattern, rate: float, seed: int, count: int, burstiness: float
) -> None:
    shape = burstiness if pattern == "gamma" else None
    times = arrival_schedule(pattern, rate, seed=seed, requests=count, burstiness=shape)
    assert times == arrival_schedule(pattern, rate, seed=seed, requests=count, burstiness=shape)
    assert len(times) == count and times[0] == 0.0
    assert all(b >= a for a, b in pairwise(times))
    span = count / rate
    bounded = arrival_schedule(pattern, rate, seed=seed, duration_s=span, burstiness=shape)
    assert all(t < span for t in bounded)
    shorter, longer = sorted((bounded, times), key=len)
    assert longer[: len(shorter)] == shorter  # the same draws, cut at another place


def test_send_times_are_drawn_lazily_and_a_schedule_never_holds_more_than_the_bound() -> None:
    """The attack run's file asked for 100,000/s for a day: 8.64e9 send times built as one
    list before the first send. They are drawn one at a time; a schedule (a sweep's rate,
    known only at run time) stops at ``SENDS_MAX``."""
    endless = arrival_times("constant", 100_000.0, seed=0)
    assert list(islice(endless, 3)) == [0.0, 1e-5, 2e-5]
    poisson = arrival_times("poisson", 300.0, seed=5)
    assert tuple(islice(poisson, 50)) == arrival_schedule("poisson", 300.0, seed=5, requests=50)
    two_seconds = arrival_schedule("constant", 100_000.0, seed=0, duration_s=2.0)
    assert len(two_seconds) == SENDS_MAX and SENDS_MAX == 100_000
    assert two_seconds[-1] == (SENDS_MAX - 1) / 100_000.0


def test_another_seed_gives_another_poisson_schedule() -> None:
    assert arrival_schedule("poisson", 10, seed=1, requests=5) != arrival_schedule(
        "poisson", 10, seed=2, requests=5
    )
    assert inter_arrivals(arrival_schedule("constant", 4, seed=9, requests=4)) == [0.25] * 3


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32), rate=st.floats(1, 1000), burstiness=st.floats(0.2, 0.5))
def test_the_ks_statistic_is_small_for_the_drawn_law_and_large_for_a_wrong_one(
    seed: int, rate: float, burstiness: float
) -> None:
    # n = 4000: the statistic of the true law exceeds 0.06 with probability ~1e-12.
    poisson = arrival_schedule("poisson", rate, seed=seed, requests=4001)
    gamma = arrival_schedule("gamma", rate, seed=seed, requests=4001, burstiness=burstiness)
    own = goodness_of_fit("poisson", rate, poisson)
    assert own is not None and own.samples == 4000 and own.value < 0.06
    assert own.p_value is not None and own.p_value > 1e-6
    gamma_own = goodness_of_fit("gamma", rate, gamma, burstiness)
    assert gamma_own is not None and gamma_own.value < 0.06
    # Wrong laws: twice the rate, or a bursty schedule judged as Poisson (and back).
    assert ks_statistic(inter_arrivals(poisson), gap_cdf("poisson", 2 * rate)) > 0.15
    wrong = goodness_of_fit("poisson", rate, gamma)
    assert wrong is not None and wrong.value > 0.1 and wrong.p_value is not None
    assert wrong.p_value < 1e-6
    back = goodness_of_fit("gamma", rate, poisson, burstiness)
    assert back is not None and back.value > 0.1


@given(a=st.floats(0.05, 50), x=st.floats(0.001, 200))
def test_the_gamma_distribution_function_matches_closed_forms(a: float, x: float) -> None:
    value = regularized_lower_gamma(a, x)
    assert 0.0 <= value <= 1.0
    assert regularized_lower_gamma(a, x * 1.1) >= value - 1e-12
    assert regularized_lower_gamma(1.0, x) == pytest.approx(1 - math.exp(-x), abs=1e-12)
    two = 1 - math.exp(-x) * (1 + x)  # shape 2
    assert regularized_lower_gamma(2.0, x) == pytest.approx(two, abs=1e-10)


def test_constant_arrivals_report_their_largest_gap_error() -> None:
    fit = goodness_of_fit("constant", 100, [0.0, 0.01, 0.021, 0.03])
    assert fit is not None and fit.statistic == "max-relative-gap-error"
    assert fit.value == pytest.approx(0.1) and fit.p_value is None
    assert goodness_of_fit("constant", 100, [0.0]) is None


def test_lateness_percentiles_and_the_achieved_rate() -> None:
    scheduled = [i * 0.01 for i in range(100)]
    sent = [t + (0.002 if i == 99 else 0.0005) for i, t in enumerate(scheduled)]
    late = lateness(scheduled, sent)
    assert late is not None and late.sends == 100
    assert late.p50_ms == pytest.approx(0.5) and late.max_ms == pytest.approx(2.0)
    assert late.p99_ms == pytest.approx(2.0)
    assert achieved_rate(sent) == pytest.approx(99 / (sent[-1] - sent[0]))
    assert achieved_rate([1.0]) is None and lateness([], []) is None


def answered(rule: OverSaturation) -> SaturationWatch:
    watch = SaturationWatch(rule)
    watch.answered()  # the ramp is over: an answer has ended
    return watch


def test_over_saturation_is_growth_of_the_queue_not_a_burst() -> None:
    rule = OverSaturation(window=8, min_in_flight=4, max_lateness_ms=100)
    steady = answered(rule)
    # A steady queue with a burst in it: never saturated.
    assert all(steady.observe(n, 0.0) is None for n in [3, 4, 3, 9, 3, 4, 3, 4] * 8)
    # A stall the queue recovers from: flat, then a jump, then a fall. Not growth either.
    stalled = answered(OverSaturation(window=32, min_in_flight=4))
    bump = [2] * 24 + [3, 5, 7, 9, 11, 12, 12, 12] + [6, 3, 2, 2] * 8
    assert all(stalled.observe(n, 0.0) is None for n in bump)
    growing = answered(rule)
    found = [growing.observe(n, 0.0) for n in range(1, 40)]
    first = next(s for s in found if s is not None)
    assert first.code == "workload.arrivals.in_flight_growing"
    assert first.send_index == 7 and first.in_flight == 8  # the first full window
    late = SaturationWatch(rule).observe(1, 0.2)
    assert late is not None and late.code == "workload.arrivals.sender_late"
    assert late.lateness_ms == pytest.approx(200)
    for saturation in (first, late):
        assert saturation.code in WORKLOAD_VERDICT_CODES


def test_the_ramp_before_the_first_answer_is_not_growth() -> None:
    rule = OverSaturation(window=8, min_in_flight=4, max_in_flight=50)
    watch = SaturationWatch(rule)
    # Until an answer ends, every send adds one in flight: the ramp to rate x latency.
    assert all(watch.observe(n, 0.0) is None for n in range(1, 30))
    watch.answered()
    # Windows that began before the first answer are not judged; the next full one is.
    growth = [4, 4, 5, 5, 8, 8, 10, 10]
    assert all(watch.observe(n, 0.0) is None for n in growth[:-1])
    found = watch.observe(growth[-1], 0.0)
    assert found is not None and found.send_index == 36
    # A server that never answers: the cap stops it.
    silent = SaturationWatch(rule)
    stops = [silent.observe(n, 0.0) for n in range(1, 60)]
    capped = next(s for s in stops if s is not None)
    assert capped.in_flight == 51 and capped.code == "workload.arrivals.in_flight_growing"


def test_sweep_rates_lie_strictly_between_the_measured_ends() -> None:
    assert sweep_rates(2.0, 10.0, 3) == (4.0, 6.0, 8.0)
    assert sweep_rates(10.0, 10.0, 3) == ()
