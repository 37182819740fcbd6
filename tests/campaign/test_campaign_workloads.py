"""A campaign of runs with workloads: each shard runs its rows' workload cells, and ``merge``
brings every shard's ``workload.json`` into the campaign report (its sections and plots, the
paths from the campaign), which ``replay CAMPAIGN`` re-folds identically. The shards are
in-process runs of ``--rows`` selections against the FAKE host on trio's fake clock."""

from __future__ import annotations

from pathlib import Path

import trio
from fake_hosts.fake_custody import FakeHostScript, fake_child_runner, fake_opener, hasher
from run_harness import thread_aware_autojump
from workload_harness import prepared_with, workload

from cache_family.actors.campaign.audit import replay_campaign
from cache_family.actors.campaign.merge import merge_campaign
from cache_family.actors.run.context import HostSettings
from cache_family.actors.run.matrix import admit_run, supervise
from cache_family.actors.run.selection import choose, narrow, prepared_keys
from cache_family.schemas.campaign import CAMPAIGN_REPORT
from cache_family.schemas.matrix import MATRIX_FILENAME, decode_matrix
from cache_family.schemas.prepared import load_prepared_input

OVERLAP = {"prompt_tokens": 32, "hit_ratios_pct": [0, 50], "groups": 2, "requests": 2}
SESSIONS = {
    "users": 2,
    "turns": 2,
    "system_prompt_tokens": 8,
    "user_context_tokens": 8,
    "question_tokens": 4,
    "answer_tokens": 2,
}


def run_rows(prepared: Path, out: Path, rows: list[str]) -> None:
    """``cache-family run --rows ROWS`` in process, against the FAKE host."""
    admitted = admit_run(str(prepared), str(out))
    admitted = narrow(admitted, choose(admitted.prepared, ",".join(rows), None, {}))
    out.mkdir()
    hosts = HostSettings(
        host_opener=fake_opener(FakeHostScript()),
        pin_hasher=hasher(),
        row_pins=None,
        child_runner=fake_child_runner(),
    )
    with thread_aware_autojump() as clock:
        outcome = trio.run(supervise, admitted, hosts, clock=clock)
    assert outcome.status == "completed", outcome


def test_merge_brings_every_shards_workload_cells_into_the_campaign_report(
    tmp_path: Path,
) -> None:
    prepared = prepared_with(
        tmp_path / "p",
        keys=("qwen3_dense", "llama"),
        plan={"prefix_sweep": [16]},
        prefix_overlap=OVERLAP,
        multi_turn=SESSIONS,
    )
    keys = sorted(prepared_keys(load_prepared_input(str(prepared))).items(), key=lambda k: k[1])
    # Rows 0 (qwen3_dense) and 1 (llama) have models: one in each shard.
    shards = [tmp_path / "shard-0", tmp_path / "shard-1"]
    for index, shard in enumerate(shards):
        run_rows(prepared, shard, [key for key, row in keys if row % 2 == index])
    measured = {
        (shard.name, arm): workload(shard, arm, row)
        for shard, row in zip(shards, (0, 1), strict=True)
        for arm in ("native-overlap", "native-sessions")
    }
    assert all(receipt.status == "accepted" for receipt in measured.values())

    campaign = tmp_path / "campaign"
    merged = merge_campaign(str(campaign), [str(s) for s in shards])
    assert merged.status == "completed"
    assert decode_matrix((campaign / MATRIX_FILENAME).read_bytes()).status == "completed"
    report = (campaign / CAMPAIGN_REPORT).read_text(encoding="utf-8")
    assert "## Workloads" in report
    for (shard, arm), receipt in measured.items():
        row = 0 if shard == "shard-0" else 1
        # Each cell's section names its receipt as the campaign journal names its shard
        # (absolute: these shards lie outside the campaign directory).
        assert f"{tmp_path / shard}/cell-{row:04d}/workload-{arm}/workload.json" in report
        assert f"### {receipt.cell_id}: {receipt.kind}" in report
    plots = sorted(p.name for p in (campaign / "plots").iterdir())
    assert len(plots) == 4 and all(p.startswith("workload-cell-000") for p in plots)
    replayed = replay_campaign(str(campaign))
    assert replayed.exit_code == 0, replayed.lines
    assert f"{CAMPAIGN_REPORT}: identical" in replayed.lines
    # A plot edited after the merge is found.
    (campaign / "plots" / plots[0]).write_text("<svg/>")
    assert replay_campaign(str(campaign)).exit_code == 1
