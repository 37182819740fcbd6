"""The row actor runs through ``ROW_TABLE`` by the one driver (``actors/run/engine.py``), with
FAKE hosts and FAKE correctness children: the row's journaled steps are a path through its table,
each arm's cell runs from the arm action of the step before it, a row whose correctness did not
pass publishes its receipt with no cell, and a row whose model is missing rests in finalize
without a directory or a receipt."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing
from fake_hosts.fake_custody import FakeHostScript, fake_child_runner
from run_harness import autojump_clock, make_prepared, records, row, run

from cache_family.schemas.journal import CellOpened, ReceiptPublished, Transition
from cache_family.states.cell import ROW_TABLE, RowEvent

__all__ = ["autojump_clock"]  # the thread-aware fixture of test_run_budgets


def row_steps(out: Path, row_index: int) -> list[tuple[str, str, str]]:
    return [
        (t.from_state, t.event, t.to_state)
        for t in records(out, Transition)
        if t.machine == ROW_TABLE.name and t.row_index == row_index
    ]


def assert_a_path_through_the_table(steps: list[tuple[str, str, str]]) -> None:
    state = ROW_TABLE.initial
    for source, event, dest in steps:
        assert source == state
        state = ROW_TABLE.step(state, RowEvent(event)).to
        assert state == dest


async def test_a_passed_row_runs_each_planned_arm_from_the_arm_action_then_publishes(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    out = tmp_path / "out"
    await run(make_prepared(tmp_path / "p", llama_parallel=2), out, FakeHostScript())
    steps = row_steps(out, 0)
    assert steps == [
        ("correctness", "correctness-passed", "serial"),
        ("serial", "arm-finished", "concurrent"),
        ("concurrent", "arm-finished", "concurrent"),
        ("concurrent", "arms-exhausted", "finalize"),
        ("finalize", "receipt-published", "done"),
    ]
    assert_a_path_through_the_table(steps)
    assert [c.arm for c in records(out, CellOpened)] == ["native-serial", "native-concurrent"]
    assert row(out).status == "completed"


async def test_an_unplanned_arm_is_a_skipped_step_and_runs_no_cell(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    out = tmp_path / "out"
    await run(make_prepared(tmp_path / "p", skip_llama_server=True), out, FakeHostScript())
    steps = row_steps(out, 0)
    assert ("serial", "arm-skipped", "concurrent") in steps
    assert_a_path_through_the_table(steps)
    assert "native-serial" not in [c.arm for c in records(out, CellOpened)]


async def test_a_row_whose_correctness_failed_publishes_its_receipt_with_no_cell(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    out = tmp_path / "out"
    await run(
        make_prepared(tmp_path / "p"),
        out,
        FakeHostScript(),
        child_runner=fake_child_runner(exit_code=1),
    )
    assert row_steps(out, 0) == [
        ("correctness", "correctness-not-passed", "finalize"),
        ("finalize", "receipt-published", "done"),
    ]
    assert records(out, CellOpened) == []
    assert row(out).status != "completed"


async def test_a_row_whose_model_is_missing_rests_in_finalize_without_a_receipt(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The prepared input plans every catalog case; only the first has its model present."""
    out = tmp_path / "out"
    await run(make_prepared(tmp_path / "p"), out, FakeHostScript())
    assert row_steps(out, 1) == [("correctness", "model-missing", "finalize")]
    published = [p for p in records(out, ReceiptPublished) if p.scope == "row"]
    assert [p.row_index for p in published] == [0]
    assert not (out / "cell-0001").exists()
