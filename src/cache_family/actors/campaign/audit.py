"""``cache-family replay CAMPAIGN``: re-verify every shard and reproduce the merged files.

A campaign journal opened but not sealed (its driver stopped before the merge) is not a
difference: every row it says arrived must still replay with the head it arrived with, and the
replay ends incomplete (exit 1) naming the rows still missing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from cache_family.actors.campaign.files import check_campaign_files
from cache_family.actors.campaign.merge import (
    ShardRead,
    fold_campaign,
    read_shard,
    resolve_dir,
    sha256_of,
)
from cache_family.errors import Refused
from cache_family.exit_codes import ExitCode
from cache_family.schemas.bounded import read_bounded
from cache_family.schemas.campaign import (
    CAMPAIGN_JOURNAL,
    CampaignFilesBound,
    CampaignOpened,
    CampaignReceipt,
    CampaignRecord,
    CampaignResumed,
    CampaignSealed,
    RowArrived,
    RowUnmeasured,
    ShardMerged,
    read_campaign,
)

_CAMPAIGN_READ_LIMIT = 256 * 1024 * 1024


@dataclass
class CampaignReplay:
    lines: list[str] = field(default_factory=list)
    differs: bool = False
    unreadable: bool = False
    # The journal is not sealed (its driver stopped): rows are missing, none differs.
    incomplete: bool = False

    def say(self, text: str) -> None:
        self.lines.append(text)

    def differ(self, text: str) -> None:
        self.differs = True
        self.say(text)

    @property
    def exit_code(self) -> int:
        if self.unreadable:
            return ExitCode.UNREADABLE
        if self.differs:
            return ExitCode.DIFFERS
        return ExitCode.NOT_COMPLETED if self.incomplete else ExitCode.IDENTICAL


def replay_campaign(campaign_dir: str, *, expect_head: str | None = None) -> CampaignReplay:
    """Re-verify every shard, reproduce the merged files and check every other file the
    merge bound; ``expect_head``: the head the campaign printed, which a journal re-chained
    end to end does not have."""
    report = CampaignReplay()
    root = os.path.abspath(campaign_dir)
    try:
        raw = read_bounded(
            os.path.join(root, CAMPAIGN_JOURNAL), _CAMPAIGN_READ_LIMIT, what="campaign journal"
        )
    except Refused as refused:
        report.unreadable = True
        for refusal in refused.refusals:
            report.say(f"refused: {refusal.line()}")
        return report
    read = read_campaign(raw.data)
    if read.problem is not None:
        report.differ(f"campaign journal: refused: {read.problem.line()}")
    records = [line.record for line in read.lines]
    opened = records[0] if records and isinstance(records[0], CampaignOpened) else None
    sealed = records[-1] if records and isinstance(records[-1], CampaignSealed) else None
    torn = read.problem is not None and read.problem.code == "campaign.journal.torn"
    if opened is not None and sealed is None and (read.problem is None or torn):
        return _unsealed(report, root, opened, records, len(read.lines))
    if opened is None or sealed is None:
        report.differ("campaign journal: it does not start with campaign_opened and end sealed")
        return _verdict(report)
    if sealed.head_sha256 != read.line_sha256s[-2]:
        report.differ("campaign journal: the seal names another head than the line before it")
    report.say(
        f"campaign journal: {len(records)} lines, hash chain intact, head sha256 "
        f"{read.line_sha256s[-1]}"
    )
    if expect_head is not None and expect_head != read.line_sha256s[-1]:
        report.differ(
            f"campaign journal: refused: replay.head.mismatch: head sha256 "
            f"{read.line_sha256s[-1]} is not the expected {expect_head}: the journal was "
            "rewritten or replaced"
        )
    merged: list[tuple[ShardMerged, ShardRead]] = []
    for record in records:
        if not isinstance(record, ShardMerged):
            continue
        shard_root = resolve_dir(root, record.shard_dir)
        try:
            shard = read_shard(shard_root)
        except Refused as refused:
            for refusal in refused.refusals:
                report.differ(f"shard {record.shard_dir}: refused: {refusal.line()}")
            continue
        if shard.head != record.journal_head:
            report.differ(
                f"shard {record.shard_dir}: journal head {shard.head}, the campaign recorded "
                f"{record.journal_head}"
            )
            continue
        report.say(f"shard {record.shard_dir}: identical, head {shard.head}")
        merged.append((record, shard))
    if report.differs:
        return _verdict(report)
    unmeasured = [r for r in records if isinstance(r, RowUnmeasured)]
    # The merged files were folded before their own receipt lines were written.
    through = sum(
        not isinstance(r, CampaignReceipt | CampaignFilesBound | CampaignSealed) for r in records
    )
    folded = fold_campaign(opened, merged, unmeasured, through_seq=through)
    recorded = {r.path: r.sha256 for r in records if isinstance(r, CampaignReceipt)}
    for name, data in folded.files.items():
        path = os.path.join(root, name)
        try:
            with open(path, "rb") as handle:
                on_disk = handle.read()
        except OSError as exc:
            report.differ(f"{name}: unreadable ({exc.strerror})")
            continue
        if on_disk != data or recorded.get(name) != sha256_of(data):
            report.differ(f"{name}: DIFFERS from the campaign's fold")
        else:
            report.say(f"{name}: identical")
    shard_roots = [shard.root for _, shard in merged]
    _check_files(report, root, records, recorded, shard_roots)
    return _verdict(report)


def _check_files(
    report: CampaignReplay,
    root: str,
    records: list[CampaignRecord],
    merged: dict[str, str],
    shards: list[str],
) -> None:
    """The campaign's own files against its ``campaign_files`` record: an edited, missing or
    planted file or directory differs."""
    bound = next((r for r in records if isinstance(r, CampaignFilesBound)), None)
    if bound is None:
        report.say(
            "campaign files: the journal binds no file list (merged before campaign_files "
            "records): only its shards and merged files are checked"
        )
        return
    problems = check_campaign_files(root, bound.files, merged, shards)
    for problem in problems:
        report.differ(f"DIFFERS {problem.path}: {problem.code}: {problem.detail}")
    if not problems:
        report.say(f"campaign files: {len(bound.files)} bound, every one as bound and no other")


def arrived_rows(records: Sequence[CampaignRecord]) -> dict[str, RowArrived]:
    """Each row's arrival still standing: a resume that runs a row again voids its earlier
    arrival (that try was moved aside)."""
    arrived: dict[str, RowArrived] = {}
    for record in records:
        if isinstance(record, RowArrived):
            arrived[record.row_key] = record
        elif isinstance(record, CampaignResumed):
            for key in record.rerun:
                arrived.pop(key, None)
    return arrived


def _unsealed(
    report: CampaignReplay,
    root: str,
    opened: CampaignOpened,
    records: Sequence[CampaignRecord],
    lines: int,
) -> CampaignReplay:
    """A journal its driver left before the merge: the rows that arrived must still replay
    as they arrived; the others are named missing."""
    report.say(
        f"campaign journal: {lines} lines, hash chain intact, not sealed: the campaign's driver "
        "stopped before its merge (`campaign --resume` continues it)"
    )
    arrived = arrived_rows(records)
    for key, record in arrived.items():
        try:
            shard = read_shard(resolve_dir(root, record.row_dir))
        except Refused as refused:
            for refusal in refused.refusals:
                report.differ(f"row {key}: refused: {refusal.line()}")
            continue
        if shard.head != record.journal_head:
            report.differ(
                f"row {key}: journal head {shard.head}, it arrived with {record.journal_head}"
            )
        else:
            report.say(f"row {key}: identical, head {shard.head}")
    missing = [key for key in opened.plan_keys if key not in arrived]
    report.incomplete = True
    report.say(
        f"campaign incomplete: {len(arrived)} of {len(opened.plan_keys)} row(s) arrived; "
        f"missing: {', '.join(missing) or 'none'}"
    )
    return _verdict(report)


def _verdict(report: CampaignReplay) -> CampaignReplay:
    if report.incomplete and not report.differs:
        report.say("replay: campaign incomplete")
        return report
    verdict = {0: "identical", 1: "DIFFERS", 2: "UNREADABLE"}[report.exit_code]
    report.say(f"replay: campaign {verdict}")
    return report
