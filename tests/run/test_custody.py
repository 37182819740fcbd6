"""Host custody against real child processes (scripted FAKE hosts under tests/fake_hosts/).

Real processes need real time: every wait here is bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from cache_family.actors.run.custody import (
    Host,
    HostConfig,
    host_basics,
    host_custody,
    host_environment,
    is_listening_line,
    listening_marker,
    port_is_free,
    recorded_environment,
    still_same,
)
from cache_family.errors import Refused
from cache_family.schemas.measurement import (
    HostCleaned,
    HostEvent,
    HostFaulted,
    HostMarkerSeen,
)
from cache_family.system.http import LoopbackHttp, Response

# Real child processes have no event to await: readiness files are polled at this interval.
CHILD_POLL_SECONDS = 0.01

FAKE_HOSTS = Path(__file__).resolve().parents[1] / "support" / "fake_hosts"
IGNORES_SIGTERM = str(FAKE_HOSTS / "fake_host_ignores_sigterm.py")
SCRIPTED = str(FAKE_HOSTS / "fake_host_scripted.py")


class Recorder:
    def __init__(self) -> None:
        self.events: list[HostEvent] = []

    async def __call__(self, event: HostEvent) -> None:
        self.events.append(event)

    def kinds(self) -> list[str]:
        return [type(event).__name__ for event in self.events]


def config(tmp_path: Path, **overrides: object) -> HostConfig:
    (tmp_path / "state").mkdir(exist_ok=True)
    values: dict[str, object] = {
        "label": "host",
        "state_parent": str(tmp_path / "state"),
        "log_dir": str(tmp_path / "logs"),
        "grace_seconds": 5.0,
    }
    values.update(overrides)
    return HostConfig(**values)  # type: ignore[arg-type]


def env_for(host: Host) -> dict[str, str]:
    return host_environment({"CACHE_FAMILY_TEST": "1"}, {}, None, host.state_dir)


def alive(pid: int, create_time: float) -> bool:
    return still_same(pid, create_time)


async def read_pids(path: Path) -> list[int]:
    with trio.fail_after(30):
        while not path.exists():
            await trio.sleep(CHILD_POLL_SECONDS)
    return list(json.loads(path.read_text()))


async def test_host_ignoring_sigterm_is_killed_with_its_grandchild(tmp_path: Path) -> None:
    recorder = Recorder()
    pids_path = tmp_path / "pids.json"
    with trio.fail_after(30):
        async with host_custody(config(tmp_path, grace_seconds=0.5), recorder) as host:
            await host.launch(
                [sys.executable, IGNORES_SIGTERM, str(host.port), str(pids_path)], env_for(host)
            )
            await host.wait_ready(30)
            assert host.still_same()
            pids = await read_pids(pids_path)
            identities = {pid: psutil.Process(pid).create_time() for pid in pids}
            state_dir = host.state_dir
            outcome = await host.cleanup()
    assert outcome.forced is True
    assert outcome.graceful is False
    assert outcome.exit_code == -9
    assert outcome.surviving_descendants == ()
    assert outcome.escaped_descendants == ()
    assert outcome.port_free is True
    assert outcome.state_dir_removed is True
    assert outcome.clean is False  # a forced kill is a custody failure
    assert not any(alive(pid, created) for pid, created in identities.items())
    assert not Path(state_dir).exists()
    assert port_is_free(host.port)
    assert not host.still_same()
    assert recorder.kinds() == ["HostSpawned", "HostMarkerSeen", "HostReady", "HostCleaned"]


async def test_grandchild_that_left_the_group_is_found_by_identity(tmp_path: Path) -> None:
    pids_path = tmp_path / "pids.json"
    with trio.fail_after(30):
        async with host_custody(config(tmp_path, grace_seconds=0.3)) as host:
            await host.launch(
                [
                    sys.executable,
                    IGNORES_SIGTERM,
                    str(host.port),
                    str(pids_path),
                    "--grandchild-escapes",
                ],
                env_for(host),
            )
            await host.wait_ready(30)
            leader, grandchild = await read_pids(pids_path)
            with trio.fail_after(5):
                while os.getsid(grandchild) != grandchild:
                    await trio.sleep(CHILD_POLL_SECONDS)
            created = psutil.Process(grandchild).create_time()
            outcome = await host.cleanup()
    assert outcome.forced is True
    assert outcome.escaped_descendants == (grandchild,)
    assert outcome.surviving_descendants == ()
    assert not alive(grandchild, created)
    assert leader == host.pid


async def test_group_member_outliving_an_obedient_leader_forces_the_kill(tmp_path: Path) -> None:
    pids_path = tmp_path / "pids.json"
    with trio.fail_after(30):
        # The grace always runs out here (the grandchild ignores SIGTERM); it only has to be
        # long enough for the leader to exit on its own, whatever the machine's load.
        async with host_custody(config(tmp_path, grace_seconds=3.0)) as host:
            await host.launch(
                [sys.executable, IGNORES_SIGTERM, str(host.port), str(pids_path), "--leader-obeys"],
                env_for(host),
            )
            await host.wait_ready(30)
            _leader, grandchild = await read_pids(pids_path)
            created = psutil.Process(grandchild).create_time()
            outcome = await host.cleanup()
    assert outcome.exit_code == 0
    assert outcome.forced is True
    assert outcome.graceful is False
    assert outcome.surviving_descendants == ()
    assert not alive(grandchild, created)


async def test_well_behaved_host_ends_gracefully(tmp_path: Path) -> None:
    recorder = Recorder()
    with trio.fail_after(30):
        async with host_custody(config(tmp_path), recorder) as host:
            spawned = await host.launch(
                [sys.executable, SCRIPTED, "graceful", str(host.port)], env_for(host)
            )
            ready = await host.wait_ready(30)
            assert spawned.pid == ready.pid == host.pid
            assert spawned.create_time == host.create_time
            assert stat.S_IMODE(os.stat(host.state_dir).st_mode) == 0o700
    outcome = host.outcome
    assert outcome is not None
    assert outcome.graceful is True
    assert outcome.forced is False
    assert outcome.exit_code == 0
    assert outcome.clean is True
    marker = next(e for e in recorder.events if isinstance(e, HostMarkerSeen))
    assert marker.stream == "stderr"
    assert marker.line == listening_marker("llama-server", host.port)
    cleaned = recorder.events[-1]
    assert isinstance(cleaned, HostCleaned) and cleaned.outcome == outcome


async def test_busy_port_is_refused_and_nothing_is_launched(tmp_path: Path) -> None:
    recorder = Recorder()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    busy = squatter.getsockname()[1]
    try:
        with pytest.raises(Refused) as caught:
            async with host_custody(config(tmp_path, port=busy), recorder) as host:
                await host.launch([sys.executable, SCRIPTED, "graceful", str(busy)], {})
    finally:
        squatter.close()
    assert caught.value.codes == ["custody.port_busy"]
    assert recorder.events == []
    assert list((tmp_path / "state").iterdir()) == []
    assert not (tmp_path / "logs").exists()


async def test_missing_listening_line_is_a_marker_timeout(tmp_path: Path) -> None:
    recorder = Recorder()
    with trio.fail_after(30), pytest.raises(Refused) as caught:
        async with host_custody(config(tmp_path), recorder) as host:
            await host.launch([sys.executable, SCRIPTED, "silent", str(host.port)], env_for(host))
            await host.wait_ready(1.0)
    assert caught.value.codes == ["custody.marker_timeout"]
    assert recorder.kinds() == ["HostSpawned", "HostFaulted", "HostCleaned"]
    assert host.outcome is not None and host.outcome.graceful
    assert host.outcome.state_dir_removed


async def test_child_exiting_before_the_marker_is_reported(tmp_path: Path) -> None:
    recorder = Recorder()
    with trio.fail_after(30), pytest.raises(Refused) as caught:
        async with host_custody(config(tmp_path), recorder) as host:
            await host.launch(
                [sys.executable, SCRIPTED, "exit-early", str(host.port)], env_for(host)
            )
            await host.wait_ready(30)
    assert caught.value.codes == ["custody.child_exited"]
    fault = next(e for e in recorder.events if isinstance(e, HostFaulted))
    assert fault.exit_code == 3
    assert host.outcome is not None and host.outcome.exit_code == 3


async def test_host_that_never_becomes_healthy_fails_readiness(tmp_path: Path) -> None:
    with trio.fail_after(30), pytest.raises(Refused) as caught:
        async with host_custody(config(tmp_path)) as host:
            await host.launch(
                [sys.executable, SCRIPTED, "unhealthy", str(host.port)], env_for(host)
            )
            # Long enough for a full readiness try after the marker on a loaded machine.
            await host.wait_ready(8.0)
    assert caught.value.codes == ["custody.readiness_failed"]
    assert "HTTP 503" in str(caught.value)


class SilentNearTheDeadline(LoopbackHttp):
    """A fault-injection client: the real client until `silent_from`, then no answer at all,
    so the last readiness tries (under HEALTH_TRY_SECONDS from it) are cut short."""

    def __init__(self, silent_from: Callable[[], float]) -> None:
        super().__init__()
        self.silent_from = silent_from
        self.answered = 0

    @asynccontextmanager
    async def request(self, method: str, url: str, **kwargs: Any) -> AsyncIterator[Response]:
        if trio.current_time() >= self.silent_from():
            await trio.sleep_forever()
        async with super().request(method, url, **kwargs) as response:
            self.answered += 1
            yield response


async def test_a_readiness_try_cut_short_by_the_deadline_keeps_the_hosts_last_answer(
    tmp_path: Path,
) -> None:
    startup, silent_for = 15.0, 1.5
    with trio.fail_after(30), pytest.raises(Refused) as caught:
        async with host_custody(config(tmp_path)) as host:
            await host.launch(
                [sys.executable, SCRIPTED, "unhealthy", str(host.port)], env_for(host)
            )
            assert host._spawned_at is not None
            spawned_at = host._spawned_at
            client = SilentNearTheDeadline(lambda: spawned_at + startup - silent_for)
            await host.wait_ready(startup, client)
    assert client.answered > 0
    assert caught.value.codes == ["custody.readiness_failed"]
    assert "last: HTTP 503" in str(caught.value)


async def test_missing_binary_is_a_spawn_failure(tmp_path: Path) -> None:
    with pytest.raises(Refused) as caught:
        async with host_custody(config(tmp_path)) as host:
            await host.launch([str(tmp_path / "no-such-server")], env_for(host))
    assert caught.value.codes == ["custody.spawn_failed"]
    assert host.outcome is not None and host.outcome.state_dir_removed


async def test_host_sees_exactly_the_environment_it_was_given(tmp_path: Path) -> None:
    dump = tmp_path / "env.json"
    build = tmp_path / "build"
    (build / "lib").mkdir(parents=True)
    (build / "lib" / "libllama.so").write_bytes(b"")
    with trio.fail_after(30):
        async with host_custody(config(tmp_path)) as host:
            env = host_environment(
                {"OPERATOR_KNOB": "on"},
                {"CUDA_HOME": "/opt/cuda"},
                str(build),
                host.state_dir,
                basics={"PATH": "/usr/bin:/bin"},
            )
            await host.launch(
                [sys.executable, SCRIPTED, "graceful", str(host.port), str(dump)], env
            )
            await host.wait_ready(30)
            state_dir, tag = host.state_dir, host.process_tag
    seen = json.loads(dump.read_text())
    seen.pop("LC_CTYPE", None)  # Python's own UTF-8 mode may coerce the locale in the child
    assert seen == {**env, "CACHE_FAMILY_CELL": tag}  # custody adds only the host's tag
    assert seen["PATH"] == "/usr/bin:/bin"
    assert seen["HOME"] == f"{state_dir}/home"
    assert seen["TMPDIR"] == f"{state_dir}/tmp"
    assert seen["LLAMA_STAGE_BUILD_DIR"] == str(build)
    assert seen["LD_LIBRARY_PATH"] == str(build / "lib")
    assert "VIRTUAL_ENV" not in seen and "PYTEST_CURRENT_TEST" not in seen


def test_environment_adds_library_path_only_when_needed(tmp_path: Path) -> None:
    static_build = tmp_path / "static"
    (static_build / "bin").mkdir(parents=True)
    env = host_environment({}, {}, str(static_build), str(tmp_path / "state"))
    assert "LD_LIBRARY_PATH" not in env
    assert set(env) >= {"PATH", "HOME", "TMPDIR", "LLAMA_STAGE_BUILD_DIR"}
    assert host_environment({"PATH": "/opt/bin"}, {}, None, "/s")["PATH"] == "/opt/bin"


def test_environment_refuses_private_names_and_conflicts() -> None:
    with pytest.raises(Refused) as caught:
        host_environment({"HOME": "/root", "X": "1"}, {"X": "2", "TMPDIR": "/t"}, None, "/s")
    assert sorted(caught.value.codes) == [
        "custody.env_conflict",
        "custody.env_reserved",
        "custody.env_reserved",
    ]


async def test_second_interrupt_shortens_the_grace(tmp_path: Path) -> None:
    pids_path = tmp_path / "pids.json"
    with trio.fail_after(20):
        async with host_custody(config(tmp_path, grace_seconds=600)) as host:
            await host.launch(
                [sys.executable, IGNORES_SIGTERM, str(host.port), str(pids_path)], env_for(host)
            )
            await host.wait_ready(30)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(host.cleanup)
                await host.terminating.wait()
                host.shorten_grace()
    outcome = host.outcome
    assert outcome is not None
    assert outcome.grace_shortened is True
    assert outcome.forced is True
    assert outcome.surviving_descendants == ()


async def test_cancellation_still_ends_the_host(tmp_path: Path) -> None:
    with trio.fail_after(30):
        with trio.CancelScope() as scope:
            async with host_custody(config(tmp_path)) as host:
                await host.launch(
                    [sys.executable, SCRIPTED, "graceful", str(host.port)], env_for(host)
                )
                await host.wait_ready(30)
                pid, created = host.pid, host.create_time
                scope.cancel()
                await trio.sleep_forever()
    assert scope.cancelled_caught
    assert pid is not None and created is not None
    assert not alive(pid, created)
    assert host.outcome is not None and host.outcome.clean


async def test_capture_is_bounded_and_marks_truncation(tmp_path: Path) -> None:
    cfg = config(tmp_path, capture_total_limit=128 * 1024)
    with trio.fail_after(30):
        async with host_custody(cfg) as host:
            await host.launch([sys.executable, SCRIPTED, "noisy", str(host.port)], env_for(host))
            await host.wait_ready(30)
    outcome = host.outcome
    assert outcome is not None
    assert outcome.oversized_lines == 1
    assert outcome.capture_truncated is True
    assert outcome.clean is False
    stdout = Path(host.stdout_log).read_bytes()
    assert len(stdout) < 128 * 1024 + 200
    assert b"[cache-family: line truncated at 65536 bytes]" in stdout
    assert stdout.rstrip().endswith(b"[cache-family: capture truncated at 131072 bytes]")
    assert b"srv  llama_server: listening on" in Path(host.stderr_log).read_bytes()


async def test_repr_shows_state_pid_and_elapsed(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with host_custody(config(tmp_path, label="native-serial")) as host:
            assert "state=reserved" in repr(host)
            await host.launch([sys.executable, SCRIPTED, "graceful", str(host.port)], env_for(host))
            await host.wait_ready(30)
            text = repr(host)
    assert text.startswith("<Host native-serial state=ready pid=")
    assert "elapsed=" in text and "elapsed=-" not in text
    assert "state=cleaned" in repr(host)


def test_listening_line_is_exact_apart_from_the_common_log_prefix() -> None:
    marker = "srv  llama_server: listening on http://127.0.0.1:8123"
    assert is_listening_line("llama-server", marker, 8123)
    assert is_listening_line("llama-server", "0.00.020.901 I " + marker, 8123)
    assert not is_listening_line("llama-server", marker, 8124)
    assert not is_listening_line("llama-server", marker + "0", 8123)
    assert not is_listening_line("llama-server", "junk " + marker, 8123)
    assert not is_listening_line(
        "llama-server", "srv llama_server: listening on http://127.0.0.1:8123", 8123
    )


def test_hosts_get_the_runners_path_and_library_paths_and_nothing_else() -> None:
    runner = {
        "PATH": "/opt/cuda/bin:/usr/bin:/bin",
        "LD_LIBRARY_PATH": "/opt/cuda/lib64",
        "HOME": "/root",
        "VIRTUAL_ENV": "/venv",
        "CUDA_VISIBLE_DEVICES": "GPU-0f3c",
    }
    assert host_basics(runner) == {
        "PATH": "/opt/cuda/bin:/usr/bin:/bin",
        "LD_LIBRARY_PATH": "/opt/cuda/lib64",
    }
    assert host_basics({}) == {"PATH": "/usr/bin:/bin"}
    env = host_environment(
        {"CUDA_VISIBLE_DEVICES": "GPU-0f3c", "PATH": "/operator/bin"},
        {},
        None,
        "/state",
        basics=host_basics(runner),
    )
    # The operator overrides a basic; the private dirs are custody's.
    assert env["PATH"] == "/operator/bin" and env["LD_LIBRARY_PATH"] == "/opt/cuda/lib64"
    assert env["HOME"] == "/state/home" and "VIRTUAL_ENV" not in env
    recorded = recorded_environment(env)
    assert recorded["CUDA_VISIBLE_DEVICES"] == "redacted" and "GPU-0f3c" not in str(recorded)
    assert recorded["PATH"] == "/operator/bin" and list(recorded) == sorted(env)


DAEMONIZES = str(FAKE_HOSTS / "fake_host_daemonizes.py")


async def read_daemon(path: Path) -> tuple[int, float]:
    (pid,) = await read_pids(path)
    return pid, psutil.Process(pid).create_time()


@pytest.mark.parametrize("moment", ["at-start", "on-sigterm"])
async def test_a_daemon_that_left_group_and_tree_is_found_by_its_tag_and_ended(
    tmp_path: Path, moment: str
) -> None:
    """A host that double-forks and calls setsid (at start-up, or from its SIGTERM handler,
    so the group stop itself looks graceful) leaves a daemon that neither group signals nor a
    walk of the host's descendants reach; the host's environment tag finds it."""
    daemon_path = tmp_path / "daemon.json"
    with trio.fail_after(30):
        async with host_custody(config(tmp_path, process_tag="cf-test/cell-0000/x")) as host:
            await host.launch(
                [sys.executable, DAEMONIZES, str(host.port), str(daemon_path), moment],
                env_for(host),
            )
            await host.wait_ready(30)
            host.note_descendants()
            if moment == "at-start":
                daemon, created = await read_daemon(daemon_path)
                assert daemon not in [p.pid for p in psutil.Process(host.pid).children(True)]
            outcome = await host.cleanup()
    if moment == "on-sigterm":
        daemon, created = await read_daemon(daemon_path)
        # Re-parented away from the host and in a session of its own, yet ended.
    assert outcome.graceful is True and outcome.forced is False
    assert outcome.escaped_descendants == ()
    assert outcome.tagged_escapees == (daemon,)
    assert outcome.surviving_descendants == ()
    assert not alive(daemon, created)
    assert outcome.clean is False  # a process escaped custody: the cell is downgraded
    assert any("environment tag" in what for _, what in outcome.problems())


async def test_the_host_carries_its_tag_and_cannot_be_given_another(tmp_path: Path) -> None:
    env_path = tmp_path / "env.json"
    with trio.fail_after(30):
        async with host_custody(config(tmp_path, process_tag="cf-run/cell-0001/x")) as host:
            await host.launch(
                [sys.executable, SCRIPTED, "graceful", str(host.port), str(env_path)],
                env_for(host),
            )
            await host.wait_ready(30)
    assert json.loads(env_path.read_text())["CACHE_FAMILY_CELL"] == "cf-run/cell-0001/x"
    with pytest.raises(Refused) as refused:
        host_environment({"CACHE_FAMILY_CELL": "other"}, {}, None, str(tmp_path))
    assert refused.value.codes == ["custody.env_reserved"]


async def test_a_cancel_during_the_spawn_waits_for_it_and_ends_the_host_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cell holds custody in one task and launches from another: a cancel that ends
    # custody while the spawn is in flight must not close the nursery under the spawn.
    real_open_process = trio.lowlevel.open_process
    holder: dict[str, Host] = {}
    spawned: list[int] = []

    async def open_process_after_the_cancel(*args: object, **kwargs: object) -> trio.Process:
        host = holder["host"]
        scope.cancel()
        with trio.CancelScope(shield=True):
            # Until custody's cleanup either waits for the spawn or (without the lock) is done.
            while host.state != "cleaned" and not host._spawning.statistics().tasks_waiting:
                await trio.sleep(0)
            process = await real_open_process(*args, **kwargs)  # type: ignore[arg-type]
        spawned.append(process.pid)
        return process

    monkeypatch.setattr(trio.lowlevel, "open_process", open_process_after_the_cancel)
    ready = trio.Event()

    async def hold() -> None:
        async with host_custody(config(tmp_path)) as host:
            holder["host"] = host
            ready.set()
            await trio.sleep_forever()

    with trio.fail_after(30):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(hold)
                await ready.wait()
                host = holder["host"]
                await host.launch(
                    [sys.executable, SCRIPTED, "graceful", str(host.port)], env_for(host)
                )
                await trio.sleep_forever()
    assert scope.cancelled_caught
    outcome = host.outcome
    assert spawned and outcome is not None and outcome.pid == spawned[0]
    assert host.create_time is not None and not alive(spawned[0], host.create_time)


async def test_a_host_that_exited_was_not_replaced_but_another_process_at_its_pid_was(
    tmp_path: Path,
) -> None:
    """A rung's identity re-check after a signal ended the host must see an exit, not a swap
    (issue 12: SIGINT mid-ladder journaled host_identity_changed)."""
    with trio.fail_after(30):
        async with host_custody(config(tmp_path)) as host:
            await host.launch([sys.executable, SCRIPTED, "graceful", str(host.port)], env_for(host))
            await host.wait_ready(30)
            assert host.pid is not None and host.create_time is not None
            assert host.still_same() and not host.replaced()
            spawned_at = host.create_time
            # The pid naming a process created at another time: a swap.
            host.create_time = spawned_at - 1.0
            assert host.replaced()
            host.create_time = spawned_at
            os.kill(host.pid, 9)  # the host dies (as on a signal), not yet reaped by custody
            while host.still_same():
                await trio.sleep(CHILD_POLL_SECONDS)
            assert not host.replaced()
    assert not host.replaced()  # ended by custody's cleanup: still not a swap
