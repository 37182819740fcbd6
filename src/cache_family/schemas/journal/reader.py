"""The journal's reader: verify the hash chain and the seals, decode every line, never raise.

Lines after the first break are never returned, because nothing vouches for them; records a
newer writer added are reported (``NEWER_WRITER_CODES``) and the chain is checked around them.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import operator
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

import msgspec

from cache_family.errors import Refusal
from cache_family.schemas.journal.chain import (
    GENESIS_PREV,
    JournalLine,
    encode_line,
    line_sha256,
    seal_digest,
)
from cache_family.schemas.journal.records import (
    KNOWN_TAGS,
    JournalSealed,
    ReceiptPublished,
    Record,
    RunResumed,
)

# What a newer writer's journal looks like to this reader: replay calls it unreadable (exit 2)
# and keeps verifying the chain around it.
UNKNOWN_TYPE: Final = "journal.record.unknown_type"
UNKNOWN_FIELD: Final = "journal.record.unknown_field"
NEWER_WRITER_CODES: Final = frozenset((UNKNOWN_TYPE, UNKNOWN_FIELD))


class _LooseLine(msgspec.Struct, frozen=True, kw_only=True):
    """Just enough of a line to check the chain when its record cannot be typed."""

    seq: int
    prev: str
    record: msgspec.Raw


class _LooseRecord(msgspec.Struct, frozen=True):
    type: str


_DECODER: Final = msgspec.json.Decoder(JournalLine)
_LOOSE_DECODER: Final = msgspec.json.Decoder(_LooseLine)
_LOOSE_RECORD_DECODER: Final = msgspec.json.Decoder(_LooseRecord)


@dataclass(frozen=True, slots=True)
class ChainBreak:
    """The first place the journal stops being trustworthy.

    ``seq`` is the first sequence number that cannot be trusted (the line that is missing,
    torn, undecodable, out of place or whose bytes differ from what its successor recorded).
    """

    seq: int
    line_no: int
    code: str
    message: str

    def refusal(self) -> Refusal:
        return Refusal(
            self.code,
            f"$.journal[{self.line_no - 1}]",
            f"seq {self.seq}: {self.message}",
            "the journal was truncated or edited after it was written; receipts after this "
            "seq cannot be replayed",
        )


@dataclass(frozen=True, slots=True)
class JournalRead:
    """The trusted prefix of a journal and what, if anything, is wrong after it."""

    lines: tuple[JournalLine, ...]
    line_sha256s: tuple[str, ...]
    chain_break: ChainBreak | None = None
    # Records of a newer writer (or edited ones) this reader cannot type: an unknown type or
    # field (``NEWER_WRITER_CODES``); replay refuses them.
    unknown_types: tuple[Refusal, ...] = field(default_factory=tuple)
    torn_tail: bool = False

    @property
    def last_seq(self) -> int:
        return self.lines[-1].seq if self.lines else 0

    @property
    def first_bad_seq(self) -> int | None:
        return self.chain_break.seq if self.chain_break else None


def read_journal(data: bytes) -> JournalRead:
    """Verify the hash chain and decode every line; never raises for bad content.

    A missing final newline is a torn last line (a crash mid-write): it is reported and never
    used. Lines after the first break are not returned, because nothing vouches for them.
    """
    with _gc_paused():
        intact = _read_intact(data)
        return intact if intact is not None else _read_checked(data)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Decoding a journal allocates millions of objects that all stay alive; the cyclic
    collector would scan them again and again (about half of replay's time) for nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _read_intact(data: bytes) -> JournalRead | None:
    """The common case in one pass: every line decodes typed (in one ``decode_lines`` call),
    seqs run 1..n and each ``prev`` is its predecessor's SHA-256. None at the first doubt:
    ``_read_checked`` then finds and names the break line by line."""
    if not data.endswith(b"\n"):
        return None
    try:
        lines = _DECODER.decode_lines(data)
    except msgspec.DecodeError:
        return None
    raw_lines = data.split(b"\n")
    raw_lines.pop()
    if len(raw_lines) != len(lines):
        return None
    shas: list[str] = []
    prev = GENESIS_PREV
    sha256 = hashlib.sha256
    for seq, (line, raw) in enumerate(zip(lines, raw_lines, strict=True), start=1):
        if line.seq != seq or line.prev != prev:
            return None
        prev = sha256(raw).hexdigest()
        shas.append(prev)
    return JournalRead(lines=tuple(lines), line_sha256s=tuple(shas))


def _read_checked(data: bytes) -> JournalRead:
    torn = bool(data) and not data.endswith(b"\n")
    raw_lines = data.split(b"\n")
    raw_lines.pop()  # the empty piece after the last "\n", or the torn tail
    decoded: list[JournalLine] = []
    shas: list[str] = []
    unknown: list[Refusal] = []
    prev_sha = GENESIS_PREV
    prev_mismatch_at: int | None = None  # line number whose prev disagreed with its predecessor
    chain_break: ChainBreak | None = None

    for index, raw in enumerate(raw_lines):
        line_no = index + 1
        sha = line_sha256(raw)
        seq, prev, typed, problem = _decode_one(raw, line_no)
        if problem is not None and problem.code in NEWER_WRITER_CODES:
            unknown.append(problem)
            problem = None
        if prev_mismatch_at is not None and (problem is not None or seq != line_no):
            # An earlier line is already suspect; it is the first untrusted one.
            chain_break = _altered(prev_mismatch_at - 1)
            break
        if problem is not None:
            chain_break = ChainBreak(line_no, line_no, problem.code, problem.message)
            break
        if seq != line_no:
            chain_break = ChainBreak(
                line_no,
                line_no,
                "journal.seq.out_of_order",
                f"line {line_no} carries seq {seq}: a line was removed, inserted or reordered",
            )
            break
        if prev != prev_sha:
            if prev_mismatch_at is not None:
                # Two disagreements in a row: the line between them was itself altered.
                chain_break = _altered(line_no - 1)
                break
            prev_mismatch_at = line_no
        elif prev_mismatch_at is not None:
            # Only the predecessor's bytes disagree with what this line's predecessor recorded.
            chain_break = _altered(prev_mismatch_at - 1)
            break
        if typed is not None:
            decoded.append(typed)
        shas.append(sha)
        prev_sha = sha

    if chain_break is None and prev_mismatch_at is not None:
        # The mismatch was on the last line: the earlier of the two candidates is reported.
        chain_break = _altered(prev_mismatch_at - 1)
    if chain_break is None and torn:
        line_no = len(raw_lines) + 1
        chain_break = ChainBreak(
            line_no,
            line_no,
            "journal.line.torn",
            "the last line has no newline terminator (the writer stopped mid-line)",
        )
    trusted = chain_break.seq - 1 if chain_break else len(shas)
    return JournalRead(
        lines=tuple(line for line in decoded if line.seq <= trusted),
        line_sha256s=tuple(shas[:trusted]),
        chain_break=chain_break,
        unknown_types=tuple(u for u in unknown if _seq_of(u) <= trusted),
        torn_tail=torn,
    )


def _altered(seq: int) -> ChainBreak:
    seq = max(seq, 1)
    return ChainBreak(
        seq,
        seq,
        "journal.chain.broken",
        "the line's bytes differ from the SHA-256 its successor recorded (edited after writing)",
    )


def _seq_of(refusal: Refusal) -> int:
    return int(refusal.path.removeprefix("$.journal[").removesuffix("]")) + 1


def _unknown_field(exc: msgspec.DecodeError) -> str | None:
    """msgspec's "Object contains unknown field `x` - at `$...`", as "field `x` (at ...)"."""
    text = str(exc)
    if not text.startswith("Object contains unknown field"):
        return None
    return "field " + text.removeprefix("Object contains unknown field ").replace(" - at ", " at ")


def _decode_one(raw: bytes, line_no: int) -> tuple[int, str, JournalLine | None, Refusal | None]:
    """(seq, prev, typed line or None, problem or None) for one line's bytes."""
    try:
        typed = _DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        unknown_field = _unknown_field(exc)
    else:
        return typed.seq, typed.prev, typed, None
    where = f"$.journal[{line_no - 1}]"
    try:
        loose = _LOOSE_DECODER.decode(raw)
        tag = _LOOSE_RECORD_DECODER.decode(loose.record).type
    except msgspec.DecodeError:
        return (
            line_no,
            "",
            None,
            Refusal(
                "journal.line.undecodable",
                where,
                f"line {line_no} is not a journal line",
                "the line was edited or corrupted",
            ),
        )
    if tag not in KNOWN_TAGS:
        return (
            loose.seq,
            loose.prev,
            None,
            Refusal(
                UNKNOWN_TYPE,
                where,
                f"record type {tag!r} at seq {loose.seq} is unknown to this version",
                "replay with the cache-family version that wrote the journal, or a newer one",
            ),
        )
    if unknown_field is not None:
        return (
            loose.seq,
            loose.prev,
            None,
            Refusal(
                UNKNOWN_FIELD,
                where,
                f"a {tag!r} record at seq {loose.seq} carries {unknown_field}, unknown to "
                "this version",
                "replay with the cache-family version that wrote the journal; a journal "
                "edited and re-chained by hand carries such fields too",
            ),
        )
    return (
        loose.seq,
        loose.prev,
        None,
        Refusal(
            "journal.line.undecodable",
            where,
            f"line {line_no}: a {tag!r} record does not match its schema",
            "the line was edited or corrupted",
        ),
    )


# --- the seals ------------------------------------------------------------------------------------


def seal_problems(data: bytes, read: JournalRead) -> list[Refusal]:
    """What is wrong with the seals of a journal's trusted lines (empty when all hold).

    Every ``journal_sealed`` must hold the digest of the bytes before it and of its own line,
    name its predecessor as its head, be written canonically, and be followed by nothing but a
    ``run_resumed`` (a later segment) or the end of the journal. The matrix's publication is
    followed by the seal and nothing else (``finish_run`` writes the two back to back; only a
    runner that died between them leaves a ``run_resumed`` there), so a record slipped in
    after the matrix, with the seal recomputed over it, is refused too.
    """
    lines = read.lines
    # Only seals, the matrix's publication and the line after each matter; they are found
    # over the whole column in C (``list.index``), so a long journal costs no Python per line.
    kinds = list(map(type, map(_RECORD, lines)))
    seals = _positions(kinds, JournalSealed)
    matrices = [
        p
        for p in _positions(kinds, ReceiptPublished)
        if isinstance(published := lines[p].record, ReceiptPublished)
        and published.scope == "matrix"
    ]
    follows_seal = {p + 1 for p in seals}
    follows_matrix = {p + 1 for p in matrices}
    problems: list[Refusal] = []
    running = hashlib.sha256()
    hashed = 0  # how many of data's bytes ``running`` holds
    cursor = _LineCursor(data)
    for position in sorted(follows_seal | follows_matrix | set(seals)):
        if position >= len(lines):
            continue
        line = lines[position]
        record = line.record
        where = f"$.journal[{position}]"
        if position in follows_seal and not isinstance(record, RunResumed):
            problems.append(
                Refusal(
                    "journal.seal.trailing_record",
                    where,
                    f"seq {line.seq}: a {_tag(record)} record follows the seal at seq "
                    f"{lines[position - 1].seq}; only run_resumed may",
                    _AFTER_THE_END,
                )
            )
        if position in follows_matrix and not isinstance(record, JournalSealed | RunResumed):
            problems.append(
                Refusal(
                    "journal.matrix.trailing_record",
                    where,
                    f"seq {line.seq}: a {_tag(record)} record follows the matrix's publication "
                    f"at seq {lines[position - 1].seq}; only the seal may (or run_resumed, when "
                    "the runner died between the two)",
                    _AFTER_THE_END,
                )
            )
        if not isinstance(record, JournalSealed):
            continue
        start, end = cursor.span(position)
        running.update(data[hashed:start])
        hashed = start
        if encode_line(line) != data[start:end]:
            problems.append(
                Refusal(
                    "journal.seal.noncanonical",
                    where,
                    f"seq {line.seq}: the seal line is not in its canonical form",
                    _SEAL_EDITED,
                )
            )
        elif seal_digest(running, line) != record.digest:
            problems.append(
                Refusal(
                    "journal.seal.digest",
                    where,
                    f"seq {line.seq}: the seal's digest does not match the journal's bytes "
                    "(an earlier line or the seal itself was edited)",
                    _SEAL_EDITED,
                )
            )
        if record.head_sha256 != line.prev or record.through_seq != line.seq - 1:
            problems.append(
                Refusal(
                    "journal.seal.head",
                    where,
                    f"seq {line.seq}: the seal names another head than its line",
                    _SEAL_EDITED,
                )
            )
    return problems


_RECORD: Final = operator.attrgetter("record")


def _positions(items: list[type], wanted: type) -> list[int]:
    """Every index of ``wanted`` in ``items``, each found by ``list.index`` (in C)."""
    found: list[int] = []
    position = -1
    while True:
        try:
            position = items.index(wanted, position + 1)
        except ValueError:
            return found
        found.append(position)


class _LineCursor:
    """Byte spans of a journal's lines by line number, moving forward only: the newlines
    between two asked-for lines are skipped in C (``re.finditer`` under ``islice``)."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._line = 0  # the line that starts at ``_offset``
        self._offset = 0

    def span(self, line: int) -> tuple[int, int]:
        """(start, end) of line ``line`` (0-based), ``end`` at its newline."""
        if line < self._line:
            raise ValueError(f"line {line} is behind the cursor at line {self._line}")
        if line > self._line:
            skipped = _NEWLINE.finditer(self._data, self._offset)
            newline = next(itertools.islice(skipped, line - self._line - 1, None))
            self._line, self._offset = line, newline.end()
        return self._offset, self._data.index(b"\n", self._offset)


_NEWLINE: Final = re.compile(b"\n")


_AFTER_THE_END: Final = (
    "the journal was extended after the run ended; compare its head with the one the run "
    "printed (replay --expect-head) or verify the head's signature"
)
_SEAL_EDITED: Final = "the journal's last segment was edited after the run sealed it"


def _tag(record: Record) -> str:
    return str(type(record).__struct_config__.tag)
