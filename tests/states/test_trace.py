"""The trace replay's pure core: the Mooncake reader's refusals, scaling that keeps the
sharing, seeded prompts, designed reuse and the per-request verdict."""

from __future__ import annotations

import json
from itertools import takewhile

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_family.errors import Refused
from cache_family.schemas.refusal_codes import TRACE_REFUSAL_CODES
from cache_family.schemas.workload_records import (
    TraceReplayed,
    TraceRequestReplayed,
    WorkloadRequest,
)
from cache_family.states.trace import (
    TRACE_LINE_MAX_BYTES,
    DesignedReuse,
    TracePrompts,
    TraceRequest,
    TraceScaling,
    TraceWindow,
    check_context,
    designed_reuse,
    reachable_reuse,
    read_mooncake,
    request_verdict,
    total_efficiency,
)
from cache_family.states.trace_fold import trace_receipt

SHA = "ab" * 32


def _line(timestamp: float, input_length: int, hash_ids: list[int], output: int = 8) -> bytes:
    return json.dumps(
        {
            "timestamp": timestamp,
            "input_length": input_length,
            "output_length": output,
            "hash_ids": hash_ids,
        }
    ).encode()


def _numbered(*lines: bytes) -> list[tuple[int, bytes]]:
    return list(enumerate(lines, start=1))


GOOD = (_line(0, 1024, [0, 1]), _line(0, 600, [0, 2]), _line(1000, 513, [0, 1]))


@pytest.mark.parametrize(
    ("bad", "code"),
    [
        (b'{"timestamp": 5, "input_length": 10}', "trace.line.malformed"),
        (b"not json", "trace.line.malformed"),
        (_line(2000, 0, []), "trace.line.malformed"),
        (_line(2000, 10, [-1]), "trace.line.malformed"),
        (
            b'{"timestamp": "5", "input_length": 10, "output_length": 1, "hash_ids": [1]}',
            "trace.line.malformed",
        ),
        (_line(-1, 10, [3]), "trace.timestamp.negative"),
        (_line(999, 10, [3]), "trace.timestamp.decreasing"),
        (_line(2000, 1025, [3, 4]), "trace.hash_ids.count"),
        (_line(2000, 512, [3, 4]), "trace.hash_ids.count"),
        (b"{" + b" " * TRACE_LINE_MAX_BYTES + b"}", "trace.line.too_long"),
    ],
)
def test_each_malformed_kind_is_refused_with_its_line(bad: bytes, code: str) -> None:
    with pytest.raises(Refused) as caught:
        read_mooncake(_numbered(*GOOD, bad, _line(3000, 10, [9])), TraceWindow())
    assert caught.value.codes == [code]
    (refusal,) = caught.value.refusals
    assert refusal.message.startswith("line 4: ")
    assert refusal.hint == TRACE_REFUSAL_CODES[code].hint


def test_a_line_past_the_window_is_still_checked() -> None:
    with pytest.raises(Refused) as caught:
        read_mooncake(_numbered(*GOOD, _line(10, 5, [1])), TraceWindow(first=1))
    assert caught.value.codes == ["trace.timestamp.decreasing"]


def test_windows_by_count_and_by_time_and_empty() -> None:
    lines = _numbered(*GOOD, b"", _line(5000, 10, [7]))
    assert [r.line for r in read_mooncake(lines, TraceWindow(first=2))] == [1, 2]
    assert [r.line for r in read_mooncake(lines, TraceWindow(from_ms=500))] == [3, 5]
    assert [r.line for r in read_mooncake(lines, TraceWindow(until_ms=1000))] == [1, 2]
    with pytest.raises(Refused) as caught:
        read_mooncake(lines, TraceWindow(from_ms=9000))
    assert caught.value.codes == ["trace.window.empty"]


def test_context_refusal_names_the_line() -> None:
    requests = read_mooncake(_numbered(*GOOD), TraceWindow())
    scaling = TraceScaling(tokens_per_block=64, output_tokens_cap=8)
    check_context(requests, scaling, 64 * 2 + 8)
    with pytest.raises(Refused) as caught:
        check_context(requests, scaling, 64 * 2 + 7)
    assert caught.value.codes == ["trace.length.beyond_context"]
    assert caught.value.refusals[0].message.startswith("line 1: ")


def test_scaling_of_lengths_times_and_answers() -> None:
    request = TraceRequest(
        line=1, timestamp_ms=0, input_length=2 * 512 + 100, output_length=300, hash_ids=(1, 2, 3)
    )
    scaling = TraceScaling(tokens_per_block=16, time_scale=0.5, output_tokens_cap=32)
    # The partial block's 100 of 512 tokens become ceil(100 x 16 / 512) = 4.
    assert scaling.block_lengths(request) == (16, 16, 4)
    assert scaling.prompt_tokens(request) == 36
    assert scaling.output_tokens(request) == 32
    later = msgspec_replace(request, timestamp_ms=3000)
    assert scaling.send_offsets([request, later]) == (0.0, 1.5)


def msgspec_replace(request: TraceRequest, **changes: float) -> TraceRequest:
    import msgspec

    return msgspec.structs.replace(request, **changes)


def _common(a: list[int], b: list[int]) -> int:
    return sum(1 for _ in takewhile(lambda pair: pair[0] == pair[1], zip(a, b, strict=False)))


def _leading(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return _common(list(a), list(b))


# Requests over a few ids, so that many share leading ids; full blocks only (a partial block
# ends a prompt early: the property is stated on the blocks both sent whole).
_ids = st.lists(st.integers(0, 6), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(
    paths=st.lists(_ids, min_size=2, max_size=6),
    tokens_per_block=st.integers(1, 9),
    sha=st.text("0123456789abcdef", min_size=64, max_size=64),
)
def test_scaling_keeps_the_sharing_and_a_seed_gives_the_same_prompts(
    paths: list[list[int]], tokens_per_block: int, sha: str
) -> None:
    requests = [
        TraceRequest(
            line=n + 1,
            timestamp_ms=0,
            input_length=512 * len(ids),
            output_length=1,
            hash_ids=tuple(ids),
        )
        for n, ids in enumerate(paths)
    ]
    scaling = TraceScaling(tokens_per_block=tokens_per_block)
    prompts = TracePrompts(requests, scaling, trace_sha256=sha, vocabulary_size=64)
    texts = [prompts.prompt(r) for r in requests]
    for a, ta in zip(requests, texts, strict=True):
        assert len(ta) == scaling.prompt_tokens(a) == tokens_per_block * len(a.hash_ids)
        for b, tb in zip(requests, texts, strict=True):
            assert _common(ta, tb) == tokens_per_block * _leading(a.hash_ids, b.hash_ids)
    again = TracePrompts(requests, scaling, trace_sha256=sha, vocabulary_size=64)
    assert [again.prompt(r) for r in requests] == texts
    # Drawn all at once before the replay (in reverse order), the blocks are the same.
    drawn = TracePrompts(requests, scaling, trace_sha256=sha, vocabulary_size=64)
    drawn.draw_blocks(reversed(requests))
    assert [drawn.prompt(r) for r in requests] == texts
    assert all(0 <= t < 64 for text in texts for t in text)


def test_a_partial_block_shares_only_what_both_sent() -> None:
    scaling = TraceScaling(tokens_per_block=8)
    short = TraceRequest(
        line=1, timestamp_ms=0, input_length=512 + 128, output_length=1, hash_ids=(0, 1)
    )
    long = TraceRequest(
        line=2, timestamp_ms=0, input_length=3 * 512, output_length=1, hash_ids=(0, 1, 2)
    )
    prompts = TracePrompts([short, long], scaling, trace_sha256=SHA, vocabulary_size=50)
    assert _common(prompts.prompt(short), prompts.prompt(long)) == 8 + 2
    assert [d.infinite_tokens for d in designed_reuse([short, long], scaling)] == [0, 10]
    assert [d.infinite_tokens for d in designed_reuse([long, short], scaling)] == [0, 10]


def test_too_many_distinct_ids_for_the_vocabulary_is_refused() -> None:
    requests = read_mooncake(_numbered(*GOOD), TraceWindow())
    with pytest.raises(Refused) as caught:
        TracePrompts(
            requests, TraceScaling(tokens_per_block=4), trace_sha256=SHA, vocabulary_size=2
        )
    assert caught.value.codes == ["trace.vocabulary"]


def test_designed_reuse_by_hand_on_a_tiny_trace() -> None:
    # B = 10 tokens a block; every block full but where noted.
    lines = _numbered(
        _line(0, 1024, [0, 1]),  # r0: 20 tokens, nothing before it
        _line(0, 1536, [0, 1, 2]),  # r1: shares [0, 1] with r0: 20
        _line(1, 1024, [0, 3]),  # r2: shares [0]: 10
        _line(2, 1536, [0, 1, 4]),  # r3: shares [0, 1] (r1 sent them last): 20
        _line(3, 1536, [5, 1, 2]),  # r4: a new first id, nothing (1, 2 lie under 0)
        _line(4, 1536, [0, 1, 2]),  # r5: all of r1's 30 tokens
    )
    requests = read_mooncake(lines, TraceWindow())
    scaling = TraceScaling(tokens_per_block=10)
    found = designed_reuse(requests, scaling, lru_capacity_tokens=40)
    assert [d.infinite_tokens for d in found] == [0, 20, 10, 20, 0, 30]
    assert [d.shared_blocks for d in found] == [0, 2, 1, 2, 0, 3]
    assert [d.last_sender for d in found] == [None, 0, 1, 1, None, 1]
    # LRU of 40 tokens (4 blocks; oldest first): r0 leaves [1, 0]; r1 [2, 1, 0]; r2
    # [2, 1, 3, 0]; r3 finds 0, 1 (20), touches 4, 1, 0 and evicts 2: [3, 4, 1, 0]; r4's
    # three new blocks (5, 1, 2 under 5 in the trie) evict 3, 4 and 1: r5 finds only 0.
    assert [d.lru_tokens for d in found] == [0, 20, 10, 20, 0, 10]


def test_the_verdict_of_each_request() -> None:
    designed = DesignedReuse(infinite_tokens=100, lru_tokens=50, shared_blocks=2, last_sender=0)
    assert request_verdict(designed, 100, 1).code is None
    assert request_verdict(designed, 99, 1).efficiency == 0.99
    assert not request_verdict(designed, 99, 1).lost
    lost = request_verdict(designed, 40, 1)
    assert lost.lost and lost.code is None and lost.efficiency == 0.4
    over = request_verdict(designed, 102, 1)
    assert over.code == "trace.reuse.over_claimed" and not over.lost
    nothing = DesignedReuse(infinite_tokens=0, lru_tokens=None, shared_blocks=0, last_sender=None)
    assert request_verdict(nothing, 1, 1).code is None
    assert request_verdict(nothing, 2, 1).code == "trace.reuse.over_claimed"
    assert request_verdict(nothing, None, 1).efficiency is None
    assert total_efficiency([(100, 50), (0, 0), (100, None), (100, 100)]) == 0.75
    assert total_efficiency([(0, 0)]) is None


def _replayed(**changes: object) -> TraceReplayed:
    fields: dict[str, object] = {
        "cell_id": "c",
        "path": "/t",
        "sha256": SHA,
        "format": "mooncake",
        "block_tokens": 512,
        "tokens_per_block": 10,
        "time_scale": 1.0,
        "output_tokens_cap": 1,
        "window_json": "{}",
        "requests": 4,
        "distinct_ids": 4,
        **changes,
    }
    return TraceReplayed(**fields)  # type: ignore[arg-type]


def _sent(
    index: int, designed: int, counted: int | None, cached: int | None
) -> TraceRequestReplayed:
    request = None
    if counted is not None:
        request = WorkloadRequest(
            position=index,
            status="completed" if cached is not None else "failed",
            prompt_tokens=counted,
            cached_tokens=cached,
            designed_prompt_tokens=30,
        )
    return TraceRequestReplayed(
        cell_id="c",
        index=index,
        line=index + 1,
        scheduled_s=float(index),
        sent_s=float(index) if request else None,
        designed_infinite_tokens=designed,
        last_sender=index - 1 if designed else None,
        request=request,
    )


def test_the_fold_judges_each_request_and_names_what_it_refuses() -> None:
    sent = [
        _sent(0, 0, 30, 0),
        _sent(1, 20, 30, 25),  # more than designed + 1: over-claimed
        _sent(2, 20, 31, 20),  # counted otherwise than designed
        _sent(3, 20, None, None),  # never sent
    ]
    receipt = trace_receipt(_replayed(), sent)
    assert [r.verdict for r in receipt.requests] == [
        None,
        "trace.reuse.over_claimed",
        "workload.prompt.token_count_mismatch",
        "not-launched",
    ]
    assert receipt.over_claimed == (1,) and receipt.token_count_mismatches == (2,)
    assert receipt.refusal == "workload.prompt.token_count_mismatch"
    assert receipt.measured_requests == 2 and receipt.requests[3].lateness_ms is None
    # Over time: four one-second slices of the 3 s replay, efficiency where something was
    # designed and measured.
    assert [b.requests for b in receipt.efficiency_over_time][:1] == [1]
    assert sum(b.requests for b in receipt.efficiency_over_time) == 4
    stopped = trace_receipt(_replayed(stop_reason="workload.arrivals.sender_late"), sent[:1])
    assert stopped.refusal == "workload.arrivals.sender_late"
    assert trace_receipt(_replayed(), sent[:1], stopped=True).refusal == "workload.stopped"


def test_what_requests_sent_together_could_reuse_of_each_other() -> None:
    # The demo's window: four requests due at once, each opening with block 0. The design
    # gives request 0 nothing; the server may take any of them first.
    lines = _numbered(
        _line(0, 1024, [0, 1]),
        _line(0, 1024, [0, 2]),
        _line(0, 1024, [0, 3]),
        _line(5000, 1536, [0, 1, 4]),  # sent after every other was answered
    )
    requests = read_mooncake(lines, TraceWindow())
    scaling = TraceScaling(tokens_per_block=10)
    sent: list[float | None] = [0.0, 0.001, 0.002, 5.0]
    answered: list[float | None] = [0.1, 0.09, 0.095, 5.1]
    reachable = reachable_reuse(requests, scaling, sent, answered)
    # Each of the three in flight together could reuse block 0 of another, never its own
    # blocks; the late one reuses what the design gives it.
    assert reachable == (10, 10, 10, 20)
    assert [d.infinite_tokens for d in designed_reuse(requests, scaling)] == [0, 10, 10, 20]
    # One that never reached the server, or was never answered, has no figure; an answer
    # sent alone reaches nothing of one sent after it.
    alone = reachable_reuse(requests, scaling, [0.0, None, 1.0, 2.0], [0.5, None, None, 2.1])
    assert alone == (0, None, None, 20)


def test_a_claim_within_what_was_reachable_is_no_over_claim() -> None:
    nothing = DesignedReuse(infinite_tokens=0, lru_tokens=None, shared_blocks=0, last_sender=None)
    # Request 0 of requests sent together found another's first block: honest.
    assert request_verdict(nothing, 10, 1, reachable_tokens=10).code is None
    # Beyond what any request could have left, it still is one.
    beyond = request_verdict(nothing, 12, 1, reachable_tokens=10)
    assert beyond.code == "trace.reuse.over_claimed"
    # The fold reads the figure from the journal (a replay from before it: the design alone).
    honest = _sent(0, 0, 30, 10)
    sent = [msgspec.structs.replace(honest, reachable_tokens=10), _sent(1, 0, 30, 10)]
    receipt = trace_receipt(_replayed(), sent)
    assert receipt.over_claimed == (1,) and receipt.refusal == "trace.reuse.over_claimed"
