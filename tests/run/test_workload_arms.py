"""The workload file's measurement kinds as arms of the row: planned only when the prepared
input pins a workload file (one arm per chosen workload, after the host arms, on the native
host with a slot per prefix group or user and no host-side prompt cache), and a prepared
input without one runs and journals exactly the arms, cells and records it did before."""

from __future__ import annotations

from pathlib import Path

import trio.testing
from fake_hosts.fake_custody import FakeHostScript
from run_harness import (  # noqa: F401
    autojump_clock,
    journal,
    make_prepared,
    row,
    run,
)

from cache_family.schemas.arms import (
    HOST_ARMS,
    NATIVE_CONCURRENT,
    NATIVE_OPEN_LOOP,
    NATIVE_OVERLAP,
    NATIVE_SESSIONS,
    WORKLOAD_ARMS,
)
from cache_family.schemas.journal import CellOpened, RowOpened, Transition
from cache_family.schemas.prepared import PreparedInput, load_prepared_input
from cache_family.schemas.workload import WorkloadsPin, validate_workload_object
from cache_family.schemas.workload_records import WORKLOAD_RECORDS
from cache_family.states.plans import (
    accepted_prompt,
    cell_plan,
    llama_server_argv,
    workload_arm_plans,
)

WORKLOADS = {
    "schema_version": 1,
    "prefix_overlap": {"prompt_tokens": 64, "groups": 3, "requests": 6},
    "multi_turn": {"users": 2, "turns": 2},
}


def with_workloads(prepared: PreparedInput, document: dict[str, object]) -> PreparedInput:
    workloads = validate_workload_object(document)
    pin = WorkloadsPin(path="/w.json", sha256="a" * 64, workloads=workloads)
    return prepared.model_copy(update={"workloads": pin})


async def test_a_run_without_a_workload_file_runs_and_journals_no_workload_arm(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,  # noqa: F811
) -> None:
    script = FakeHostScript()
    out = tmp_path / "out"
    outcome = await run(make_prepared(tmp_path / "p"), out, script)
    assert outcome.status == "completed"
    assert script.launched == ["native-serial", "sweep-native-concurrent"]
    lines = journal(out)
    opened = [line.record for line in lines if isinstance(line.record, RowOpened)]
    assert [a.arm for a in opened[0].arms] == ["native-serial", "native-concurrent"]
    assert not [line for line in lines if isinstance(line.record, WORKLOAD_RECORDS)]
    cells = {line.record.arm for line in lines if isinstance(line.record, CellOpened)}
    assert cells == {"native-serial", "native-concurrent"}
    states = {line.record.to_state for line in lines if isinstance(line.record, Transition)}
    assert "workload" not in states
    assert not list(out.glob("cell-0000/workload-*"))
    assert [o.arm for o in row(out).observations] == ["native-serial", "native-concurrent"]


def test_without_a_workload_file_no_workload_arm_is_planned_and_hosts_are_as_before(
    tmp_path: Path,
) -> None:
    prepared = load_prepared_input(str(make_prepared(tmp_path / "p")))
    assert prepared.workloads is None
    prepared_row = prepared.rows[0]
    assert workload_arm_plans(prepared, prepared_row) == ()
    prompt = accepted_prompt("hello", "t")
    plan = cell_plan(prepared, prepared_row, NATIVE_CONCURRENT, prompt, 4)
    assert plan.workloads is None and plan.cache_ram_mib is None
    assert "--cache-ram" not in llama_server_argv(plan, "/bin/llama-server", 8080)


def test_a_workload_file_plans_one_arm_per_chosen_workload_after_the_host_arms(
    tmp_path: Path,
) -> None:
    prepared = with_workloads(load_prepared_input(str(make_prepared(tmp_path / "p"))), WORKLOADS)
    prepared_row = prepared.rows[0]
    plans = workload_arm_plans(prepared, prepared_row)
    # The file chooses overlap and sessions, not open loop: two arms, in arm order.
    assert [(p.arm, p.status) for p in plans] == [
        (NATIVE_OVERLAP.name, "planned"),
        (NATIVE_SESSIONS.name, "planned"),
    ]
    assert NATIVE_OPEN_LOOP in WORKLOAD_ARMS and not set(WORKLOAD_ARMS) & set(HOST_ARMS)
    prompt = accepted_prompt("hello", "t")
    overlap = cell_plan(prepared, prepared_row, NATIVE_OVERLAP, prompt, 4)
    assert overlap.workloads is not None and overlap.rungs == ()
    assert overlap.workloads_sha256 == "a" * 64
    argv = llama_server_argv(overlap, "/bin/llama-server", 8080)
    # A slot per prefix group, each holding a whole prompt and its answer, no host cache.
    assert argv[argv.index("--parallel") + 1] == "3"
    assert argv[argv.index("--cache-ram") + 1] == "0"
    assert int(argv[argv.index("--ctx-size") + 1]) >= 3 * (64 + 1)
    sessions = cell_plan(prepared, prepared_row, NATIVE_SESSIONS, prompt, 4)
    argv = llama_server_argv(sessions, "/bin/llama-server", 8080)
    assert argv[argv.index("--parallel") + 1] == "2"
    # The longest session (system, context, two turns of question and answer) fits a slot.
    assert int(argv[argv.index("--ctx-size") + 1]) >= 2 * (256 + 128 + 2 * (32 + 32))
    # The host arms' plans do not change with a workload file.
    concurrent = cell_plan(prepared, prepared_row, NATIVE_CONCURRENT, prompt, 4)
    assert concurrent.workloads is None and concurrent.cache_ram_mib is None
