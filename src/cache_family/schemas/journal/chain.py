"""The journal's chain: each record stamped into one hash-chained JSON line, and the seal.

The writer actor and tests that build journals in memory share :class:`JournalChain`, so both
produce the same bytes for the same records and clocks; the line layout is :class:`JournalLine`'s.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Final

import msgspec

from cache_family.schemas.journal.records import JournalSealed, Record

JOURNAL_FILENAME: Final = "journal.jsonl"
GENESIS_PREV: Final = "0" * 64


class JournalLine(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, gc=False):
    """One line of ``journal.jsonl`` (one journal per run directory)::

        {"seq":1,"mono_ns":...,"wall_ns":...,"prev":"000...0","record":{"type":"run_started",...}}
        {"seq":2,"mono_ns":...,"wall_ns":...,"prev":"<sha256 of line 1>","record":{...}}

    ``seq`` starts at 1 and grows by exactly one per line. ``prev`` is the lowercase SHA-256
    hex of the previous line's bytes without its ``\\n`` terminator; the first line's is
    :data:`GENESIS_PREV` (64 zeros). ``mono_ns`` is the writer's monotonic clock (trio's in a
    run) and ``wall_ns`` the wall clock, both integer nanoseconds so that no float formatting
    question ever arises. ``record`` is one member of :data:`Record`, tagged by its ``type``.
    A finished journal ends with ``journal_sealed``; only a ``run_resumed`` may follow a seal,
    starting the next segment of the same chain.
    """

    # Untracked by the cyclic collector (it holds only numbers, a string and a frozen record,
    # so it can close no cycle): a replay holds millions, and the collector would otherwise
    # walk them all again at every full collection.
    seq: int
    mono_ns: int
    wall_ns: int
    prev: str
    record: Record


_ENCODER: Final = msgspec.json.Encoder(order="deterministic")
_DECODER: Final = msgspec.json.Decoder(JournalLine)
# A line's bytes up to its record: JournalLine's fields in declaration order.
_LINE_HEAD: Final = b'{"seq":%d,"mono_ns":%d,"wall_ns":%d,"prev":"%s","record":'
# A whole line from its head's fields and its encoded record, in one formatting step.
_LINE_FORMAT: Final = _LINE_HEAD + b"%s}"
_sha256: Final = hashlib.sha256


def line_sha256(line_bytes: bytes) -> str:
    return hashlib.sha256(line_bytes).hexdigest()


def encode_line(line: JournalLine) -> bytes:
    """The line's bytes WITHOUT the newline terminator (what ``prev`` hashes)."""
    return _ENCODER.encode(line)


def decode_line(line_bytes: bytes) -> JournalLine:
    return _DECODER.decode(line_bytes)


class JournalChain:
    """Pure appender: stamps ``seq`` and ``prev`` and returns each line's bytes.

    The writer actor and tests that build journals in memory share it, so both produce the
    same bytes for the same records and clocks.
    """

    __slots__ = ("next_seq", "prev")

    def __init__(self, *, next_seq: int = 1, prev: str = GENESIS_PREV) -> None:
        self.next_seq = next_seq
        self.prev = prev

    def line(self, record: Record, *, mono_ns: int, wall_ns: int) -> tuple[JournalLine, bytes]:
        """Chain one record; returns the line and its bytes including the ``\\n``."""
        line = JournalLine(
            seq=self.next_seq, mono_ns=mono_ns, wall_ns=wall_ns, prev=self.prev, record=record
        )
        return line, self.encode(record, mono_ns=mono_ns, wall_ns=wall_ns)

    def encode(self, record: Record, *, mono_ns: int, wall_ns: int) -> bytes:
        """Chain one record and return only its bytes (with the ``\\n``): the writer's hot path.

        The bytes are exactly ``encode_line`` of the :class:`JournalLine` (its fields in
        declaration order, integers as JSON writes them), without building that struct.
        """
        data = _LINE_FORMAT % (
            self.next_seq,
            mono_ns,
            wall_ns,
            self.prev.encode(),
            _ENCODER.encode(record),
        )
        self.prev = _sha256(data).hexdigest()
        self.next_seq += 1
        return data + b"\n"

    def encode_many(self, items: list[tuple[Record, int, int]]) -> list[bytes]:
        """``encode`` for each (record, mono_ns, wall_ns) in order, in one batch."""
        records, monos, walls = zip(*items, strict=True) if items else ((), (), ())
        return [data + b"\n" for data in self.encode_batch(records, monos, walls)]

    def encode_batch(
        self, records: Sequence[Record], monos: Sequence[int], walls: Sequence[int]
    ) -> list[bytes]:
        """Chain ``records`` (stamped ``monos[i]``, ``walls[i]``) and return each line's bytes
        WITHOUT the newline: the writer's hot path, so the loop does only what the per-line
        chain needs (one format, one SHA-256 per line). The records are encoded in one call;
        JSON strings escape every newline, so the encoded records split cleanly."""
        if not records:
            return []
        encoded = _ENCODER.encode_lines(records).split(b"\n")
        encoded.pop()  # the empty piece after the last newline
        out: list[bytes] = []
        append, line_format, sha256 = out.append, _LINE_FORMAT, _sha256
        first, prev = self.next_seq, self.prev.encode()
        for seq, mono_ns, wall_ns, record in zip(
            range(first, first + len(records)), monos, walls, encoded, strict=True
        ):
            data = line_format % (seq, mono_ns, wall_ns, prev, record)
            prev = sha256(data).hexdigest().encode()
            append(data)
        self.next_seq, self.prev = first + len(out), prev.decode()
        return out

    def seal(
        self, record: JournalSealed, before: hashlib._Hash, *, mono_ns: int, wall_ns: int
    ) -> tuple[JournalLine, bytes]:
        """Chain the seal line; ``before`` hashes every journal byte before it."""
        blank = JournalLine(
            seq=self.next_seq,
            mono_ns=mono_ns,
            wall_ns=wall_ns,
            prev=self.prev,
            record=msgspec.structs.replace(record, digest=""),
        )
        sealed = msgspec.structs.replace(record, digest=seal_digest(before, blank))
        return self.line(sealed, mono_ns=mono_ns, wall_ns=wall_ns)

    def __repr__(self) -> str:
        return f"<JournalChain next_seq={self.next_seq} prev={self.prev[:12]}…>"


def seal_digest(before: hashlib._Hash, line: JournalLine) -> str:
    """The digest a seal line holds: the bytes before it, then its own with ``digest`` empty."""
    record = line.record
    if not isinstance(record, JournalSealed):
        raise TypeError(f"not a seal line: {type(record).__name__}")
    digest = before.copy()
    digest.update(encode_line(msgspec.structs.replace(line, record=_unsigned(record))))
    return digest.hexdigest()


def _unsigned(record: JournalSealed) -> JournalSealed:
    return msgspec.structs.replace(record, digest="")


def encode_journal(
    records: Iterable[Record], *, mono_ns_step: int = 1_000_000, wall_ns_start: int = 0
) -> bytes:
    """A whole journal for the given records with synthetic clocks (tests, examples)."""
    chain = JournalChain()
    return b"".join(
        chain.encode(record, mono_ns=i * mono_ns_step, wall_ns=wall_ns_start + i)
        for i, record in enumerate(records)
    )
