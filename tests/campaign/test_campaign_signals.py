"""A campaign's signals at its edges: during the local cluster's start-up (acted on 21.5 s
late in the attack run: every node started and every row submitted first), and after every
row had ended (exit 130 with a completed matrix, yet "the rows were cancelled" printed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_harness import make_prepared

from cache_family.actors.campaign import ray_driver
from cache_family.actors.campaign.merge import MergeOutcome
from cache_family.exit_codes import ExitCode

# A real `campaign --ray local` in its own process (it enters a network namespace) whose
# commands that start the head and the test hosts are FAKEs: the operator's Ctrl-C reaches
# the process while the head starts. The FAKEs record what the campaign asked afterwards;
# the row driver is a FAKE too, so a row submitted at all is seen.
SIGINT_WHILE_THE_HEAD_STARTS = """
import json, os, signal, sys
from cache_family.actors.campaign import local_cluster, ray_driver

asked = []

def fake_run_signalled_as_the_head_starts(*argv, env=None):
    if "--head" in argv:
        asked.append("head")
        os.kill(os.getpid(), signal.SIGINT)

def fake_add_host(self, index):
    asked.append("node")

real_shutdown = local_cluster.LocalCluster.shutdown

def recorded_shutdown(self):
    asked.append("shutdown")
    return real_shutdown(self)

def fake_drive(*_args, **_options):
    asked.append("rows submitted")
    return {}, {}

local_cluster._run = fake_run_signalled_as_the_head_starts
local_cluster.LocalCluster._add_host = fake_add_host
local_cluster.LocalCluster.shutdown = recorded_shutdown
ray_driver.drive = fake_drive
code, lines = ray_driver.campaign_main(sys.argv[1], sys.argv[2], "local", None, 2)
print(json.dumps({"code": code, "asked": asked, "lines": lines}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="--ray local needs root for its namespace")
def test_a_sigint_during_the_cluster_start_up_starts_no_node_and_submits_no_row(
    tmp_path: Path,
) -> None:
    prepared = make_prepared(tmp_path / "p")
    out = tmp_path / "campaign"
    done = subprocess.run(
        [sys.executable, "-c", SIGINT_WHILE_THE_HEAD_STARTS, str(prepared), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["asked"] == ["head", "shutdown"]
    assert result["code"] == ExitCode.INTERRUPTED
    rows = json.loads((out / "local-cluster.json").read_text())["rows"]
    assert rows >= 1
    assert result["lines"][-1].startswith(f"interrupted: {rows} row(s) were cancelled")
    assert "no row sealed a run directory: nothing to merge" in result["lines"]


def test_a_signal_after_every_row_ended_says_no_row_was_cancelled(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    completed = MergeOutcome(
        status="completed", campaign_dir="/c", matrix_path="/c/m.json", head="a" * 64
    )

    def fake_run_campaign(*_args: object, **_options: object) -> ray_driver.CampaignResult:
        # Every row sealed and merged; the signal came after the last one ended.
        return ray_driver.CampaignResult(ExitCode.INTERRUPTED, completed, [], cancelled_rows=0)

    monkeypatch.setattr(ray_driver, "run_campaign", fake_run_campaign)
    code, lines = ray_driver.campaign_main("/p.json", "/c", "local", None, 1)
    assert code == ExitCode.INTERRUPTED
    assert lines[-1] == (
        "interrupted after every row had ended: no row was cancelled; the merged matrix is "
        "completed"
    )
    assert "cancelled and their hosts" not in capsys.readouterr().out
