"""``cache-family campaign --resume CAMPAIGN``: run again only the rows without a finished run.

A row is kept only when its run directory is sealed, replays identical and ended without a run-
wide refusal (cancellation, deadline, interrupt failure): such a row is never run twice; every
other row runs again and its earlier try moves under ``superseded/N/``. The prepared input and
the placement file must still have the bytes the campaign started with.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from cache_family.actors.audit.replay import replay
from cache_family.errors import Refused
from cache_family.schemas.bounded import read_bounded
from cache_family.schemas.campaign import (
    CAMPAIGN_JOURNAL,
    CAMPAIGN_REQUEST,
    CampaignRequest,
    decode_request,
)
from cache_family.schemas.journal import PlannedRowBrief
from cache_family.schemas.matrix import MATRIX_FILENAME, decode_matrix

SUPERSEDED: str = "superseded"
# The prefix of a row the driver is receiving (``row_return.STAGING_PREFIX``).
STAGING_PREFIX: str = ".incoming-"
ROWS_SUBDIR: str = "rows"
# The campaign's own files an earlier merge wrote (moved aside before the new merge).
MERGED_FILES: tuple[str, ...] = (
    "campaign-journal.jsonl",
    "cache-family-matrix.json",
    "production-cache-bench.json",
    "production-cache-bench.md",
    "campaign-report.md",
    "local-cluster.json",
)


@dataclass(frozen=True, slots=True)
class ResumePlan:
    request: CampaignRequest
    kept: tuple[str, ...]  # run directories kept as they are
    rerun: tuple[PlannedRowBrief, ...]
    moves: tuple[tuple[str, str], ...]  # (source, target), absolute


def read_request(campaign: str) -> CampaignRequest:
    try:
        raw = read_bounded(os.path.join(campaign, CAMPAIGN_REQUEST), 1 << 20, what="request")
        return decode_request(raw.data)
    except (Refused, ValueError) as exc:
        raise Refused.one(
            "campaign.resume.not_a_campaign",
            "$.resume",
            f"{campaign} holds no readable {CAMPAIGN_REQUEST} ({exc})",
            "give the directory a `cache-family campaign` wrote",
        ) from None


def check_bytes(path: str | None, expected: str | None, what: str) -> None:
    if path is None or expected is None:
        return
    raw = read_bounded(path, 256 << 20, what=what)
    if raw.sha256 != expected:
        raise Refused.one(
            "campaign.resume.input_changed",
            "$.resume",
            f"{path} now has sha256 {raw.sha256}; the campaign started with {expected}",
            f"restore the {what} the campaign started with, or start a new campaign",
        )


def finished(row_dir: str) -> bool:
    """Sealed, replay-identical, and not ended by a cancellation, deadline or interrupt."""
    if not os.path.isfile(os.path.join(row_dir, MATRIX_FILENAME)):
        return False
    if replay(row_dir).exit_code != 0:
        return False
    with open(os.path.join(row_dir, MATRIX_FILENAME), "rb") as handle:
        return decode_matrix(handle.read()).terminal_refusal is None


def plan_resume(
    campaign: str,
    plan: list[PlannedRowBrief],
    rows_dir: str,
    request: CampaignRequest,
    *,
    keep_journal: bool = False,
) -> ResumePlan:
    """What a resume keeps, runs again and moves aside; ``keep_journal``: the campaign
    journal is an unsealed one the resume continues (it stays in place)."""
    kept: list[str] = []
    rerun: list[PlannedRowBrief] = []
    moves: list[tuple[str, str]] = []
    generation = 1
    while os.path.lexists(os.path.join(campaign, SUPERSEDED, str(generation))):
        generation += 1
    aside = os.path.join(campaign, SUPERSEDED, str(generation))
    for brief in plan:
        name = f"row-{brief.index:04d}"
        row_dir = os.path.join(rows_dir, name)
        if finished(row_dir):
            kept.append(row_dir)
            continue
        rerun.append(brief)
        for suffix in ("", ".log"):
            if os.path.lexists(row_dir + suffix):
                moves.append((row_dir + suffix, os.path.join(aside, ROWS_SUBDIR, name + suffix)))
    # A row the driver was receiving when it stopped: never placed, never journaled.
    with os.scandir(rows_dir) if os.path.isdir(rows_dir) else contextlib.nullcontext(()) as found:
        for entry in found:
            if entry.name.startswith(STAGING_PREFIX):
                moves.append((entry.path, os.path.join(aside, ROWS_SUBDIR, entry.name)))
    for name in MERGED_FILES:
        if keep_journal and name == CAMPAIGN_JOURNAL:
            continue
        source = os.path.join(campaign, name)
        if os.path.lexists(source):
            moves.append((source, os.path.join(aside, name)))
    return ResumePlan(request=request, kept=tuple(kept), rerun=tuple(rerun), moves=tuple(moves))


def move_aside(moves: tuple[tuple[str, str], ...]) -> None:
    for source, target in moves:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.rename(source, target)
