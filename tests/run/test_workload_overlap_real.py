"""The server facts the overlap planning relies on, checked on the real llama-server and the
zoo: after one priming request of a prefix group, a request designed at 90 % reports (in its
final stream event's ``timings.cache_n``) the designed share within the acceptance band, and
the 0 % control reports no reuse at all. llama (plain attention) reuses the designed prefix;
qwen3next (hybrid recurrent) reuses what its checkpoint rule allows, not an attention model's
figure. Tiny random-weight models: plumbing evidence, not performance claims."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cache_family.oracles.native_parts import Parts, RunningServer, serve
from cache_family.oracles.zoo.vocab import CONTROL_TOKENS, vocabulary
from cache_family.states.cache_reuse import reuse_rule
from cache_family.states.workloads import (
    FreshStarts,
    design_prefix,
    overlap_order,
    overlap_prompts,
    overlap_verdict,
)

pytestmark = pytest.mark.native

SEED = 20
GROUPS = 1
MEASURED = 3


def final_event(
    server: RunningServer, prompt: list[int], *, cache_prompt: bool = True
) -> dict[str, Any]:
    """Send one streamed /completion and return its final (``stop: true``) event."""
    body = {
        "prompt": prompt,
        "n_predict": 1,
        "temperature": 0,
        "top_k": 1,
        "cache_prompt": cache_prompt,
        "ignore_eos": True,
        "stream": True,
    }
    status, reply = server.request("POST", "/completion", body)
    assert status == 200 and isinstance(reply, str), reply
    events = [
        json.loads(line.removeprefix("data: "))
        for line in reply.splitlines()
        if line.startswith("data: ")
    ]
    assert events and events[-1]["stop"] is True
    final: dict[str, Any] = events[-1]
    return final


@pytest.mark.parametrize(
    ("key", "architecture", "prompt_tokens"),
    [
        ("llama", "llama", 256),
        ("qwen3next", "qwen3next", 1024),
    ],
)
def test_a_primed_group_reuses_the_designed_prefix_and_the_control_reuses_nothing(
    native_parts: Parts, key: str, architecture: str, prompt_tokens: int
) -> None:
    rule = reuse_rule(architecture)
    vocabulary_size = len(vocabulary()[0]) - len(CONTROL_TOKENS)
    starts = FreshStarts(vocabulary_size, SEED)  # one pool: no prompt of the run shares by chance
    order = overlap_order(GROUPS, GROUPS * MEASURED, SEED)
    verdicts = {}
    with serve(
        native_parts.llama_server,
        native_parts.model_path(key),
        ctx_size=prompt_tokens + 64,
        cache_ram_mib=0,
    ) as server:
        for ratio in (0, 90):
            design = design_prefix(rule, prompt_tokens, ratio)
            prompts = overlap_prompts(
                design, order, vocabulary_size=vocabulary_size, seed=SEED + ratio, starts=starts
            )
            measured = []
            for request, prompt in zip(order, prompts, strict=True):
                final = final_event(server, prompt)
                cached = final["timings"]["cache_n"]
                evaluated = final["tokens_evaluated"]
                assert evaluated == prompt_tokens
                if not request.priming:
                    measured.append((evaluated, cached))
                    # Each request reports exactly what the rule lets it reuse.
                    assert cached == design.reusable_tokens, (key, ratio, request, final)
            verdicts[ratio] = overlap_verdict(design, measured)
        # The same design, asked of a server told not to reuse its cache: refused.
        design = design_prefix(rule, prompt_tokens, 90)
        prompts = overlap_prompts(
            design, order, vocabulary_size=vocabulary_size, seed=SEED + 1, starts=starts
        )
        unused = [
            (final["tokens_evaluated"], final["timings"]["cache_n"])
            for request, prompt in zip(order, prompts, strict=True)
            if (final := final_event(server, prompt, cache_prompt=False)) and not request.priming
        ]
        refused = overlap_verdict(design, unused)
        assert refused.refusal == "workload.overlap.outside_band", refused
        assert refused.achieved_ratio_pct == 0.0
    control, high = verdicts[0], verdicts[90]
    assert control.accepted and control.achieved_ratio_pct == 0.0
    assert high.accepted, high
    assert high.band_pp is not None and high.achieved_ratio_pct is not None
    assert abs(high.achieved_ratio_pct - high.designed_ratio_pct) <= high.band_pp
    if key == "llama":
        assert high.achieved_ratio_pct == pytest.approx(90.0, abs=high.band_pp)
    else:
        # A checkpoint of the earlier prompt: len - 4 - n_ubatch, about half, not 90 %.
        assert high.designed_ratio_pct == pytest.approx(100 * (1024 - 4 - 512) / 1024)
