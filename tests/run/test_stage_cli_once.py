"""A stage server's help is read once per run for each pinned binary: later cells of the run
reuse the dialect read from the same pinned bytes, and still journal it and write their own
``cli-admission.json`` (the real cell actor and journal; the help probe is a FAKE)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import pytest
import trio
from cell_plans import cell_plan, host_profile
from fake_hosts.fake_custody import hasher

from cache_family.actors.journal.writer import JournalWriter
from cache_family.actors.run import stage_host
from cache_family.actors.run.cell import CellActor
from cache_family.actors.run.context import HostSettings, RunContext, RunStop
from cache_family.actors.run.private_exec import PrivateCopy
from cache_family.schemas.arms import SKIPPY_NEW
from cache_family.schemas.journal import CliAdmission, read_journal
from cache_family.states.budgets import Budgets


async def test_a_stage_servers_help_is_read_once_per_run_for_each_pinned_binary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probed: list[str] = []

    async def fake_admit_cli(
        binary: str,
        env: Mapping[str, str],
        custody: stage_host.ProbeCustody,
        same_bytes: Callable[[], Awaitable[bool]],
        *,
        pinned: str,
    ) -> stage_host.CliAdmitted:
        assert await same_bytes()
        probed.append(pinned)
        return stage_host.CliAdmitted("current", (stage_host.Probe("serve", 0, True),))

    monkeypatch.setattr(stage_host, "admit_cli", fake_admit_cli)
    profile = host_profile(str(tmp_path))
    other = profile.model_copy(
        update={"binary": str(tmp_path / "skippy-old"), "binary_sha256": "e" * 64}
    )
    Path(other.binary).write_text("#!/bin/sh\nexit 0\n")
    run_dir = str(tmp_path / "run")
    writer = JournalWriter(os.path.join(run_dir, "journal.jsonl"), fsync=lambda _fd: None)
    os.makedirs(run_dir)
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        stop = RunStop(run_deadline=trio.current_time() + 600)
        ctx = RunContext(
            writer=writer,
            run_dir=run_dir,
            budgets=Budgets(stop.run_deadline, 300, request_timeout_ms=30_000),
            stop=stop,
            hosts=HostSettings(pin_hasher=hasher()),
        )
        cells = []
        for index, chosen in enumerate((profile, other, profile, other)):
            plan = dataclasses.replace(
                cell_plan(run_dir, index, "concurrent", chosen), arm=SKIPPY_NEW
            )
            actor = CellActor(plan, ctx)
            actor._exec = PrivateCopy(root="", binary=chosen.binary, native_build=None)
            os.makedirs(actor.cell_path)
            cells.append(await actor._admit_cli())
            assert (Path(actor.cell_path) / stage_host.CLI_ADMISSION_NAME).is_file()
        await writer.aclose()
    assert probed == [profile.binary, other.binary]  # one probe per pinned binary
    assert {admitted.dialect for admitted in cells} == {"current"}
    journal = read_journal((Path(run_dir) / "journal.jsonl").read_bytes())
    admissions = [line.record for line in journal.lines if isinstance(line.record, CliAdmission)]
    assert [a.binary for a in admissions] == [profile.binary, other.binary] * 2
