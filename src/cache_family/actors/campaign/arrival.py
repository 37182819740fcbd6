"""What the driver makes of a row's task once it ended: the row received, verified and placed
under the campaign's ``rows/`` (its ``row_arrived`` record ready to journal), or the reason
the row is missing.

The driver journals the arrival before it looks at the next task.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from cache_family.actors.campaign.audit import arrived_rows
from cache_family.actors.campaign.journal import CampaignJournal
from cache_family.actors.campaign.merge import Missing, ShardRead, read_shard, recorded_dir
from cache_family.actors.campaign.placement import brief_key
from cache_family.actors.campaign.resume import ResumePlan
from cache_family.actors.campaign.row_return import ROW_MAX_BYTES, receive_row, row_files
from cache_family.actors.campaign.row_task import LOG_TAIL_BYTES
from cache_family.errors import Refused
from cache_family.schemas.campaign import (
    CampaignOpened,
    CampaignResumed,
    RowArrived,
    files_digest,
)
from cache_family.schemas.host_identity import HostIdentity
from cache_family.schemas.journal import (
    JOURNAL_FILENAME,
    BoundFile,
    JournalSealed,
    PlannedRowBrief,
    read_journal,
)
from cache_family.system.publish import replace_atomically

ROWS_DIR: Final = "rows"
# How a row's sealed run reaches the driver: through Ray's object store (no directory shared
# between the nodes and the driver), or written by its node into the campaign's own rows/
# (which every node must then see).
OBJECT_STORE: Final = "object-store"
SHARED_OUTPUT: Final = "shared-output"
ROW_RETURNS: Final = (OBJECT_STORE, SHARED_OUTPUT)
ROW_UNSEALED: Final = "row.unsealed"
ROW_UNVERIFIED: Final = "campaign.row.unverified"
# How a resume journals the rows it keeps.
KEPT: Final = "kept"


@dataclass(frozen=True, slots=True)
class Arrived:
    shard: ShardRead
    record: RowArrived


def sealed(run_dir: str) -> bool:
    try:
        with open(os.path.join(run_dir, JOURNAL_FILENAME), "rb") as journal:
            read = read_journal(journal.read())
    except OSError:
        return False
    return (
        read.chain_break is None
        and bool(read.lines)
        and isinstance(read.lines[-1].record, JournalSealed)
    )


def host_of(result: Mapping[str, object]) -> HostIdentity | None:
    hostname = result.get("hostname")
    if not isinstance(hostname, str):
        return None
    labels = result.get("labels")
    node_id = result.get("node_id")
    return HostIdentity(
        hostname=hostname,
        node_id=node_id if isinstance(node_id, str) else None,
        labels={str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {},
    )


def arrival_record(
    campaign: str,
    shard: ShardRead,
    index: int,
    key: str,
    files: tuple[BoundFile, ...],
    how: str,
    host: HostIdentity | None,
) -> RowArrived:
    selected_host = shard.selected.host if shard.selected is not None else None
    return RowArrived(
        row_index=index,
        row_key=key,
        row_dir=recorded_dir(campaign, shard.root),
        journal_head=shard.head,
        files_sha256=files_digest(files),
        files=len(files),
        size=sum(f.size for f in files),
        how=how,
        host=selected_host or host,
    )


def arrive_through_store(
    result: Mapping[str, object],
    campaign: str,
    name: str,
    key: str,
    index: int,
    prepared_sha256: str,
    fetch_chunk: Callable[[int], bytes],
    max_bytes: int = ROW_MAX_BYTES,
) -> Arrived | Missing:
    """The row a node returned through the object store; ``fetch_chunk`` asks the node for
    the chunks after the first (it may raise Ray's errors: the node was lost meanwhile)."""
    host = host_of(result)
    rows_dir = os.path.join(campaign, ROWS_DIR)
    tail = result.get("log_tail")
    if isinstance(tail, bytes):
        replace_atomically(os.path.join(rows_dir, f"{name}.log"), tail[-LOG_TAIL_BYTES:])
    refusal = result.get("refusal")
    if isinstance(refusal, tuple | list) and len(refusal) == 2:
        return Missing(str(refusal[0]), str(refusal[1])[:2000], host)
    manifest, first = result.get("manifest"), result.get("first_chunk")
    if not isinstance(manifest, bytes) or not isinstance(first, bytes):
        return Missing(ROW_UNSEALED, f"the row's run exited {result.get('returncode')}", host)
    try:
        shard, checked = receive_row(
            manifest, first, fetch_chunk, rows_dir, name, row_key=key,
            prepared_sha256=prepared_sha256, max_bytes=max_bytes,
        )  # fmt: skip
    except Refused as refused:
        (refusal_, *_) = refused.refusals
        return Missing(refusal_.code, refusal_.message[:2000], host)
    return Arrived(
        shard, arrival_record(campaign, shard, index, key, checked.files, OBJECT_STORE, host)
    )


def arrive_in_place(
    campaign: str, name: str, key: str, index: int, host: HostIdentity | None, how: str
) -> Arrived | Missing | None:
    """A row its node sealed in the campaign's own ``rows/`` (a shared --output), or one a
    resume keeps: verified as ``merge`` verifies a shard. None: no sealed run is there."""
    row_dir = os.path.join(campaign, ROWS_DIR, name)
    if not sealed(row_dir):
        return None
    try:
        shard = read_shard(row_dir)
    except Refused as refused:
        (refusal, *_) = refused.refusals
        return Missing(ROW_UNVERIFIED, refusal.message[:2000], host)
    _, files = row_files(row_dir)
    return Arrived(shard, arrival_record(campaign, shard, index, key, files, how, host))


def resume_journal(
    campaign: str,
    resumed: ResumePlan,
    fresh: CampaignOpened,
    plan: Sequence[PlannedRowBrief],
    continued: bool,
) -> tuple[CampaignJournal, dict[str, ShardRead]]:
    """The campaign journal a resume goes on with (the unsealed one its driver left, or a
    fresh one beside the sealed one moved aside), the kept rows journaled as arrived where
    the journal has no standing arrival of them; and the kept rows, verified."""
    journal = (
        CampaignJournal.continued(campaign)
        if continued
        else CampaignJournal.create(campaign, fresh)
    )
    by_dir = {os.path.join(campaign, ROWS_DIR, f"row-{b.index:04d}"): b for b in plan}
    kept_keys = tuple(brief_key(by_dir[d]) for d in resumed.kept)
    journal.append(
        CampaignResumed(kept=kept_keys, rerun=tuple(brief_key(b) for b in resumed.rerun))
    )
    standing = arrived_rows(journal.records)
    verified: dict[str, ShardRead] = {}
    for row_dir in resumed.kept:
        brief = by_dir[row_dir]
        found = arrive_in_place(
            campaign, os.path.basename(row_dir), brief_key(brief), brief.index, None, KEPT
        )
        if not isinstance(found, Arrived):
            continue
        verified[row_dir] = found.shard
        record = standing.get(brief_key(brief))
        if record is None or record.journal_head != found.shard.head:
            journal.append(found.record)
    return journal, verified
