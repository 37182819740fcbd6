"""``cache-family replay RUN_DIR [--reap]``: verify the journal and re-fold every receipt.

Only the chain's trusted prefix is used; every published receipt is re-folded through its
``through_seq`` with the run's own pure fold and compared by bytes and with the SHA-256 its
record holds; every receipt file on disk must be accounted for by the journal, and a finished
journal ends in a valid seal. ``--reap`` acts only on a journal that verifies and never while
the run's runner lives; it ends a process only while it is still the journaled pid and create
time and carries the run's environment tag (or carries the tag after leaving the group):
SIGTERM, a bounded grace, SIGKILL. Exit 0: identical and finished; 1: something differs or the
run did not finish; 2: unreadable.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import msgspec
import psutil

from cache_family.actors.audit.head_signature import head_line, verify_head
from cache_family.actors.audit.production import refold_production_md
from cache_family.actors.audit.run_files import (
    REPORT_MANIFEST_NAME,
    check_run_files,
    report_entries,
    report_manifest,
)
from cache_family.actors.journal.rows_file import cell_rows
from cache_family.actors.journal.writer import JOURNAL_READ_LIMIT
from cache_family.errors import Refusal, Refused
from cache_family.exit_codes import ExitCode
from cache_family.report.run import read_run
from cache_family.report.run_report import (
    MARKDOWN_NAME,
    render_run_report,
    written_in_this_format,
)
from cache_family.schemas.bounded import MIB, BoundedBytes, read_bounded
from cache_family.schemas.journal import (
    JOURNAL_FILENAME,
    CellOpened,
    ChildSpawned,
    JournalLine,
    JournalRead,
    JournalSealed,
    ReceiptPublished,
    RowOpened,
    RunFilesBound,
    RungCompleted,
    RungRows,
    RunResumed,
    RunStarted,
    read_journal,
    seal_problems,
)
from cache_family.schemas.matrix import MATRIX_FILENAME
from cache_family.schemas.request_rows import REQUESTS_FILENAME
from cache_family.states.fold import JournalIndex, Refolder, refold, refold_cell, refold_row
from cache_family.states.matrix import (
    SCOPE_PRODUCTION_JSON,
    SCOPE_PRODUCTION_MD,
    refold_matrix,
    refold_production,
)
from cache_family.states.tally import tally_cell
from cache_family.states.workload_fold import SCOPE_WORKLOAD, refold_workload
from cache_family.system.process_group import (
    PROCESS_TAG_NAME,
    end_processes,
    parse_run_tag,
    process_tag_of,
    tagged_processes,
)
from cache_family.system.publish import is_temp_sibling
from cache_family.system.run_lock import lock_held, run_lock

RECEIPT_READ_LIMIT: Final = 64 * MIB
RECEIPT_NAMES: Final = frozenset(("cell.json", "row.json", "workload.json"))
CREATE_TIME_TOLERANCE_S: Final = 0.01
# Every receipt scope a run publishes, and what refolds it; a scope missing here is one this
# version cannot refold (``fold.scope.unsupported``), never a receipt left unchecked.
REFOLDERS: Final[dict[str, Refolder]] = {
    "cell": refold_cell,
    "row": refold_row,
    "matrix": refold_matrix,
    SCOPE_PRODUCTION_JSON: refold_production,
    SCOPE_PRODUCTION_MD: refold_production_md,
    SCOPE_WORKLOAD: refold_workload,
}


@dataclass
class ReplayReport:
    """What replay found; ``exit_code`` folds it into 0/1/2."""

    lines: list[str] = field(default_factory=list)
    differs: bool = False
    unreadable: bool = False
    first_bad_seq: int | None = None
    identical: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    # Why the journal says the run never finished (killed, crashed), or None.
    unfinished: str | None = None

    def say(self, text: str) -> None:
        self.lines.append(text)

    @property
    def exit_code(self) -> int:
        if self.unreadable:
            return ExitCode.UNREADABLE
        return ExitCode.DIFFERS if self.differs or self.unfinished else ExitCode.IDENTICAL


@dataclass(frozen=True, slots=True)
class HeadCheck:
    """What the auditor holds apart from the run directory: the head the run printed
    (``--expect-head``), and/or who may have signed it (``--allowed-signers``, an ssh-keygen
    allowed-signers file, with ``--signer-identity``)."""

    expect_head: str | None = None
    allowed_signers: str | None = None
    signer_identity: str | None = None


def replay(
    run_dir: str, *, reap: bool = False, reap_grace_s: float = 5.0, head: HeadCheck | None = None
) -> ReplayReport:
    report = ReplayReport()
    root = str(Path(run_dir).absolute())
    journal_file = os.path.join(root, JOURNAL_FILENAME)
    try:
        raw = read_bounded(journal_file, JOURNAL_READ_LIMIT, what="journal")
    except Refused as refused:
        _unreadable(report, refused.refusals)
        return report
    read = read_journal(raw.data)
    if read.unknown_types:
        _unreadable(report, read.unknown_types)
        return report
    if reap:
        refuse_while_runner_lives(read.lines)
    if not read.lines and read.chain_break is None:
        _unreadable(
            report,
            [
                Refusal(
                    "journal.empty",
                    "$.journal",
                    f"{journal_file} is empty",
                    "a run journal starts with a run_started record",
                )
            ],
        )
        return report
    # One writer at a time: no run or resume may write into the directory while it is reaped.
    with run_lock(root, what="replay --reap") if reap else contextlib.nullcontext():
        return _verify(report, root, raw, read, reap=reap, reap_grace_s=reap_grace_s, head=head)


def _verify(
    report: ReplayReport,
    root: str,
    raw: BoundedBytes,
    read: JournalRead,
    *,
    reap: bool,
    reap_grace_s: float,
    head: HeadCheck | None,
) -> ReplayReport:
    if read.chain_break is not None:
        report.differs = True
        report.first_bad_seq = read.chain_break.seq
        report.say(
            f"journal: first bad seq {read.chain_break.seq} ({read.chain_break.code}: "
            f"{read.chain_break.message}); {len(read.lines)} lines before it are trusted"
        )
    else:
        report.say(f"journal: {len(read.lines)} lines, hash chain intact (sha256 {raw.sha256})")

    problems = seal_problems(raw.data, read)
    for problem in problems:
        report.differs = True
        report.say(f"journal: seal broken: refused: {problem.line()}")
    if read.lines and isinstance(read.lines[-1].record, JournalSealed) and not problems:
        # The head the run printed as its last line: an auditor compares the two.
        report.say(f"journal: sealed at seq {read.last_seq}, head sha256 {read.line_sha256s[-1]}")
        # In the very words of the run's last line (the verdict stays replay's own).
        report.say(head_line(read.line_sha256s[-1]))
    head_holds = True
    if head is not None:
        head_holds = _check_head(report, root, read.line_sha256s, head)
    journaled = _compare_published(report, root, read.lines)
    _account_for_files(report, root, journaled, read.last_seq)
    _check_run_files(report, root, read.lines, journaled)
    _compare_run_report(report, root)
    report.unfinished = _unfinished(read.lines)
    if reap:
        unverified = _reap_unverified(read, bool(problems), head_holds)
        if unverified is None:
            reap_children(report, read.lines, reap_grace_s, root)
        else:
            report.differs = True
            report.say(f"reap: refused: {unverified.line()}")
    if report.unfinished is not None:
        report.say(f"replay: run did not finish: {report.unfinished}")
    verdict: dict[int, str] = {
        ExitCode.IDENTICAL: "identical",
        ExitCode.DIFFERS: "DIFFERS",
        ExitCode.UNREADABLE: "UNREADABLE",
    }
    if report.unfinished is not None and not report.differs and not report.unreadable:
        verdict[ExitCode.DIFFERS] = "UNFINISHED"
    report.say(
        f"replay: {verdict[report.exit_code]} ({len(report.identical)} identical, "
        f"{len(report.mismatched)} differing)"
    )
    return report


def _reap_unverified(read: JournalRead, seal_broken: bool, head_holds: bool) -> Refusal | None:
    """Why the journal may not steer the reaper, or None. An edited chain, a broken seal or a
    head other than the one the auditor holds may name any process as a child; only a torn
    last line (a runner killed mid-write) leaves the trusted prefix usable."""
    why: list[str] = []
    if read.chain_break is not None and read.chain_break.code != "journal.line.torn":
        why.append(f"its hash chain breaks at seq {read.chain_break.seq}")
    if seal_broken:
        why.append("its seal is broken")
    if not head_holds:
        why.append("its head is not the expected one (or its signature does not verify)")
    if not why:
        return None
    return Refusal(
        "replay.reap.unverified",
        "$.journal",
        f"the journal does not verify ({'; '.join(why)}): no process is ended on its word",
        "reap only a run directory whose journal replays with an intact chain (and the head "
        "the run printed); end a process you know to be the run's by hand",
    )


def _check_head(report: ReplayReport, root: str, shas: Sequence[str], check: HeadCheck) -> bool:
    """Compare the trusted journal's head with what the auditor holds apart from the run
    directory; a journal rewritten and re-folded end to end is caught only here."""
    head = shas[-1] if shas else None
    refusals: list[Refusal] = []
    if check.expect_head is not None and check.expect_head != head:
        refusals.append(_head_mismatch(check.expect_head, head, shas))
    if check.allowed_signers is not None and check.signer_identity is not None:
        if head is None:
            refusals.append(
                Refusal(
                    "replay.signature.invalid",
                    "$.journal_head_signature",
                    "the journal has no trusted line whose head a signature could cover",
                    "the journal is empty or broken from its first line",
                )
            )
        else:
            problem = verify_head(root, head, check.allowed_signers, check.signer_identity)
            if problem is None:
                report.say(f"journal: head signed by {check.signer_identity!r}: verified")
            else:
                refusals.append(problem)
    for refusal in refusals:
        report.differs = True
        report.say(f"journal: refused: {refusal.line()}")
    return not refusals


def _head_mismatch(expected: str, head: str | None, shas: Sequence[str]) -> Refusal:
    if expected in shas:
        seq = shas.index(expected) + 1
        detail = (
            f"the journal goes on for {len(shas) - seq} line(s) after the expected head "
            f"(seq {seq}): records were appended after the run ended"
        )
    else:
        detail = "no line of the trusted journal has it: the journal was rewritten or replaced"
    return Refusal(
        "replay.head.mismatch",
        "$.journal",
        f"head sha256 {head or '(none)'} is not the expected {expected}; {detail}",
        "compare with the head the run printed as its last line; only that or the head's "
        "signature shows a journal re-chained and re-folded end to end",
    )


def _check_run_files(
    report: ReplayReport, root: str, lines: Sequence[JournalLine], receipts: set[str]
) -> None:
    """The run directory against the last ``run_files`` record: an edited, missing or extra
    file differs. Receipts (journaled or planted) are left to the receipt checks above, which
    say more. A journal without the record (written before files were bound) is said to be
    so; a segment resumed after it has not bound its files yet (the run is unfinished)."""
    last: RunFilesBound | None = None
    resumed_after = False
    for line in lines:
        if isinstance(line.record, RunFilesBound):
            last, resumed_after = line.record, False
        elif isinstance(line.record, RunResumed):
            resumed_after = True
    if last is None:
        report.say(
            "run files: the journal binds no file list (a run from before run_files records): "
            "only its receipts and rows files are checked"
        )
        return
    if resumed_after:
        report.say("run files: not checked: the resumed segment has not bound its files yet")
        return
    said = {os.path.normpath(path) for path in report.mismatched}
    problems = [
        problem
        for problem in check_run_files(root, last.files)
        if not _said_by_receipt_checks(problem.path, problem.code, receipts, said)
    ]
    for problem in problems:
        report.differs = True
        report.mismatched.append(problem.path)
        report.say(f"DIFFERS {problem.path}: {problem.code}: {problem.detail}")
    if not problems:
        report.say(f"run files: {len(last.files)} bound, every one as bound and no other")
    _flag_leftover_temporaries(report, last)


def _said_by_receipt_checks(path: str, code: str, receipts: set[str], said: set[str]) -> bool:
    """A receipt the receipt checks found differing (journaled or planted) and a journaled
    cell's rows file (re-read against its ``rung_rows`` digests) are reported there, which
    says more. A receipt they found identical is still held to its ``run_files`` digest."""
    if os.path.normpath(path) in said:
        return True
    cell_receipt = os.path.normpath(os.path.join(os.path.dirname(path), "cell.json"))
    return (
        os.path.basename(path) == REQUESTS_FILENAME
        and code != "replay.file.unbound"
        and cell_receipt in receipts
    )


def _flag_leftover_temporaries(report: ReplayReport, bound: RunFilesBound) -> None:
    """A publication cut short (its writer killed between writing and linking, then the
    directory moved aside by a resume) leaves its temporary file; the run bound it as it
    found it, so it is no difference, but it is named: no receipt or evidence is in it."""
    for entry in bound.files:
        if is_temp_sibling(os.path.basename(entry.path)):
            report.say(
                f"run files: note: {entry.path}: replay.file.leftover_temporary: a "
                "publication cut short (its writer was killed before the file got its "
                "name); not a receipt or evidence of the run"
            )


def _compare_run_report(report: ReplayReport, root: str) -> None:
    """When ``cache-family report-run`` wrote its files into the run directory (any one of
    them, or its manifest), regenerate them from the receipts (its defaults) and compare
    byte for byte: a missing one or an extra plot differs too."""
    present = report_entries(root)
    if not present:
        return
    try:
        written = read_bounded(
            os.path.join(root, MARKDOWN_NAME), RECEIPT_READ_LIMIT, what="report file"
        ).data
    except Refused:
        written = b""
    if written and not written_in_this_format(written):
        # An earlier report layout: nothing to compare it with (the receipts were compared).
        report.say(
            f"run report: {MARKDOWN_NAME} was written in an earlier layout, not compared "
            f"(`cache-family report-run {root}` writes the current one)"
        )
        return
    try:
        files = render_run_report(read_run(root))
    except Refused as refused:
        report.differs = True
        report.say(f"DIFFERS run report: cannot be regenerated: {refused}")
        return
    files = {**files, REPORT_MANIFEST_NAME: report_manifest(files)}
    for relative in present:
        if relative not in files:
            report.differs = True
            report.mismatched.append(relative)
            report.say(
                f"DIFFERS {relative} (run report): replay.report.unlisted: report-run "
                "writes no such file"
            )
    if REPORT_MANIFEST_NAME not in present and written:
        # report.md in this layout was written with its manifest: only a deletion removed it.
        del files[REPORT_MANIFEST_NAME]
        report.differs = True
        report.mismatched.append(REPORT_MANIFEST_NAME)
        report.say(
            f"DIFFERS {REPORT_MANIFEST_NAME} (run report): replay.report.manifest_missing: "
            f"{MARKDOWN_NAME} is of the layout report-run writes with its manifest"
        )
    elif REPORT_MANIFEST_NAME not in present:
        # A report written before report manifests: its files are still all expected.
        del files[REPORT_MANIFEST_NAME]
        report.say(
            f"run report: no {REPORT_MANIFEST_NAME} (written before report manifests): its "
            "files are compared, a missing one included"
        )
    for relative, expected in files.items():
        try:
            on_disk = read_bounded(
                os.path.join(root, relative), RECEIPT_READ_LIMIT, what="report file"
            ).data
        except Refused as refused:
            report.differs = True
            report.mismatched.append(relative)
            report.say(f"DIFFERS {relative} (run report): {refused}")
            continue
        if on_disk == expected:
            report.identical.append(relative)
            report.say(f"identical {relative} (run report)")
        else:
            report.differs = True
            report.mismatched.append(relative)
            report.say(f"DIFFERS {relative} (run report): {_first_difference(expected, on_disk)}")


def _unfinished(lines: tuple[JournalLine, ...]) -> str | None:
    """Why the trusted journal is not that of a finished run, or None: the matrix was never
    published, or a cell or a row with a directory was opened and never published its receipt
    (a row journaled without a directory, never launched, has no receipt to publish). Names the
    first such cell and the first such row: the cell is where the run was when it stopped."""
    opened: dict[tuple[str, str], int] = {}
    rows_of_cells: dict[str, int] = {}
    published: set[tuple[str, str]] = set()
    matrix_published = False
    for line in lines:
        record = line.record
        if isinstance(record, RunResumed):
            # The resumed segment re-runs these rows and publishes its own matrix.
            rerun = {str(index) for index in record.rerun_rows}
            for key in list(opened):
                row = str(rows_of_cells.get(key[1], "")) if key[0] == "cell" else key[1]
                if row in rerun:
                    del opened[key]
            matrix_published = False
        elif isinstance(record, CellOpened):
            opened.setdefault(("cell", record.cell_id), line.seq)
            rows_of_cells[record.cell_id] = record.row_index
        elif isinstance(record, RowOpened) and record.row_dir:
            opened.setdefault(("row", str(record.row_index)), line.seq)
        elif isinstance(record, ReceiptPublished):
            if record.scope == "matrix":
                matrix_published = True
            elif record.scope == "cell" and record.cell_id is not None:
                published.add(("cell", record.cell_id))
            elif record.scope == "row" and record.row_index is not None:
                published.add(("row", str(record.row_index)))
    problems: list[str] = []
    for wanted in ("cell", "row"):
        first = next(
            (
                (key, seq)
                for key, seq in opened.items()
                if key[0] == wanted and key not in published
            ),
            None,
        )
        if first is not None:
            (kind, name), seq = first
            problems.append(f"{kind} {name} opened at seq {seq} never published its receipt")
    if not matrix_published:
        problems.append(f"no {MATRIX_FILENAME} was published")
    if not lines or not isinstance(lines[-1].record, JournalSealed):
        problems.append("the journal is not sealed")
    if not problems:
        return None
    last_seq = lines[-1].seq if lines else 0
    return "; ".join(problems) + f" (the trusted journal ends at seq {last_seq})"


def _unreadable(report: ReplayReport, refusals: Iterable[Refusal]) -> None:
    report.unreadable = True
    for refusal in refusals:
        report.say(f"unreadable: {refusal.line()}")


def _superseded_path(path: str, seq: int, resumes: list[tuple[int, RunResumed]]) -> str:
    """Where a receipt published at ``seq`` lies now: under the superseded directory of the
    first later resume that moved it aside, else where it was published."""
    for resumed_at, resumed in resumes:
        if resumed_at <= seq:
            continue
        for moved in resumed.moved:
            if path == moved or path.startswith(moved.rstrip("/") + "/"):
                return f"{resumed.superseded_dir}/{path}"
    return path


def _compare_published(report: ReplayReport, root: str, lines: tuple[JournalLine, ...]) -> set[str]:
    """Re-fold every publication with the journal as it stood when it was published (a later
    ``run_resumed`` changes what later folds see, never what an earlier one saw)."""
    journaled: set[str] = set()
    resumes = [(line.seq, line.record) for line in lines if isinstance(line.record, RunResumed)]
    index = JournalIndex()
    for line in lines:
        index.add(line)
        record = line.record
        if not isinstance(record, ReceiptPublished):
            continue
        where = _superseded_path(record.path, line.seq, resumes)
        journaled.add(os.path.normpath(where))
        name = f"{where} (seq {line.seq}, through {record.through_seq})"
        cell_dir = os.path.join(root, os.path.dirname(where))
        try:
            if record.scope == "cell":
                # Its inline rows come from the rows file, as at publication.
                expected = refold_cell(index, record, cell_rows(cell_dir))
            else:
                expected = refold(index, record, REFOLDERS)
        except Refused as refused:
            if refused.codes == ["fold.scope.unsupported"]:
                _unreadable(report, refused.refusals)
            else:
                report.differs = True
                report.mismatched.append(record.path)
                report.say(f"DIFFERS {name}: cannot be re-folded: {refused}")
            continue
        on_disk = _read_receipt(report, root, where, name)
        if on_disk is None:
            continue
        disk_sha = hashlib.sha256(on_disk).hexdigest()
        problems = []
        if disk_sha != record.sha256:
            problems.append("the file changed after it was published (sha256 differs)")
        if on_disk != expected:
            problems.append(
                f"re-folded bytes differ from the file {_first_difference(expected, on_disk)}"
            )
        elif record.scope == "cell" and record.cell_id is not None:
            problems += _tally_problems(index, record.cell_id, record.through_seq, cell_dir)
        if problems:
            report.differs = True
            report.mismatched.append(where)
            report.say(f"DIFFERS {name}: " + "; ".join(problems))
        else:
            report.identical.append(where)
            report.say(f"identical {name}")
    return journaled


def _tally_problems(index: JournalIndex, cell_id: str, through: int, cell_dir: str) -> list[str]:
    """A cell receipt holds only when its rows file streams to the digest of every
    ``rung_rows`` record (read a chunk at a time: no read cap applies) and re-tallies to the
    facts every ``rung_completed`` record holds, which the receipt's summaries came from."""
    opened: CellOpened | None = None
    segments: list[RungRows] = []
    completed: dict[int, RungCompleted] = {}
    for line in index.lines_for_cell(cell_id):
        record = line.record
        if line.seq > through:
            break
        if isinstance(record, CellOpened) and record.cell_id == cell_id:
            opened = opened or record
        elif isinstance(record, RungRows) and record.cell_id == cell_id:
            segments.append(record)
        elif isinstance(record, RungCompleted) and record.cell_id == cell_id:
            completed[record.rung_index] = record
    if opened is None or not segments:
        return []
    try:
        facts = tally_cell(opened, completed, cell_rows(cell_dir)(segments))
    except Refused as refused:
        return [f"its rows file does not hold: {refused}"]
    return [
        f"rung {rung}: its rows re-tally to other facts than its rung_completed record holds"
        for rung, record in sorted(completed.items())
        if record.tally != facts.get(rung)
    ]


def _read_receipt(report: ReplayReport, root: str, relative: str, name: str) -> bytes | None:
    path = os.path.normpath(os.path.join(root, relative))
    if not path.startswith(root + os.sep):
        report.unreadable = True
        report.say(f"unreadable {name}: path leaves the run directory")
        return None
    try:
        return read_bounded(path, RECEIPT_READ_LIMIT, what="receipt").data
    except Refused as refused:
        if refused.codes == ["file.missing"]:
            report.differs = True
            report.mismatched.append(relative)
            report.say(f"DIFFERS {name}: the journal says it was published but the file is gone")
        else:
            report.unreadable = True
            report.say(f"unreadable {name}: {refused}")
        return None


def _first_difference(expected: bytes, actual: bytes) -> str:
    limit = min(len(expected), len(actual))
    offset = next((i for i in range(limit) if expected[i] != actual[i]), limit)
    line_no = expected.count(b"\n", 0, offset) + 1
    want = expected.splitlines()[line_no - 1 : line_no] or [b"<end of file>"]
    got = actual.splitlines()[line_no - 1 : line_no] or [b"<end of file>"]
    fold_text = want[0].decode(errors="replace").strip()
    file_text = got[0].decode(errors="replace").strip()
    return f"at byte {offset}, line {line_no}: fold gives {fold_text!r}, file has {file_text!r}"


class _ReceiptHead(msgspec.Struct):
    journal_through_seq: int = 0


def _account_for_files(report: ReplayReport, root: str, journaled: set[str], last_seq: int) -> None:
    """Every receipt file on disk must be named by a trusted receipt_published record."""
    for relative in _receipt_files(root):
        if os.path.normpath(relative) in journaled:
            continue
        report.differs = True
        report.mismatched.append(relative)
        through = _through_seq_of(os.path.join(root, relative))
        if through is not None and through > last_seq:
            report.first_bad_seq = min(report.first_bad_seq or last_seq + 1, last_seq + 1)
            report.say(
                f"DIFFERS {relative}: folded through seq {through} but the trusted journal ends "
                f"at seq {last_seq} (first missing seq {last_seq + 1})"
            )
        else:
            report.say(f"DIFFERS {relative}: no receipt_published record in the trusted journal")


def _through_seq_of(path: str) -> int | None:
    try:
        data = read_bounded(path, RECEIPT_READ_LIMIT, what="receipt").data
        return msgspec.json.decode(data, type=_ReceiptHead).journal_through_seq
    except (Refused, msgspec.DecodeError):
        return None


def _receipt_files(root: str) -> Iterator[str]:
    for directory, dirs, files in os.walk(root, followlinks=False):
        dirs.sort()
        for name in sorted(files):
            at_root = directory == root and name == MATRIX_FILENAME
            if name in RECEIPT_NAMES or at_root:
                yield os.path.relpath(os.path.join(directory, name), root)


# --- reaping -------------------------------------------------------------------------------


def refuse_while_runner_lives(lines: Sequence[JournalLine]) -> None:
    """Refuse --reap while the process that ran the journal's run is still alive.

    Its hosts are not orphans then: they are the run's own, mid-ladder, and reaping them
    would turn a live run's receipts into faults. A runner pid now used by another process
    (different create time) is gone; journals from before the runner was recorded carry no
    identity and are reaped as before.
    """
    run_id = next((ln.record.run_id for ln in lines if isinstance(ln.record, RunStarted)), "")
    for line in lines:
        started = line.record
        if not isinstance(started, RunStarted | RunResumed) or started.runner_pid is None:
            continue
        if started.runner_create_time is None or not _alive_as(
            started.runner_pid, started.runner_create_time
        ):
            continue
        raise Refused.one(
            "replay.reap.run_alive",
            f"$.journal[seq {line.seq}].runner_pid",
            f"run {run_id} is still going: its runner, pid {started.runner_pid}, "
            "is alive, so its hosts are not orphans",
            "let the run finish, or stop it with Ctrl-C / SIGTERM (it cleans up its hosts); "
            "reap only a run whose runner has died",
        )


def _alive_as(pid: int, create_time: float) -> bool:
    try:
        process = psutil.Process(pid)
        same = abs(process.create_time() - create_time) <= CREATE_TIME_TOLERANCE_S
        return same and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # cannot tell: a process we may not inspect is not ours to reap around


def reap_children(
    report: ReplayReport, lines: Sequence[JournalLine], grace_s: float, root: str
) -> list[int]:
    """End every journaled child still alive as itself (and its descendants), and every
    process carrying the run's environment tag; the pids signalled. Only a process that still
    carries this run's tag (``CACHE_FAMILY_CELL``, whose run part a journaled host's
    environment names) is ever ended: a journaled pid without it (a forged record, a reused
    pid, a journal from before hosts were tagged) is left alone, and so are its descendants.
    The tag must also name this journal's run, and that run must be dead: a host whose tag
    names another run, a runner still alive, or a run directory whose lock another process
    holds is left alone (a forged journal may copy any live run's tag). ``root`` is the run
    directory being reaped, whose lock this process holds.
    Call only once ``refuse_while_runner_lives`` passed and the journal verified."""
    spawned = [line.record for line in lines if isinstance(line.record, ChildSpawned)]
    if not spawned:
        report.say("reap: the journal records no child process")
        return []
    run_ids = {line.record.run_id for line in lines if isinstance(line.record, RunStarted)}
    tagged = tagged_processes(_run_tag_matcher(spawned))
    targets: dict[int, psutil.Process] = {}
    for child in spawned:
        label = f"pid {child.pid} ({child.role}, cell {child.cell_id or '-'})"
        try:
            process = psutil.Process(child.pid)
            create_time = process.create_time()
        except psutil.NoSuchProcess:
            report.say(f"reap: {label} is not running")
            continue
        except psutil.AccessDenied:
            report.say(f"reap: {label} cannot be inspected (access denied); left alone")
            continue
        if abs(create_time - child.create_time) > CREATE_TIME_TOLERANCE_S:
            report.say(
                f"reap: {label} now belongs to another process (created {create_time}, journal "
                f"says {child.create_time}); left alone"
            )
            continue
        if tagged.get(child.pid) != create_time:
            report.say(
                f"reap: {label} does not carry this run's {PROCESS_TAG_NAME} tag in its "
                "environment: not this run's process; it and its descendants are left alone"
            )
            continue
        why = _not_this_dead_runs(child.pid, run_ids, root)
        if why is not None:
            report.say(f"reap: {label} {why}; it and its descendants are left alone")
            continue
        targets[process.pid] = process
        try:
            for descendant in process.children(recursive=True):
                targets.setdefault(descendant.pid, descendant)
        except psutil.NoSuchProcess:
            pass
    for pid, created in tagged.items():
        try:
            process = psutil.Process(pid)
        except psutil.Error:
            continue
        if pid not in targets and process.create_time() == created:
            why = _not_this_dead_runs(pid, run_ids, root)
            if why is not None:
                report.say(f"reap: pid {pid} carries the tag but {why}; left alone")
                continue
            report.say(f"reap: pid {pid} carries the run's environment tag (left the group)")
            targets[pid] = process
    if not targets:
        return []
    outcome = end_processes(list(targets.values()), grace=grace_s, kill_wait=grace_s)
    for name, pid in outcome.denied:
        if name == "SIGTERM":
            report.say(f"reap: SIGTERM to pid {pid} denied")
    if outcome.ended:
        report.say(f"reap: ended with SIGTERM: {sorted(outcome.ended)}")
    if outcome.forced:
        for name, pid in outcome.denied:
            if name == "SIGKILL":
                report.say(f"reap: SIGKILL to pid {pid} denied")
        report.say(f"reap: killed with SIGKILL after {grace_s:g} s: {sorted(outcome.forced)}")
        if outcome.survivors:
            report.say(f"reap: STILL ALIVE after SIGKILL: {sorted(outcome.survivors)}")
    return sorted(targets)


def _run_tag_matcher(spawned: Sequence[ChildSpawned]) -> Callable[[str], bool]:
    """Whether a process tag belongs to this run: its run part (before the first "/") is that
    of a journaled host's tag. Journals from before hosts were tagged match nothing (and so
    reap nothing)."""
    runs: set[str] = set()
    for child in spawned:
        tag = (child.effective_environment or {}).get(PROCESS_TAG_NAME, "")
        run, slash, _ = tag.partition("/")
        if run and slash:
            runs.add(run + "/")
    return lambda tag: any(tag.startswith(run) for run in runs)


def _not_this_dead_runs(pid: int, run_ids: set[str], root: str) -> str | None:
    """Why the tagged process ``pid`` is not a dead run's of this journal, or None. Its tag
    must name one of ``run_ids`` and a runner that is gone, and no other process may hold
    the lock of the run directory it works in."""
    tag = process_tag_of(pid)
    run = parse_run_tag(tag) if tag is not None else None
    if run is None:
        return "carries a tag that names no run (from before runs were named in tags)"
    if run.run_id not in run_ids:
        return f"belongs to run {run.run_id}, not to this journal's"
    if _alive_as(run.runner_pid, run.runner_create_time):
        return f"belongs to a live run: its runner, pid {run.runner_pid}, is alive"
    locked = _run_dir_locked_elsewhere(pid, root)
    if locked is not None:
        return f"works in {locked}, whose lock another process holds (a live run)"
    return None


def _run_dir_locked_elsewhere(pid: int, root: str) -> str | None:
    """The run directory ``pid`` works in (the nearest one above its working directory) when
    another process holds its lock; None when it is ``root`` (ours), unlocked or not found."""
    try:
        directory = psutil.Process(pid).cwd()
    except psutil.Error:
        return None
    ours = os.path.realpath(root)
    while True:
        if os.path.isfile(os.path.join(directory, JOURNAL_FILENAME)):
            if os.path.realpath(directory) == ours or not lock_held(directory):
                return None
            return directory
        parent = os.path.dirname(directory)
        if parent == directory:
            return None
        directory = parent
