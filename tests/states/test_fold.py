"""The pure fold journal -> receipts and the receipt lattice it obeys."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from typing import Any

import msgspec
import pytest
from cell_journal_builder import CellScript, RowScript, row_records, serial_cell
from fold_journals import journal

from cache_family.errors import Refused
from cache_family.schemas import request_rows
from cache_family.schemas.journal import (
    ArmPlan,
    Cancellation,
    CellOpened,
    CleanupOutcome,
    CorrectnessTopologyRan,
    CorrectnessVerdict,
    DeadlineExpired,
    Fault,
    InterruptFinishFailed,
    JournalLine,
    PinDrift,
    Record,
    RowOpened,
    RungCompleted,
    RungRows,
    Transition,
)
from cache_family.schemas.matrix import (
    MATRIX_SCOPE,
    MATRIX_SCOPE_SYNTHETIC,
    MatrixCatalog,
    encode_matrix,
)
from cache_family.schemas.measurement import HostCleanup, RequestRow
from cache_family.schemas.receipts import (
    SYNTHETIC_EVIDENCE_CLASS,
    CellReceipt,
    CorrectnessObservation,
    decode_cell_receipt,
    decode_row_receipt,
    encode_receipt,
)
from cache_family.states.cell import CELL_TABLE, CellEvent, CellState, RowEvent, StatePolicy
from cache_family.states.fold import (
    CellFold,
    JournalIndex,
    fold_cell,
    fold_row,
)
from cache_family.states.fold import cell as cell_fold_module
from cache_family.states.matrix import fold_matrix
from cache_family.states.receipts import (
    ALL_STATUSES,
    MEASURED_CHAIN,
    UNMEASURED,
    may_follow,
    meet,
    terminal_downgrade,
)
from cache_family.states.tally import tally_cell


def fold(script: CellScript, *extra: Record) -> CellReceipt:
    return fold_cell(journal(*script.records, *extra), script.cell_id, rows=script.rows_source)


def finish(script: CellScript) -> CellScript:
    """Whatever state a faulted script is in, run cleanup and reach finalize."""
    if script.state != CellState.CLEANUP:
        script.fault("internal")
    script.cleanup()
    return script


def fault_kinds(receipt: CellReceipt) -> list[str]:
    return [fault.kind for fault in receipt.faults]


# --- complete sessions ----------------------------------------------------------------------


def test_complete_concurrent_cell() -> None:
    receipt = fold(CellScript().happy())
    assert receipt.status == "completed" and receipt.accepted_for_parity
    assert receipt.terminal_refusal is None and receipt.faults == ()
    skipped = (CellState.NOT_LAUNCHED, CellState.WORKLOAD, CellState.DONE)
    assert receipt.lifecycle == tuple(s.value for s in CellState if s not in skipped)
    assert receipt.final_state == "finalize"
    assert receipt.host is not None and receipt.host.pid == 4242
    assert receipt.readiness.ready and receipt.readiness.marker_seen
    assert receipt.readiness.port == 18080
    assert [p.name for p in receipt.before_identity] == ["binary", "model"]
    assert all(p.matches for p in receipt.after_identity)
    assert receipt.cleanup is not None and receipt.cleanup.clean
    rungs = receipt.measurement.rungs
    assert receipt.measurement.complete and [r.concurrency for r in rungs] == [1, 2]
    assert [len(r.rows) for r in rungs] == [2, 4]
    assert all(r.host_retained for r in rungs)
    second = rungs[1].rung_summary
    assert second is not None and second.complete and second.measured_requests == 4
    assert second.makespan_seconds == 1.0 and second.throughput_requests_per_sec == 4.0
    assert receipt.run_id == "run-test" and receipt.request_sha256 == "1" * 64


def test_complete_serial_cell_excludes_its_warmup() -> None:
    receipt = fold(serial_cell().happy())
    assert receipt.status == "completed"
    rung = receipt.measurement.rungs[0]
    assert rung.warmup_excluded_ids == (0,)
    assert rung.serial_summary is not None and rung.rung_summary is None
    assert rung.serial_summary.excluded_runs == 1 and rung.serial_summary.warm_requests == 2
    assert rung.serial_summary.warm_median_ms == 21.5


# --- faults before the host is ready: failed, nothing measured --------------------------------


def test_pin_mismatch_before_launch_fails_without_launching() -> None:
    script = CellScript().open()
    script.pins("before", drift=True)
    script.records.append(Fault(cell_id=script.cell_id, kind="pin_mismatch"))
    script.fire(CellEvent.PINS_MISMATCH)
    script.nothing_launched()
    receipt = fold(script)
    assert receipt.status == "failed" and not receipt.accepted_for_parity
    assert receipt.host is None and receipt.cleanup is None
    assert receipt.lifecycle == ("pin-verify", "not-launched", "finalize")
    assert "pin_mismatch" in fault_kinds(receipt)
    assert not receipt.before_identity[1].matches


@pytest.mark.parametrize(
    ("phase", "drift_record", "ceiling", "faults"),
    [
        ("before", True, "failed", ["pin_drift"]),
        ("before", False, "failed", []),
        ("after", True, "incomplete", ["pin_drift"]),
        ("after", False, "incomplete", []),
    ],
)
def test_a_pin_that_differs_lowers_the_cell_by_phase(
    phase: str, drift_record: bool, ceiling: str, faults: list[str]
) -> None:
    """Before launch a differing pin fails the cell; after the ladder it keeps the measurements
    and refuses parity. A ``pin_drift`` record adds its fault; the observation alone lowers."""
    script = CellScript()
    script.pins(phase, drift=True)
    records = [r for r in script.records if drift_record or not isinstance(r, PinDrift)]
    assert any(isinstance(r, PinDrift) for r in records) == drift_record
    cell = CellFold(script.cell_id)
    for line in journal(*records):
        cell.apply(line)
    assert cell.ceiling == ceiling
    assert [f.kind for f in cell.faults] == faults
    assert cell.drifted == cell.parity_refused == (phase == "after")
    table = cell.pins_after if phase == "after" else cell.pins_before
    assert [pin.matches for pin in table.values()] == [True, False]


@pytest.mark.parametrize(
    "kind", ["child_exited", "marker_missing", "readiness_failed", "port_busy", "spawn_failed"]
)
def test_launch_faults_fail_the_cell(kind: str) -> None:
    script = CellScript().open()
    script.launch()
    script.fault(kind, "exit status 1")
    script.cleanup()
    receipt = fold(script)
    assert receipt.status == "failed"
    assert receipt.faults[0].kind == kind and receipt.faults[0].state == "launch"
    assert not receipt.readiness.ready
    assert [r.status for r in receipt.measurement.rungs] == ["not-run", "not-run"]
    assert all(r.rows == () for r in receipt.measurement.rungs)
    assert not receipt.measurement.complete


# --- late faults: incomplete, observations kept, parity refused -------------------------------


def test_request_timeout_keeps_earlier_rows() -> None:
    script = CellScript().open()
    script.launch()
    script.become_ready()
    script.warmup()
    script.request(0, 0)
    script.request(0, 1, RequestRow(request_id=1, status="incomplete", error="timed out"))
    script.rung_done(0, status="incomplete")
    script.fault("request_timeout", "request 1 after 120000 ms")
    script.cleanup()
    receipt = fold(script)
    assert receipt.status == "incomplete" and not receipt.accepted_for_parity
    rung = receipt.measurement.rungs[0]
    assert [row.status for row in rung.rows] == ["completed", "incomplete"]
    assert rung.status == "incomplete"
    assert rung.rung_summary is not None and not rung.rung_summary.complete
    assert receipt.measurement.rungs[1].status == "not-run"


def test_post_run_drift_keeps_measurements_and_refuses_parity() -> None:
    receipt = fold(CellScript().happy(drift=True))
    assert receipt.status == "incomplete" and receipt.pins_drifted
    assert not receipt.accepted_for_parity
    assert receipt.measurement.complete and len(receipt.measurement.rungs) == 2
    assert [f.kind for f in receipt.faults] == ["pin_drift"]
    assert receipt.faults[0].state == "post-verify"


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=8)))
def test_the_cleanup_verdict_is_custodys_and_every_unclean_cleanup_is_a_fault(
    flags: tuple[bool, ...],
) -> None:
    graceful, forced, escaped, survived, port_free, removed, truncated, bounded = flags
    fields: dict[str, Any] = {
        "pid": 4242,
        "graceful": graceful,
        "forced": forced,
        "exit_code": 0,
        "escaped_descendants": (7,) if escaped else (),
        "surviving_descendants": (8,) if survived else (),
        "port_free": port_free,
        "state_dir_removed": removed,
        "capture_truncated": truncated,
        "oversized_lines": 0,
        "bounded_out": bounded,
    }
    custody = HostCleanup(**fields)
    custody_verdict = not custody.problems()
    script = CellScript().happy()
    records = [
        CleanupOutcome(cell_id=script.cell_id, cleanup=custody)
        if isinstance(r, CleanupOutcome)
        else r
        for r in script.records
    ]
    receipt = fold_cell(journal(*records), script.cell_id)
    assert receipt.cleanup == custody  # cell.json shows custody's record as it is
    faults = sorted(f.kind for f in receipt.faults)
    assert faults == sorted(kind for kind, _ in custody.problems())
    assert (receipt.status == "completed") == custody_verdict
    assert receipt.accepted_for_parity == custody_verdict


def test_forced_kill_keeps_measurements_and_refuses_parity() -> None:
    receipt = fold(CellScript().happy(forced=True))
    assert receipt.status == "incomplete" and not receipt.accepted_for_parity
    assert receipt.cleanup is not None and not receipt.cleanup.clean and receipt.cleanup.forced
    assert fault_kinds(receipt) == ["cleanup_forced"]
    assert receipt.measurement.complete


def test_surviving_descendants_are_unclean() -> None:
    receipt = fold(_with_survivor())
    assert receipt.status == "incomplete"
    assert fault_kinds(receipt) == ["cleanup_unclean"]
    assert "4243" in receipt.faults[0].detail


def test_truncated_capture_is_a_custody_failure() -> None:
    receipt = fold(CellScript().happy(capture_truncated=True))
    assert receipt.status == "incomplete" and not receipt.accepted_for_parity
    assert fault_kinds(receipt) == ["capture_truncated"]
    assert receipt.faults[0].state == "cleanup"
    assert receipt.cleanup is not None and not receipt.cleanup.clean
    assert receipt.cleanup.capture_truncated
    assert receipt.measurement.complete  # the observations are kept


def test_oversized_output_lines_are_a_truncated_capture() -> None:
    receipt = fold(CellScript().happy(oversized_lines=2))
    assert receipt.status == "incomplete" and not receipt.accepted_for_parity
    assert fault_kinds(receipt) == ["capture_truncated"]
    assert "2 oversized" in receipt.faults[0].detail
    assert receipt.cleanup is not None and receipt.cleanup.oversized_lines == 2


def test_a_descendant_that_escaped_the_process_group_is_a_custody_failure() -> None:
    # Ended one by one, so nothing survives and the port is free: still not clean custody.
    receipt = fold(CellScript().happy(escaped=(4250,)))
    assert receipt.status == "incomplete" and not receipt.accepted_for_parity
    assert fault_kinds(receipt) == ["cleanup_unclean"]
    assert "escaped the process group" in receipt.faults[0].detail
    assert "4250" in receipt.faults[0].detail
    assert receipt.cleanup is not None and not receipt.cleanup.clean
    assert receipt.cleanup.escaped_descendants == (4250,)
    assert receipt.cleanup.surviving_descendants == ()
    assert receipt.measurement.complete


@pytest.mark.parametrize(
    ("finding", "detail"),
    [
        ({"bounded_out": True}, "past its time bound"),
        ({"state_dir_error": "Directory not empty"}, "state dir not removed (Directory not"),
    ],
)
def test_cleanup_past_its_bound_or_a_state_dir_left_is_unclean(
    finding: dict[str, object], detail: str
) -> None:
    receipt = fold(CellScript().happy(**finding))
    assert receipt.status == "incomplete" and not receipt.accepted_for_parity
    assert fault_kinds(receipt) == ["cleanup_unclean"]
    assert detail in receipt.faults[0].detail
    assert receipt.cleanup is not None and not receipt.cleanup.clean


def test_a_shortened_grace_alone_keeps_custody_clean() -> None:
    """Custody counts a second interrupt's shorter grace as information, not as a failure
    (the interrupt itself downgrades the cell through its cancellation record)."""
    receipt = fold(CellScript().happy(grace_shortened=True))
    assert receipt.status == "completed" and receipt.accepted_for_parity
    assert receipt.cleanup is not None and receipt.cleanup.clean
    assert receipt.cleanup.grace_shortened


def test_custody_failures_reach_the_row_as_refused_parity() -> None:
    cells = [serial_cell().happy(), CellScript().happy(capture_truncated=True)]
    arms = [ArmPlan(arm="native-serial"), ArmPlan(arm="native-concurrent")]
    receipt = fold_row(journal(*row_with(cells, arms)), 0)
    assert receipt.status == "incomplete"
    assert [o.accepted_for_parity for o in receipt.observations] == [True, False]
    assert receipt.observations[1].reason == "capture_truncated"


def _with_survivor() -> CellScript:
    script = CellScript().open()
    script.launch()
    script.become_ready()
    script.warmup()
    script.ladder()
    script.pins("after")
    script.fire(CellEvent.PINS_VERIFIED)
    script.cleanup(survivors=(4243,))
    return script


def test_rung_against_another_host_is_a_custody_fault() -> None:
    script = CellScript().open()
    script.launch()
    script.become_ready()
    script.warmup()
    for request_id in range(2):
        script.request(0, request_id)
    script.rung_done(0, pid=9999)
    receipt = fold(finish(script))
    assert receipt.measurement.rungs[0].host_retained is False
    assert "host_identity_changed" in fault_kinds(receipt)
    assert receipt.status == "incomplete"


# --- terminal refusals -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stop", "expected"),
    [("cancel", "cancelled"), ("deadline", "deadline_expired")],
)
def test_cancel_or_deadline_during_ladder(stop: str, expected: str) -> None:
    script = CellScript().open()
    script.launch()
    script.become_ready()
    script.warmup()
    script.request(0, 0)
    script.rows_done(0)  # what was written is journaled, as a warmup's row is
    script.cancel() if stop == "cancel" else script.deadline()
    script.cleanup()
    receipt = fold(script)
    assert receipt.status == "incomplete" and receipt.terminal_refusal == expected
    assert len(receipt.measurement.rungs[0].rows) == 1  # nothing already observed is erased


def test_a_failed_cell_stays_failed_when_later_cancelled() -> None:
    script = CellScript().open()
    script.launch()
    script.fault("readiness_failed")
    script.records.append(Cancellation(cell_id=script.cell_id, signal="SIGINT"))
    script.fire(CellEvent.CANCELLED)
    script.cleanup()
    receipt = fold(script)
    assert receipt.status == "failed" and receipt.terminal_refusal == "cancelled"


def test_run_wide_stops_apply_until_the_cell_is_done() -> None:
    script = CellScript().happy()
    during = fold(script, InterruptFinishFailed(detail="sigaction restore failed"))
    assert during.status == "incomplete"
    assert during.terminal_refusal == "interrupt_finish_failed"
    script.fire(CellEvent.RECEIPT_PUBLISHED)
    after = fold(script, DeadlineExpired(cell_id=None, budget="execution"))
    assert after.status == "completed" and after.terminal_refusal is None
    assert after.final_state == "done"


def test_first_terminal_refusal_wins() -> None:
    script = CellScript().open()
    script.launch()
    script.deadline()
    script.records.append(Cancellation(cell_id=None, signal="SIGTERM"))
    script.fire(CellEvent.CANCELLED)
    script.cleanup()
    assert fold(script).terminal_refusal == "deadline_expired"


# --- the measurement level: its own status and terminal refusal -----------------------------


def _ladder_started(script: CellScript) -> CellScript:
    script.open()
    script.launch()
    script.become_ready()
    script.warmup()
    return script


def test_measurement_fields_are_defaulted_and_last() -> None:
    """Evolution rule: the new fields go last with defaults, so an older cell.json decodes."""
    from cache_family.schemas.receipts import Measurement

    later = (
        "status",
        "terminal_refusal",
        "ignore_eos",
        "cache_shortfall_rungs",
        "rows_file",
        "server_metrics_disagreeing_rungs",
    )
    assert Measurement.__struct_fields__[-6:] == later
    published = json.loads(encode_receipt(fold(CellScript().happy())))
    # A cell that journaled no server metrics read writes no disagreeing rungs at all.
    assert "server_metrics_disagreeing_rungs" not in published["measurement"]
    for name in later:
        published["measurement"].pop(name, None)
    older = decode_cell_receipt(json.dumps(published).encode())
    assert older.measurement.status is None and older.measurement.terminal_refusal is None
    assert older.measurement.ignore_eos is None and older.measurement.cache_shortfall_rungs == ()
    assert older.measurement.rows_file is None
    assert older.measurement.server_metrics_disagreeing_rungs is msgspec.UNSET


def test_a_whole_ladder_without_a_stop_is_a_completed_measurement() -> None:
    for script in (CellScript().happy(), serial_cell().happy()):
        measurement = fold(script).measurement
        assert measurement.status == "completed" and measurement.terminal_refusal is None
        published = json.loads(encode_receipt(fold(script)))["measurement"]
        assert published["status"] == "completed" and published["terminal_refusal"] is None


@pytest.mark.parametrize(
    ("stop", "expected"),
    [("cancel", "cancelled"), ("deadline", "deadline_expired"), ("run-wide", "cancelled")],
)
def test_a_stop_during_the_ladder_downgrades_the_measurement_level(
    stop: str, expected: str
) -> None:
    script = _ladder_started(CellScript())
    script.request(0, 0)
    script.rows_done(0)
    if stop == "deadline":
        script.deadline()
    else:
        script.cancel(run_wide=stop == "run-wide")
    script.cleanup()
    receipt = fold(script)
    measurement = receipt.measurement
    assert measurement.status == "incomplete" and measurement.terminal_refusal == expected
    assert measurement.terminal_refusal == receipt.terminal_refusal
    assert len(measurement.rungs[0].rows) == 1  # the downgrade erases nothing


@pytest.mark.parametrize("when", ["post-verify", "cleanup", "finalize"])
def test_a_stop_after_a_whole_ladder_still_downgrades_the_measurement(when: str) -> None:
    """Every receipt level is downgraded by a stop before the cell is done, even when the
    rungs themselves were all completed (``complete`` keeps saying so)."""
    script = _ladder_started(CellScript())
    script.ladder()
    if when == "post-verify":
        script.deadline()
        script.cleanup()
    else:
        script.pins("after")
        script.fire(CellEvent.PINS_VERIFIED)
        if when == "cleanup":
            script.deadline()
        script.cleanup()
        if when == "finalize":
            script.deadline()
    measurement = fold(script).measurement
    assert measurement.complete
    assert measurement.status == "incomplete"
    assert measurement.terminal_refusal == "deadline_expired"


def test_an_interrupt_finish_failure_before_done_downgrades_the_measurement() -> None:
    script = CellScript().happy()
    during = fold(script, InterruptFinishFailed(detail="sigaction restore failed"))
    assert during.measurement.status == "incomplete"
    assert during.measurement.terminal_refusal == "interrupt_finish_failed"
    script.fire(CellEvent.RECEIPT_PUBLISHED)
    after = fold(script, InterruptFinishFailed(detail="sigaction restore failed"))
    assert after.measurement.status == "completed"
    assert after.measurement.terminal_refusal is None


def test_a_late_custody_fault_leaves_the_measurement_level_completed() -> None:
    """Drift or a forced kill after the ladder lowers the cell, not the rungs it measured."""
    for script in (CellScript().happy(drift=True), CellScript().happy(forced=True)):
        receipt = fold(script)
        assert receipt.status == "incomplete"
        assert receipt.measurement.status == "completed"


def test_a_measurement_that_never_ran_is_not_run_and_keeps_the_stop() -> None:
    mismatch = CellScript().open()
    mismatch.pins("before", drift=True)
    mismatch.records.append(Fault(cell_id=mismatch.cell_id, kind="pin_mismatch"))
    mismatch.fire(CellEvent.PINS_MISMATCH)
    mismatch.nothing_launched()
    measurement = fold(mismatch).measurement
    assert measurement.status == "not-run" and measurement.terminal_refusal is None

    cancelled = CellScript().open()
    cancelled.launch()
    cancelled.cancel()
    cancelled.cleanup()
    receipt = fold(cancelled)
    assert receipt.measurement.status == "not-run"  # nothing to downgrade
    assert receipt.measurement.terminal_refusal == "cancelled" == receipt.terminal_refusal


def test_a_cut_short_rung_is_an_incomplete_measurement() -> None:
    script = _ladder_started(CellScript())
    script.request(0, 0)
    script.request(0, 1, RequestRow(request_id=1, status="incomplete", error="timed out"))
    script.rung_done(0, status="incomplete")
    script.fault("request_timeout", "request 1 after 120000 ms")
    script.cleanup()
    measurement = fold(script).measurement
    assert measurement.status == "incomplete" and measurement.terminal_refusal is None


def test_rungs_that_ran_and_produced_nothing_usable_are_a_failed_measurement() -> None:
    script = _ladder_started(CellScript())
    for request_id in range(2):
        script.request(0, request_id, RequestRow(request_id=request_id, status="failed"))
    script.rung_done(0, status="failed")
    script.fault("request_failed", "rung 0 ended failed")
    script.cleanup()
    receipt = fold(script)
    assert receipt.status == "incomplete"
    assert receipt.measurement.status == "failed"


def test_no_planned_rung_is_an_unmeasured_measurement() -> None:
    script = CellScript(rungs=()).open()
    script.launch()
    script.become_ready()
    script.warmup()
    script.fire(CellEvent.LADDER_DONE)
    script.pins("after")
    script.fire(CellEvent.PINS_VERIFIED)
    script.cleanup()
    receipt = fold(script)
    assert receipt.measurement.status == "unmeasured"
    assert receipt.status == "incomplete"


# --- malformed or partial journals ---------------------------------------------------------------


def test_journal_that_stops_before_finalize_is_incomplete() -> None:
    script = CellScript().open()
    script.launch()
    script.become_ready()
    receipt = fold(script)
    assert receipt.status == "incomplete" and receipt.final_state == "warmup"
    assert receipt.faults[-1].kind == "journal_ended_before_finalize"
    assert receipt.faults[-1].seq is None


@pytest.mark.parametrize(
    ("event", "to_state", "detail"),
    [
        ("host-ready", "warmup", "finalize --host-ready--> warmup while in finalize"),
        ("teleport", "done", "unknown name in "),  # an event no table knows
    ],
)
def test_a_transition_the_table_refuses_is_a_fault(event: str, to_state: str, detail: str) -> None:
    script = CellScript().happy()
    bogus = Transition(
        machine="cell",
        cell_id=script.cell_id,
        from_state="finalize",
        event=event,
        to_state=to_state,
    )
    receipt = fold(script, bogus)
    assert receipt.status == "incomplete"
    assert fault_kinds(receipt) == ["journal_transition_invalid"]
    assert receipt.faults[0].detail.startswith(detail)
    assert receipt.final_state == "finalize"


def test_short_roster_is_refused_by_the_metrics_and_marks_incomplete() -> None:
    script = CellScript(rungs=((1, 3),)).open()
    script.launch()
    script.become_ready()
    script.warmup()
    script.request(0, 0)
    script.request(0, 1)  # request 2 never journaled
    script.rung_done(0)
    script.fire(CellEvent.LADDER_DONE)
    script.pins("after")
    script.fire(CellEvent.PINS_VERIFIED)
    script.cleanup()
    receipt = fold(script)
    assert receipt.measurement.rungs[0].summary_refusals == ("metrics.short_roster",)
    assert receipt.status == "incomplete"
    assert fault_kinds(receipt) == ["measurement_incomplete"]


def without_makespan(script: CellScript, rung_index: int) -> list[Record]:
    """The script's records with that rung reported without a makespan (and tallied so)."""
    opened = next(r for r in script.records if isinstance(r, CellOpened))
    records: list[Record] = []
    for record in script.records:
        if isinstance(record, RungCompleted) and record.rung_index == rung_index:
            record = msgspec.structs.replace(record, makespan_seconds=None)
            facts = tally_cell(opened, {rung_index: record}, script.lines)[rung_index]
            record = msgspec.structs.replace(record, tally=facts)
        records.append(record)
    return records


def test_a_concurrent_rung_without_its_makespan_is_not_summarised() -> None:
    script = CellScript().happy()
    receipt = fold_cell(journal(*without_makespan(script, 1)), script.cell_id)
    first, second = receipt.measurement.rungs
    assert first.rung_summary is not None and first.summary_refusals == ()
    assert second.rung_summary is None and second.serial_summary is None
    assert second.summary_refusals == ("fold.makespan_missing",)
    assert receipt.status == "incomplete"
    assert [(f.kind, f.detail) for f in receipt.faults] == [
        ("measurement_incomplete", "rung 1 roster refused: fold.makespan_missing")
    ]
    # A serial baseline is summarised from its requests alone.
    serial = serial_cell().happy()
    receipt = fold_cell(journal(*without_makespan(serial, 0)), serial.cell_id)
    assert receipt.status == "completed"
    assert receipt.measurement.rungs[0].serial_summary is not None


def test_unknown_cell_is_refused() -> None:
    with pytest.raises(Refused) as refused:
        fold_cell(journal(*CellScript().happy().records), "cell-9999/none")
    assert refused.value.codes == ["fold.cell.unknown"]


# --- determinism ------------------------------------------------------------------------------


def test_fold_is_deterministic_and_view_independent() -> None:
    a = CellScript(cell_id="cell-0000/native-concurrent").happy()
    b = CellScript(cell_id="cell-0001/native-concurrent", row_index=1).happy(drift=True)
    mixed: list[Record] = [
        r for pair in itertools.zip_longest(a.records, b.records) for r in pair if r is not None
    ]
    lines = journal(*mixed)
    index = JournalIndex(lines)
    for script in (a, b):
        whole = encode_receipt(fold_cell(lines, script.cell_id))
        view = encode_receipt(
            fold_cell(
                index.lines_for_cell(script.cell_id), script.cell_id, through_seq=lines[-1].seq
            )
        )
        assert whole == view == encode_receipt(fold_cell(lines, script.cell_id))
        assert decode_cell_receipt(whole) == fold_cell(lines, script.cell_id)
        assert whole.endswith(b"}\n")


def test_through_seq_limits_what_counts() -> None:
    script = CellScript().happy(forced=True)
    lines = journal(*script.records)
    cleanup_seq = next(line.seq for line in lines if type(line.record).__name__ == "CleanupOutcome")
    before = fold_cell(lines, script.cell_id, through_seq=cleanup_seq - 1)
    assert before.journal_through_seq == cleanup_seq - 1
    assert before.cleanup is None and before.status == "incomplete"
    assert fold_cell(lines, script.cell_id).journal_through_seq == lines[-1].seq


def test_incremental_fold_equals_fold_from_scratch() -> None:
    script = CellScript().happy()
    lines = journal(*script.records)
    incremental = CellFold(script.cell_id)
    compared = 0
    for line in lines:
        incremental.apply(line)
        if incremental.opened is None:
            continue
        from_scratch = fold_cell(lines[: line.seq], script.cell_id)
        assert encode_receipt(incremental.receipt()) == encode_receipt(from_scratch)
        compared += 1
    assert compared == len(lines) - 1


# --- rows --------------------------------------------------------------------------------------


def row_with(
    cells: list[CellScript],
    arms: list[ArmPlan],
    *,
    finish_row: bool = True,
    stop: Record | None = None,
    model_status: str = "present",
) -> list[Record]:
    row = RowScript(0)
    records: list[Record] = [row_records(0, arms, model_status=model_status)]
    if model_status == "missing-model":
        row.fire(RowEvent.MODEL_MISSING)
        return records + row.records
    if stop is not None:
        records.append(stop)
        row.fire(RowEvent.CANCELLED)
        return records + row.records
    row.pass_correctness()
    for script in cells:
        records += script.records
        row.fire(RowEvent.ARM_FINISHED)
    if finish_row:
        row.fire(RowEvent.ARMS_EXHAUSTED)
    return records + row.records


def test_completed_row() -> None:
    cells = [serial_cell().happy(), CellScript().happy()]
    arms = [
        ArmPlan(arm="native-serial"),
        ArmPlan(arm="native-concurrent"),
        ArmPlan(arm="skippy-old", status="skipped", reason="no old/new servers"),
    ]
    receipt = fold_row(journal(*row_with(cells, arms)), 0)
    assert receipt.status == "completed" and receipt.terminal_refusal is None
    assert [o.arm for o in receipt.observations] == [
        "native-serial",
        "native-concurrent",
        "skippy-old",
    ]
    assert [o.status for o in receipt.observations] == ["completed", "completed", "skipped"]
    assert receipt.observations[1].rungs[1].rung_summary is not None
    assert receipt.correctness == CorrectnessObservation(
        status="completed",
        planned_topologies=("one-stage",),
        prompt_sha256="c" * 64,
        suffix_prefill_matches=True,
    )
    assert receipt.lifecycle == ("correctness", "serial", "concurrent", "finalize")
    assert decode_row_receipt(encode_receipt(receipt)) == receipt
    published = json.loads(encode_receipt(receipt))
    # One representation: a nested object, no flat status beside it.
    assert published["correctness"]["status"] == "completed"
    assert not any(key.startswith("correctness_") for key in published)


def test_a_row_whose_correctness_never_ran_is_never_completed() -> None:
    cells = [serial_cell().happy()]
    records = row_with(cells, [ArmPlan(arm="native-serial")])
    # The same row without its correctness verdict (a foreign or edited journal).
    bare = [r for r in records if not isinstance(r, CorrectnessVerdict)]
    receipt = fold_row(journal(*bare), 0)
    assert receipt.correctness == CorrectnessObservation(
        status="not-run", reason="correctness_not_started"
    )
    assert receipt.status == "incomplete" and receipt.reason == "correctness_not_run"


def test_failed_correctness_skips_the_baselines_and_keeps_the_evidence() -> None:
    row = RowScript(0)
    arms = [ArmPlan(arm="native-serial"), ArmPlan(arm="native-concurrent")]
    ran = CorrectnessTopologyRan(
        row_index=0,
        topology_index=0,
        topology="one-stage",
        status="refused",
        reason="model id 'x' is not the row's 'y'",
        refusal_codes=("handoff.model_id",),
        evidence_dir="cell-0000/correctness/topology-00",
    )
    verdict = CorrectnessVerdict(
        row_index=0,
        status="failed-or-incomplete",
        reason="correctness_report_refused: one-stage: model id 'x' is not the row's 'y'",
        planned_topologies=("one-stage",),
    )
    row.fire(RowEvent.CORRECTNESS_NOT_PASSED)
    row.fire(RowEvent.RECEIPT_PUBLISHED)
    receipt = fold_row(journal(row_records(0, arms), ran, verdict, *row.records), 0)
    assert receipt.status == "failed" and receipt.reason == "correctness_report_refused"
    assert [(o.arm, o.status, o.reason) for o in receipt.observations] == [
        (arm.arm, "skipped", "correctness failed-or-incomplete: baselines skipped") for arm in arms
    ]
    [topology] = receipt.correctness.topologies
    assert topology.status == "refused" and topology.refusal_codes == ("handoff.model_id",)
    assert topology.evidence_dir == "cell-0000/correctness/topology-00"
    assert receipt.lifecycle == ("correctness", "finalize", "done")


def test_row_with_a_drifted_arm_is_incomplete() -> None:
    cells = [serial_cell().happy(), CellScript().happy(drift=True)]
    arms = [ArmPlan(arm="native-serial"), ArmPlan(arm="native-concurrent")]
    receipt = fold_row(journal(*row_with(cells, arms)), 0)
    assert receipt.status == "incomplete"
    assert not receipt.observations[1].accepted_for_parity
    assert receipt.observations[1].reason == "pin_drift"
    # The row says why it fell short: its first arm that did not complete.
    assert receipt.reason == "pin_drift"


def test_a_completed_row_has_no_reason() -> None:
    cells = [serial_cell().happy(), CellScript().happy()]
    arms = [ArmPlan(arm="native-serial"), ArmPlan(arm="native-concurrent")]
    assert fold_row(journal(*row_with(cells, arms)), 0).reason is None


def test_an_incomplete_row_takes_its_first_shortfall_as_its_reason() -> None:
    """The first planned arm that did not complete names the row's reason, also when that cell
    recorded no fault (a cancelled cell; a rung reported incomplete without a fault)."""
    cancelled = _ladder_started(CellScript())
    cancelled.request(0, 0)
    cancelled.rows_done(0)
    cancelled.cancel()
    cancelled.cleanup()
    cells = [serial_cell().happy(), cancelled]
    arms = [ArmPlan(arm="native-serial"), ArmPlan(arm="native-concurrent")]
    receipt = fold_row(journal(*row_with(cells, arms)), 0)
    assert fault_kinds(fold(cancelled)) == []
    assert receipt.status == "incomplete" and receipt.reason == "cancelled"

    short = _ladder_started(CellScript())
    short.ladder()
    short_records = [
        msgspec.structs.replace(r, status="incomplete")
        if isinstance(r, RungCompleted) and r.rung_index == 1
        else r
        for r in short.records
    ]
    short.records[:] = short_records
    short.pins("after")
    short.fire(CellEvent.PINS_VERIFIED)
    short.cleanup()
    assert fault_kinds(fold(short)) == []
    receipt = fold_row(journal(*row_with([serial_cell().happy(), short], arms)), 0)
    assert receipt.status == "incomplete" and receipt.reason == "measurement_incomplete"
    assert receipt.observations[1].reason == "measurement_incomplete"

    # A failed first arm is named before a later drifted one.
    failed = CellScript(cell_id="cell-0000/native-serial", arm="native-serial").open()
    failed.launch()
    failed.fault("readiness_failed", "GET /health never returned ok")
    failed.cleanup()
    cells = [failed, CellScript().happy(drift=True)]
    receipt = fold_row(journal(*row_with(cells, arms)), 0)
    assert receipt.status == "failed" and receipt.reason == "readiness_failed"


def test_missing_model_row() -> None:
    receipt = fold_row(
        journal(*row_with([], [ArmPlan(arm="native-serial")], model_status="missing-model")), 0
    )
    assert receipt.status == "missing-model" and receipt.final_state == "finalize"
    assert receipt.correctness == CorrectnessObservation(status="not-run", reason="missing-model")


def test_cancelled_before_any_cell_is_not_launched() -> None:
    records = row_with(
        [],
        [ArmPlan(arm="native-serial"), ArmPlan(arm="native-concurrent")],
        stop=Cancellation(cell_id=None, signal="SIGINT"),
    )
    receipt = fold_row(journal(*records), 0)
    assert receipt.status == "not-launched" and receipt.reason == "cancellation_or_deadline"
    assert receipt.terminal_refusal == "cancelled"
    assert {o.status for o in receipt.observations} == {"not-launched"}


def test_late_run_wide_cancel_downgrades_the_row_not_the_finished_cell() -> None:
    serial = serial_cell().happy()
    serial.fire(CellEvent.RECEIPT_PUBLISHED)
    records = row_with(
        [serial], [ArmPlan(arm="native-serial"), ArmPlan(arm="native-concurrent")], finish_row=False
    )
    records.append(Cancellation(cell_id=None, signal="SIGTERM"))
    receipt = fold_row(journal(*records), 0)
    assert receipt.observations[0].status == "completed"
    assert receipt.observations[1].status == "not-launched"
    assert receipt.status == "incomplete" and receipt.terminal_refusal == "cancelled"


@pytest.mark.parametrize(
    ("from_state", "event", "to_state"),
    [("finalize", "model-missing", "done"), ("finalize", "teleport", "done")],
)
def test_a_row_transition_the_table_refuses_leaves_the_row_incomplete(
    from_state: str, event: str, to_state: str
) -> None:
    records = row_with([serial_cell().happy()], [ArmPlan(arm="native-serial")])
    bogus = Transition(
        machine="row", row_index=0, from_state=from_state, event=event, to_state=to_state
    )
    receipt = fold_row(journal(*records, bogus), 0)
    assert receipt.status == "incomplete" and receipt.reason == "journal_transition_invalid"
    assert receipt.final_state == "finalize"
    assert fold_row(journal(*records), 0).status == "completed"


def test_row_journal_that_stops_early_is_incomplete() -> None:
    cells = [serial_cell().happy()]
    receipt = fold_row(
        journal(*row_with(cells, [ArmPlan(arm="native-serial")], finish_row=False)), 0
    )
    assert receipt.status == "incomplete" and receipt.reason == "journal_ended_before_finalize"


def test_row_fold_reads_only_its_view() -> None:
    cells = [serial_cell().happy(), CellScript().happy()]
    records = row_with(cells, [ArmPlan(arm="native-serial"), ArmPlan(arm="native-concurrent")])
    other = CellScript(cell_id="cell-0001/native-concurrent", row_index=1).happy().records
    lines = journal(*records, *other)
    index = JournalIndex(lines)
    assert len(index.lines_for_row(0)) < len(lines)
    assert encode_receipt(
        fold_row(index.lines_for_row(0), 0, through_seq=lines[-1].seq)
    ) == encode_receipt(fold_row(lines, 0))
    index.forget_row(0)
    assert index.lines_for_cell("cell-0000/native-serial") == index.lines_for_cell("nope")
    with pytest.raises(Refused) as refused:
        fold_row(lines, 7)
    assert refused.value.codes == ["fold.row.unknown"]


def test_identity_records_route_to_their_views() -> None:
    script = CellScript().happy()
    lines = journal(*script.records)
    index = JournalIndex(lines)
    cell_lines = index.lines_for_cell(script.cell_id)
    assert isinstance(cell_lines[1].record, CellOpened)
    assert sum(isinstance(line.record, RungRows) for line in cell_lines) == 2
    assert "cells=1" in repr(index)


# --- synthetic evidence ---------------------------------------------------------------------------


def synthetic_run(
    *, catalog: bool, row: bool, cell: bool, second_cell: bool | None = None
) -> tuple[JournalLine, ...]:
    """A completed row with a serial and a concurrent cell; who is flagged synthetic is chosen
    (``second_cell`` defaults to ``cell``)."""
    cells = [
        serial_cell(synthetic=cell).happy(),
        CellScript(synthetic=cell if second_cell is None else second_cell).happy(),
    ]
    records = row_with(cells, [ArmPlan(arm="native-serial"), ArmPlan(arm="native-concurrent")])
    opened = records[0]
    assert isinstance(opened, RowOpened)
    records[0] = msgspec.structs.replace(opened, synthetic=row)
    return journal(*records, synthetic_catalog=catalog)


def test_receipts_of_a_real_catalog_carry_no_synthetic_label() -> None:
    lines = synthetic_run(catalog=False, row=False, cell=False)
    cell = fold_cell(lines, "cell-0000/native-serial")
    row = fold_row(lines, 0)
    assert (cell.synthetic, cell.evidence_class) == (False, None)
    assert (row.synthetic, row.evidence_class) == (False, None)
    # New members go last, after every member older readers know.
    for receipt, later in (
        (cell, []),
        (row, ["parity", "observation_order", "producer_report_row", "promotion"]),
    ):
        published = list(json.loads(encode_receipt(receipt)))
        assert published[-2 - len(later) :] == ["synthetic", "evidence_class", *later]
    matrix = fold_matrix(JournalIndex(lines), through_seq=lines[-1].seq)
    assert matrix.scope == MATRIX_SCOPE and SYNTHETIC_EVIDENCE_CLASS not in matrix.scope
    assert matrix.catalog == MatrixCatalog(
        path="/pkg/catalog.json", sha256="2" * 64, synthetic=False, packaged=True
    )
    assert [r.synthetic for r in matrix.rows] == [False]
    assert list(json.loads(encode_matrix(matrix)))[-6:] == [
        "catalog",
        "report_error",
        "report",
        "report_input",
        "client_calibration",
        "client_calibration_error",
    ]


def test_a_synthetic_catalog_labels_every_receipt_level() -> None:
    lines = synthetic_run(catalog=True, row=True, cell=True)
    cells = [fold_cell(lines, c) for c in ("cell-0000/native-serial", CellScript().cell_id)]
    row = fold_row(lines, 0)
    for receipt in (*cells, row):
        assert receipt.status == "completed"  # the label never changes a verdict
        assert receipt.synthetic and receipt.evidence_class == SYNTHETIC_EVIDENCE_CLASS
        published = json.loads(encode_receipt(receipt))
        assert published["synthetic"] is True
        assert published["evidence_class"] == SYNTHETIC_EVIDENCE_CLASS
    matrix = fold_matrix(JournalIndex(lines), through_seq=lines[-1].seq)
    assert matrix.scope == MATRIX_SCOPE_SYNTHETIC and SYNTHETIC_EVIDENCE_CLASS in matrix.scope
    assert matrix.catalog == MatrixCatalog(
        path="/zoo/catalog.json", sha256="2" * 64, synthetic=True, packaged=False
    )
    assert [r.synthetic for r in matrix.rows] == [True]
    assert json.loads(encode_matrix(matrix))["rows"][0]["synthetic"] is True


@pytest.mark.parametrize(
    ("catalog", "row", "cell"),
    [(True, False, False), (False, True, False), (False, False, True), (False, True, True)],
)
def test_the_synthetic_label_is_only_ever_added(catalog: bool, row: bool, cell: bool) -> None:
    """Any one source (catalog, row_opened, cell_opened) labels what it reaches: the catalog
    every level, a row its row and matrix entry, a cell its own receipt, its row and entry."""
    lines = synthetic_run(catalog=catalog, row=row, cell=cell)
    receipt = fold_cell(lines, "cell-0000/native-serial")
    assert receipt.synthetic == (catalog or cell)
    assert receipt.evidence_class == (SYNTHETIC_EVIDENCE_CLASS if catalog or cell else None)
    row_receipt = fold_row(lines, 0)
    assert row_receipt.synthetic and row_receipt.evidence_class == SYNTHETIC_EVIDENCE_CLASS
    matrix = fold_matrix(JournalIndex(lines), through_seq=lines[-1].seq)
    assert [r.synthetic for r in matrix.rows] == [True]
    assert matrix.scope == MATRIX_SCOPE_SYNTHETIC
    assert matrix.catalog is not None and matrix.catalog.synthetic == catalog


def test_one_synthetic_cell_labels_its_row_but_not_its_sibling_cell() -> None:
    lines = synthetic_run(catalog=False, row=False, cell=True, second_cell=False)
    assert fold_cell(lines, "cell-0000/native-serial").synthetic
    assert not fold_cell(lines, CellScript().cell_id).synthetic
    assert fold_row(lines, 0).synthetic


def test_a_journal_from_before_the_label_folds_unlabelled() -> None:
    """Records written before the fields existed decode with their defaults: not synthetic."""
    older = RowOpened(row_index=0, row_key="k", case_key="c", arms=(ArmPlan(arm="native-serial"),))
    script = serial_cell().happy()
    row = RowScript(0)
    row.pass_correctness()
    row.fire(RowEvent.ARM_FINISHED)
    row.fire(RowEvent.ARMS_EXHAUSTED)
    lines = journal(older, *script.records, *row.records)
    assert not fold_row(lines, 0).synthetic
    matrix = fold_matrix(JournalIndex(lines), through_seq=lines[-1].seq)
    assert matrix.scope == MATRIX_SCOPE and not matrix.rows[0].synthetic


# --- the lattice ----------------------------------------------------------------------------------


def test_measured_chain_order() -> None:
    assert MEASURED_CHAIN == ("refused", "failed", "incomplete", "completed")
    assert meet("completed", "incomplete") == "incomplete"
    assert meet("failed", "refused") == meet("refused", "failed") == "refused"
    for a, b in itertools.product(MEASURED_CHAIN, repeat=2):
        m = meet(a, b)
        assert may_follow(a, m) and may_follow(b, m)
        assert meet(a, b) == meet(b, a)
        assert meet(m, a) == m


def test_unmeasured_statuses_are_fixed_points() -> None:
    for status in UNMEASURED:
        assert terminal_downgrade(status) == status
        assert meet(status, "failed") == status
        assert may_follow(status, status) and not may_follow(status, "completed")
        with pytest.raises(Refused) as refused:
            meet("completed", status)
        assert refused.value.codes == ["receipt.downgrade.unmeasured"]
    assert set(ALL_STATUSES) == set(MEASURED_CHAIN) | UNMEASURED


def test_terminal_downgrade_never_raises() -> None:
    assert terminal_downgrade("completed") == "incomplete"
    assert terminal_downgrade("incomplete") == "incomplete"
    assert terminal_downgrade("failed") == "failed"
    assert not may_follow("incomplete", "completed")


def test_rows_past_the_inline_limit_move_to_the_rows_file_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Six rows stay inline at a limit of six (read through the rows source); at five, the
    receipt names the rows file by its last ``rung_rows`` record, reads no row, and nothing
    else in the receipt changes."""
    script = CellScript().happy()  # rungs of 2 and 4 requests
    lines = journal(*script.records)
    monkeypatch.setattr(request_rows, "INLINE_ROWS_MAX", 6)
    inline = fold_cell(lines, script.cell_id, rows=script.rows_source)
    assert inline.measurement.rows_file is None
    assert [(x.rung_index, x.concurrency, x.row) for x in script.lines] == sorted(
        (
            (rung.rung_index, rung.concurrency, row)
            for rung in inline.measurement.rungs
            for row in rung.rows
        ),
        key=lambda x: (x[0], x[2].request_id),
    )
    monkeypatch.setattr(request_rows, "INLINE_ROWS_MAX", 5)

    def unread(segments: object) -> list[request_rows.RequestRowLine]:
        raise AssertionError("a receipt that names its rows file reads none of them")

    moved = fold_cell(lines, script.cell_id, rows=unread)
    rows_file = moved.measurement.rows_file
    assert rows_file is not None and rows_file.path == request_rows.REQUESTS_FILENAME
    assert (rows_file.count, rows_file.sha256) == request_rows.rows_digest(script.lines)
    stripped = msgspec.structs.replace(
        inline.measurement,
        rungs=tuple(msgspec.structs.replace(r, rows=()) for r in inline.measurement.rungs),
        rows_file=rows_file,
    )
    assert moved == msgspec.structs.replace(inline, measurement=stripped)
    assert fold_cell(lines, script.cell_id) == moved


def test_what_a_fault_lowers_to_is_the_tables_on_fault_column(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fold reads the state's ``on_fault`` column, not a list of its own: a table saying a
    fault in launch leaves the cell incomplete folds a launch fault that way, and a table
    saying no state is finished folds every receipt as ended too early."""
    script = CellScript().open()
    script.launch()
    script.fault("readiness_failed", "exit status 1")
    script.cleanup()
    assert fold(script).status == "failed"
    policies = dict(CELL_TABLE.policies)
    policies[CellState.LAUNCH] = StatePolicy(on_fault="incomplete")
    monkeypatch.setattr(cell_fold_module, "CELL_TABLE", replace(CELL_TABLE, policies=policies))
    assert fold(script).status == "incomplete"
    unfinished = {s: replace(CELL_TABLE.policy(s), finished=False) for s in CELL_TABLE.states}
    monkeypatch.setattr(cell_fold_module, "CELL_TABLE", replace(CELL_TABLE, policies=unfinished))
    kinds = [f.kind for f in fold(serial_cell().happy()).faults]
    assert "journal_ended_before_finalize" in kinds
