"""The verbs that talk to the terminal: ``run``, ``run --resume``, ``replay`` and preparation.

The actors do the work and return what happened; these functions print it (progress, notes,
the result lines, the three closing lines of a failing exit) and choose the exit code. Only
this room and ``cli.py`` print.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from cache_family.actors.audit.head_signature import check_sign_key, head_line, sign_head
from cache_family.actors.audit.replay import HeadCheck, replay
from cache_family.actors.journal.writer import journal_path
from cache_family.actors.run.matrix import (
    AdmittedRun,
    MatrixOutcome,
    Resumption,
    RunHandle,
    admit_run,
    final_line,
    guarded_trees,
    is_interrupt,
    make_fresh_dir,
    supervise,
    unwritten_matrix,
)
from cache_family.actors.run.resume import plan_resumption
from cache_family.console.progress import Mode, choose_mode, run_progress_for
from cache_family.console.refusals import print_refusals, say_failed
from cache_family.errors import Refused
from cache_family.exit_codes import ExitCode
from cache_family.schemas.matrix import MATRIX_FILENAME, FailedMatrix, MatrixReceipt, encode_matrix
from cache_family.system import interrupts
from cache_family.system.publish import publish_fresh
from cache_family.system.run_lock import run_lock

# --- run ---------------------------------------------------------------------------------------


def run_command(
    input: str,
    output: str,
    *,
    sign_key: str | None = None,
    mode: Mode | None = None,
    select: Callable[[AdmittedRun], AdmittedRun] | None = None,
) -> int:
    """The ``run`` verb: admit, create the fresh output, lock it, supervise, publish; the exit
    code. ``select`` narrows the admitted run to some of its rows (``actors/run/selection.py``)."""
    with interrupts.held():
        try:
            admitted = admit_run(input, output)
            if select is not None:
                admitted = select(admitted)
            if sign_key is not None:
                check_sign_key(sign_key)
            handle = make_fresh_dir(admitted.output, guarded_trees(admitted.prepared))
        except Refused as refused:
            print_refusals(refused.refusals, sys.stderr)
            say_failed(
                sys.stderr,
                "run",
                f"the run was refused ({len(refused.refusals)} refusal(s) above)",
                f"{input}; nothing was written under {output}",
                "fix what each refusal names (its hint), then run again",
            )
            return ExitCode.REFUSED
        admitted = dataclasses.replace(admitted, handle_path=handle.path)
        try:
            with handle, run_lock(admitted.run_dir, what="run", named=admitted.output):
                return supervise_command(admitted, sign_key=sign_key, mode=mode)
        except Refused as refused:  # the fresh directory was taken over before it was locked
            print_refusals(refused.refusals, sys.stderr)
            return ExitCode.REFUSED


def supervise_command(
    admitted: AdmittedRun,
    resumption: Resumption | None = None,
    *,
    sign_key: str | None = None,
    mode: Mode | None = None,
) -> int:
    """Supervise an admitted run (fresh, or resumed) and print its last lines; the exit code.

    ``mode`` is how progress is shown (default: rich on a terminal, else plain lines). With
    ``sign_key`` the sealed head is signed (``journal.head.sig``) before it is printed. Any
    SIGINT/SIGTERM, whenever it came, makes it 130; none ends the process."""
    with interrupts.held() as latch:
        code = _supervise_and_print(admitted, resumption, latch, sign_key=sign_key, mode=mode)
        late = latch.take()
    for name in late:
        print(f"{name} after the matrix was published: the run had finished", file=sys.stderr)
    return ExitCode.INTERRUPTED if late else code


def _supervise_and_print(
    admitted: AdmittedRun,
    resumption: Resumption | None,
    latch: interrupts.Latch,
    *,
    sign_key: str | None,
    mode: Mode | None,
) -> int:
    synthetic = admitted.prepared.catalog.synthetic
    progress = run_progress_for(
        mode or choose_mode(sys.stderr),
        sys.stderr,
        len(admitted.prepared.rows),
        synthetic=synthetic,
    )
    run_dir = admitted.output
    matrix = os.path.join(run_dir, MATRIX_FILENAME)  # as shown; read and written through:
    matrix_file = os.path.join(admitted.run_dir, MATRIX_FILENAME)
    try:
        outcome = interrupts.run_then_release_wakeup_fd(
            supervise, admitted, None, progress, resumption, latch
        )
    except BaseException as exc:
        if not is_interrupt(exc):
            raise
        # Only a caller that put Python's SIGINT handler back over the run's latch gets here:
        # a matrix receipt is on disk either way.
        if not os.path.lexists(matrix_file):
            failed = FailedMatrix(
                detail="interrupted before the run began", request_sha256=admitted.request_sha256
            )
            try:
                publish_fresh(matrix_file, encode_matrix(failed))
            except OSError as exc:
                print(f"interrupted: {unwritten_matrix(admitted, exc.strerror)}", file=sys.stderr)
                _say_interrupted(run_dir, run_dir, resumable=True)
                progress.finished("interrupted", None, None, ExitCode.INTERRUPTED)
                return ExitCode.INTERRUPTED
        print(f"interrupted: {matrix}", file=sys.stderr)
        _say_interrupted(matrix, run_dir, resumable=True)
        progress.finished("interrupted", matrix, None, ExitCode.INTERRUPTED)
        return ExitCode.INTERRUPTED
    written = os.path.isfile(matrix_file)
    signed = True
    if written and outcome.journal_head is not None:
        signed = _sign(admitted, sign_key, outcome.journal_head)
    if outcome.interrupted:
        code = ExitCode.INTERRUPTED
    elif not signed:  # the head's signature was asked for and is missing: not a clean run
        code = ExitCode.NOT_COMPLETED
    else:
        code = ExitCode.COMPLETED if outcome.status == "completed" else ExitCode.NOT_COMPLETED
    if progress.result_lines:
        if written:
            print(final_line(admitted, outcome))
            if outcome.journal_head is not None:
                print(head_line(outcome.journal_head), flush=True)
        else:  # a full disk, say: the failure was reported above; name no missing file
            print(f"{outcome.status}: {unwritten_matrix(admitted, None)}", flush=True)
    if code == ExitCode.INTERRUPTED:
        _say_interrupted(matrix if written else run_dir, run_dir, resumable=resumable(outcome))
    elif code != ExitCode.COMPLETED:
        say_failed(
            sys.stderr,
            "run",
            f"the matrix is {outcome.status}{_why(outcome.receipt)}",
            (matrix if written else run_dir) + "; each row's row.json and logs are beside it",
            f"read each row's status and reason there (`cache-family report-run {run_dir}` "
            f"renders them; `cache-family replay {run_dir}` verifies the receipts), fix the "
            "cause, then run again into a fresh --output",
        )
    progress.finished(outcome.status, matrix if written else None, outcome.journal_head, code)
    return code


def resumable(outcome: MatrixOutcome) -> bool:
    """Whether ``run --resume`` would take the run: not when its journal was sealed without a
    terminal refusal (a signal that came after the rows ended changes no receipt, and resume
    refuses a finished run)."""
    if outcome.journal_head is None or isinstance(outcome.receipt, FailedMatrix):
        return True
    return outcome.receipt.terminal_refusal is not None


def _why(receipt: MatrixReceipt | FailedMatrix) -> str:
    if isinstance(receipt, FailedMatrix):
        return f" ({receipt.detail})"
    return f" ({receipt.terminal_refusal})" if receipt.terminal_refusal else ""


def _say_interrupted(evidence: str, run_dir: str, *, resumable: bool) -> None:
    if resumable:
        say_failed(
            sys.stderr,
            "run",
            "interrupted by a signal; the hosts were cleaned up",
            evidence,
            f"`cache-family run --resume {run_dir}` continues the run (completed rows are kept)",
        )
    else:
        say_failed(
            sys.stderr,
            "run",
            "a signal arrived after every row had ended; the receipts are sealed as they are",
            evidence,
            f"nothing is left to resume: `cache-family replay {run_dir}` verifies the receipts",
        )


def _sign(admitted: AdmittedRun, sign_key: str | None, head: str) -> bool:
    """Sign the head when asked (written through the run's handle, named as given); False
    (said on stderr) when the signature was not written. The receipts stand either way:
    only the head's signature is missing."""
    if sign_key is None:
        return True
    try:
        path = sign_head(admitted.run_dir, sign_key, head)
    except Refused as refused:
        print_refusals(refused.refusals, sys.stderr)
        return False
    shown = os.path.join(admitted.output, os.path.relpath(path, admitted.run_dir))
    print(f"journal head signed: {shown}", file=sys.stderr)
    return True


# --- run --resume ------------------------------------------------------------------------------


def resume_command(run_dir: str, *, sign_key: str | None = None, mode: Mode | None = None) -> int:
    """The ``run --resume`` verb; exit codes as ``run``'s (``mode``: how progress shows). The
    run directory is locked before its journal is read, so two resumes never both write."""
    root = str(Path(run_dir).absolute())
    try:
        if sign_key is not None:
            check_sign_key(sign_key)
        # A directory with no journal is refused as no run, and left without a lock file.
        has_journal = os.path.lexists(journal_path(root))
        # Opened once: the resumed run writes through this handle, as a fresh run does.
        handle = _resume_handle(root) if has_journal else None
        with (
            handle or contextlib.nullcontext(),
            (
                run_lock(handle.path, what="run --resume", named=root)
                if handle
                else contextlib.nullcontext()
            ),
        ):
            admitted, resumption, notes = plan_resumption(
                root, handle_path=handle.path if handle else None
            )
            for note in notes:
                print(note, file=sys.stderr)
            return supervise_command(admitted, resumption, sign_key=sign_key, mode=mode)
    except Refused as refused:
        print_refusals(refused.refusals, sys.stderr)
        say_failed(
            sys.stderr,
            "run --resume",
            f"the run cannot be resumed ({len(refused.refusals)} refusal(s) above)",
            f"{run_dir}; nothing in it was changed",
            f"fix what each refusal names, or check it with `cache-family replay {run_dir}`; "
            "a run that cannot be resumed is rerun into a fresh --output",
        )
        return ExitCode.REFUSED


def _resume_handle(root: str) -> RunHandle:
    try:
        return RunHandle.open(root)
    except OSError as exc:
        raise Refused.one(
            "run.resume.unreadable",
            "$.resume",
            f"cannot open {root} as a run directory: {exc.strerror or exc}",
            "give the run directory itself (not a link to it)",
        ) from None


# --- replay ------------------------------------------------------------------------------------


def replay_command(
    run_dir: str,
    *,
    reap: bool,
    reap_grace_s: float = 5.0,
    head: HeadCheck | None = None,
    out: TextIO | None = None,
) -> int:
    """The ``replay`` verb: every line of the report on stdout; the exit code (0/1/2)."""
    report = replay(run_dir, reap=reap, reap_grace_s=reap_grace_s, head=head)
    stream = sys.stdout if out is None else out
    for line in report.lines:
        print(line, file=stream)
    return report.exit_code
