"""``cache-family run --resume RUN_DIR``: continue a run whose runner died or was stopped.

Refused, touching nothing: without the run directory's lock, on a journal that does not verify,
on a run sealed without a terminal refusal, while the journal's runner lives, or when the
prepared input's bytes changed. Then the journaled children still alive are reaped (only those
carrying the run's tag); a row is kept only when its last ``row.json`` folds to completed with
every receipt on disk and its host profiles' pins unchanged, and every other row re-runs in a
new journal segment (``run_resumed``), its earlier directory moved under
``superseded/attempt-N/``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Final

import psutil
import trio

from cache_family.actors.audit.replay import ReplayReport, reap_children, refuse_while_runner_lives
from cache_family.actors.journal.writer import JOURNAL_READ_LIMIT, journal_path
from cache_family.actors.run.context import hash_pins
from cache_family.actors.run.matrix import AdmittedRun, Resumption
from cache_family.actors.run.prompts import PromptSelector
from cache_family.errors import Refused
from cache_family.schemas.bounded import read_bounded
from cache_family.schemas.journal import (
    JournalLine,
    JournalSealed,
    ReceiptPublished,
    RowOpened,
    RowsSelected,
    RunResumed,
    RunStarted,
    read_journal,
    seal_problems,
)
from cache_family.schemas.matrix import MATRIX_FILENAME
from cache_family.schemas.prepared import PREPARED_INPUT_MAX_BYTES, PreparedInput, decode_document
from cache_family.schemas.production import PRODUCTION_JSON, PRODUCTION_MD
from cache_family.states.fold import JournalIndex, fold_row
from cache_family.states.plans import PinTarget, pin_targets

SUPERSEDED_DIR: Final = "superseded"
# Hashing every kept row's pins again is bounded like a cell's pin check.
PIN_CHECK_SECONDS: Final = 3600.0
REAP_GRACE_SECONDS: Final = 5.0
# Files of the interrupted segment a resumed run publishes afresh.
SEGMENT_FILES: Final = (MATRIX_FILENAME, PRODUCTION_JSON, PRODUCTION_MD)


def _refused(code: str, message: str, hint: str) -> Refused:
    return Refused.one(code, "$.resume", message, hint)


def _read(run_dir: str, io_dir: str) -> tuple[tuple[JournalLine, ...], int]:
    """The trusted lines and the length in bytes of a torn last line (0 when none); read
    through ``io_dir``, named ``run_dir``."""
    try:
        raw = read_bounded(journal_path(io_dir), JOURNAL_READ_LIMIT, what="journal")
    except Refused as refused:  # named as the operator gave it, not as the handle reaches it
        raise Refused(
            tuple(
                dataclasses.replace(r, message=r.message.replace(io_dir, run_dir))
                for r in refused.refusals
            )
        ) from None
    read = read_journal(raw.data)
    if read.unknown_types:
        raise Refused(read.unknown_types)
    torn = 0
    if read.chain_break is not None:
        if read.chain_break.code != "journal.line.torn":
            raise Refused((read.chain_break.refusal(),))
        torn = len(raw.data) - (raw.data.rfind(b"\n") + 1)
    # A journal whose seals do not hold may not steer the reaper or the rows kept.
    problems = seal_problems(raw.data, read)
    if problems:
        raise Refused(tuple(problems))
    if not read.lines or not isinstance(read.lines[0].record, RunStarted):
        raise _refused(
            "run.resume.not_a_run",
            f"{journal_path(run_dir)} does not start with a run_started record",
            "resume only a directory written by `cache-family run`",
        )
    last = read.lines[-1].record
    if isinstance(last, JournalSealed) and last.terminal_refusal is None:
        raise _refused(
            "run.resume.finished",
            f"the run in {run_dir} finished (its journal is sealed, matrix {last.matrix_status})",
            "a finished run is not resumed; start a new run with a fresh --output",
        )
    return read.lines, torn


def _admit_input(run_dir: str, started: RunStarted) -> AdmittedRun:
    raw = read_bounded(started.input_path, PREPARED_INPUT_MAX_BYTES, what="prepared input")
    if raw.sha256 != started.request_sha256:
        raise _refused(
            "run.resume.input_changed",
            f"{started.input_path} now has sha256 {raw.sha256}; the run was admitted with "
            f"{started.request_sha256}",
            "restore the prepared input the run started with, or start a new run",
        )
    prepared = decode_document(raw.data, PreparedInput, what="prepared input")
    prompts = PromptSelector(prepared)
    prompts.check()
    return AdmittedRun(
        prepared=prepared,
        input_path=raw.path,
        request_sha256=raw.sha256,
        output=run_dir,
        prompts=prompts,
    )


def _published_intact(run_dir: str, records: list[ReceiptPublished]) -> bool:
    for record in records:
        try:
            data = read_bounded(os.path.join(run_dir, record.path), JOURNAL_READ_LIMIT, what="r")
        except Refused:
            return False
        if data.sha256 != record.sha256:
            return False
    return True


def _row_targets(prepared: PreparedInput, key: str) -> tuple[PinTarget, ...]:
    """The pins of every host profile of the row's case (native, old and new servers and a
    declared one), each target once."""
    profiles = prepared.profile(key)
    if profiles is None:
        return ()
    targets: dict[tuple[str, str], PinTarget] = {}
    for profile in profiles.hosts().values():
        for target in pin_targets(profile):
            targets.setdefault((target.path, target.expected_sha256), target)
    return tuple(targets.values())


def _completed_rows(
    run_dir: str, lines: tuple[JournalLine, ...], prepared: PreparedInput
) -> tuple[set[int], dict[int, tuple[PinTarget, ...]]]:
    """Rows that need no re-run, if their pins still verify (and the targets to hash)."""
    index = JournalIndex(lines)
    kept: set[int] = set()
    to_verify: dict[int, tuple[PinTarget, ...]] = {}
    for row in prepared.rows:
        row_lines = index.lines_for_row(row.index)
        opened = [ln.record for ln in row_lines if isinstance(ln.record, RowOpened)]
        if opened and opened[0].model_status == "missing-model":
            kept.add(row.index)
            continue
        published = [ln.record for ln in row_lines if isinstance(ln.record, ReceiptPublished)]
        row_pub = [p for p in published if p.scope == "row" and p.row_index == row.index]
        if not row_pub:
            continue
        receipt = fold_row(row_lines, row.index, through_seq=row_pub[-1].through_seq)
        if receipt.status != "completed" or not _published_intact(run_dir, published):
            continue
        kept.add(row.index)
        to_verify[row.index] = _row_targets(prepared, row.key)
    return kept, to_verify


async def _pins_hold(targets: tuple[PinTarget, ...]) -> bool:
    if not targets:
        return True
    results = await hash_pins(targets, PIN_CHECK_SECONDS)
    return all(result.matches for result in results)


def plan_resumption(
    run_dir: str, *, handle_path: str | None = None
) -> tuple[AdmittedRun, Resumption, list[str]]:
    """Admit the resume, reap the dead runner's children and decide every row; the lines to
    print. Raises ``Refused`` before anything is touched. ``handle_path``: the run directory's
    handle (``RunHandle.path``), which everything is read and written through."""
    root = str(Path(run_dir).absolute())
    io = handle_path or root
    lines, torn = _read(root, io)
    refuse_while_runner_lives(lines)
    started = lines[0].record
    assert isinstance(started, RunStarted)
    admitted = dataclasses.replace(_admit_input(root, started), handle_path=handle_path)
    selected = next(
        (line.record for line in lines[1:2] if isinstance(line.record, RowsSelected)), None
    )
    if selected is not None:  # a run of some rows (--rows, --shard) resumes those rows only
        planned = {brief.index for brief in started.planned_rows}
        rows = [row for row in admitted.prepared.rows if row.index in planned]
        admitted = dataclasses.replace(
            admitted, prepared=admitted.prepared.model_copy(update={"rows": rows})
        )
    kept, to_verify = _completed_rows(io, lines, admitted.prepared)

    async def verify() -> set[int]:
        return {index for index, targets in to_verify.items() if not await _pins_hold(targets)}

    drifted = trio.run(verify)
    kept -= drifted
    notes = ReplayReport()
    reaped = reap_children(notes, lines, REAP_GRACE_SECONDS, io)
    if torn:
        # The torn bytes were never part of the chain: cut them so the journal continues.
        with open(journal_path(io), "r+b") as journal:
            journal.truncate(os.path.getsize(journal_path(io)) - torn)
            os.fsync(journal.fileno())
    attempt = 1 + sum(isinstance(line.record, RunResumed) for line in lines)
    superseded = f"{SUPERSEDED_DIR}/attempt-{attempt}"
    rerun = [row for row in admitted.prepared.rows if row.index not in kept]
    sources = [f"cell-{row.index:04d}" for row in rerun] + list(SEGMENT_FILES)
    moved = tuple(s for s in sources if os.path.lexists(os.path.join(io, s)))
    me = psutil.Process()
    record = RunResumed(
        resumed_after_seq=lines[-1].seq,
        kept_rows=tuple(sorted(kept)),
        rerun_rows=tuple(row.index for row in rerun),
        superseded_dir=superseded,
        moved=moved,
        runner_pid=me.pid,
        runner_create_time=me.create_time(),
        reaped_pids=tuple(reaped),
        torn_tail_bytes=torn,
        detail=(f"pins changed for rows {sorted(drifted)}; re-run" if drifted else ""),
    )
    resumption = Resumption(
        record=record,
        kept_rows=frozenset(kept),
        moves=tuple((path, f"{superseded}/{path}") for path in moved),
        run_id=started.run_id,
    )
    notes.say(f"resume: keeping rows {sorted(kept)}, re-running rows {[r.index for r in rerun]}")
    return admitted, resumption, notes.lines
