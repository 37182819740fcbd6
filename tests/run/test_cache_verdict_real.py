"""Cache verdicts against the real llama-server: a plain-attention zoo family (llama) and a
hybrid recurrent one (qwen3next), prepared and run end to end. The rule's expected cached
tokens must be exactly what the server reports for every warm request, and replay must fold
the same verdicts. Tiny random-weight models: plumbing evidence, not performance claims."""

from __future__ import annotations

from pathlib import Path

import pytest
from real_run_harness import prepare_then_run

from cache_family.actors.audit.replay import replay
from cache_family.oracles.native_parts import Parts
from cache_family.schemas.matrix import MATRIX_FILENAME, decode_matrix
from cache_family.schemas.receipts import CellReceipt, decode_cell_receipt
from cache_family.states.cache_reuse import CHECKPOINT_TAIL

pytestmark = pytest.mark.native


def expected_for(case: str, prompt_tokens: int) -> int:
    # llama: the whole prompt but its last token; qwen3next: its checkpoint at len - 4.
    return prompt_tokens - 1 if case == "llama" else prompt_tokens - CHECKPOINT_TAIL


def check_cell(case: str, receipt: CellReceipt) -> None:
    assert receipt.status == "completed", receipt.faults
    assert receipt.measurement.ignore_eos is True  # the zoo's catalog is synthetic
    assert receipt.measurement.cache_shortfall_rungs == ()
    cold = 0
    for rung in receipt.measurement.rungs:
        verdict = rung.cache_verdict
        assert verdict is not None and verdict.rule is not None
        assert verdict.rule.startswith("exact-prefix" if case == "llama" else "checkpoint")
        prompts = {row.prompt_tokens for row in rung.rows}
        assert len(prompts) == 1
        (prompt,) = prompts
        assert prompt is not None
        expected = expected_for(case, prompt)
        assert verdict.expected_cached_tokens == expected
        assert verdict.shortfall is False
        assert verdict.observed_hits is not None and verdict.expected_hits is not None
        assert verdict.observed_hits >= verdict.expected_hits
        # The server's own accounting: a request is either cold or reuses exactly the rule's.
        for row in rung.rows:
            assert row.slot_id is not None and row.timings is not None
            assert row.cached_tokens == row.timings.cache_n
            assert row.cached_tokens in (0, expected), (case, row)
        cold += sum(1 for row in rung.rows if row.cached_tokens == 0)
        if rung.rung_index == 0:
            assert verdict.observed_cached_tokens_min in (expected, None)
    lanes = len({row.slot_id for rung in receipt.measurement.rungs for row in rung.rows})
    assert 1 <= cold <= lanes


def test_verdicts_follow_each_architectures_reuse_rule_on_the_real_server(
    native_parts: Parts, oracle_tools: Path, tmp_path: Path
) -> None:
    out, _ = prepare_then_run(
        native_parts, oracle_tools, tmp_path, ["llama", "qwen3next"], "prepare-full"
    )
    matrix = decode_matrix((out / MATRIX_FILENAME).read_bytes())
    seen = set()
    for entry in matrix.rows:
        if entry.case not in ("llama", "qwen3next"):
            continue
        seen.add(entry.case)
        row_dir = out / str(entry.result.evidence).removesuffix("/row.json")
        for arm in ("native-serial", "sweep-native-concurrent"):
            check_cell(entry.case, decode_cell_receipt((row_dir / arm / "cell.json").read_bytes()))
    assert seen == {"llama", "qwen3next"}
    verdict = replay(str(out))
    assert verdict.exit_code == 0, verdict.lines
