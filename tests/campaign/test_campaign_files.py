"""``replay CAMPAIGN`` binds the campaign's own files as a run's replay binds a run's.

The attack run edited ``local-cluster.json`` (127.0.0.1 made 10.0.0.1: the evidence that
nothing listened beyond loopback), ``campaign-request.json``, ``rows/row-0000.log``, planted a
top-level file and an extra row directory: each replayed identical, with or without
``--expect-head``. The campaign here is laid out as the Ray driver lays one out (its row as a
real ``cache-family run`` under ``rows/``, the row's log beside it, the request and the
cluster's evidence at the top) and merged by the driver's own ``merge_campaign``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from run_harness import make_prepared

from cache_family.actors.campaign.audit import replay_campaign
from cache_family.actors.campaign.merge import merge_campaign
from cache_family.cli import main as cli_main
from cache_family.schemas.campaign import (
    CAMPAIGN_JOURNAL,
    CAMPAIGN_REQUEST,
    CampaignFilesBound,
    CampaignRequest,
    encode_request,
    read_campaign,
)

CLI = Path(sys.executable).parent / "cache-family"
EVIDENCE = "local-cluster.json"
ROW_LOG = "rows/row-0000.log"


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A merged campaign and the head its merge printed."""
    root = tmp_path_factory.mktemp("campaign-files")
    prepared = make_prepared(root / "p", prefix_sweep=[16])
    campaign = root / "campaign"
    row = campaign / "rows" / "row-0000"
    (campaign / "rows").mkdir(parents=True)
    request = CampaignRequest(input_path=str(prepared), input_sha256="0" * 64)
    (campaign / CAMPAIGN_REQUEST).write_bytes(encode_request(request))
    done = subprocess.run(
        [str(CLI), "run", "--input", str(prepared), "--output", str(row), "--quiet"],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (campaign / ROW_LOG).write_bytes(done.stdout + done.stderr)

    def evidence() -> None:
        tcp = [["127.0.0.1:6379", "127.0.0.1:0"]]
        (campaign / EVIDENCE).write_text(json.dumps({"interfaces": ["lo"], "tcp": tcp}))

    outcome = merge_campaign(str(campaign), [str(row)], before_binding=evidence)
    return campaign, outcome.head


def edit_evidence(campaign: Path) -> Path:
    path = campaign / EVIDENCE
    path.write_text(path.read_text().replace("127.0.0.1", "10.0.0.1"))
    return path


def edit_request(campaign: Path) -> Path:
    path = campaign / CAMPAIGN_REQUEST
    path.write_text(path.read_text().replace("0" * 64, "1" * 64))
    return path


def edit_row_log(campaign: Path) -> Path:
    path = campaign / ROW_LOG
    path.write_bytes(path.read_bytes() + b"completed\n")
    return path


def plant_top_level_file(campaign: Path) -> Path:
    path = campaign / "NOTES.txt"
    path.write_text("all rows ran on loopback\n")
    return path


def plant_row_directory(campaign: Path) -> Path:
    path = campaign / "rows" / "row-0001"
    path.mkdir()
    return path


EDITS: dict[str, Callable[[Path], Path]] = {
    "evidence": edit_evidence,
    "request": edit_request,
    "row-log": edit_row_log,
    "planted-file": plant_top_level_file,
    "planted-row-dir": plant_row_directory,
}


def test_the_merge_binds_the_campaigns_own_files_and_replays_identical(
    merged: tuple[Path, str],
) -> None:
    campaign, head = merged
    read = read_campaign((campaign / CAMPAIGN_JOURNAL).read_bytes())
    (bound,) = [line.record for line in read.lines if isinstance(line.record, CampaignFilesBound)]
    paths = {entry.path for entry in bound.files}
    assert {EVIDENCE, CAMPAIGN_REQUEST, ROW_LOG, "rows", "rows/row-0000"} <= paths
    assert not any(path.startswith("rows/row-0000/") for path in paths)  # its journal's
    report = replay_campaign(str(campaign), expect_head=head)
    assert report.exit_code == 0, report.lines
    assert f"campaign files: {len(bound.files)} bound, every one as bound and no other" in (
        report.lines
    )


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edit_of_the_campaigns_own_files_differs(
    merged: tuple[Path, str], tmp_path: Path, edit: str, capsys: pytest.CaptureFixture[str]
) -> None:
    source, head = merged
    campaign = tmp_path / "campaign"
    shutil.copytree(source, campaign, symlinks=True)
    changed = EDITS[edit](campaign).relative_to(campaign)
    report = replay_campaign(str(campaign))
    assert report.exit_code == 1, report.lines
    assert any(line.startswith(f"DIFFERS {changed}: replay.file.") for line in report.lines)
    assert cli_main(["replay", str(campaign), "--expect-head", head]) == 1
    assert "replay: campaign DIFFERS" in capsys.readouterr().out


def test_a_campaign_journal_rewritten_is_caught_by_the_expected_head(
    merged: tuple[Path, str], tmp_path: Path
) -> None:
    source, head = merged
    campaign = tmp_path / "campaign"
    shutil.copytree(source, campaign, symlinks=True)
    assert replay_campaign(str(campaign), expect_head=head).exit_code == 0
    other = replay_campaign(str(campaign), expect_head="f" * 64)
    assert other.exit_code == 1
    assert any("replay.head.mismatch" in line for line in other.lines)
