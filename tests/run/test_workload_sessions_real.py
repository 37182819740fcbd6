"""Multi-turn sessions on the real llama-server and the zoo: with a slot of its own per user,
every turn reuses the session so far (less the last answer token) on plain attention (llama)
and hybrid recurrent (qwen3next) alike, as the planning expects; on one shared slot without a
host-RAM prompt cache, the other user's turn evicts the session, and the eviction turn is the
first turn that followed another user's request. Tiny random-weight models: plumbing
evidence, not performance claims."""

from __future__ import annotations

from itertools import pairwise

import pytest

from cache_family.oracles.native_parts import Parts, RunningServer, serve
from cache_family.oracles.zoo.vocab import CONTROL_TOKENS, vocabulary
from cache_family.schemas.workload import MultiTurn
from cache_family.states.cache_reuse import reuse_rule
from cache_family.states.sessions import (
    SessionTurn,
    eviction_turn,
    reuse_by_turn,
    session_plan,
    session_tokens,
)
from cache_family.states.workloads import FreshStarts

pytestmark = pytest.mark.native

SPEC = MultiTurn(
    users=2,
    turns=3,
    system_prompt_tokens=64,
    user_context_tokens=32,
    question_tokens=16,
    answer_tokens=8,
    seed=3,
)


def run_sessions(
    server: RunningServer, plan: tuple[SessionTurn, ...], *, slot_per_user: bool
) -> dict[int, tuple[int, int]]:
    """Send the plan; (prompt tokens, cached tokens) by plan position, as the server said."""
    vocabulary_size = len(vocabulary()[0]) - len(CONTROL_TOKENS)
    tokens = session_tokens(
        SPEC, vocabulary_size=vocabulary_size, starts=FreshStarts(vocabulary_size, SPEC.seed)
    )
    sessions: dict[int, list[int]] = {}
    achieved: dict[int, tuple[int, int]] = {}
    for item in plan:
        if item.turn == 0:
            prompt = tokens.first_prompt(item.user)
        else:
            prompt = sessions[item.user] + list(tokens.questions[item.user][item.turn])
        assert len(prompt) == item.prompt_tokens
        body = {
            "prompt": prompt,
            "n_predict": SPEC.answer_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "cache_prompt": True,
            "return_tokens": True,
            "id_slot": item.user if slot_per_user else 0,
        }
        status, reply = server.request("POST", "/completion", body)
        assert status == 200 and isinstance(reply, dict), reply
        answer = reply["tokens"]
        assert len(answer) == SPEC.answer_tokens
        sessions[item.user] = prompt + answer
        achieved[item.position] = (reply["tokens_evaluated"], reply["timings"]["cache_n"])
    return achieved


@pytest.mark.parametrize("key", ["llama", "qwen3next"])
def test_each_turn_reuses_the_session_so_far_on_a_slot_of_its_own(
    native_parts: Parts, key: str
) -> None:
    plan = session_plan(SPEC, reuse_rule(key))
    longest = max(t.prompt_tokens for t in plan) + SPEC.answer_tokens
    with serve(
        native_parts.llama_server,
        native_parts.model_path(key),
        ctx_size=SPEC.users * (longest + 64),
        extra_args=["--parallel", str(SPEC.users)],
    ) as server:
        achieved = run_sessions(server, plan, slot_per_user=True)
    for item in plan:
        assert achieved[item.position] == (item.prompt_tokens, item.expected_reused_tokens), item
    assert eviction_turn(reuse_by_turn(plan, achieved)) is None


def test_a_shared_slot_evicts_the_session_at_the_first_interleaved_turn(
    native_parts: Parts,
) -> None:
    plan = session_plan(SPEC, "exact-prefix")
    interleaved = [
        item.turn for before, item in pairwise(plan) if item.turn > 0 and before.user != item.user
    ]
    assert interleaved  # the seed interleaves the users
    with serve(
        native_parts.llama_server, native_parts.model_path("llama"), ctx_size=1024
    ) as server:
        achieved = run_sessions(server, plan, slot_per_user=False)
    assert eviction_turn(reuse_by_turn(plan, achieved)) == min(interleaved)
