"""The campaign journal: ``campaign-journal.jsonl``, one hash-chained line per record.

It has the run journal's line layout and chain (``schemas/journal.py``) with records of its own,
from ``campaign_opened`` to ``campaign_sealed``. Records are frozen tagged Structs that forbid
unknown fields; new fields get defaults and go last, a new record is a new tag.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import ClassVar, Final, TypeAlias

import msgspec

from cache_family.errors import Refusal
from cache_family.schemas.host_identity import HostIdentity
from cache_family.schemas.journal import GENESIS_PREV, BoundFile, PlannedRowBrief

CAMPAIGN_JOURNAL: Final = "campaign-journal.jsonl"
CAMPAIGN_REPORT: Final = "campaign-report.md"


class _CampaignRecord(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=True
):
    durable: ClassVar[bool] = True


class CampaignOpened(_CampaignRecord, tag="campaign_opened", frozen=True, kw_only=True):
    campaign_id: str
    prepared_sha256: str
    catalog_sha256: str
    tool_version: str = ""
    # Every row of the prepared input, in plan order (run_started + rows_selected of a shard).
    plan: tuple[PlannedRowBrief, ...] = ()
    plan_keys: tuple[str, ...] = ()
    catalog_synthetic: bool = False
    # The placement file the campaign was driven with (its bytes' SHA-256), if any.
    placement_path: str | None = None
    placement_sha256: str | None = None


class ShardMerged(_CampaignRecord, tag="shard_merged", frozen=True, kw_only=True):
    shard_dir: str  # absolute
    run_id: str
    journal_head: str  # SHA-256 of the shard journal's seal line
    row_keys: tuple[str, ...]
    row_indices: tuple[int, ...]
    matrix_status: str
    terminal_refusal: str | None = None
    how: str = "all"  # all | rows | shard
    shard_index: int | None = None
    shard_count: int | None = None
    host: HostIdentity | None = None
    # The placement's requirement for these rows, as its rule was written (None: anywhere).
    placement: str | None = None


class RowUnmeasured(_CampaignRecord, tag="row_unmeasured", frozen=True, kw_only=True):
    row_index: int
    row_key: str
    reason: str  # host.lost | cancelled | not_in_any_shard | row.failed | ...
    detail: str = ""
    host: HostIdentity | None = None


class RowArrived(_CampaignRecord, tag="row_arrived", frozen=True, kw_only=True):
    """A row's sealed run, verified (replayed, its head and every file's SHA-256) and placed
    under the campaign's ``rows/``, journaled (and fsynced) as it arrives."""

    row_index: int
    row_key: str
    row_dir: str  # relative to the campaign directory
    journal_head: str
    # SHA-256 of the row's file list (``files_digest``), and its count and bytes.
    files_sha256: str
    files: int
    size: int
    how: str  # object-store | shared | kept (found sealed by a resume)
    host: HostIdentity | None = None


class CampaignResumed(_CampaignRecord, tag="campaign_resumed", frozen=True, kw_only=True):
    """``campaign --resume`` continued this journal (its driver had stopped before the seal)."""

    kept: tuple[str, ...]
    rerun: tuple[str, ...]


class CampaignReceipt(_CampaignRecord, tag="campaign_receipt", frozen=True, kw_only=True):
    path: str  # relative to the campaign directory
    sha256: str


class CampaignFilesBound(_CampaignRecord, tag="campaign_files", frozen=True, kw_only=True):
    """Every entry of the campaign directory the other records do not vouch for (its
    request, the cluster's evidence, the rows' logs, directories), as the merge found it."""

    files: tuple[BoundFile, ...]


class CampaignSealed(_CampaignRecord, tag="campaign_sealed", frozen=True, kw_only=True):
    through_seq: int
    head_sha256: str
    matrix_status: str


CampaignRecord: TypeAlias = (
    CampaignOpened
    | ShardMerged
    | RowUnmeasured
    | CampaignReceipt
    | RowArrived
    | CampaignResumed
    | CampaignFilesBound
    | CampaignSealed
)


class CampaignLine(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    seq: int
    mono_ns: int
    wall_ns: int
    prev: str
    record: CampaignRecord


_ENCODER: Final = msgspec.json.Encoder(order="deterministic")
_DECODER: Final = msgspec.json.Decoder(CampaignLine)


class CampaignChain:
    """Stamps ``seq`` and ``prev`` as the run journal's chain does; returns each line's bytes."""

    def __init__(self) -> None:
        self.next_seq = 1
        self.prev = GENESIS_PREV

    def encode(self, record: CampaignRecord, *, mono_ns: int, wall_ns: int) -> bytes:
        line = CampaignLine(
            seq=self.next_seq, mono_ns=mono_ns, wall_ns=wall_ns, prev=self.prev, record=record
        )
        data = _ENCODER.encode(line)
        self.prev = hashlib.sha256(data).hexdigest()
        self.next_seq += 1
        return data + b"\n"


@dataclass(frozen=True, slots=True)
class CampaignRead:
    lines: tuple[CampaignLine, ...]
    line_sha256s: tuple[str, ...]
    problem: Refusal | None


def read_campaign(data: bytes) -> CampaignRead:
    """Verify the chain and decode every line; the first problem stops the reading."""
    lines: list[CampaignLine] = []
    shas: list[str] = []
    prev = GENESIS_PREV
    raw_lines = data.split(b"\n")
    torn = raw_lines.pop() != b""
    for number, raw in enumerate(raw_lines, start=1):
        where = f"$.campaign_journal[{number - 1}]"
        try:
            line = _DECODER.decode(raw)
        except msgspec.DecodeError as exc:
            return CampaignRead(
                tuple(lines),
                tuple(shas),
                Refusal(
                    "campaign.journal.undecodable",
                    where,
                    f"line {number} is not a campaign journal line ({exc})",
                    "the campaign journal was edited or corrupted; merge the shards again",
                ),
            )
        if line.seq != number or line.prev != prev:
            return CampaignRead(
                tuple(lines),
                tuple(shas),
                Refusal(
                    "campaign.journal.chain_broken",
                    where,
                    f"line {number} does not follow the line before it (seq or prev differs)",
                    "the campaign journal was edited; merge the shards again",
                ),
            )
        prev = hashlib.sha256(raw).hexdigest()
        lines.append(line)
        shas.append(prev)
    if torn:
        return CampaignRead(
            tuple(lines),
            tuple(shas),
            Refusal(
                "campaign.journal.torn",
                "$.campaign_journal",
                "the last line has no newline terminator",
                "the merge stopped mid-write; merge the shards again",
            ),
        )
    return CampaignRead(tuple(lines), tuple(shas), None)


def files_digest(files: tuple[BoundFile, ...]) -> str:
    """The SHA-256 of a row's file list (path, SHA-256 and size of each, in order)."""
    return hashlib.sha256(_ENCODER.encode(files)).hexdigest()


class RowManifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a node says of the sealed row it returns through the object store: its files
    (the journal, the matrix and every file its ``run_files`` record binds) as one byte
    stream in this order, cut into chunks of ``chunk_bytes`` (the last one shorter)."""

    schema_version: int = 1
    row_key: str
    journal_head: str
    files: tuple[BoundFile, ...]
    total_bytes: int
    chunk_bytes: int
    chunk_sha256s: tuple[str, ...]


def encode_manifest(manifest: RowManifest) -> bytes:
    return _ENCODER.encode(manifest)


def decode_manifest(data: bytes) -> RowManifest:
    return msgspec.json.decode(data, type=RowManifest)


CAMPAIGN_REQUEST: Final = "campaign-request.json"


class CampaignRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``cache-family campaign`` was started with, written before its first row, so
    ``campaign --resume`` continues the same campaign (same input bytes, same placement)."""

    schema_version: int = 1
    input_path: str
    input_sha256: str
    placement_path: str | None = None
    placement_sha256: str | None = None


def encode_request(request: CampaignRequest) -> bytes:
    return msgspec.json.format(_ENCODER.encode(request), indent=2) + b"\n"


def decode_request(data: bytes) -> CampaignRequest:
    return msgspec.json.decode(data, type=CampaignRequest)
