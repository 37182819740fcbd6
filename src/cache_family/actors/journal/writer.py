"""The journal writer: the one task that appends to ``journal.jsonl``, and receipt publication.

Start it with ``nursery.start`` in a nursery that outlives every actor that journals (cleanup
records come after cancellation). Seq order is call order: ``append_nowait`` stamps and queues
without a checkpoint between. Observations are buffered and written with the next durable record
(one write, one fsync); only state changes are promised durable. The queue is unbounded on
purpose: a bounded one would let a cancelled sender leave a hole in the seqs.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Generic, TypeVar, cast

import trio

from cache_family.actors.journal.rows_file import cell_rows
from cache_family.errors import Refused
from cache_family.schemas.bounded import read_bounded
from cache_family.schemas.journal import (
    JOURNAL_FILENAME,
    JournalChain,
    JournalSealed,
    ReceiptPublished,
    Record,
    read_journal,
)
from cache_family.schemas.receipts import (
    CellReceipt,
    RowReceipt,
    decode_cell_receipt,
    decode_row_receipt,
    encode_receipt,
)
from cache_family.states.fold import JournalIndex, fold_cell, fold_row
from cache_family.system.publish import fsync_dir, publish_fresh

# A week-long run journals a few million short lines; replay and resume read at most this much.
JOURNAL_READ_LIMIT: Final = 4 * 1024 * 1024 * 1024
# Buffered observations are written once they reach this much, durable point or not.
FLUSH_BYTES: Final = 1024 * 1024

# The queue is one flat list of (mono_ns, wall_ns, record) triples: a record's seq is its
# place in it (the first queued one's is the chain's next). Flat, because an append then
# allocates nothing that outlives it (a queued tuple per record kept the cyclic collector
# busy) and a batch splits into its columns by three strided slices. A state change's wait
# is a ``_SyncRequest`` through its seq, queued beside it.
_FIELDS: Final = 3


@dataclass(slots=True)
class _SyncRequest:
    """Write everything through seq ``through``; fsync it too when ``durable``."""

    through: int
    done: trio.Event
    durable: bool = True


def journal_path(run_dir: str) -> str:
    return os.path.join(run_dir, JOURNAL_FILENAME)


def _trio_monotonic_ns() -> int:
    return round(trio.current_time() * 1e9)


def _system_clock_offset_ns(clock: trio.abc.Clock) -> int | None:
    """For trio's default clock (``offset + time.perf_counter()``), its offset in ns: its
    reading is then ``time.perf_counter_ns()`` plus that (within a nanosecond), two C calls
    instead of three Python-level ones. None for any other clock (the autojump clock)."""
    offset = getattr(clock, "offset", None)
    kind = type(clock)
    if kind.__name__ != "SystemClock" or not kind.__module__.startswith("trio."):
        return None
    return round(offset * 1e9) if isinstance(offset, float) else None


class JournalWriter:
    """Single writer of one run's journal. See the module docstring for the protocol."""

    def __init__(
        self,
        path: str,
        *,
        fsync: Callable[[int], None] = os.fsync,
        monotonic_ns: Callable[[], int] = _trio_monotonic_ns,
        wall_ns: Callable[[], int] = time.time_ns,
        batch_max: int = 4096,
        flush_bytes: int = FLUSH_BYTES,
        resume: bool = False,
        on_record: Callable[[Record, int], None] | None = None,
    ) -> None:
        self.path = path
        # Shown every record as it is stamped (with its monotonic ns): the progress display.
        self._on_record = on_record
        self.index = JournalIndex()
        self.fsync_count = 0
        self._fsync = fsync
        self._monotonic_ns = monotonic_ns
        # The hot path reads ``_clock_ns() + _clock_offset_ns`` (see ``run``).
        self._clock_ns = monotonic_ns
        self._clock_offset_ns = 0
        self._wall_ns = wall_ns
        self._batch_max = batch_max
        self._flush_bytes = flush_bytes
        self._resume = resume
        self._chain = JournalChain()
        # Every byte written so far, for the seal (``seal``).
        self._bytes_digest = hashlib.sha256()
        self.head_sha256: str | None = None
        self._next_seq = 1
        self._written_seq = 0
        self._durable_seq = 0
        self._state = "created"
        self._failure: BaseException | None = None
        self._fd: int | None = None
        self._queue: list[int | Record] = []
        # Triples before this one are taken (see ``_take``).
        self._queue_head = 0
        # In ``through`` order: each is answered once everything through it is written.
        self._syncs: deque[_SyncRequest] = deque()
        self._wakeup = trio.Event()
        # True while the writer task waits for work: only then does an append wake it.
        self._asleep = False
        self._closing = False
        # Chained but not yet written: the lines' bytes (without newlines), their records,
        # the first one's seq and how many bytes they hold.
        self._buffered: list[bytes] = []
        self._buffered_records: list[Record] = []
        self._buffered_first = 1
        self._buffered_bytes = 0
        self._finished = trio.Event()
        self._progress = trio.Event()

    # -- state ------------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def written_seq(self) -> int:
        return self._written_seq

    @property
    def durable_seq(self) -> int:
        return self._durable_seq

    @property
    def pending(self) -> int:
        return self._next_seq - 1 - self._written_seq

    @property
    def state(self) -> str:
        return self._state

    def __repr__(self) -> str:
        return (
            f"<JournalWriter {self.path} state={self._state} next_seq={self._next_seq} "
            f"written={self._written_seq} durable={self._durable_seq} pending={self.pending} "
            f"fsyncs={self.fsync_count}>"
        )

    # -- the API callers use -----------------------------------------------------------------

    def append_nowait(self, record: Record) -> int:
        """Stamp and queue ``record``; returns its seq. Never blocks, never checkpoints."""
        if self._failure is None and self._state == "running":
            # The hot path: stamp and queue, nothing else (``_enqueue`` inlined: this is
            # called once per request row).
            seq = self._next_seq
            mono_ns = self._clock_ns() + self._clock_offset_ns
            self._queue += (mono_ns, self._wall_ns(), record)
            self._next_seq = seq + 1
            if self._asleep:
                self._asleep = False
                self._wakeup.set()
            if self._on_record is not None:
                self._on_record(record, mono_ns)
            return seq
        return self._enqueue(record)

    async def append(self, record: Record, *, durable: bool | None = None) -> int:
        """Queue ``record``; for a state change (or ``durable=True``) wait until it is fsynced."""
        seq = self._enqueue(record)
        if not (record.durable if durable is None else durable):
            await trio.lowlevel.checkpoint()
            return seq
        # Queued with the record, no checkpoint between: answered once it is written with
        # everything before it, and fsynced.
        done = trio.Event()
        self._put(_SyncRequest(seq, done))
        await done.wait()
        self._raise_if_failed()
        return seq

    async def sync(self) -> int:
        """Wait until everything queued so far is written and fsynced; returns that seq."""
        self._raise_if_failed()
        done = trio.Event()
        self._put(_SyncRequest(self._next_seq - 1, done))
        await done.wait()
        self._raise_if_failed()
        return self._durable_seq

    async def wait_written(self, seq: int) -> None:
        """Wait until line ``seq`` is written (not necessarily fsynced) or the writer stopped."""
        if self._written_seq < seq and not self._finished.is_set():
            # Buffered observations are written now rather than with the next state change.
            self._put(_SyncRequest(self._next_seq - 1, trio.Event(), durable=False))
        while self._written_seq < seq and not self._finished.is_set():
            await self._progress.wait()
        self._raise_if_failed()

    async def aclose(self) -> None:
        """Write what is queued, fsync, close the file and end ``run``."""
        if self._state in ("created", "failed", "closed") and self._finished.is_set():
            self._raise_if_failed()
            return
        if self._state == "created":
            self._state = "closed"
            self._finished.set()
            return
        self._closing = True
        self._wakeup.set()
        await self._finished.wait()
        self._raise_if_failed()

    async def seal(self, *, matrix_status: str | None, terminal_refusal: str | None) -> str:
        """Write everything queued, then the ``journal_sealed`` line, fsynced; nothing can be
        appended afterwards. Returns the SHA-256 of the seal line: the journal's head."""
        through = await self.sync()
        self._state = "sealed"
        record = JournalSealed(
            through_seq=through,
            head_sha256=self._chain.prev,
            matrix_status=matrix_status,
            terminal_refusal=terminal_refusal,
        )
        line, data = self._chain.seal(
            record,
            self._bytes_digest,
            mono_ns=self._clock_ns() + self._clock_offset_ns,
            wall_ns=self._wall_ns(),
        )
        self._next_seq += 1
        with trio.CancelScope(shield=True):
            try:
                await trio.to_thread.run_sync(self._write, data, True)
            except OSError as exc:
                self._failure = exc
                self._raise_if_failed()
        self.index.add(line)
        self._written_seq = self._durable_seq = line.seq
        self.head_sha256 = self._chain.prev
        return self._chain.prev

    def _enqueue(self, record: Record) -> int:
        self._raise_if_failed()
        if self._state == "sealed":
            raise Refused.one(
                "journal.sealed",
                "$.journal",
                f"journal {self.path} is sealed; {type(record).__name__} not written",
                "nothing is appended after the seal; resume the run to continue it",
            )
        if self._state not in ("created", "running"):
            raise Refused.one(
                "journal.closed",
                "$.journal",
                f"journal {self.path} is {self._state}; {type(record).__name__} not written",
                "journal before closing the writer",
            )
        seq = self._next_seq
        mono_ns = self._clock_ns() + self._clock_offset_ns
        self._queue += (mono_ns, self._wall_ns(), record)
        self._wakeup.set()
        self._next_seq += 1
        if self._on_record is not None:
            self._on_record(record, mono_ns)
        return seq

    def _put(self, request: _SyncRequest) -> None:
        self._syncs.append(request)
        self._wakeup.set()

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise Refused.one(
                "journal.write.failed",
                "$.journal",
                f"journal {self.path} could not be written: {self._failure}",
                "check free space and permissions of the run directory; the run stops",
            ) from self._failure

    # -- the writer task ---------------------------------------------------------------------

    async def run(
        self, *, task_status: trio.TaskStatus[JournalWriter] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            await trio.to_thread.run_sync(self._open)
        except BaseException:
            self._state = "failed"
            self._finished.set()
            raise
        if self._monotonic_ns is _trio_monotonic_ns:
            # The same reading as trio.current_time(), without its per-call lookup.
            clock = trio.lowlevel.current_clock()
            offset = _system_clock_offset_ns(clock)
            if offset is not None:
                self._clock_ns, self._clock_offset_ns = time.perf_counter_ns, offset
            else:
                self._clock_ns = lambda: round(clock.current_time() * 1e9)
        self._state = "running"
        task_status.started(self)
        syncs = self._syncs
        try:
            while True:
                if not self.queued and not syncs:
                    if self._closing:
                        break
                    self._asleep = True
                    await self._wakeup.wait()
                    self._wakeup = trio.Event()
                    self._asleep = False
                    continue
                # Written without a checkpoint: no cancellation can split a batch.
                self._write_batch(self._take(self._batch_max), force_sync=False)
                if self.queued:
                    await trio.lowlevel.checkpoint()  # a long backlog never starves the loop
        except BaseException as exc:
            if self._failure is None and not isinstance(exc, trio.Cancelled):
                self._failure = exc
            raise
        finally:
            # Even when cancelled, what was queued is written: cleanup records matter most.
            with trio.CancelScope(shield=True):
                await self._finish()

    async def _finish(self) -> None:
        self._closing = True
        rest = self._take(self.queued)
        try:
            if self._failure is None and self._fd is not None:
                self._write_batch(rest, force_sync=True)
        except OSError as exc:
            self._failure = exc
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._state = "failed" if self._failure else "closed"
            while self._syncs:
                self._syncs.popleft().done.set()
            self._finished.set()
            self._progress.set()

    @property
    def queued(self) -> int:
        """Records appended and not yet taken by the writer task."""
        return len(self._queue) // _FIELDS - self._queue_head

    def _take(self, most: int) -> list[int | Record]:
        """The next ``most`` (or fewer) queued triples, flat, in order."""
        queue, head = self._queue, self._queue_head
        if self.queued <= most:
            taken = queue[head * _FIELDS :] if head else queue
            self._queue, self._queue_head = [], 0
            return taken
        self._queue_head = head + most
        taken = queue[head * _FIELDS : (head + most) * _FIELDS]
        if self._queue_head * 2 > len(queue) // _FIELDS:
            # Drop what was taken once it is half the list: amortised O(1) per record, and a
            # long backlog does not keep the list's head alive.
            del queue[: self._queue_head * _FIELDS]
            self._queue_head = 0
        return taken

    def _write_batch(self, batch: list[int | Record], *, force_sync: bool) -> None:
        """Chain the batch into the buffer; write (and fsync) the buffer when the batch holds a
        state change, when a sync request waits for it, when ``force_sync``, or when the buffer
        is full. Per record this does only the chain's own work (``encode_batch``): the rest
        runs over whole columns."""
        waiting: list[trio.Event] = []
        must_write = must_sync = force_sync
        if batch:
            monos = cast(list[int], batch[0::_FIELDS])
            walls = cast(list[int], batch[1::_FIELDS])
            records = cast(list[Record], batch[2::_FIELDS])
            if not self._buffered:
                self._buffered_first = self._chain.next_seq
            datas = self._chain.encode_batch(records, monos, walls)
            self._buffered += datas
            self._buffered_records += records
            # A line's bytes plus its newline.
            self._buffered_bytes += sum(map(len, datas)) + len(datas)
        chained = self._chain.next_seq - 1
        if chained + self.queued != self._next_seq - 1:
            raise AssertionError(f"journal chained {chained} + queued != {self._next_seq - 1}")
        syncs = self._syncs
        while syncs and syncs[0].through <= chained:
            request = syncs.popleft()
            waiting.append(request.done)
            must_write = True
            must_sync = must_sync or request.durable
        if must_write or self._buffered_bytes >= self._flush_bytes:
            self._flush(must_sync, waiting)
        for done in waiting:
            done.set()

    def _flush(self, must_sync: bool, waiting: list[trio.Event]) -> None:
        """Write the buffer in one ``write`` (plus one fsync when ``must_sync``)."""
        buffered, records, first = self._buffered, self._buffered_records, self._buffered_first
        self._buffered, self._buffered_records, self._buffered_bytes = [], [], 0
        if buffered:
            buffered.append(b"")  # for the last line's newline, without a copy of the data
            data = b"\n".join(buffered)
            buffered.pop()
        else:
            data = b""
        if data or must_sync:
            try:
                # In the event loop's own thread: one write (and one fsync) and no hand-off to
                # a worker thread, whose two wake-ups cost more than the fsync on a busy
                # machine. State changes happen between a cell's phases, not amid its requests.
                self._write(data, must_sync)
            except OSError as exc:
                self._failure = exc
                for done in waiting:
                    done.set()
                raise
        # The index decodes these very bytes when a fold reads them, so live folds equal
        # replay; decoding only then keeps it off the append path.
        self.index.add_written(first, records, buffered)
        if buffered:
            self._written_seq = first + len(buffered) - 1
        if must_sync:
            self._durable_seq = self._written_seq
        self._progress.set()
        self._progress = trio.Event()

    # -- file I/O (in worker threads) -------------------------------------------------------

    def _open(self) -> None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
        if self._resume and os.path.exists(self.path):
            self._load_existing()
            self._fd = os.open(self.path, flags)
            return
        try:
            self._fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise Refused.one(
                "journal.exists",
                "$.journal",
                f"{self.path} already exists",
                "a run directory gets one fresh journal; use a new output directory",
            ) from None
        fsync_dir(os.path.dirname(self.path) or ".")

    def _load_existing(self) -> None:
        raw = read_bounded(self.path, JOURNAL_READ_LIMIT, what="journal")
        read = read_journal(raw.data)
        problems = [read.chain_break.refusal()] if read.chain_break else []
        problems += list(read.unknown_types)
        if problems:
            raise Refused(tuple(problems))
        for line in read.lines:
            self.index.add(line)
        self._bytes_digest.update(raw.data)
        last = read.last_seq
        self._chain = JournalChain(
            next_seq=last + 1, prev=read.line_sha256s[-1] if read.line_sha256s else self._chain.prev
        )
        self._next_seq = last + 1
        self._written_seq = self._durable_seq = last

    def _write(self, data: bytes, must_sync: bool) -> None:
        fd = self._fd
        if fd is None:
            raise OSError("journal file is not open")
        self._bytes_digest.update(data)
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        if must_sync:
            self._fsync(fd)
            self.fsync_count += 1


# --- receipt publication -------------------------------------------------------------------


_Receipt = TypeVar("_Receipt", CellReceipt, RowReceipt)


@dataclass(frozen=True, slots=True)
class PublishedReceipt(Generic[_Receipt]):
    """A published receipt, decoded from the very bytes written, and the journal's record of it."""

    receipt: _Receipt
    record: ReceiptPublished


async def publish_cell_receipt(
    writer: JournalWriter, run_dir: str, cell_id: str, relative_path: str
) -> PublishedReceipt[CellReceipt]:
    """Fold ``cell.json`` from the durable journal, publish it fresh, journal the publication.

    Call in the cell's ``finalize`` state; then fire ``receipt-published`` on the machine and
    journal that transition.
    """

    def fold(through: int) -> CellReceipt:
        # The rows file the load runs wrote beside the receipt (read only for inline rows).
        rows = cell_rows(os.path.dirname(os.path.join(run_dir, relative_path)))
        return fold_cell(
            writer.index.lines_for_cell(cell_id), cell_id, through_seq=through, rows=rows
        )

    return await _publish_folded(
        writer, run_dir, relative_path, fold, decode_cell_receipt, scope="cell", cell_id=cell_id
    )


async def publish_row_receipt(
    writer: JournalWriter, run_dir: str, row_index: int, relative_path: str
) -> PublishedReceipt[RowReceipt]:
    """Fold the native part of ``row.json`` and publish it like a cell receipt."""

    def fold(through: int) -> RowReceipt:
        return fold_row(writer.index.lines_for_row(row_index), row_index, through_seq=through)

    return await _publish_folded(
        writer, run_dir, relative_path, fold, decode_row_receipt, scope="row", row_index=row_index
    )


async def _publish_folded(
    writer: JournalWriter,
    run_dir: str,
    relative_path: str,
    fold: Callable[[int], _Receipt],
    decode: Callable[[bytes], _Receipt],
    *,
    scope: str,
    cell_id: str | None = None,
    row_index: int | None = None,
) -> PublishedReceipt[_Receipt]:
    """Fold through everything durable so far, publish the canonical bytes, journal that."""
    through = await writer.sync()
    data = encode_receipt(fold(through))
    record = await publish_receipt(
        writer,
        run_dir,
        relative_path,
        data,
        scope=scope,
        through=through,
        cell_id=cell_id,
        row_index=row_index,
    )
    return PublishedReceipt(decode(data), record)


async def publish_receipt(
    writer: JournalWriter,
    run_dir: str,
    relative_path: str,
    data: bytes,
    *,
    scope: str,
    through: int,
    cell_id: str | None = None,
    row_index: int | None = None,
) -> ReceiptPublished:
    """Publish a receipt's bytes fresh inside the run directory, then journal the publication
    (folded through seq ``through``) and return that record."""
    if os.path.isabs(relative_path) or ".." in relative_path.split("/"):
        raise Refused.one(
            "journal.receipt.path",
            "$.path",
            f"receipt path {relative_path!r} is not inside the run directory",
            "give a relative path without '..'",
        )
    await trio.to_thread.run_sync(publish_fresh, os.path.join(run_dir, relative_path), data)
    record = ReceiptPublished(
        scope=scope,
        cell_id=cell_id,
        row_index=row_index,
        path=relative_path,
        sha256=hashlib.sha256(data).hexdigest(),
        through_seq=through,
    )
    await writer.append(record)
    return record
