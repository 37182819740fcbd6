"""``cache-family merge`` and ``replay CAMPAIGN``: shards of one prepared input, one campaign.

The shards are real ``cache-family run --shard I/N`` processes against the FAKE llama-server of
``test_run_budgets.make_prepared`` (one row with a model, the rest cheap missing-model rows).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from run_harness import make_prepared

from cache_family.schemas.campaign import (
    CAMPAIGN_JOURNAL,
    CAMPAIGN_REPORT,
    CampaignOpened,
    RowUnmeasured,
    ShardMerged,
    read_campaign,
)
from cache_family.schemas.matrix import MATRIX_FILENAME, decode_matrix
from cache_family.schemas.production import PRODUCTION_JSON, PRODUCTION_MD

CLI = Path(sys.executable).parent / "cache-family"
ENV = {"PATH": "/usr/bin:/bin"}


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLI), *args],
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


class Shards:
    def __init__(self, root: Path, prepared: Path) -> None:
        self.root = root
        self.prepared = prepared
        self.plan = cli("run", "--input", str(prepared), "--dry-run").stdout.split()
        self.dirs: list[Path] = []
        for index in range(2):
            out = root / f"shard-{index}"
            done = cli(
                "run", "--input", str(prepared), "--output", str(out), "--quiet",
                "--shard", "auto/2", env={"SLURM_ARRAY_TASK_ID": str(index)},
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            self.dirs.append(out)

    def copy(self, index: int, target: Path) -> Path:
        shutil.copytree(self.dirs[index], target, symlinks=True)
        return target


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Shards:
    root = tmp_path_factory.mktemp("campaign")
    return Shards(root, make_prepared(root / "p", prefix_sweep=[16]))


def merged_records(campaign: Path) -> list[object]:
    read = read_campaign((campaign / CAMPAIGN_JOURNAL).read_bytes())
    assert read.problem is None
    return [line.record for line in read.lines]


def test_merged_shards_cover_the_plan_once_and_replay_identical(
    shards: Shards, tmp_path: Path
) -> None:
    campaign = tmp_path / "campaign"
    done = cli("merge", "--output", str(campaign), *map(str, shards.dirs))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"completed: {campaign / MATRIX_FILENAME}")
    matrix = decode_matrix((campaign / MATRIX_FILENAME).read_bytes())
    assert matrix.status == "completed" and matrix.terminal_refusal is None
    assert len(matrix.rows) == len(shards.plan)
    assert [row.index for row in matrix.rows] == sorted(row.index for row in matrix.rows)
    production = json.loads((campaign / PRODUCTION_JSON).read_bytes())
    assert len(production) == len(shards.plan)
    assert (campaign / PRODUCTION_MD).is_file()
    records = merged_records(campaign)
    merged = [r for r in records if isinstance(r, ShardMerged)]
    assert sorted(k for r in merged for k in r.row_keys) == sorted(shards.plan)
    # Each shard's host is named, in the journal and in the campaign report.
    assert all(r.host is not None and r.host.hostname for r in merged)
    assert merged[0].host is not None and merged[0].host.hostname in (
        campaign / CAMPAIGN_REPORT
    ).read_text(encoding="utf-8")
    replayed = cli("replay", str(campaign))
    assert replayed.returncode == 0, replayed.stdout
    assert "replay: campaign identical" in replayed.stdout
    # An edited merged file is found.
    (campaign / PRODUCTION_JSON).write_bytes(b"[]")
    assert cli("replay", str(campaign)).returncode == 1


def test_a_missing_shard_leaves_its_rows_unmeasured_with_the_reason(
    shards: Shards, tmp_path: Path
) -> None:
    campaign = tmp_path / "campaign"
    done = cli("merge", "--output", str(campaign), str(shards.dirs[0]))
    assert done.returncode == 1, done.stderr
    matrix = decode_matrix((campaign / MATRIX_FILENAME).read_bytes())
    assert matrix.status == "incomplete"
    assert matrix.terminal_refusal == "campaign_rows_unmeasured"
    missing = [row for row in matrix.rows if row.result.status == "unmeasured"]
    assert missing and all(row.result.reason == "not_in_any_shard" for row in missing)
    unmeasured = [r for r in merged_records(campaign) if isinstance(r, RowUnmeasured)]
    assert {r.row_index for r in unmeasured} == {row.index for row in missing}
    assert cli("replay", str(campaign)).returncode == 0


def test_merge_refuses_a_shard_of_another_input(shards: Shards, tmp_path: Path) -> None:
    other = make_prepared(tmp_path / "other", prefix_sweep=[24])
    foreign = tmp_path / "foreign"
    ran = cli(
        "run", "--input", str(other), "--output", str(foreign), "--quiet",
        "--rows", "llama/none/24",
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    campaign = tmp_path / "campaign"
    refused = cli("merge", "--output", str(campaign), str(shards.dirs[0]), str(foreign))
    assert refused.returncode == 2
    assert "campaign.shard.other_input" in refused.stderr
    assert not (campaign / CAMPAIGN_JOURNAL).exists()


def test_merge_refuses_a_row_run_twice(shards: Shards, tmp_path: Path) -> None:
    twice = shards.copy(0, tmp_path / "again")
    refused = cli("merge", "--output", str(tmp_path / "c"), str(shards.dirs[0]), str(twice))
    assert refused.returncode == 2
    assert "campaign.shard.duplicate_row" in refused.stderr


def test_merge_refuses_an_edited_shard_journal_and_replay_finds_one_edited_later(
    shards: Shards, tmp_path: Path
) -> None:
    edited = shards.copy(1, tmp_path / "edited")
    journal = edited / "journal.jsonl"
    journal.write_bytes(journal.read_bytes().replace(b'"how":"shard"', b'"how":"rows" ', 1))
    refused = cli("merge", "--output", str(tmp_path / "c"), str(shards.dirs[0]), str(edited))
    assert refused.returncode == 2
    assert "campaign.shard.unverified" in refused.stderr
    # Merged first, edited after: the campaign's replay names the shard.
    later = shards.copy(1, tmp_path / "later")
    campaign = tmp_path / "c2"
    assert cli("merge", "--output", str(campaign), str(shards.dirs[0]), str(later)).returncode == 0
    journal = later / "journal.jsonl"
    journal.write_bytes(journal.read_bytes().replace(b'"how":"shard"', b'"how":"rows" ', 1))
    replayed = cli("replay", str(campaign))
    assert replayed.returncode == 1
    assert "campaign.shard.unverified" in replayed.stdout


def test_a_placement_file_is_pinned_and_each_shard_records_what_it_asked(
    shards: Shards, tmp_path: Path
) -> None:
    placement = tmp_path / "placement.json"
    placement.write_text(
        json.dumps(
            {
                "schema_version": 1,
                "rules": [
                    {"preset": "qwen3_dense", "labels": {"cf.host": "small"}},
                    {"row": "qwen3_dense/none/16", "labels": {"cf.host": "big"}, "gpus": 1},
                ],
            }
        )
    )
    campaign = tmp_path / "campaign"
    done = cli(
        "merge", "--output", str(campaign), "--placement", str(placement),
        *map(str, shards.dirs),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = merged_records(campaign)
    opened = records[0]
    assert isinstance(opened, CampaignOpened)
    assert opened.placement_sha256 == hashlib.sha256(placement.read_bytes()).hexdigest()
    asked = [r.placement for r in records if isinstance(r, ShardMerged)]
    # The row key's rule wins over its preset's.
    assert [a for a in asked if a] == [
        "row qwen3_dense/none/16: labels {cf.host=big}, gpus 1, cpus 1"
    ]
    assert cli("replay", str(campaign)).returncode == 0
    placement.write_text(json.dumps({"schema_version": 1, "rules": [{"family": "nope"}]}))
    refused = cli(
        "merge", "--output", str(tmp_path / "c2"), "--placement", str(placement),
        *map(str, shards.dirs),
    )  # fmt: skip
    assert refused.returncode == 2 and "placement.unknown_target" in refused.stderr
