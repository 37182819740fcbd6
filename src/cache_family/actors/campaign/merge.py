"""``cache-family merge --output CAMPAIGN SHARD_DIR…``: one campaign from the runs of its shards.

Refused before anything is written: a shard whose replay is not identical
(``campaign.shard.unverified``), one of another prepared input (``campaign.shard.other_input``),
a row two shards ran (``campaign.shard.duplicate_row``). The merged files are a pure fold of the
campaign journal and the shards' verified receipts (``fold_campaign``), so ``replay CAMPAIGN``
reproduces them byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import msgspec

from cache_family import __version__
from cache_family.actors.audit.replay import replay
from cache_family.actors.campaign.files import bind_campaign_files
from cache_family.actors.campaign.journal import CampaignJournal
from cache_family.actors.campaign.placement import brief_key, load_placement
from cache_family.actors.journal.writer import JOURNAL_READ_LIMIT
from cache_family.errors import Refusal, Refused
from cache_family.report.producer import render_producer_report
from cache_family.report.workloads import (
    WORKLOAD_ARM_NAMES,
    WorkloadView,
    read_workloads,
    workload_sections,
)
from cache_family.schemas.bounded import read_bounded
from cache_family.schemas.campaign import (
    CAMPAIGN_JOURNAL,
    CAMPAIGN_REPORT,
    CampaignChain,
    CampaignFilesBound,
    CampaignOpened,
    CampaignReceipt,
    CampaignRecord,
    CampaignSealed,
    RowUnmeasured,
    ShardMerged,
)
from cache_family.schemas.host_identity import HostIdentity
from cache_family.schemas.journal import (
    JOURNAL_FILENAME,
    JournalSealed,
    PlannedRowBrief,
    RowsSelected,
    RunStarted,
    read_journal,
)
from cache_family.schemas.matrix import (
    MATRIX_FILENAME,
    MATRIX_SCOPE,
    MATRIX_SCOPE_SYNTHETIC,
    MatrixReceipt,
    MatrixRow,
    MatrixRowResult,
    decode_matrix,
    encode_matrix,
)
from cache_family.schemas.production import (
    PRODUCTION_JSON,
    PRODUCTION_MD,
    ProducerRow,
    encode_production,
)
from cache_family.schemas.receipts import ReceiptStatus, decode_row_receipt
from cache_family.states.projection import project_row
from cache_family.states.receipts import MEASURED_CHAIN, meet_all, terminal_downgrade
from cache_family.system.publish import publish_fresh

# The matrix's terminal refusal when some planned row has no measurement in the campaign.
ROWS_UNMEASURED: Final = "campaign_rows_unmeasured"
NOT_IN_ANY_SHARD: Final = "not_in_any_shard"
CALIBRATION_PER_SHARD: Final = "measured per shard: see each shard's cache-family-matrix.json"
_MEASURED: Final[dict[str, ReceiptStatus]] = {status: status for status in MEASURED_CHAIN}


# --- reading a shard --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShardRead:
    """One verified shard: its journal's plan and head, its matrix and report rows."""

    root: str
    started: RunStarted
    selected: RowsSelected | None
    head: str
    matrix: MatrixReceipt
    production: tuple[ProducerRow, ...] | None
    # The shard's workload cells' ``workload.json`` (paths relative to the shard).
    workloads: tuple[WorkloadView, ...] = ()

    @property
    def plan(self) -> tuple[PlannedRowBrief, ...]:
        unselected = self.selected.unselected_rows if self.selected else ()
        return tuple(sorted((*self.started.planned_rows, *unselected), key=lambda b: b.index))


def _shard_refusal(code: str, root: str, message: str, hint: str) -> Refusal:
    return Refusal(code, f"$.shards[{root!r}]", message, hint)


def read_shard(root: str) -> ShardRead:
    """Replay the shard and read what the campaign takes from it; raises ``Refused``."""
    report = replay(root)
    if report.exit_code != 0:
        why = report.unfinished or next(
            (line for line in report.lines if "DIFFERS" in line or "first bad" in line),
            report.lines[-1] if report.lines else "replay failed",
        )
        raise Refused(
            (
                _shard_refusal(
                    "campaign.shard.unverified",
                    root,
                    f"{root} does not replay identical: {why}",
                    f"`cache-family replay {root}` names what differs; rerun the shard's rows "
                    "into a fresh directory",
                ),
            )
        )
    raw = read_bounded(os.path.join(root, JOURNAL_FILENAME), JOURNAL_READ_LIMIT, what="journal")
    read = read_journal(raw.data)
    records = [line.record for line in read.lines]
    started = records[0] if records else None
    if not isinstance(started, RunStarted) or not isinstance(records[-1], JournalSealed):
        raise Refused(
            (
                _shard_refusal(
                    "campaign.shard.unverified",
                    root,
                    f"{root}'s journal does not start with run_started and end sealed",
                    "give the directory of a finished `cache-family run`",
                ),
            )
        )
    selected = records[1] if len(records) > 1 and isinstance(records[1], RowsSelected) else None
    matrix = decode_matrix(read_bounded(os.path.join(root, MATRIX_FILENAME), JOURNAL_READ_LIMIT,
                                        what="matrix").data)  # fmt: skip
    production: tuple[ProducerRow, ...] | None = None
    if matrix.report_input is not None:
        data = read_bounded(
            os.path.join(root, matrix.report_input), JOURNAL_READ_LIMIT, what="report rows"
        ).data
        production = msgspec.json.decode(data, type=tuple[ProducerRow, ...])
    return ShardRead(
        root=root,
        started=started,
        selected=selected,
        head=read.line_sha256s[-1],
        matrix=matrix,
        production=production,
        workloads=_shard_workloads(root, matrix),
    )


def _shard_workloads(root: str, matrix: MatrixReceipt) -> tuple[WorkloadView, ...]:
    """The ``workload.json`` of every workload arm the shard's row receipts observed (replay
    has just found each of them identical to its fold)."""
    cells: list[tuple[str, str]] = []
    for entry in matrix.rows:
        evidence = entry.result.evidence
        if evidence is None:
            continue
        data = read_bounded(os.path.join(root, evidence), JOURNAL_READ_LIMIT, what="row").data
        for observation in decode_row_receipt(data).observations:
            if observation.arm in WORKLOAD_ARM_NAMES and observation.cell_dir is not None:
                cells.append((observation.arm, f"{observation.cell_dir}/cell.json"))
    return read_workloads(root, cells)


# --- the fold (pure: the campaign journal's records and the shards' receipts in, files out) ---


@dataclass(frozen=True, slots=True)
class CampaignFiles:
    matrix: MatrixReceipt
    files: dict[str, bytes] = field(default_factory=dict)  # name -> bytes, in write order


def fold_campaign(
    opened: CampaignOpened,
    merged: Sequence[tuple[ShardMerged, ShardRead]],
    unmeasured: Sequence[RowUnmeasured],
    through_seq: int,
) -> CampaignFiles:
    """The campaign's matrix, report rows, report and host table."""
    measured: dict[int, tuple[ShardMerged, ShardRead, int]] = {}
    for record, shard in merged:
        for position, brief in enumerate(shard.started.planned_rows):
            measured[brief.index] = (record, shard, position)
    missing = {row.row_index: row for row in unmeasured}
    matrix_rows: list[MatrixRow] = []
    production: list[ProducerRow] = []
    terminal: str | None = None
    for brief in opened.plan:
        synthetic = brief.synthetic or opened.catalog_synthetic
        found = measured.get(brief.index)
        if found is not None:
            record, shard, position = found
            row = next(r for r in shard.matrix.rows if r.index == brief.index)
            evidence = row.result.evidence
            if evidence is not None:
                evidence = os.path.join(record.shard_dir, evidence)
            matrix_rows.append(
                msgspec.structs.replace(
                    row, result=msgspec.structs.replace(row.result, evidence=evidence)
                )
            )
            if shard.production is not None and position < len(shard.production):
                production.append(shard.production[position])
            else:
                production.append(project_row(brief, None, synthetic=synthetic))
            terminal = terminal or record.terminal_refusal
            continue
        why = missing.get(brief.index)
        status = "unmeasured" if why is None or why.reason == NOT_IN_ANY_SHARD else "incomplete"
        matrix_rows.append(
            MatrixRow(
                index=brief.index,
                case=brief.case,
                prefix_tokens=brief.prefix_tokens,
                use_case=brief.use_case,
                result=MatrixRowResult(
                    status=status, reason=why.reason if why is not None else NOT_IN_ANY_SHARD
                ),
                synthetic=synthetic,
            )
        )
        production.append(project_row(brief, None, synthetic=synthetic))
    statuses = [_MEASURED[r.result.status] for r in matrix_rows if r.result.status in _MEASURED]
    status = meet_all(statuses)
    if any(r.index not in measured for r in matrix_rows):
        terminal = terminal or ROWS_UNMEASURED
    if terminal is not None:
        status = terminal_downgrade(status)
    first = merged[0][1].matrix if merged else None
    synthetic = opened.catalog_synthetic or any(r.synthetic for r in matrix_rows)
    matrix = MatrixReceipt(
        status=status,
        scope=MATRIX_SCOPE_SYNTHETIC if synthetic else MATRIX_SCOPE,
        request_sha256=opened.prepared_sha256,
        catalog_sha256=opened.catalog_sha256,
        planned_cells=len(matrix_rows),
        rows=tuple(matrix_rows),
        promotion=None,
        terminal_refusal=terminal,
        journal_through_seq=through_seq,
        catalog=first.catalog if first is not None else None,
        report=PRODUCTION_MD,
        report_input=PRODUCTION_JSON,
        client_calibration=None,
        client_calibration_error=CALIBRATION_PER_SHARD,
    )
    production_json = encode_production(tuple(production))
    # Every shard's workload cells, under the campaign's report (paths from the campaign).
    views = [
        WorkloadView(os.path.join(record.shard_dir, view.path), view.receipt)
        for record, shard in merged
        for view in shard.workloads
    ]
    plots: dict[str, str] = {}
    workloads = workload_sections(views, plots)
    report = _host_table(opened, merged, unmeasured, matrix)
    if workloads:
        report += ("\n" + "\n".join(workloads) + "\n").encode("utf-8")
    return CampaignFiles(
        matrix=matrix,
        files={
            PRODUCTION_JSON: production_json,
            PRODUCTION_MD: render_producer_report(production_json, opened.plan),
            CAMPAIGN_REPORT: report,
            **{name: svg.encode("utf-8") for name, svg in sorted(plots.items())},
            MATRIX_FILENAME: encode_matrix(matrix),
        },
    )


def _host_name(host: HostIdentity | None) -> str:
    if host is None:
        return "unknown host"
    labels = ",".join(f"{k}={v}" for k, v in sorted(host.labels.items()))
    parts = [host.hostname]
    if host.node_id:
        parts.append(f"node {host.node_id[:12]}")
    if labels:
        parts.append(labels)
    if host.gpus:
        parts.append("; ".join(host.gpus))
    return " · ".join(parts)


def _host_table(
    opened: CampaignOpened,
    merged: Sequence[tuple[ShardMerged, ShardRead]],
    unmeasured: Sequence[RowUnmeasured],
    matrix: MatrixReceipt,
) -> bytes:
    where: dict[int, tuple[str, str]] = {}
    for record, shard in merged:
        for brief in shard.started.planned_rows:
            where[brief.index] = (_host_name(record.host), record.shard_dir)
    for row in unmeasured:
        where.setdefault(row.row_index, (_host_name(row.host), f"- ({row.reason})"))
    lines = [
        "# Campaign",
        "",
        f"Prepared input sha256 `{opened.prepared_sha256}`; matrix **{matrix.status}**"
        + (f" ({matrix.terminal_refusal})" if matrix.terminal_refusal else "")
        + f"; {len(merged)} shard(s).",
    ]
    if opened.placement_sha256 is not None:
        lines.append(f"Placement `{opened.placement_path}` sha256 `{opened.placement_sha256}`.")
    lines += ["", "| row | status | host | run directory |", "|---|---|---|---|"]
    statuses = {row.index: row.result.status for row in matrix.rows}
    for brief in opened.plan:
        host, shard_dir = where.get(brief.index, ("-", f"- ({NOT_IN_ANY_SHARD})"))
        lines.append(
            f"| `{brief_key(brief)}` | {statuses.get(brief.index, '-')} | {host} | {shard_dir} |"
        )
    return ("\n".join(lines) + "\n").encode("utf-8")


# --- the command ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Missing:
    """A planned row the driver could not measure, and why (``host.lost``, ``cancelled``)."""

    reason: str
    detail: str = ""
    host: HostIdentity | None = None


@dataclass(frozen=True, slots=True)
class MergeOutcome:
    status: str
    campaign_dir: str
    matrix_path: str
    head: str


def recorded_dir(campaign: str, shard: str) -> str:
    """A shard directory as the campaign journal names it: relative inside the campaign (so
    the campaign can be moved whole), absolute outside it."""
    relative = os.path.relpath(shard, campaign)
    return shard if relative.startswith("..") else relative


def resolve_dir(campaign: str, recorded: str) -> str:
    return recorded if os.path.isabs(recorded) else os.path.join(campaign, recorded)


def check_shards(shards: Sequence[ShardRead]) -> None:
    """Refuse shards of another input and rows run twice (every problem, not the first)."""
    problems: list[Refusal] = []
    first = shards[0]
    owner: dict[str, str] = {}
    for shard in shards:
        if shard.started.request_sha256 != first.started.request_sha256:
            problems.append(
                _shard_refusal(
                    "campaign.shard.other_input",
                    shard.root,
                    f"{shard.root} ran a prepared input with sha256 "
                    f"{shard.started.request_sha256}, not {first.started.request_sha256} "
                    f"(that of {first.root})",
                    "merge only the shards of one prepared input",
                )
            )
            continue
        for brief in shard.started.planned_rows:
            key = brief_key(brief)
            if key in owner:
                problems.append(
                    _shard_refusal(
                        "campaign.shard.duplicate_row",
                        shard.root,
                        f"row {key} was run by both {owner[key]} and {shard.root}",
                        "give each row's run once (drop one of the two directories)",
                    )
                )
            owner.setdefault(key, shard.root)
    if problems:
        raise Refused(tuple(problems))


def merge_campaign(
    campaign_dir: str,
    shard_dirs: Sequence[str],
    *,
    placement_file: str | None = None,
    missing: Mapping[str, Missing] | None = None,
    before_binding: Callable[[], None] | None = None,
    journal: CampaignJournal | None = None,
    verified: Mapping[str, ShardRead] | None = None,
) -> MergeOutcome:
    """Verify the shards, then publish the campaign journal and files into the fresh
    ``campaign_dir`` (which may already hold the shards, as the Ray driver's does).
    ``before_binding`` writes the caller's own files (the local cluster's evidence) once the
    shards are verified and folded, before every file of the directory is bound. With
    ``journal`` (the Ray driver's, opened before its first row), the merge's lines continue
    it; ``verified``: shards (by directory) the caller has just verified as the merge would."""
    campaign = os.path.abspath(campaign_dir)
    if not shard_dirs:
        raise Refused.one(
            "campaign.shard.none",
            "$.shards",
            "no shard directory was given",
            "give the run directories of the campaign's shards",
        )
    if journal is None and os.path.lexists(os.path.join(campaign, CAMPAIGN_JOURNAL)):
        raise Refused.one(
            "campaign.output_exists",
            "$.output",
            f"{campaign} already holds a campaign journal",
            "merge into a fresh --output",
        )
    roots = [os.path.abspath(d) for d in shard_dirs]
    shards: list[ShardRead] = []
    problems: list[Refusal] = []
    for root in roots:
        try:
            shards.append((verified or {}).get(root) or read_shard(root))
        except Refused as refused:
            problems.extend(refused.refusals)
    if problems:
        raise Refused(tuple(problems))
    check_shards(shards)

    first = shards[0]
    plan = first.plan
    placement = load_placement(placement_file, plan).pin if placement_file else None
    opened = (
        journal.opened
        if journal is not None
        else CampaignOpened(
            campaign_id=f"campaign-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-"
            f"{secrets.token_hex(4)}",
            prepared_sha256=first.started.request_sha256,
            catalog_sha256=first.started.catalog_sha256,
            tool_version=__version__,
            plan=plan,
            plan_keys=tuple(brief_key(b) for b in plan),
            catalog_synthetic=first.started.catalog_synthetic,
            placement_path=placement.path if placement else None,
            placement_sha256=placement.sha256 if placement else None,
        )
    )
    if opened.prepared_sha256 != first.started.request_sha256:
        raise Refused(
            (
                _shard_refusal(
                    "campaign.shard.other_input",
                    first.root,
                    f"{first.root} ran a prepared input with sha256 "
                    f"{first.started.request_sha256}, not the campaign's {opened.prepared_sha256}",
                    "merge only the rows of the campaign's prepared input",
                ),
            )
        )
    records: list[CampaignRecord] = [] if journal is not None else [opened]
    # Lines the journal already holds (opened, the rows' arrivals) come before the merge's.
    before = journal.chain.next_seq - 1 if journal is not None else 0
    merged: list[tuple[ShardMerged, ShardRead]] = []
    ran: set[int] = set()
    for shard in shards:
        keys = tuple(brief_key(b) for b in shard.started.planned_rows)
        rules = placement.rules if placement else {}
        asked = sorted({rules[k] for k in keys if k in rules})
        selected = shard.selected
        record = ShardMerged(
            shard_dir=recorded_dir(campaign, shard.root),
            run_id=shard.started.run_id,
            journal_head=shard.head,
            row_keys=keys,
            row_indices=tuple(b.index for b in shard.started.planned_rows),
            matrix_status=shard.matrix.status,
            terminal_refusal=shard.matrix.terminal_refusal,
            how=selected.how if selected else "all",
            shard_index=selected.shard_index if selected else None,
            shard_count=selected.shard_count if selected else None,
            host=selected.host if selected else None,
            placement="; ".join(asked) or None,
        )
        records.append(record)
        merged.append((record, shard))
        ran.update(record.row_indices)
    for brief in plan:
        if brief.index in ran:
            continue
        why = (missing or {}).get(brief_key(brief), Missing(NOT_IN_ANY_SHARD))
        records.append(
            RowUnmeasured(
                row_index=brief.index,
                row_key=brief_key(brief),
                reason=why.reason,
                detail=why.detail,
                host=why.host,
            )
        )
    unmeasured = [r for r in records if isinstance(r, RowUnmeasured)]
    folded = fold_campaign(opened, merged, unmeasured, through_seq=before + len(records))
    for name, data in folded.files.items():
        records.append(CampaignReceipt(path=name, sha256=sha256_of(data)))

    os.makedirs(campaign, exist_ok=True)
    if before_binding is not None:
        before_binding()
    for name, data in folded.files.items():
        # Workload plots go under plots/, as in a run's report.
        os.makedirs(os.path.dirname(os.path.join(campaign, name)), exist_ok=True)
        publish_fresh(os.path.join(campaign, name), data)
    # Bound after every file is written (the merged ones are bound by their receipts).
    records.append(CampaignFilesBound(files=bind_campaign_files(campaign, folded.files, roots)))
    if journal is not None:
        journal.append(*records)
        head = journal.seal(folded.matrix.status)
        return MergeOutcome(
            status=folded.matrix.status,
            campaign_dir=campaign,
            matrix_path=os.path.join(campaign, MATRIX_FILENAME),
            head=head,
        )
    chain = CampaignChain()
    lines = [
        chain.encode(record, mono_ns=time.monotonic_ns(), wall_ns=time.time_ns())
        for record in records
    ]
    head = chain.prev
    lines.append(
        chain.encode(
            CampaignSealed(
                through_seq=len(records), head_sha256=head, matrix_status=folded.matrix.status
            ),
            mono_ns=time.monotonic_ns(),
            wall_ns=time.time_ns(),
        )
    )
    publish_fresh(os.path.join(campaign, CAMPAIGN_JOURNAL), b"".join(lines))
    return MergeOutcome(
        status=folded.matrix.status,
        campaign_dir=campaign,
        matrix_path=os.path.join(campaign, MATRIX_FILENAME),
        head=chain.prev,
    )


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
