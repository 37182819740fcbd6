"""The campaign journal written as the campaign goes: opened before the first row, a line
per row as it arrives (fsynced), the merge's lines and the seal at the end. A driver killed
outright leaves every line it wrote; ``campaign --resume`` continues the same chain.

A resume cuts off a torn last line (a write a kill cut short) and refuses a broken chain, so a
campaign killed and resumed is one chain.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Sequence

from cache_family import __version__
from cache_family.actors.campaign.placement import Placement, brief_key
from cache_family.actors.run.matrix import planned_brief
from cache_family.errors import Refused
from cache_family.schemas.bounded import read_bounded
from cache_family.schemas.campaign import (
    CAMPAIGN_JOURNAL,
    CampaignChain,
    CampaignOpened,
    CampaignRecord,
    CampaignSealed,
    read_campaign,
)
from cache_family.schemas.prepared import PreparedInput
from cache_family.system.publish import fsync_dir

CAMPAIGN_JOURNAL_READ_LIMIT = 256 * 1024 * 1024


class CampaignJournal:
    """An open campaign journal: every ``append`` is on disk when it returns."""

    def __init__(self, path: str, chain: CampaignChain, records: Sequence[CampaignRecord]) -> None:
        self.path = path
        self.chain = chain
        self.records = list(records)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)

    @classmethod
    def create(cls, campaign: str, opened: CampaignOpened) -> CampaignJournal:
        path = os.path.join(campaign, CAMPAIGN_JOURNAL)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
        fsync_dir(campaign)
        journal = cls(path, CampaignChain(), [])
        journal.append(opened)
        return journal

    @classmethod
    def continued(cls, campaign: str) -> CampaignJournal:
        """The unsealed journal a stopped driver left, its torn last line (a write the kill
        cut short) cut off; raises ``Refused`` for a broken chain."""
        path = os.path.join(campaign, CAMPAIGN_JOURNAL)
        raw = read_bounded(path, CAMPAIGN_JOURNAL_READ_LIMIT, what="campaign journal").data
        read = read_campaign(raw)
        if read.problem is not None and read.problem.code != "campaign.journal.torn":
            raise Refused((read.problem,))
        whole = raw[: raw.rfind(b"\n") + 1]
        if len(whole) != len(raw):
            with open(path, "r+b") as handle:
                handle.truncate(len(whole))
                os.fsync(handle.fileno())
        chain = CampaignChain()
        chain.next_seq = len(read.lines) + 1
        if read.line_sha256s:
            chain.prev = read.line_sha256s[-1]
        return cls(path, chain, [line.record for line in read.lines])

    @property
    def opened(self) -> CampaignOpened:
        first = self.records[0]
        assert isinstance(first, CampaignOpened)
        return first

    def append(self, *records: CampaignRecord) -> None:
        data = b"".join(
            self.chain.encode(record, mono_ns=time.monotonic_ns(), wall_ns=time.time_ns())
            for record in records
        )
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        os.fsync(self._fd)
        self.records.extend(records)

    def seal(self, matrix_status: str) -> str:
        """Seal the journal; the head (the seal line's SHA-256)."""
        self.append(
            CampaignSealed(
                through_seq=self.chain.next_seq - 1,
                head_sha256=self.chain.prev,
                matrix_status=matrix_status,
            )
        )
        return self.chain.prev

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def opened_record(
    prepared: PreparedInput, sha256: str, placement: Placement | None
) -> CampaignOpened:
    """The ``campaign_opened`` of a campaign the Ray driver starts from a prepared input (the
    plan a shard's journal would give ``merge``)."""
    plan = tuple(planned_brief(prepared, row) for row in prepared.rows)
    return CampaignOpened(
        campaign_id=f"campaign-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-"
        f"{secrets.token_hex(4)}",
        prepared_sha256=sha256,
        catalog_sha256=prepared.catalog.sha256,
        tool_version=__version__,
        plan=plan,
        plan_keys=tuple(brief_key(b) for b in plan),
        catalog_synthetic=prepared.catalog.synthetic,
        placement_path=placement.path if placement else None,
        placement_sha256=placement.sha256 if placement else None,
    )


def journal_sealed(campaign: str) -> bool | None:
    """Whether the campaign's journal is sealed (None: there is none)."""
    path = os.path.join(campaign, CAMPAIGN_JOURNAL)
    if not os.path.lexists(path):
        return None
    raw = read_bounded(path, CAMPAIGN_JOURNAL_READ_LIMIT, what="campaign journal").data
    read = read_campaign(raw)
    return bool(read.lines) and isinstance(read.lines[-1].record, CampaignSealed)
