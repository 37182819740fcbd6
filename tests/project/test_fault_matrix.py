"""The fault matrix: one fault in one state per cell, each with the receipt it must leave.

Every cell is a real ``cache-family run`` process. Its host is either the FAULT-INJECTION
host ``tests/support/fake_hosts/fake_run_llama_server.py`` (a real child process speaking
llama-server's HTTP; it tells the test through a FIFO when a streamed request arrived, so each
fault lands at a known point without sleeping) or the real ``llama-server`` with the tiny
model zoo (marked native). After each fault the test checks, from the files alone: the run's
exit code, the matrix, row and faulted cell receipts (status, terminal refusal), that the
faulted cell is refused for parity, that no observation was lost (every request row the
cell's ``rung_rows`` records journal is in its ``cell.json``, and a completed earlier cell stays
completed), that no journaled process is left and every journaled port is free, and what
``cache-family replay`` says.

``docs/fault-matrix.md`` is generated from :data:`CELLS` (``just fault-matrix-doc``, which
runs this file as a script); a test checks the checked-in document matches the table.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio
from run_harness import make_prepared
from signal_harness import (
    Fifo,
    assert_no_orphan_and_ports_free,
    behave,
    logs_dir,
    poll_journal_until,
    start_run,
    wait_exit,
)

from cache_family.actors.audit.replay import replay
from cache_family.schemas import request_rows
from cache_family.schemas.journal import CellOpened, ChildSpawned, RungRows, read_journal
from cache_family.schemas.matrix import MATRIX_FILENAME, decode_matrix
from cache_family.schemas.receipts import decode_cell_receipt, decode_row_receipt

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "fault-matrix.md"
FAKE = "fault-injection host"
REAL_RUN_BOUND_S = 600
REAL = "real llama-server"


@dataclass(frozen=True)
class FaultCell:
    """One fault in one state and the receipt it must leave (what the document shows)."""

    key: str
    fault: str
    state: str
    host: str
    exit_code: int
    matrix_status: str | None  # None: no matrix is published (the runner itself died)
    terminal_refusal: str | None
    cell: str  # the faulted cell's directory under cell-0000/
    cell_status: str
    faults: tuple[str, ...]  # fault kinds the faulted receipt must hold (a row: its reason)
    cleanup: str  # see ``cleanup_words``
    kept: str  # which observations survive, in words
    replay: str  # identical | unfinished, then --reap


CELLS: tuple[FaultCell, ...] = (
    FaultCell(
        key="host-sigkill-mid-ladder",
        fault="host killed with SIGKILL (kill -9)",
        state="concurrent ladder, a streamed request in the host",
        host=FAKE,
        exit_code=1,
        matrix_status="incomplete",
        terminal_refusal=None,
        cell="sweep-native-concurrent",
        cell_status="incomplete",
        faults=("request_failed",),  # an exit, not a swap: no host_identity_changed
        cleanup="found dead (exit -9)",
        kept="serial cell completed; every journaled request row of the ladder",
        replay="identical",
    ),
    FaultCell(
        key="host-sigstop-mid-ladder",
        fault="host stopped with SIGSTOP",
        state="concurrent ladder, a streamed request in the host",
        host=FAKE,
        exit_code=1,
        matrix_status="incomplete",
        terminal_refusal=None,
        cell="sweep-native-concurrent",
        cell_status="incomplete",
        faults=("request_timeout", "cleanup_forced"),
        cleanup="forced (SIGKILL after the grace)",
        kept="serial cell completed; every journaled request row of the ladder",
        replay="identical",
    ),
    FaultCell(
        key="runner-sigint-mid-ladder",
        fault="runner gets SIGINT",
        state="concurrent ladder, a streamed request in the host",
        host=FAKE,
        exit_code=130,
        matrix_status="incomplete",
        terminal_refusal="cancelled",
        cell="sweep-native-concurrent",
        cell_status="incomplete",
        faults=(),
        cleanup="graceful (SIGTERM)",
        kept="serial cell completed; every journaled request row of the ladder",
        replay="identical",
    ),
    FaultCell(
        key="runner-sigterm-host-ignores-sigterm",
        fault="runner gets SIGTERM; the host ignores SIGTERM",
        state="concurrent ladder, a streamed request in the host",
        host=FAKE,
        exit_code=130,
        matrix_status="incomplete",
        terminal_refusal="cancelled",
        cell="sweep-native-concurrent",
        cell_status="incomplete",
        faults=(),
        cleanup="forced (SIGKILL after the grace)",
        kept="serial cell completed; every journaled request row of the ladder",
        replay="identical",
    ),
    FaultCell(
        key="runner-sigkill-mid-ladder",
        fault="runner killed with SIGKILL (kill -9)",
        state="concurrent ladder, a streamed request in the host",
        host=FAKE,
        exit_code=-9,
        matrix_status=None,
        terminal_refusal=None,
        cell="sweep-native-concurrent",
        cell_status="(no receipt: the runner died)",
        faults=(),
        cleanup="reaped",
        kept="serial cell completed; the journal up to the kill",
        replay="unfinished (exit 1), then replay --reap ends the orphaned host",
    ),
    FaultCell(
        key="server-binary-changed-before-launch",
        fault="server binary changed on disk",
        state="after preparation, before the run",
        host=FAKE,
        exit_code=1,
        matrix_status="failed",
        terminal_refusal=None,
        cell="native-serial",
        cell_status="failed",
        faults=("pin_drift", "pin_mismatch"),
        cleanup="never launched",
        kept="the drift (expected and observed SHA-256) in the cell receipt",
        replay="identical",
    ),
    FaultCell(
        key="model-changed-before-launch",
        fault="model file changed on disk",
        state="after preparation, before the run",
        host=FAKE,
        exit_code=1,
        matrix_status="incomplete",
        terminal_refusal=None,
        cell="row",
        cell_status="incomplete",
        faults=("pin_mismatch",),
        cleanup="never launched",
        kept="correctness not run, both baselines skipped: nothing measured on changed bytes",
        replay="identical",
    ),
    FaultCell(
        key="real-host-sigkill",
        fault="host killed with SIGKILL (kill -9)",
        state="concurrent cell's host just spawned (before its ladder ends)",
        host=REAL,
        exit_code=1,
        matrix_status="failed or incomplete",
        terminal_refusal=None,
        cell="sweep-native-concurrent",
        cell_status="failed or incomplete",
        faults=(),
        cleanup="found dead (exit -9)",
        kept="serial cell completed; every journaled request row of the ladder",
        replay="identical",
    ),
    FaultCell(
        key="real-host-sigstop",
        fault="host stopped with SIGSTOP",
        state="concurrent cell's host just spawned (before its ladder ends)",
        host=REAL,
        exit_code=1,
        matrix_status="failed or incomplete",
        terminal_refusal=None,
        cell="sweep-native-concurrent",
        cell_status="failed or incomplete",
        faults=("cleanup_forced",),
        cleanup="forced (SIGKILL after the grace)",
        kept="serial cell completed; every journaled request row of the ladder",
        replay="identical",
    ),
    FaultCell(
        key="real-model-changed-before-launch",
        fault="model file changed on disk",
        state="after preparation, before the run",
        host=REAL,
        exit_code=1,
        matrix_status="incomplete",
        terminal_refusal=None,
        cell="row",
        cell_status="incomplete",
        faults=("pin_mismatch",),
        cleanup="never launched",
        kept="correctness not run, both baselines skipped: nothing measured on changed bytes",
        replay="identical",
    ),
)


@dataclass(frozen=True)
class InputFault:
    """A malformed or hostile input a command reads and the typed verdict it must end in
    (never a traceback); ``test`` names the test that holds it."""

    key: str
    input: str
    command: str
    exit_code: int
    verdict: str
    test: str  # tests/FILE.py::FUNCTION


INPUT_FAULTS: tuple[InputFault, ...] = (
    InputFault(
        key="report-integer-5000-digits",
        input="an integer literal of 5,000 digits (past the 4,300 int() converts)",
        command="`report --input`, `report --use-case-corpus`",
        exit_code=2,
        verdict="report.json naming the file",
        test="tests/report/test_report_refusals.py::test_a_corpus_with_an_integer_of_5000_digits_is_refused",
    ),
    InputFault(
        key="report-run-integer-5000-digits",
        input="an integer literal of 5,000 digits in a cell.json",
        command="`report-run`",
        exit_code=2,
        verdict="report.json naming the cell.json",
        test="tests/report/test_report_run.py::test_an_integer_of_5000_digits_in_a_cell_receipt_is_refused",
    ),
    InputFault(
        key="report-run-production-integer-5000-digits",
        input="an integer literal of 5,000 digits in the production rows",
        command="`report-run --production`",
        exit_code=2,
        verdict="report.json naming the file",
        test="tests/report/test_report_run.py::"
        "test_an_integer_of_5000_digits_in_the_production_rows_is_refused",
    ),
    InputFault(
        key="every-reader-integer-5000-digits",
        input="an integer literal of 5,000 digits (also in the fuzz mutations)",
        command="operator, prepared input, corpus and report readers",
        exit_code=2,
        verdict="each reader's typed refusal",
        test="tests/project/test_fuzz_long.py::"
        "test_an_integer_of_5000_digits_ends_in_typed_refusals_for_every_reader",
    ),
    InputFault(
        key="operator-amplifying-mebibyte",
        input="1 MiB: ~900 toolkit_directories entries of 115 unknown members",
        command="`validate`",
        exit_code=2,
        verdict="one operator.json.too_many_values (was 130,000 refusals, 20 MB, 230 MB)",
        test="tests/schemas/test_input_bounds.py::"
        "test_the_amplifying_mebibyte_is_one_refusal_in_bounded_memory",
    ),
    InputFault(
        key="operator-one-mistake-repeated",
        input="30 toolkit entries of 100 unknown members (under the values bound)",
        command="`validate`",
        exit_code=2,
        verdict="8 of each code under each top-level member, then operator.more_refusals "
        "with the count",
        test="tests/schemas/test_input_bounds.py::"
        "test_one_mistake_repeated_is_listed_a_few_times_with_a_count",
    ),
    InputFault(
        key="report-run-cell-receipt-deleted",
        input="a cell.json the row receipt names, deleted",
        command="`report-run`",
        exit_code=2,
        verdict="report.receipt: the cell receipt is missing (the arm was dropped, exit 0)",
        test="tests/report/test_report_run.py::"
        "test_a_missing_cell_receipt_is_refused_and_a_path_outside_is_refused",
    ),
    InputFault(
        key="report-run-nan-in-receipt",
        input="NaN, Infinity or -Infinity in a cell.json",
        command="`report-run`",
        exit_code=2,
        verdict="report.json (was printed as nan)",
        test="tests/report/test_report_run.py::test_nan_or_infinity_in_a_receipt_is_refused_not_printed",
    ),
    InputFault(
        key="report-corpus-without-use-cases",
        input="a corpus of `{}`",
        command="`report --use-case-corpus`",
        exit_code=2,
        verdict="report.missing_field at $.use_cases",
        test="tests/report/test_report_refusals.py::test_a_malformed_corpus_is_refused",
    ),
    InputFault(
        key="validate-json-path-refused",
        input="a refused path argument (e.g. a trailing slash)",
        command="`validate --json`",
        exit_code=2,
        verdict="the JSON verdict on stdout (was nothing)",
        test="tests/console/test_cli_validate.py::test_a_path_refused_with_json_is_a_json_verdict_on_stdout",
    ),
    InputFault(
        key="empty-path-argument",
        input='`--input ""` (any path argument)',
        command="`validate`, `report`, `run`, `report-run`",
        exit_code=2,
        verdict="cli.path.empty (was read as the current directory)",
        test="tests/console/test_cli.py::test_a_path_argument_is_refused_with_its_own_code",
    ),
    InputFault(
        key="workload-day-at-100000-per-second",
        input="an open_loop of 100,000/s for 86,400 s (8.64e9 sends)",
        command="`prepare-full --workloads`",
        exit_code=2,
        verdict="workload.arrivals.too_many_sends (was prepared, then 24 GB at run time); send "
        "times are drawn lazily and a schedule holds at most 100,000",
        test="tests/schemas/test_workload_schema.py::test_each_mistake_is_refused_with_its_code_and_path",
    ),
    InputFault(
        key="workloads-path-escapes",
        input="`--workloads` (or `--use-case-corpus`) with terminal escapes, a trailing slash "
        "or `..`",
        command="`prepare-full`, `prepare-use-cases`",
        exit_code=2,
        verdict="cli.path.bad_char / cli.path.trailing_slash as `--input`; admission: "
        "preparation.override.bad_path (shown escaped) / preparation.override.not_normalized",
        test="tests/prepare/test_preparation.py::test_overrides_are_pairs_each_once_and_known",
    ),
)


@dataclass(frozen=True)
class CheckedElsewhere:
    """A fault whose regression test lives beside the code it checks (not a full run here)."""

    key: str
    fault: str
    state: str
    outcome: str
    test: str  # tests/FILE.py::NAME


ELSEWHERE: tuple[CheckedElsewhere, ...] = (
    CheckedElsewhere(
        key="help-probe-daemon",
        fault="the stage server's `--help` starts `sleep 1000 &`",
        state="pin-verify: the help probe that reads the dialect",
        outcome="the probe is a child in custody (own group, the cell's tag, journaled as "
        "`child_spawned` role `help_probe`): the daemon is ended with its group; the cell "
        "relying on the probe is failed (`help_probe_unclean`)",
        test="tests/run/test_stage_help_probe.py::"
        "test_a_help_probe_that_starts_a_daemon_leaves_nothing_and_the_cell_is_faulted",
    ),
    CheckedElsewhere(
        key="help-probe-swap",
        fault="the operator's stage binary swapped after the pre-probe check, restored after",
        state="pin-verify: the help probe that reads the dialect",
        outcome="the probe runs the row's private pinned copy: the swapped program never "
        "answers, the dialect is the pinned bytes'",
        test="tests/run/test_stage_help_probe.py::"
        "test_a_swap_of_the_operators_binary_around_the_probe_is_never_what_answers",
    ),
    CheckedElsewhere(
        key="model-flip-restore-in-cell",
        fault="a model byte flipped and restored (every hash matches)",
        state="serial ladder, between pin-verify and post-verify",
        outcome="the watch (inotify) saw it: the cell is incomplete with `pin_drift` at "
        "post-verify and refused for parity; replay identical",
        test="tests/system/test_pin_watch.py::test_a_model_flipped_and_restored_during_a_cell_is_drift",
    ),
    CheckedElsewhere(
        key="model-flip-restore-in-correctness",
        fault="a model byte flipped and restored (every hash matches)",
        state="correctness arm, while the tool runs",
        outcome="the correctness gate fails (`pin_drift: model ...`), the baselines are "
        "skipped, the row is not completed; replay identical",
        test="tests/system/test_pin_watch.py::"
        "test_a_model_flipped_and_restored_during_correctness_fails_the_gate",
    ),
    CheckedElsewhere(
        key="output-parent-flipped",
        fault="the `--output` parent flipped to a symlink into the native build",
        state="`run` start: after admission, before the run directory is made",
        outcome="exit 2, `run.output_parent`; nothing is created in the build, nothing runs",
        test="tests/run/test_output_placement.py::"
        "test_a_parent_flipped_into_the_build_after_admission_gets_no_run_directory",
    ),
    CheckedElsewhere(
        key="output-parent-flipping",
        fault="the `--output` parent flipping between a directory and a symlink into the build",
        state="`run` start, 40 tries against a flipping thread",
        outcome="each try makes its run directory in the real directory or exits 2 with a "
        "typed refusal (a link flipped while resolved: `run.output_parent`); none lands in "
        "the build, no traceback",
        test="tests/run/test_output_placement.py::test_an_output_parent_flipping_between_a_"
        "directory_and_a_link_never_lands_in_the_build",
    ),
    CheckedElsewhere(
        key="output-parent-flipped-after-the-run-directory",
        fault="the `--output` parent flipped to a link into the build (an empty `NATIVE/out` "
        "made beforehand) after the run directory was made",
        state="`run` start: before the journal and the lock are opened",
        outcome="every write goes through the directory handle opened when the directory was "
        "made (`/proc/<runner>/fd/<n>`): the run completes in the real directory, nothing "
        "lands in the build, replay identical",
        test="tests/run/test_output_placement.py::test_a_parent_flipped_into_the_build_after_"
        "the_run_directory_is_made_moves_no_write",
    ),
    CheckedElsewhere(
        key="workload-send-times-lazy",
        fault="an open-loop rate whose duration would schedule more than 100,000 sends (a "
        "sweep's measured rate)",
        state="an open-loop stage drawing its schedule",
        outcome="send times drawn one at a time; the schedule stops at 100,000 (memory "
        "independent of duration x rate); the same schedules as before",
        test="tests/states/test_workload_planning.py::test_send_times_are_drawn_lazily_and_"
        "a_schedule_never_holds_more_than_the_bound",
    ),
)


# --- faults at a run's edges: its exit, its directory, its audit ------------------------------


@dataclass(frozen=True)
class EdgeFault:
    """A fault outside any one cell, the outcome it must leave, and the test that injects it
    (``tests/FILE::TEST``; the document's table is generated from these)."""

    key: str
    fault: str
    moment: str
    outcome: str
    test: str


EDGES: tuple[EdgeFault, ...] = (
    EdgeFault(
        key="signal-after-the-last-line",
        fault="runner gets SIGTERM or SIGINT",
        moment="after the seal and the last printed line, while the process exits",
        outcome="exit 130 (never -15 / -2); receipts and journal unchanged; no `--resume` "
        "suggested; replay identical",
        test="tests/run/test_run_signals.py::test_a_signal_after_the_last_line_still_exits_130_and_"
        "changes_no_receipt",
    ),
    EdgeFault(
        key="signal-after-the-rows-before-the-fold",
        fault="runner gets SIGTERM",
        moment="every row ended, the matrix not folded yet",
        outcome="exit 130; matrix completed and sealed; closing lines say nothing is left to "
        "resume",
        test="tests/run/test_run_signals.py::test_a_signal_after_the_rows_before_the_fold_exits_130_and_"
        "changes_no_receipt",
    ),
    EdgeFault(
        key="second-writer-of-a-run-directory",
        fault="a second `run --resume` (or `replay --reap`) while one holds the run",
        moment="a killed run being resumed",
        outcome="exit 2, `run.locked` naming the holder's pid; nothing written; a holder "
        "killed with SIGKILL leaves no stale lock",
        test="tests/run/test_run_resume.py::test_a_second_writer_of_a_run_directory_is_refused_naming_"
        "the_holder",
    ),
    EdgeFault(
        key="forged-child-record",
        fault="a re-chained `child_spawned` record names an unrelated process",
        moment="`replay --reap` of a killed run",
        outcome="the process and its descendants are left alone (no run tag); the run's own "
        "tagged host is ended",
        test="tests/audit/test_replay.py::test_reap_never_ends_a_process_a_forged_record_names",
    ),
    EdgeFault(
        key="reap-of-an-unverified-journal",
        fault="head other than `--expect-head`, or an edited line",
        moment="`replay --reap`",
        outcome="`replay.reap.unverified`; no process is signalled; exit 1",
        test="tests/audit/test_replay.py::test_reap_refuses_a_journal_whose_head_is_not_the_expected_one",
    ),
    EdgeFault(
        key="evidence-file-edited",
        fault="`state-handoff.json`, `stage.json` or a log edited, removed, planted or linked",
        moment="after the run",
        outcome="exit 1, `replay.file.changed` / `replay.file.missing` / "
        "`replay.file.unbound` (a journal without `run_files`: said so, receipts checked)",
        test="tests/audit/test_replay.py::test_an_evidence_file_no_receipt_names_is_bound_by_the_journal",
    ),
    EdgeFault(
        key="report-file-edited-without-report-md",
        fault="`report.md` deleted and `report.html` or a plot edited, or a plot planted",
        moment="after `report-run`",
        outcome="exit 1: every report file regenerated and compared (`file.missing`, "
        "`replay.report.unlisted`); `report-files.json` binds their SHA-256",
        test="tests/audit/test_replay.py::test_report_run_files_are_all_compared_even_without_report_md",
    ),
    EdgeFault(
        key="forged-journal-names-a-live-runs-tag",
        fault="a killed run's journal re-chained with a live run's `child_spawned` tag (and "
        "its run id)",
        moment="`replay --reap` while the other run lives",
        outcome="nothing is ended: a host's tag names its run and runner; the reaper ends only "
        "a host whose tag names the verified journal's run whose runner is gone",
        test="tests/audit/test_reap_live_runs.py::"
        "test_a_forged_journal_naming_a_live_runs_tag_ends_nothing",
    ),
    EdgeFault(
        key="reap-of-a-locked-runs-host",
        fault="a host whose runner is gone, in a run directory another process holds locked",
        moment="`replay --reap` of another journal naming it",
        outcome="left alone (a live resume's or reap's run); once unlocked, its own run's "
        "journal reaps it",
        test="tests/audit/test_reap_live_runs.py::"
        "test_a_host_of_a_run_whose_directory_is_locked_is_left_alone",
    ),
    EdgeFault(
        key="signal-while-the-last-line-is-flushed",
        fault="runner gets SIGTERM while its last line is flushed (a worker thread alive)",
        moment="after the seal, in the exit window",
        outcome="exit 130 (was 0: the signal went to a worker thread after the last look); "
        "no traceback",
        test="tests/system/test_interrupts.py::test_a_signal_while_the_last_line_is_flushed_exits_130",
    ),
    EdgeFault(
        key="signal-in-trios-teardown",
        fault="SIGTERM after trio closed its wakeup socket's read end",
        moment="trio's teardown, 0.2-0.3 ms after the seal",
        outcome="the latch records it; no `BrokenPipeError` on the signal wakeup fd (released "
        "as the supervisor returns)",
        test="tests/system/test_interrupts.py::"
        "test_a_signal_in_trios_teardown_reaches_the_latch_without_a_broken_pipe",
    ),
    EdgeFault(
        key="campaign-file-edited",
        fault="`local-cluster.json` (127.0.0.1 made 10.0.0.1), `campaign-request.json` or "
        "`rows/row-0000.log` edited; a top-level file or a row directory planted",
        moment="after the campaign",
        outcome="exit 1 with or without `--expect-head`: `replay.file.changed` / "
        "`replay.file.unbound` (bound by the merge's `campaign_files` record)",
        test="tests/campaign/test_campaign_files.py::test_an_edit_of_the_campaigns_own_files_differs",
    ),
    EdgeFault(
        key="campaign-sigint-during-cluster-start",
        fault="SIGINT while the local Ray cluster starts",
        moment="`campaign --ray local`, the head starting",
        outcome="acted on at the next step (was 21.5 s later): no node more, no row submitted; "
        "every row cancelled; exit 130",
        test="tests/campaign/test_campaign_signals.py::"
        "test_a_sigint_during_the_cluster_start_up_starts_no_node_and_submits_no_row",
    ),
    EdgeFault(
        key="campaign-signal-after-every-row",
        fault="SIGINT after every row ended",
        moment="`campaign`, before the merge",
        outcome="exit 130; says no row was cancelled and the matrix's status (was: the rows "
        "were cancelled)",
        test="tests/campaign/test_campaign_signals.py::"
        "test_a_signal_after_every_row_ended_says_no_row_was_cancelled",
    ),
    EdgeFault(
        key="report-manifest-deleted-alone",
        fault="`report-files.json` deleted, every other report file intact",
        moment="after `report-run`",
        outcome="exit 1, `replay.report.manifest_missing` (was identical)",
        test="tests/audit/test_replay_bound_files.py::test_report_files_json_deleted_alone_differs",
    ),
    EdgeFault(
        key="leftover-publication-temporary",
        fault="SIGKILL between writing `.cli-admission.json.<token>.tmp` and linking it; the "
        "cell moved under `superseded/attempt-1` by a resume",
        moment="replay of the resumed run",
        outcome="named: `replay.file.leftover_temporary` (bound by the run, so no difference)",
        test="tests/audit/test_replay_bound_files.py::test_a_publications_leftover_temporary_is_named",
    ),
    EdgeFault(
        key="receipt-against-its-run-files-digest",
        fault="a re-chained `run_files` record binding a receipt with another digest",
        moment="after the run",
        outcome="exit 1, `replay.file.changed` for the receipt (its own checks hold)",
        test="tests/audit/test_replay_bound_files.py::test_a_receipt_is_held_to_its_run_files_digest",
    ),
)

EDGE_COLUMNS = (
    ("fault", "fault"),
    ("moment", "moment"),
    ("outcome", "outcome"),
    ("test", "test"),
)


def test_every_edge_names_a_test_that_exists() -> None:
    assert len({edge.key for edge in EDGES}) == len(EDGES)
    for edge in EDGES:
        file, _, name = edge.test.partition("::")
        assert f"def {name}(" in (ROOT / file).read_text(), edge.test


# --- the document ---------------------------------------------------------------------------------

COLUMNS = (
    ("fault", "fault"),
    ("state", "state"),
    ("host", "host"),
    ("exit", "exit_code"),
    ("matrix", "matrix_status"),
    ("terminal refusal", "terminal_refusal"),
    ("faulted receipt", "cell"),
    ("receipt status", "cell_status"),
    ("faults", "faults"),
    ("cleanup", "cleanup"),
    ("kept observations", "kept"),
    ("replay", "replay"),
)


def render_doc(cells: tuple[FaultCell, ...] = CELLS) -> str:
    def shown(value: object) -> str:
        return "none" if value is None else str(value).replace("|", "\\|")

    lines = [
        "# Fault matrix",
        "",
        "Generated from `CELLS` in `tests/project/test_fault_matrix.py` by",
        "`just fault-matrix-doc`; its `test_the_checked_in_document_is_the_table` keeps the",
        "two equal. Each row is a test (`pytest tests/project/test_fault_matrix.py -k KEY`)",
        "that runs a real `cache-family run`, injects the fault, and asserts the receipt shown.",
        "Every row also",
        "asserts, from the files alone: the faulted cell is refused for parity",
        "(`accepted_for_parity: false`); no observation is lost (each request row that the",
        "cell's `rung_rows` records journal is in its `cell.json`; a cell that completed",
        "before the fault stays completed); no journaled process is left and every journaled",
        "port is free.",
        "",
        "| key | " + " | ".join(title for title, _ in COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for cell in cells:
        values = [shown(getattr(cell, name)) for _, name in COLUMNS]
        lines.append(f"| `{cell.key}` | " + " | ".join(values) + " |")
    lines += [
        "",
        "## Malformed and hostile inputs",
        "",
        "Generated from `INPUT_FAULTS` in the same file. Each row is an input a command reads,",
        "the typed verdict it ends in (never a traceback) and the test that holds it.",
        "",
        "| key | input | command | exit | verdict | test |",
        "|---|---|---|---|---|---|",
    ]
    for fault in INPUT_FAULTS:
        values = [fault.input, fault.command, str(fault.exit_code), fault.verdict]
        lines.append(
            f"| `{fault.key}` | " + " | ".join(shown(v) for v in values) + f" | `{fault.test}` |"
        )
    lines += [
        "",
        "## Faults checked by their own tests",
        "",
        "Generated from `ELSEWHERE` in the same file. Each is a regression test beside the",
        "code it checks (`pytest TEST`), not a full run of the matrix above.",
        "",
        "| key | fault | state | outcome | test |",
        "|---|---|---|---|---|",
    ]
    for other in ELSEWHERE:
        values = [shown(v) for v in (other.fault, other.state, other.outcome)]
        lines.append(f"| `{other.key}` | " + " | ".join(values) + f" | `{other.test}` |")
    lines += [
        "",
        "## Faults at a run's edges",
        "",
        "Generated from `EDGES` in the same file: faults outside any one cell (the run's exit,",
        "its directory, its audit), each asserted by the test named in its row.",
        "",
        "| key | " + " | ".join(title for title, _ in EDGE_COLUMNS) + " |",
        "|---|" + "---|" * len(EDGE_COLUMNS),
    ]
    for edge in EDGES:
        values = [shown(getattr(edge, name)) for _, name in EDGE_COLUMNS]
        lines.append(f"| `{edge.key}` | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def test_the_checked_in_document_is_the_table() -> None:
    assert DOC.read_text() == render_doc(), "run `just fault-matrix-doc`"


def test_every_input_fault_names_a_test_that_exists() -> None:
    assert len({f.key for f in INPUT_FAULTS}) == len(INPUT_FAULTS)
    for fault in INPUT_FAULTS:
        file, function = fault.test.split("::")
        assert f"def {function}(" in (ROOT / file).read_text(), fault.key


def test_every_cell_has_a_scenario_and_keys_are_unique() -> None:
    assert len({c.key for c in CELLS}) == len(CELLS)
    assert {c.key for c in CELLS} == set(SCENARIOS)


def test_every_fault_checked_elsewhere_names_a_test_that_exists() -> None:
    keys = [c.key for c in CELLS] + [o.key for o in ELSEWHERE]
    assert len(set(keys)) == len(keys)
    for other in ELSEWHERE:
        path, name = other.test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), other.test


@dataclass
class Ran:
    out: Path
    code: int
    stderr: str


@dataclass
class Where:
    """What a scenario runs in: its own temporary directory, and for real llama-server cells
    the real parts and the installed reference tools (``native_parts``, ``oracle_tools``)."""

    tmp: Path
    parts: Any = None
    tools: Path | None = None


Scenario = Callable[[Where], Awaitable[Ran]]


async def _stalled_fake(tmp_path: Path, inject: Callable[[trio.Process, int], Any],
                        **behaviour: Any) -> Ran:  # fmt: skip
    """A fake-host run whose concurrent ladder holds a streamed request; ``inject(runner,
    host_pid)`` is the fault, landed once that request is in the host."""
    prepared = make_prepared(tmp_path / "p", top=behaviour.pop("top", None))
    fifo = Fifo(tmp_path / "notify")
    behave(prepared, stream_delay=3600, notify_fifo=str(fifo.path), **behaviour)
    out, logs = tmp_path / "out", logs_dir(tmp_path)
    process = await start_run(prepared, out, logs)
    try:
        event, pid = (await fifo.next_line()).split()
        while event != "stream":  # e.g. the serial cell's host reporting its SIGTERM
            event, pid = (await fifo.next_line()).split()
        await inject(process, int(pid))
        code = await wait_exit(process)
    finally:
        fifo.close()
        if process.returncode is None:
            process.kill()
    return Ran(out, code, (logs / "run.stderr").read_text())


def _signal_host(signum: int) -> Callable[[trio.Process, int], Awaitable[None]]:
    async def inject(runner: trio.Process, host: int) -> None:
        del runner
        os.kill(host, signum)

    return inject


async def host_sigkill(where: Where) -> Ran:
    tmp_path = where.tmp
    return await _stalled_fake(tmp_path, _signal_host(signal.SIGKILL))


async def host_sigstop(where: Where) -> Ran:
    tmp_path = where.tmp

    # A stopped host answers nothing: the request timeout ends the cell; SIGTERM stays
    # pending in a stopped process, so cleanup must SIGKILL it. The host stops itself as
    # the request arrives (a signal from here could land after the request timeout on a
    # loaded machine); the timeout is generous for the serial cell's requests before it.
    async def nothing_more(runner: trio.Process, host: int) -> None:
        del runner, host

    return await _stalled_fake(
        tmp_path, nothing_more, stop_on_stream=True, top={"request_timeout_ms": 5000}
    )


async def runner_sigint(where: Where) -> Ran:
    tmp_path = where.tmp

    async def inject(runner: trio.Process, host: int) -> None:
        del host
        runner.send_signal(signal.SIGINT)

    return await _stalled_fake(tmp_path, inject)


async def runner_sigterm_host_ignores(where: Where) -> Ran:
    tmp_path = where.tmp

    async def inject(runner: trio.Process, host: int) -> None:
        del host
        runner.send_signal(signal.SIGTERM)

    return await _stalled_fake(tmp_path, inject, ignore_sigterm="after_stream")


async def runner_sigkill(where: Where) -> Ran:
    tmp_path = where.tmp

    async def inject(runner: trio.Process, host: int) -> None:
        del host
        runner.kill()

    return await _stalled_fake(tmp_path, inject)


async def _changed_before_run(tmp_path: Path, pick: Callable[[Path], Path]) -> Ran:
    prepared = make_prepared(tmp_path / "p")
    target = pick(prepared)
    with open(target, "ab") as handle:  # one byte more: another SHA-256, same path
        handle.write(b"\0")
    out, logs = tmp_path / "out", logs_dir(tmp_path)
    code = await wait_exit(await start_run(prepared, out, logs))
    return Ran(out, code, (logs / "run.stderr").read_text())


async def server_changed(where: Where) -> Ran:
    tmp_path = where.tmp
    return await _changed_before_run(
        tmp_path, lambda prepared: prepared.parent / "tools" / "fake-llama-server"
    )


def pinned_model(prepared: Path) -> Path:
    """The one present model file the prepared input pinned (the bytes its row runs)."""
    models = json.loads(prepared.read_bytes())["models"]
    [pinned] = [m["pinned_file"] for m in models.values() if m["status"] == "present"]
    return Path(pinned)


async def model_changed(where: Where) -> Ran:
    return await _changed_before_run(where.tmp, pinned_model)


# --- real llama-server (the tiny model zoo) ------------------------------------------------------


async def _real_run(where: Where, *, private_model: bool = False, **top: Any) -> tuple[Path, Path]:
    """Prepare (for real) one llama row of the zoo; the prepared input and the model file it
    pinned. ``private_model``: the row's model is a private copy (the zoo is shared)."""
    from real_run_harness import cli, operator_for

    assert where.parts is not None and where.tools is not None
    root = where.tmp
    operator = operator_for(where.parts, where.tools, root, ["llama"])
    document = json.loads(operator.read_text())
    document.update(top)
    if private_model:
        hub = root / "hub"
        for entry in Path(where.parts.zoo_root).iterdir():
            if entry.is_dir() and "Llama" in entry.name:
                shutil.copytree(entry, hub / entry.name, symlinks=True)
        document["plan"]["cache_root"] = str(hub)
    operator.write_text(json.dumps(document))
    prepared_dir = root / "prepared"
    prepare = await trio.to_thread.run_sync(
        lambda: cli("prepare-full", "--input", str(operator), "--output", str(prepared_dir),
                    cwd=root)
    )  # fmt: skip
    assert prepare.returncode == 0, prepare.stderr
    prepared = prepared_dir / "cache-family-input.json"
    return prepared, pinned_model(prepared)


async def _real_host_signal(where: Where, signum: int, **top: Any) -> Ran:
    """Signal the concurrent cell's llama-server as soon as the run journals its spawn: the
    cell cannot have finished its ladder then, whatever the machine's load."""
    prepared, _ = await _real_run(where, **top)
    out, logs = where.tmp / "out", logs_dir(where.tmp)
    process = await start_run(prepared, out, logs)
    try:
        await poll_journal_until(
            out,
            process,
            lambda r: (
                isinstance(r, ChildSpawned)
                and r.role == "host"
                and (r.cell_id or "").endswith("native-concurrent")
            ),
        )
        [host] = [
            r.pid
            for r in records_of(out, ChildSpawned)
            if (r.cell_id or "").endswith("native-concurrent")
        ]
        os.kill(host, signum)
        # An upper bound, never a pause: a stopped host spends the cell's startup budget.
        with trio.fail_after(REAL_RUN_BOUND_S):
            code = await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
    return Ran(out, code, (logs / "run.stderr").read_text())


async def real_host_sigkill(where: Where) -> Ran:
    return await _real_host_signal(where, signal.SIGKILL)


async def real_host_sigstop(where: Where) -> Ran:
    # A stopped host never answers: its startup budget (the cell's, less a margin) runs out,
    # and SIGTERM stays pending in a stopped process, so cleanup must SIGKILL it. A shorter
    # cell budget keeps the wait short; the other cells finish well inside it.
    return await _real_host_signal(where, signal.SIGSTOP, cell_seconds=75)


async def real_model_changed(where: Where) -> Ran:
    prepared, model = await _real_run(where, private_model=True)
    with open(model, "ab") as handle:
        handle.write(b"\0")
    out, logs = where.tmp / "out", logs_dir(where.tmp)
    code = await wait_exit(await start_run(prepared, out, logs))
    return Ran(out, code, (logs / "run.stderr").read_text())


SCENARIOS: dict[str, Scenario] = {
    "real-host-sigkill": real_host_sigkill,
    "real-host-sigstop": real_host_sigstop,
    "real-model-changed-before-launch": real_model_changed,
    "host-sigkill-mid-ladder": host_sigkill,
    "host-sigstop-mid-ladder": host_sigstop,
    "runner-sigint-mid-ladder": runner_sigint,
    "runner-sigterm-host-ignores-sigterm": runner_sigterm_host_ignores,
    "runner-sigkill-mid-ladder": runner_sigkill,
    "server-binary-changed-before-launch": server_changed,
    "model-changed-before-launch": model_changed,
}


# --- the asserted receipt -------------------------------------------------------------------------


def records_of(out: Path, kind: type) -> list[Any]:
    data = (out / "journal.jsonl").read_bytes()
    return [ln.record for ln in read_journal(data[: data.rfind(b"\n") + 1]).lines
            if isinstance(ln.record, kind)]  # fmt: skip


def journaled_rows(out: Path, cell_id: str) -> list[Any]:
    """The rows of the cell's rows file that its ``rung_rows`` records journaled."""
    read = read_journal((out / "journal.jsonl").read_bytes())
    assert read.chain_break is None
    records = [
        line.record for line in read.lines if getattr(line.record, "cell_id", None) == cell_id
    ]
    segments = [record for record in records if isinstance(record, RungRows)]
    if not segments:
        return []
    opened = next(record for record in records if isinstance(record, CellOpened))
    data = (out / opened.cell_dir / request_rows.REQUESTS_FILENAME).read_bytes()
    lines = request_rows.DECODER.decode_lines(data)
    return [line.row for line in lines[: segments[-1].first_line + segments[-1].count]]


def cleanup_words(receipt: Any) -> str:
    cleanup = receipt.cleanup
    if cleanup is None:
        return "never launched"
    if cleanup.forced:
        return "forced (SIGKILL after the grace)"
    if cleanup.exit_code == -signal.SIGKILL:
        return "found dead (exit -9)"
    assert cleanup.graceful
    return "graceful (SIGTERM)"


async def check_cell(cell: FaultCell, ran: Ran) -> None:
    out = ran.out
    assert ran.code == cell.exit_code, ran.stderr
    assert "Traceback" not in ran.stderr
    cell_dir = out / "cell-0000" / cell.cell
    if cell.matrix_status is None:
        assert not (out / MATRIX_FILENAME).exists()
        report = await trio.to_thread.run_sync(lambda: replay(str(out), reap=True, reap_grace_s=10))
        assert report.exit_code == 1 and not report.differs and report.unfinished
        assert any(line.startswith("reap: ended with SIGTERM: ") for line in report.lines)
        assert (out / "cell-0000" / "native-serial" / "cell.json").exists()
        assert not (cell_dir / "cell.json").exists()
        assert_no_orphan_and_ports_free(out)
        return
    matrix = decode_matrix((out / MATRIX_FILENAME).read_bytes())
    assert matrix.status in cell.matrix_status.split(" or ")
    assert matrix.terminal_refusal == cell.terminal_refusal
    row = decode_row_receipt((out / "cell-0000" / "row.json").read_bytes())
    assert row.status != "completed"
    if cell.cell == "row":  # refused before any cell opened
        assert (row.status, row.terminal_refusal) == (cell.cell_status, cell.terminal_refusal)
        assert (row.reason,) == cell.faults
        assert all(not o.accepted_for_parity and o.cell_id is None for o in row.observations)
        assert not list(out.glob("cell-0000/*/cell.json"))
    else:
        receipt = decode_cell_receipt((cell_dir / "cell.json").read_bytes())
        assert receipt.status in cell.cell_status.split(" or "), receipt.faults
        assert set(cell.faults) <= {f.kind for f in receipt.faults}, receipt.faults
        assert receipt.terminal_refusal == cell.terminal_refusal
        assert not receipt.accepted_for_parity  # parity refused
        assert cleanup_words(receipt) == cell.cleanup
        # No observation lost: every row the journal holds for the cell is in its receipt.
        kept = [r for rung in receipt.measurement.rungs for r in rung.rows]
        for journaled in journaled_rows(out, receipt.cell_id):
            assert journaled in kept
        if cell.cell != "native-serial":
            serial = decode_cell_receipt((out / "cell-0000/native-serial/cell.json").read_bytes())
            assert serial.status == "completed"  # finished before the fault: never lowered
    spawned = [
        line.record
        for line in read_journal((out / "journal.jsonl").read_bytes()).lines
        if isinstance(line.record, ChildSpawned)
    ]
    if spawned:
        assert_no_orphan_and_ports_free(out)
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(
        p.info["cmdline"] or [])]  # fmt: skip
    assert await trio.to_thread.run_sync(lambda: replay(str(out)).exit_code) == 0


@pytest.mark.parametrize("cell", [c for c in CELLS if c.host == FAKE], ids=lambda c: c.key)
async def test_fault_cell_with_the_fault_injection_host(cell: FaultCell, tmp_path: Path) -> None:
    await check_cell(cell, await SCENARIOS[cell.key](Where(tmp_path)))


@pytest.mark.native
@pytest.mark.parametrize("cell", [c for c in CELLS if c.host == REAL], ids=lambda c: c.key)
async def test_fault_cell_with_the_real_llama_server(
    cell: FaultCell, native_parts: Any, oracle_tools: Path, tmp_path: Path
) -> None:
    await check_cell(cell, await SCENARIOS[cell.key](Where(tmp_path, native_parts, oracle_tools)))


if __name__ == "__main__":  # `just fault-matrix-doc`
    sys.stdout.write(render_doc())
