"""Old/new paired serving end to end: the real oracles (correctness tool, stage servers),
the real ``llama-server`` and the tiny model zoo, through the installed ``cache-family``.

The old server is the demo's ``skippy-prefix-reuse-off``, the new one ``skippy``: the same
oracle with prefix reuse off and on, so their greedy answers must agree request by request.
Figures come from tiny random-weight models: plumbing evidence, never performance claims.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from real_run_harness import paired_operator, prepare_and_run

from cache_family.actors.audit.replay import replay
from cache_family.oracles import native_build
from cache_family.oracles.native_parts import Parts
from cache_family.schemas.corpus import default_corpus_path
from cache_family.schemas.journal import (
    ChildSpawned,
    CliAdmission,
    RungCompleted,
    ServerMetricsRead,
    WarmupExclusion,
    read_journal,
)
from cache_family.schemas.matrix import MATRIX_FILENAME, decode_matrix
from cache_family.schemas.receipts import decode_cell_receipt, decode_row_receipt
from cache_family.schemas.request_rows import REQUESTS_FILENAME
from cache_family.schemas.server_metrics import ServerMetricsVerdict

pytestmark = pytest.mark.native


def test_a_reduced_plan_with_old_and_new_bound_completes_with_parity_accepted(
    native_parts: Parts, oracle_tools: Path, tmp_path: Path
) -> None:
    operator = paired_operator(native_parts, oracle_tools, tmp_path, ["llama", "qwen3next"])
    out, code, stderr = prepare_and_run(operator, tmp_path)
    assert code == 0, stderr
    matrix = decode_matrix((out / MATRIX_FILENAME).read_bytes())
    assert matrix.status == "completed"
    present = [r for r in matrix.rows if r.result.status != "missing-model"]
    assert sorted(r.case for r in present) == ["llama", "qwen3next"]
    read = read_journal((out / "journal.jsonl").read_bytes())
    records = [line.record for line in read.lines]
    for entry in present:
        row_dir = out / str(entry.result.evidence).removesuffix("/row.json")
        row = decode_row_receipt((row_dir / "row.json").read_bytes())
        assert row.status == "completed", (entry.case, row.reason)
        assert row.correctness.status == "completed"
        assert [o.arm for o in row.observations] == [
            "native-serial",
            "native-concurrent",
            "skippy-old",
            "skippy-new",
        ]
        # The reference's observation order: serial, then per rung native, old, new, parity.
        assert [(e.cohort, e.concurrency) for e in row.observation_order] == [
            ("native-serial", 1),
            ("native-concurrent", 1),
            ("skippy-old", 1),
            ("skippy-new", 1),
            ("old-new-parity", 1),
            ("native-concurrent", 2),
            ("skippy-old", 2),
            ("skippy-new", 2),
            ("old-new-parity", 2),
        ]
        for parity in row.parity:
            assert parity.matches and parity.complete and parity.comparable_requests == 2
        for arm, command in (("skippy-old", "serve"), ("skippy-new", "serve")):
            cell_dir = row_dir / f"sweep-{arm}"
            cell = decode_cell_receipt((cell_dir / "cell.json").read_bytes())
            assert cell.status == "completed" and cell.accepted_for_parity
            stage = json.loads((cell_dir / "stage.json").read_text())
            assert stage["run_id"] == "cache-family-serving-cell"
            assert (stage["layer_start"], stage["load_mode"]) == (0, "runtime-slice")
            admission = json.loads((cell_dir / "cli-admission.json").read_text())
            assert admission["dialect"] == "Current" and admission["role"] == "Public"
            cell_id = f"{row_dir.name}/{arm}"
            [admitted] = [
                r for r in records if isinstance(r, CliAdmission) and r.cell_id == cell_id
            ]
            assert admitted.dialect == "current" and admitted.probes == ((command, 0),)
            # Exactly one launch per arm across all rungs, retained at every rung.
            children = [r for r in records if isinstance(r, ChildSpawned) and r.cell_id == cell_id]
            spawns = [r for r in children if r.role == "host"]
            assert len(spawns) == 1 and spawns[0].host_argv[1] == "serve"
            # The help probe (once per run per binary) ran the row's private copy, as the host.
            for probe in (r for r in children if r.role == "help_probe"):
                assert probe.host_argv[1:] == ("serve", "--help")
                assert probe.executable == spawns[0].executable
            rungs = [r for r in records if isinstance(r, RungCompleted) and r.cell_id == cell_id]
            assert [r.concurrency for r in rungs] == [1, 2]
            assert {r.host_pid for r in rungs} == {spawns[0].pid}
            assert all(r.host_retained for r in cell.measurement.rungs)
            # The prompt went as one chat message: every request counted as the host renders
            # and tokenizes it, the message's tokens intact (the zoo's byte tokens merge
            # with nothing of the template).
            [warmup] = [
                r for r in records if isinstance(r, WarmupExclusion) and r.cell_id == cell_id
            ]
            assert warmup.prompt_tokens is not None and warmup.chat_prompt_tokens is not None
            assert warmup.chat_prompt_tokens > warmup.prompt_tokens
            assert warmup.chat_prompt_merged_tokens == 0
            counted = {
                json.loads(line)["row"].get("prompt_tokens")
                for line in (cell_dir / REQUESTS_FILENAME).read_text().splitlines()
            }
            assert counted == {warmup.chat_prompt_tokens}
            # A stage server serves no /metrics: each rung says so, nothing is guessed (and
            # nothing was asked of it), beside the client's own sums.
            reads = [
                r for r in records if isinstance(r, ServerMetricsRead) and r.cell_id == cell_id
            ]
            assert [(r.index, r.status, r.path, r.counters) for r in reads] == [
                (0, "none", None, ()),
                (1, "none", None, ()),
            ]
            for rung in cell.measurement.rungs:
                assert isinstance(rung.server_metrics, ServerMetricsVerdict)
                assert rung.server_metrics.server is None
                assert rung.server_metrics.reason == "this host kind serves no /metrics"
                assert rung.server_metrics.client is not None
                assert rung.server_metrics.client.accounted == len(rung.rows)
    production = json.loads((out / "production-cache-bench.json").read_bytes())
    assert [(r["skippy"]["status"], r["llama_server"]["status"]) for r in production] == [
        ("pass", "ok")
    ] * len(production)
    verdict = replay(str(out))
    assert verdict.exit_code == 0, verdict.lines


def test_a_one_use_case_plan_completes_and_writes_its_production_rows(
    native_parts: Parts, oracle_tools: Path, tmp_path: Path
) -> None:
    """The reduced plan with one use case: its prompt drives correctness, the baselines and
    old/new, and production-cache-bench.json carries one measured row per family."""
    corpus = json.loads(Path(default_corpus_path()).read_text())
    corpus["use_cases"] = corpus["use_cases"][:1]
    one = tmp_path / "one-use-case.json"
    one.write_text(json.dumps(corpus))
    operator = paired_operator(native_parts, oracle_tools, tmp_path, ["llama", "qwen3next"])
    out, code, stderr = prepare_and_run(
        operator, tmp_path, "prepare-use-cases", "--use-case-corpus", str(one)
    )
    assert code == 0, stderr
    assert decode_matrix((out / MATRIX_FILENAME).read_bytes()).status == "completed"
    production = json.loads((out / "production-cache-bench.json").read_bytes())
    key = corpus["use_cases"][0]["key"]
    assert sorted(r["family"] for r in production) == ["Llama", "Qwen3Next"]
    for entry in production:
        assert entry["use_case"] == key
        assert entry["skippy"]["status"] == "pass" and entry["llama_server"]["status"] == "ok"
        assert entry["skippy"]["cache_storage_bytes"] > 0
    assert replay(str(out)).exit_code == 0


# --- faults a real stage server cannot be made to produce (scripted wrappers, named so) ---------


def fault_wrapper(root: Path, real: Path, action: str) -> Path:
    """A FAKE new server: a shell wrapper that does ``action`` when started to serve (never for
    a ``--help`` probe), then runs the real oracle stage server with the same arguments."""
    path = root / "fault-wrappers" / "skippy-new"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/bin/sh\n"
        "# FAKE stage server for a fault-injection test: wraps the real oracle.\n"
        f'if [ "$2" != "--help" ]; then {action}; fi\n'
        f'exec {real} "$@"\n'
    )
    path.chmod(0o755)
    return path


def test_a_new_server_binary_changed_while_serving_keeps_measurements_and_refuses_parity(
    native_parts: Parts, oracle_tools: Path, tmp_path: Path
) -> None:
    real = oracle_tools.joinpath(*native_build.TOOLS_SUBDIR) / "skippy"
    # The host runs a private copy ("$0"): the pinned file itself changes while it serves.
    pinned = tmp_path / "fault-wrappers" / "skippy-new"
    wrapper = fault_wrapper(tmp_path, real, f"printf '# changed while serving\\n' >> '{pinned}'")
    assert wrapper == pinned
    operator = paired_operator(
        native_parts,
        oracle_tools,
        tmp_path,
        ["llama"],
        new_server={"path": str(wrapper), "sha256": None},
    )
    out, code, _ = prepare_and_run(operator, tmp_path)
    assert code != 0
    row_dir = out / "cell-0000"
    row = decode_row_receipt((row_dir / "row.json").read_bytes())
    new = decode_cell_receipt((row_dir / "sweep-skippy-new" / "cell.json").read_bytes())
    old = decode_cell_receipt((row_dir / "sweep-skippy-old" / "cell.json").read_bytes())
    # The drift is found after the ladder: every measurement is kept, the cell is downgraded.
    assert new.pins_drifted and not new.accepted_for_parity and new.status == "incomplete"
    assert [p.name for p in new.after_identity if not p.matches] == ["binary"]
    assert [r.status for r in new.measurement.rungs] == ["completed", "completed"]
    assert all(r.rung_summary is not None for r in new.measurement.rungs)
    assert old.status == "completed" and old.accepted_for_parity
    assert [(p.matches, p.unavailable_reason) for p in row.parity] == [
        (False, "custody_or_lifecycle_failure"),
        (False, "custody_or_lifecycle_failure"),
    ]
    assert row.status == "incomplete" and row.correctness.status == "completed"
    assert replay(str(out)).exit_code == 0


def test_a_cancel_during_the_new_arm_keeps_the_old_arms_rungs(
    native_parts: Parts, oracle_tools: Path, tmp_path: Path
) -> None:
    real = oracle_tools.joinpath(*native_build.TOOLS_SUBDIR) / "skippy"
    # The runner is the wrapper's parent: SIGINT it as the new server starts.
    wrapper = fault_wrapper(tmp_path, real, "kill -INT $PPID")
    operator = paired_operator(
        native_parts,
        oracle_tools,
        tmp_path,
        ["llama"],
        new_server={"path": str(wrapper), "sha256": None},
    )
    out, code, _ = prepare_and_run(operator, tmp_path)
    assert code != 0
    row_dir = out / "cell-0000"
    row = decode_row_receipt((row_dir / "row.json").read_bytes())
    assert row.terminal_refusal == "cancelled" and row.status == "incomplete"
    old = decode_cell_receipt((row_dir / "sweep-skippy-old" / "cell.json").read_bytes())
    assert old.status == "completed" and old.accepted_for_parity
    assert [(r.concurrency, r.status) for r in old.measurement.rungs] == [
        (1, "completed"),
        (2, "completed"),
    ]
    new = decode_cell_receipt((row_dir / "sweep-skippy-new" / "cell.json").read_bytes())
    assert new.terminal_refusal == "cancelled" and new.cleanup is not None
    assert {p.unavailable_reason for p in row.parity} == {"custody_or_lifecycle_failure"}
    entries = [(e.cohort, e.concurrency, e.status) for e in row.observation_order]
    assert ("skippy-old", 1, "completed") in entries and ("skippy-old", 2, "completed") in entries
    assert decode_matrix((out / MATRIX_FILENAME).read_bytes()).terminal_refusal == "cancelled"
    assert replay(str(out)).exit_code == 0
