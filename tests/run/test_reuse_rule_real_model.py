"""The reuse rule against the real model and the real llama-server: Gemma 3 270M (a trained
model from the package registry, sliding window 512 in its header) served by the project's
own build. The probe's expectations, read off the header, hold to the token below, at and
above the window; overlap points cut for the server's checkpoints reuse what they were
designed to at 256, 512 and 1,024 tokens (designed against achieved within the band), where
the rounding design shared nothing; the workload runner probes, journals and judges a sweep
whose every point shares; sessions expect the window's checkpoint, not an eviction.

CPU figures of a loaded 2-core host are not asserted: only the server's token accounting."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from cache_family.actors.run.workload_dialects import WorkloadHost
from cache_family.actors.run.workloads import run_overlap, run_sessions
from cache_family.oracles.native_parts import Parts, RunningServer, serve
from cache_family.oracles.real_model import RealModel, ensure_real_model
from cache_family.schemas.gguf_header import read_gguf_header
from cache_family.schemas.journal import JournalLine, Record
from cache_family.schemas.workload import WorkloadFile, validate_workload_object
from cache_family.schemas.workload_records import ReuseProbed, WorkloadReceipt
from cache_family.states.cache_reuse import (
    probe_expected,
    probe_prompts,
    probe_shapes,
    probed_rule,
)
from cache_family.states.workload_fold import fold_workload
from cache_family.states.workloads import (
    FreshStarts,
    design_prefix,
    nothing_shared,
    overlap_order,
    overlap_prompts,
    overlap_verdict,
)
from cache_family.system.http import LoopbackHttp

pytestmark = pytest.mark.native

SEED = 30
#: Ids well inside the 262k vocabulary, below its control and byte tokens' corners.
VOCABULARY = 200_000
CELL = "cell-0000/native-overlap"


@pytest.fixture(scope="module")
def real_model() -> RealModel:
    return ensure_real_model(sys.stderr)


@pytest.fixture(scope="module")
def window(real_model: RealModel) -> int:
    header = read_gguf_header(str(Path(real_model.model).resolve()))
    assert header.architecture == "gemma3"
    found = header.sliding_window
    assert found == 512, found
    return found


@pytest.fixture(scope="module")
def server(native_parts: Parts, real_model: RealModel) -> Iterator[RunningServer]:
    with serve(
        native_parts.llama_server,
        real_model.model,
        ctx_size=8192,
        cache_ram_mib=0,
        extra_args=["--threads", "2", "--parallel", "2"],
    ) as running:
        yield running


def cached(server: RunningServer, prompt: list[int], slot: int = 0) -> int:
    reply = server.completion(prompt, 1, id_slot=slot)
    assert reply["tokens_evaluated"] == len(prompt)
    found: int = reply["timings"]["cache_n"]
    return found


@pytest.mark.parametrize("prompt_tokens", [256, 513, 1025])
def test_the_probe_holds_to_the_token_below_at_and_above_the_window(
    server: RunningServer, window: int, prompt_tokens: int
) -> None:
    rng = random.Random(SEED + prompt_tokens)
    starts = FreshStarts(VOCABULARY, SEED + prompt_tokens)

    def fresh(length: int) -> list[int]:
        return [starts.take(), *(rng.randrange(VOCABULARY) for _ in range(length - 1))]

    shapes = probe_shapes("checkpoint-swa", prompt_tokens)
    prompts = probe_prompts(shapes, fresh)
    observed = [
        (shape, cached(server, prompt)) for shape, prompt in zip(shapes, prompts, strict=True)
    ]
    for shape, found in observed:
        expected = probe_expected("checkpoint-swa", shape, n_ubatch=512, sliding_window=window)
        assert found == expected, (prompt_tokens, shape, found)
    assert probed_rule("checkpoint-swa", observed, sliding_window=window) == "checkpoint-swa"
    # The facts' figures: the same prompt again reuses all but its last token past the window,
    # and the checkpoint 4 tokens before its end, less one, within it.
    again = observed[1][1]
    assert again == (prompt_tokens - 5 if prompt_tokens <= window + 1 else prompt_tokens - 1)


@pytest.mark.parametrize("prompt_tokens", [256, 512, 1024, 2048])
def test_a_point_cut_for_the_checkpoints_reuses_its_design(
    server: RunningServer, window: int, prompt_tokens: int
) -> None:
    starts = FreshStarts(VOCABULARY, SEED * prompt_tokens)
    for ratio in (50, 90):
        rounded = design_prefix("checkpoint-swa", prompt_tokens, ratio)
        design = design_prefix(
            "checkpoint-swa", prompt_tokens, ratio, place_checkpoint=True, sliding_window=window
        )
        assert not nothing_shared(design) and design.shared_prefix_tokens > 0
        order = overlap_order(1, 3, SEED, reprimed=design.reprimed)
        prompts = overlap_prompts(
            design, order, vocabulary_size=VOCABULARY, seed=SEED + ratio, starts=starts
        )
        measured = []
        for request, prompt in zip(order, prompts, strict=True):
            found = cached(server, prompt, request.group)
            if not request.priming:
                assert found == design.reusable_tokens, (prompt_tokens, ratio, found)
                measured.append((len(prompt), found))
        verdict = overlap_verdict(design, measured)
        assert verdict.accepted, verdict
        assert verdict.band_pp is not None and verdict.achieved_ratio_pct is not None
        assert abs(verdict.achieved_ratio_pct - verdict.designed_ratio_pct) <= verdict.band_pp
        # The rounding design shared nothing below a checkpoint's reach: refused, never sent.
        if rounded.shared_prefix_tokens == 0:
            assert nothing_shared(rounded)


def fold(journaled: list[Record], cell: str = CELL) -> WorkloadReceipt:
    lines = [
        JournalLine(seq=seq, mono_ns=0, wall_ns=0, prev="", record=record)
        for seq, record in enumerate(journaled, start=1)
    ]
    return fold_workload(lines, cell)


def workload_host(
    server: RunningServer, window: int, spec: WorkloadFile, journaled: list[Record], cell: str
) -> WorkloadHost:
    async def journal(record: Record) -> None:
        journaled.append(record)

    return WorkloadHost(
        cell_id=cell,
        base_url=server.url,
        http=LoopbackHttp(),
        journal=journal,
        deadline=trio.current_time() + 600,
        request_timeout_ms=120_000,
        architecture="gemma3",
        workloads=spec,
        workloads_sha256="",
        prompt_text="",
        ignore_eos=True,
        sliding_window=window,
        slots=2,
        slot_context_tokens=4096,
    )


def test_the_runner_probes_then_measures_a_sweep_that_shares_at_every_point(
    server: RunningServer, window: int
) -> None:
    spec = validate_workload_object(
        {
            "schema_version": 1,
            "prefix_overlap": {
                "prompt_tokens": 512,
                "hit_ratios_pct": [0, 30, 90],
                "groups": 1,
                "requests": 2,
                "seed": SEED,
            },
        }
    )
    journaled: list[Record] = []

    async def main() -> bool:
        return await run_overlap(workload_host(server, window, spec, journaled, CELL))

    assert trio.run(main)
    [probe] = [r for r in journaled if isinstance(r, ReuseProbed)]
    assert probe.header_rule == probe.rule == "checkpoint-swa" and probe.sliding_window == 512
    receipt = fold(journaled)
    assert receipt.rule == "checkpoint-swa" and receipt.status == "accepted", receipt
    points = {p.hit_ratio_pct: p for p in receipt.overlap}
    assert points[0].achieved_ratio_pct == 0.0
    for ratio in (30, 90):
        point = points[ratio]
        assert point.accepted and point.shared_prefix_tokens == 512 * ratio // 100, point
        assert point.achieved_ratio_pct == pytest.approx(point.designed_ratio_pct)


def test_sessions_expect_the_windows_checkpoint_and_report_no_eviction(
    server: RunningServer, window: int
) -> None:
    # The shape: 2 users, 2 turns; each turn-1 session (119 tokens) lies within the
    # window, so the server restores its checkpoint of turn 0 (107), which an exact rule
    # took for an eviction.
    spec = validate_workload_object(
        {
            "schema_version": 1,
            "multi_turn": {
                "users": 2,
                "turns": 2,
                "system_prompt_tokens": 64,
                "user_context_tokens": 32,
                "question_tokens": 16,
                "answer_tokens": 8,
                "seed": SEED,
            },
        }
    )
    journaled: list[Record] = []
    cell = "cell-0000/native-sessions"

    async def main() -> bool:
        return await run_sessions(workload_host(server, window, spec, journaled, cell))

    assert trio.run(main)
    [probe] = [r for r in journaled if isinstance(r, ReuseProbed)]
    assert probe.rule == "checkpoint-swa"
    receipt = fold(journaled, cell)
    sessions = receipt.sessions
    assert sessions is not None and sessions.failed_requests == 0
    later = [t for t in sessions.by_turn if t.turn > 0]
    assert later and all(t.achieved_reused_tokens == t.expected_reused_tokens for t in later)
    assert later[0].expected_reused_tokens == 2 * 107
    assert sessions.eviction_turn is None and sessions.shortfall_turn is None
    assert receipt.status == "accepted"
