"""The default demo's row on the trained Gemma 3 270M, for real: the correctness gate passes on
the real model, the native serial and ladder, both stage servers and their parity run, every
figure carries the real model's evidence class (no synthetic label), each stage server's
prompt count is journaled with the message's tokens as they met the template, and replay is
identical. The same steps ``./bootstrap demo`` takes for its ``real/`` row."""

from __future__ import annotations

import io
from pathlib import Path

import msgspec
import pytest
from real_run_harness import cli

from cache_family.console import bench_sequence
from cache_family.oracles.demo import DEFAULT_PLAN, PLANS, REAL_RUN, real_steps
from cache_family.oracles.native_parts import Parts
from cache_family.oracles.real_model import ensure_real_model
from cache_family.schemas.matrix import MATRIX_FILENAME, decode_matrix
from cache_family.schemas.receipts import REAL_EVIDENCE_PREFIX, decode_cell_receipt

pytestmark = pytest.mark.native


def test_the_real_row_passes_the_gate_measures_every_host_arm_and_replays(
    native_parts: Parts, oracle_tools: Path, tmp_path: Path
) -> None:
    real = ensure_real_model(io.StringIO(), fetch=False)
    plan = PLANS[DEFAULT_PLAN]
    assert plan.real == "row"
    steps, _ = real_steps(tmp_path, str(tmp_path), native_parts, oracle_tools, real, plan)
    runner = bench_sequence.default_runner()
    for step in steps:
        done = cli(*step.argv[len(runner) :], cwd=tmp_path)
        assert done.returncode == 0, (step.name, done.stdout[-3000:], done.stderr[-3000:])
    assert [s.name.split()[0] for s in steps][-1] == "replay"  # and it exited 0 above

    run = tmp_path / REAL_RUN
    matrix = decode_matrix((run / MATRIX_FILENAME).read_bytes())
    assert matrix.status == "completed"
    assert [(r.case, r.result.status) for r in matrix.rows] == [(real.key, "completed")]
    cells = {
        path.parent.name: decode_cell_receipt(path.read_bytes())
        for path in run.glob("cell-0000/*/cell.json")
    }
    assert {"native-serial", "sweep-native-concurrent"} <= set(cells)
    assert {"sweep-skippy-old", "sweep-skippy-new"} <= set(cells)
    for name, receipt in cells.items():
        assert receipt.status == "completed", (name, receipt.faults)
        assert not receipt.synthetic
        assert receipt.evidence_class is not None
        assert receipt.evidence_class.startswith(REAL_EVIDENCE_PREFIX), receipt.evidence_class
        chat = receipt.chat_prompt
        if name.startswith("sweep-skippy-"):
            # Counted by the stage server itself; the message tokens as they met the template.
            assert not isinstance(chat, msgspec.UnsetType)
            assert chat.prompt_tokens == chat.message_tokens + 24 - chat.merged_tokens
        else:
            assert isinstance(chat, msgspec.UnsetType)
    correctness = list(run.glob("cell-0000/correctness/topology-*"))
    assert correctness, "the gate ran on the real model"
