"""A stage server's help probe runs as a child in custody, from the row's private copy.

Fault-injection stage binaries (shell scripts, named FAKE): one whose ``--help`` starts
``sleep 1000 &`` (a daemon in its group that outlives it), and a swap of the operator's binary
between the pre-probe byte check and the probe. The real cell actor, journal writer and
``run_child``; the pin hasher and the host are FAKES (the cell never gets to launch a host).
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psutil
import trio
from cell_plans import cell_plan, host_profile
from fake_hosts.fake_custody import FakeHostScript, fake_opener, hasher

from cache_family.actors.journal.writer import JournalWriter
from cache_family.actors.run.cell import CellActor
from cache_family.actors.run.context import (
    Budgets,
    HostSettings,
    PinResult,
    PinTarget,
    RunContext,
    RunStop,
)
from cache_family.actors.run.private_exec import make_private_copy
from cache_family.schemas.arms import SKIPPY_NEW
from cache_family.schemas.journal import ChildSpawned, CliAdmission, Fault, read_journal
from cache_family.system.process_group import PROCESS_TAG_NAME, tagged_processes


def write_script(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(stat.S_IRWXU)


def daemon_stage_binary(path: Path, pid_file: Path) -> None:
    """FAKE stage server: its ``serve --help`` starts ``sleep 1000 &`` (no setsid) and exits 0."""
    write_script(
        path,
        f'if [ "$2" = "--help" ]; then\n  sleep 1000 &\n  echo $! > "{pid_file}"\n'
        '  echo "usage: serve --config FILE"\n  exit 0\nfi\nexit 1\n',
    )


@asynccontextmanager
async def stage_context(root: Path, pin_hasher: Any) -> AsyncIterator[RunContext]:
    run_dir = root / "run"
    run_dir.mkdir()
    writer = JournalWriter(str(run_dir / "journal.jsonl"), fsync=lambda _fd: None)
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        stop = RunStop(run_deadline=trio.current_time() + 600)
        yield RunContext(
            writer=writer,
            run_dir=str(run_dir),
            budgets=Budgets(stop.run_deadline, 300, request_timeout_ms=30_000),
            stop=stop,
            hosts=HostSettings(host_opener=fake_opener(FakeHostScript()), pin_hasher=pin_hasher),
        )
        await writer.aclose()


def journal_of(root: Path) -> list[Any]:
    data = (root / "run" / "journal.jsonl").read_bytes()
    return [line.record for line in read_journal(data).lines]


def end_leftovers(root: Path) -> None:
    """Kill whatever a failing run left working under ``root`` (the daemons of old code)."""
    for process in psutil.process_iter():
        try:
            if process.cwd().startswith(str(root)):
                process.kill()
        except psutil.Error:
            pass


def test_a_help_probe_that_starts_a_daemon_leaves_nothing_and_the_cell_is_faulted(
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "daemon.pid"
    profile = host_profile(str(tmp_path))
    daemon_stage_binary(Path(profile.binary), pid_file)
    plan = dataclasses.replace(
        cell_plan(str(tmp_path / "run"), 0, "concurrent", profile), arm=SKIPPY_NEW
    )

    async def main() -> tuple[Any, str]:
        async with stage_context(tmp_path, hasher()) as ctx:
            actor = CellActor(plan, ctx)
            receipt = await actor.run()
            return receipt, ctx.cell_process_tag(plan.cell_id)

    try:
        receipt, tag = trio.run(main)
        daemon = int(pid_file.read_text())
        assert not tagged_processes(lambda seen: seen == tag)
        assert not psutil.pid_exists(daemon) or (
            psutil.Process(daemon).status() == psutil.STATUS_ZOMBIE
        ), "the probe's daemon survived"
    finally:
        end_leftovers(tmp_path)
    assert receipt is not None and receipt.status == "failed"
    assert not receipt.accepted_for_parity
    assert [f.kind for f in receipt.faults] == ["help_probe_unclean"]
    records = journal_of(tmp_path)
    probes = [r for r in records if isinstance(r, ChildSpawned) and r.role == "help_probe"]
    assert len(probes) == 1 and probes[0].pgid == probes[0].pid
    assert (probes[0].effective_environment or {})[PROCESS_TAG_NAME] == tag
    # The probe ran the private copy, never the operator's path.
    assert probes[0].executable != profile.binary
    assert any(isinstance(r, CliAdmission) for r in records)
    assert any(isinstance(r, Fault) and r.kind == "help_probe_unclean" for r in records)


def test_a_swap_of_the_operators_binary_around_the_probe_is_never_what_answers(
    tmp_path: Path,
) -> None:
    profile = host_profile(str(tmp_path))
    genuine = Path(profile.binary)
    # FAKE genuine stage server: only the legacy command answers its help.
    write_script(genuine, 'if [ "$1" = serve-openai ]; then echo usage; exit 0; fi\nexit 2\n')
    marker = tmp_path / "swapped-program-ran"
    swapped = tmp_path / "swapped"
    # FAKE other program: answers every help (so it would be read as the current dialect) and
    # leaves a mark.
    write_script(swapped, f'touch "{marker}"\necho usage\nexit 0\n')
    kept = tmp_path / "genuine-kept"
    calls: list[int] = []

    async def swapping_hasher(targets: Sequence[PinTarget], seconds: float) -> list[PinResult]:
        """FAKE pin answers (the expected pins) that swap the operator's binary right after
        the pre-probe check and put it back at the post-probe check."""
        calls.append(len(calls))
        if len(calls) == 1:
            os.replace(genuine, kept)
            os.replace(swapped, genuine)
        elif len(calls) == 2:
            os.replace(genuine, swapped)
            os.replace(kept, genuine)
        await trio.lowlevel.checkpoint()
        return [PinResult(t, t.expected_sha256) for t in targets]

    plan = dataclasses.replace(
        cell_plan(str(tmp_path / "run"), 0, "concurrent", profile), arm=SKIPPY_NEW
    )

    async def main() -> str:
        async with stage_context(tmp_path, swapping_hasher) as ctx:
            actor = CellActor(plan, ctx)
            os.makedirs(actor.cell_path)
            # What pin-verify does before the probes: the private copy the host will run.
            actor._exec = make_private_copy(profile.binary, None, actor.cell_path)
            admitted = await actor._admit_cli()
            return admitted.dialect

    dialect = trio.run(main)
    assert not marker.exists(), "the swapped program answered the help probe"
    assert dialect == "legacy"
    assert len(calls) >= 2  # the copy's pin was checked around the probes
