"""In-process FAKE host custody for fault-injection tests (never a real server, never timed).

``fake_opener(script)`` stands where custody's ``host_custody`` stands: each host is a
``FakeLlamaHttp`` endpoint on a real 127.0.0.1 socket plus custody's events, scripted by a
``FakeHostScript``; ``hasher()`` answers pin re-hashes instantly. Used with the real cell, row
and matrix actors, the journal writer and the folds.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from fake_hosts.fake_correctness_tool import write_report
from fake_hosts.fake_llama_http import FakeLlamaHttp, Reply

from cache_family.actors.run import custody
from cache_family.actors.run.context import HostHandle, Observe, PinResult
from cache_family.errors import Refused
from cache_family.schemas.measurement import (
    HostCleaned,
    HostCleanup,
    HostFaulted,
    HostMarkerSeen,
    HostReady,
    HostSpawned,
)
from cache_family.states.plans import PinTarget
from cache_family.system.child import ChildCommand, ChildEnded, ChildRunner, OnSpawn
from cache_family.system.http import LoopbackHttp


@dataclass
class FakeHostScript:
    """How the in-process FAKE host behaves (one per test)."""

    reply: Callable[[int, dict[str, Any]], Reply] = lambda _i, _b: Reply(
        first_token_delay=0.01, token_delay=0.0
    )
    # still_same() turns false after this many calls (None: never): the pid now names
    # another process (a swap).
    identity_lasts: int | None = None
    # Set (by a reply, say) when the FAKE host has exited: still_same() is false from then
    # on, and it is an exit, not a swap (replaced() stays false).
    exited: bool = False
    forced_cleanup: bool = False
    # Further custody findings of the fake cleanup (CleanupOutcome fields), e.g. a truncated
    # capture or a descendant that escaped the process group.
    cleanup_findings: dict[str, Any] = field(default_factory=dict)
    never_ready: bool = False
    launched: list[str] = field(default_factory=list)
    cleaned: list[str] = field(default_factory=list)
    argv: list[list[str]] = field(default_factory=list)
    env: list[dict[str, str]] = field(default_factory=list)
    # The label of the host custody sampled the process tree of, once per sample.
    tree_samples: list[str] = field(default_factory=list)


class FakeHost:
    """A FAKE host in custody: an in-process llama HTTP endpoint and custody's events."""

    def __init__(self, config: custody.HostConfig, observe: Observe, script: FakeHostScript):
        self.config = config
        self.observe = observe
        self.script = script
        self.port = 0
        self.state_dir = os.path.join(config.state_parent, "fake-state")
        self.pid: int | None = None
        self.create_time: float | None = None
        self.identity_checks = 0
        self._outcome: HostCleanup | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def launch(self, argv: Sequence[str], env: Any) -> HostSpawned:
        self.pid, self.create_time = 40000 + len(self.script.launched), 1700000000.5
        self.script.launched.append(self.config.label)
        self.script.argv.append(list(argv))
        self.script.env.append(dict(env))
        spawned = HostSpawned(
            label=self.config.label,
            pid=self.pid,
            create_time=self.create_time,
            port=self.port,
            argv=tuple(argv),
            env=dict(env),
            state_dir=self.state_dir,
            stdout_log="",
            stderr_log="",
        )
        await self.observe(spawned)
        return spawned

    async def wait_ready(
        self, startup_seconds: float, http: LoopbackHttp | None = None
    ) -> HostReady:
        assert self.pid is not None
        if self.script.never_ready:
            await trio.sleep(startup_seconds)
            await self.observe(
                HostFaulted(
                    label=self.config.label,
                    code="custody.readiness_failed",
                    message="never healthy",
                    pid=self.pid,
                )
            )
            raise Refused.one("custody.readiness_failed", "$.host", "never healthy", "fake")
        marker = custody.listening_marker("llama-server", self.port)
        await self.observe(
            HostMarkerSeen(
                label=self.config.label, pid=self.pid, stream="stderr", line=marker, after_seconds=0
            )
        )
        ready = HostReady(
            label=self.config.label, pid=self.pid, after_seconds=0.05, health_attempts=1
        )
        await self.observe(ready)
        return ready

    def still_same(self) -> bool:
        self.identity_checks += 1
        lasts = self.script.identity_lasts
        if self.script.exited:
            return False
        return self.pid is not None and (lasts is None or self.identity_checks <= lasts)

    def replaced(self) -> bool:
        if self.script.exited:
            return False
        return self.pid is not None and not self.still_same()

    def note_descendants(self) -> None:
        self.script.tree_samples.append(self.config.label)

    def shorten_grace(self) -> None:
        pass

    async def cleanup(self) -> HostCleanup:
        if self._outcome is None:
            forced = self.script.forced_cleanup and self.pid is not None
            self._outcome = HostCleanup(
                pid=self.pid,
                graceful=not forced,
                forced=forced,
                exit_code=-9 if forced else 0,
                port_free=True,
                state_dir_removed=True,
                **(self.script.cleanup_findings if self.pid is not None else {}),
            )
            self.script.cleaned.append(self.config.label)
            with trio.CancelScope(shield=True):
                await self.observe(HostCleaned(label=self.config.label, outcome=self._outcome))
        return self._outcome


def fake_opener(script: FakeHostScript) -> Any:
    @asynccontextmanager
    async def open_host(config: custody.HostConfig, observe: Observe) -> AsyncIterator[HostHandle]:
        server = FakeLlamaHttp(script=script.reply)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            host = FakeHost(config, observe, script)
            host.port = server.port
            try:
                yield host
            finally:
                await host.cleanup()
                nursery.cancel_scope.cancel()

    return open_host


def hasher(drift: dict[int, str] | None = None) -> Any:
    """Instant FAKE pin answers: the expected pins, except ``drift[call number] = pin name``."""
    calls: list[int] = []

    async def hash_pins(targets: Sequence[PinTarget], seconds: float) -> list[PinResult]:
        assert seconds > 0
        bad = (drift or {}).get(len(calls))
        calls.append(len(calls))
        await trio.lowlevel.checkpoint()
        return [PinResult(t, "f" * 64 if t.name == bad else t.expected_sha256) for t in targets]

    return hash_pins


def fake_child_runner(
    edit: dict[str, Any] | Callable[[int], dict[str, Any]] | None = None,
    *,
    exit_code: int = 0,
    ran: list[tuple[str, ...]] | None = None,
) -> ChildRunner:
    """FAKE correctness children, in process (trio's autojump clock cannot wait on a real
    one): each writes ``fake_correctness_tool``'s passing report for its argv, then ``edit``
    (or ``edit(call number)``)."""
    calls: list[tuple[str, ...]] = [] if ran is None else ran

    async def runner(command: ChildCommand, on_spawn: OnSpawn) -> ChildEnded:
        # Above Linux's largest pid: a reap of this journal can never touch a real process.
        pid = (1 << 22) + 1 + len(calls)
        await on_spawn(pid, 1.0)
        changes = edit(len(calls)) if callable(edit) else edit
        calls.append(command.argv)
        for path in (command.stdout_path, command.stderr_path):
            with open(path, "x"):
                pass
        write_report(command.argv[1:], changes)
        return ChildEnded(pid=pid, graceful=True, exit_code=exit_code, create_time=1.0)

    return runner
