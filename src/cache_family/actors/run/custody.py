"""Host custody: one server process, from port reservation to a verified-clean end."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NoReturn

import psutil
import trio

from cache_family.errors import Refusal, Refused
from cache_family.schemas.host_kinds import (
    LLAMA_SERVER_READINESS,
    HostReadiness,
)
from cache_family.schemas.host_kinds import (
    is_listening_line as is_listening_line,
)
from cache_family.schemas.host_kinds import (
    listening_marker as listening_marker,
)
from cache_family.schemas.measurement import (
    CaptureStream,
    HostCleaned,
    HostCleanup,
    HostEvent,
    HostFaulted,
    HostMarkerSeen,
    HostReady,
    HostSpawned,
)
from cache_family.system.http import HttpError, LoopbackHttp
from cache_family.system.process_group import (
    PROCESS_TAG_NAME,
    descendants,
    end_identified,
    end_tagged,
    pid_replaced,
    still_same,
    stop_group,
)

KIB = 1024
MIB = 1024 * KIB

Observe = Callable[[HostEvent], Awaitable[None]]
HostState = Literal["new", "reserved", "spawned", "ready", "faulted", "terminating", "cleaned"]

# Names the host environment owns; the operator and toolkits may not set them.
PRIVATE_ENV_NAMES = (
    "HOME",
    "TMPDIR",
    "TMP",
    "TEMP",
    "XDG_CACHE_HOME",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "XDG_STATE_HOME",
    "XDG_RUNTIME_DIR",
    "LLAMA_STAGE_BUILD_DIR",
    PROCESS_TAG_NAME,
)
BASE_PATH = "/usr/bin:/bin"
# The host basics the runner passes on (reference: PATH and the library search paths), so a
# dynamically linked server (CUDA, ROCm) finds its libraries; the operator may override them.
HOST_BASIC_NAMES = ("PATH", "LD_LIBRARY_PATH", "LIBRARY_PATH", "DYLD_LIBRARY_PATH")
# Device ids say which accelerator of a shared host ran a cell: records show them redacted.
DEVICE_ID_NAMES = frozenset(
    (
        "CUDA_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "GPU_DEVICE_ORDINAL",
        "ZE_AFFINITY_MASK",
        "ONEAPI_DEVICE_SELECTOR",
    )
)
REDACTED = "redacted"

# Custody refusal code -> the journal's fault kind.
FAULT_KIND_OF_CODE: Mapping[str, str] = {
    "custody.port_busy": "port_busy",
    "custody.port_unavailable": "port_busy",
    "custody.state_dir": "spawn_failed",
    "custody.spawn_failed": "spawn_failed",
    "custody.child_exited": "child_exited",
    "custody.marker_timeout": "marker_missing",
    "custody.readiness_failed": "readiness_failed",
    "custody.env_reserved": "spawn_failed",
    "custody.env_conflict": "spawn_failed",
}

HEALTH_TRY_SECONDS = 2.0
HEALTH_GAP_SECONDS = 0.05
HEALTH_FIRST_GAP_SECONDS = 0.0005
HEALTH_BODY_LIMIT = 64 * KIB


@dataclass(frozen=True, slots=True)
class HostConfig:
    """Where and how one host session runs; budgets in seconds."""

    label: str
    state_parent: str
    log_dir: str
    port: int = 0
    # How the host is seen to listen and answer ready (its kind's, ``schemas/host_kinds.py``).
    readiness: HostReadiness = LLAMA_SERVER_READINESS
    grace_seconds: float = 5.0
    kill_wait_seconds: float = 5.0
    cleanup_bound_seconds: float = 30.0
    capture_line_limit: int = 64 * KIB
    capture_total_limit: int = 16 * MIB
    # The environment tag the host and everything it starts inherit (``<run tag>/<cell id>``);
    # empty: custody makes a unique one.
    process_tag: str = ""


def host_basics(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The runner's PATH (else /usr/bin:/bin) and library search paths, nothing else."""
    source = os.environ if environ is None else environ
    basics = {name: source[name] for name in HOST_BASIC_NAMES if source.get(name)}
    basics.setdefault("PATH", BASE_PATH)
    return basics


def recorded_environment(env: Mapping[str, str]) -> dict[str, str]:
    """A child's effective environment as records show it: device ids redacted."""
    return {name: REDACTED if name in DEVICE_ID_NAMES else env[name] for name in sorted(env)}


def host_environment(
    operator_env: Mapping[str, str],
    toolkits: Mapping[str, str],
    native_build: str | None,
    state_dir: str,
    basics: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The complete environment of a host or tool child: only the host basics are inherited.

    The basics (the runner's PATH and library search paths, ``host_basics``) come first; the
    operator's nonsecret variables and the toolkit variables follow (and may override them);
    HOME, TMPDIR and the XDG dirs point inside the private state dir; LLAMA_STAGE_BUILD_DIR
    names the native build, and LD_LIBRARY_PATH gains the build's lib dir only when it holds
    shared libraries.
    """
    refusals: list[Refusal] = []
    for source, mapping in (("operator_env", operator_env), ("toolkits", toolkits)):
        for name in mapping:
            if name in PRIVATE_ENV_NAMES:
                refusals.append(
                    Refusal(
                        "custody.env_reserved",
                        f"$.{source}.{name}",
                        f"{name} is set by host custody, not by {source}",
                        f"remove {name} from {source}",
                    )
                )
    for name, value in toolkits.items():
        if name in operator_env and operator_env[name] != value:
            refusals.append(
                Refusal(
                    "custody.env_conflict",
                    f"$.toolkits.{name}",
                    f"{name} is set differently by the operator environment and a toolkit",
                    "set it in one place only",
                )
            )
    if refusals:
        raise Refused(tuple(refusals))

    env: dict[str, str] = dict(host_basics() if basics is None else basics)
    env.update(operator_env)
    env.update(toolkits)
    home = str(Path(state_dir) / "home")
    tmp = str(Path(state_dir) / "tmp")
    env.update(
        {
            "HOME": home,
            "TMPDIR": tmp,
            "TMP": tmp,
            "TEMP": tmp,
            "XDG_CACHE_HOME": str(Path(home) / ".cache"),
            "XDG_CONFIG_HOME": str(Path(home) / ".config"),
            "XDG_DATA_HOME": str(Path(home) / ".local" / "share"),
            "XDG_STATE_HOME": str(Path(home) / ".local" / "state"),
            "XDG_RUNTIME_DIR": str(Path(state_dir) / "run"),
        }
    )
    if native_build is not None:
        env["LLAMA_STAGE_BUILD_DIR"] = native_build
        lib = Path(native_build) / "lib"
        if lib.is_dir() and any(p.name.endswith(".so") or ".so." in p.name for p in lib.iterdir()):
            inherited = env.get("LD_LIBRARY_PATH")
            env["LD_LIBRARY_PATH"] = f"{lib}:{inherited}" if inherited else str(lib)
    return env


def port_is_free(port: int) -> bool:
    """Whether 127.0.0.1:port could be listened on now (TIME_WAIT leftovers do not count)."""
    try:
        probe = _bind_listener(port)
    except OSError:
        return False
    probe.close()
    return True


def _bind_listener(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # Linux lets SO_REUSEADDR skip TIME_WAIT sockets but never a live listener.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(1)
    except OSError:
        sock.close()
        raise
    return sock


class _BoundedLog:
    """An exclusive log file that stops growing at a cap and says so."""

    def __init__(self, path: str, total_limit: int) -> None:
        self.path = path
        self.total_limit = total_limit
        self.written = 0
        self.truncated = False
        self.error: str | None = None
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd: int | None = os.open(path, flags, 0o600)

    def write(self, data: bytes) -> None:
        if self._fd is None or self.truncated:
            return
        room = self.total_limit - self.written
        if len(data) > room:
            data = (
                data[:room]
                + f"\n[cache-family: capture truncated at {self.total_limit} bytes]\n".encode()
            )
            self.truncated = True
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self.error = exc.strerror
            self.truncated = True
        self.written += len(data)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None


class Host:
    """Custody of one server process; create it with ``host_custody``."""

    def __init__(self, config: HostConfig, observe: Observe | None = None) -> None:
        self.config = config
        self._observe = observe
        self.state: HostState = "new"
        # Held by launch from its state check until the spawned host is watched, and taken by
        # cleanup: a cancel that ends custody (in another task) while the spawn is in flight
        # waits for the spawn, then ends the host it made, instead of closing the nursery
        # under it and leaving a process that no cleanup record names.
        self._spawning = trio.Lock()
        self.port: int = config.port
        self.state_dir: str = ""
        self.pid: int | None = None
        self.create_time: float | None = None
        self.exit_code: int | None = None
        self.process_tag = config.process_tag or f"cf-{secrets.token_hex(8)}/{config.label}"
        self.stdout_log = str(Path(config.log_dir) / f"{config.label}.stdout.log")
        self.stderr_log = str(Path(config.log_dir) / f"{config.label}.stderr.log")
        self._reservation: socket.socket | None = None
        self._process: trio.Process | None = None
        self._nursery: trio.Nursery | None = None
        self._spawned_at: float | None = None
        self._marker_line: tuple[CaptureStream, str] | None = None
        self._marker_or_exit = trio.Event()
        self._exited = trio.Event()
        self._pumps_running = 0
        self._pumps_done = trio.Event()
        self._logs: list[_BoundedLog] = []
        self._oversized_lines = 0
        self._known_descendants: dict[int, float] = {}
        self._hurry = trio.Event()
        self._grace_shortened = False
        self._outcome: HostCleanup | None = None
        self.terminating = trio.Event()

    def __repr__(self) -> str:
        elapsed = "-"
        if self._spawned_at is not None:
            with contextlib.suppress(RuntimeError):
                elapsed = f"{trio.current_time() - self._spawned_at:.1f}s"
        return (
            f"<Host {self.config.label} state={self.state} pid={self.pid} port={self.port}"
            f" elapsed={elapsed}>"
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def readiness_url(self) -> str:
        """Where the host answers ready (its kind's readiness path)."""
        return f"{self.base_url}{self.config.readiness.path}"

    @property
    def outcome(self) -> HostCleanup | None:
        return self._outcome

    # -- reserve -------------------------------------------------------------------------

    def reserve(self) -> None:
        """Hold the port and create the private state dir; nothing is launched here."""
        if self.state != "new":
            raise RuntimeError(f"reserve() in state {self.state}")
        try:
            self._reservation = _bind_listener(self.config.port)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise Refused.one(
                    "custody.port_busy",
                    "$.port",
                    f"127.0.0.1:{self.config.port} is already in use",
                    "stop whatever listens there or let the tool pick a free port (0)",
                ) from None
            raise Refused.one(
                "custody.port_unavailable",
                "$.port",
                f"cannot bind 127.0.0.1:{self.config.port}: {exc.strerror}",
                "choose another port",
            ) from None
        self.port = self._reservation.getsockname()[1]
        try:
            Path(self.config.log_dir).mkdir(parents=True, exist_ok=True)
            self.state_dir = make_private_dir(self.config.state_parent, self.config.label)
        except OSError as exc:
            self._release_reservation()
            raise Refused.one(
                "custody.state_dir",
                "$.state_parent",
                f"cannot create a private state dir under {self.config.state_parent}: {exc}",
                "give a writable directory on a local filesystem",
            ) from None
        self.state = "reserved"

    def _release_reservation(self) -> None:
        if self._reservation is not None:
            self._reservation.close()
            self._reservation = None

    # -- launch --------------------------------------------------------------------------

    async def launch(self, argv: Sequence[str], env: Mapping[str, str]) -> HostSpawned:
        """Spawn the host in its own session with exactly ``env`` and the host's environment
        tag; returns the spawn record."""
        async with self._spawning:
            # Custody may have been cleaned up by a cancel while this waited for the lock.
            await trio.lowlevel.checkpoint_if_cancelled()
            return await self._launch(argv, env)

    async def _launch(self, argv: Sequence[str], env: Mapping[str, str]) -> HostSpawned:
        if self.state != "reserved" or self._nursery is None:
            raise RuntimeError(f"launch() in state {self.state}")
        env = {**env, PROCESS_TAG_NAME: self.process_tag}
        try:
            stdout_log = _BoundedLog(self.stdout_log, self.config.capture_total_limit)
            stderr_log = _BoundedLog(self.stderr_log, self.config.capture_total_limit)
        except OSError as exc:
            await self._fault("custody.spawn_failed", f"cannot create host logs: {exc}")
            raise self._refusal("custody.spawn_failed", f"cannot create host logs: {exc}") from None
        self._logs = [stdout_log, stderr_log]
        # Released at the last moment: the window in which another process could take the
        # port is one system call long, and the host's own bind reports it if that happens.
        self._release_reservation()
        try:
            process = await trio.lowlevel.open_process(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=dict(env),
                cwd=self.state_dir,
                start_new_session=True,
            )
        except OSError as exc:
            for log in self._logs:
                log.close()
            message = f"cannot start {argv[0] if argv else '?'}: {exc.strerror or exc}"
            await self._fault("custody.spawn_failed", message)
            raise self._refusal("custody.spawn_failed", message) from None
        self._process = process
        self.pid = process.pid
        self._spawned_at = trio.current_time()
        try:
            self.create_time = psutil.Process(process.pid).create_time()
        except psutil.NoSuchProcess:
            # Unreaped children stay visible, so this is a host gone within microseconds;
            # 0.0 never equals a real create time, so every identity check says "not same".
            self.create_time = 0.0
        self.state = "spawned"
        assert process.stdout is not None and process.stderr is not None
        self._pumps_running = 2
        self._nursery.start_soon(self._pump, process.stdout, "stdout", stdout_log)
        self._nursery.start_soon(self._pump, process.stderr, "stderr", stderr_log)
        self._nursery.start_soon(self._watch_exit, process)
        record = HostSpawned(
            label=self.config.label,
            pid=process.pid,
            create_time=self.create_time,
            port=self.port,
            argv=tuple(argv),
            env=dict(env),
            state_dir=self.state_dir,
            stdout_log=self.stdout_log,
            stderr_log=self.stderr_log,
        )
        await self._emit(record)
        return record

    async def _watch_exit(self, process: trio.Process) -> None:
        self.exit_code = await process.wait()
        self._exited.set()
        self._marker_or_exit.set()

    async def _pump(
        self, stream: trio.abc.ReceiveStream, name: CaptureStream, log: _BoundedLog
    ) -> None:
        limit = self.config.capture_line_limit
        buffer = bytearray()
        discarding = False
        try:
            while True:
                try:
                    chunk = await stream.receive_some(64 * KIB)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
                if not chunk:
                    break
                buffer += chunk
                while True:
                    newline = buffer.find(b"\n")
                    if newline < 0:
                        break
                    line = bytes(buffer[: newline + 1])
                    del buffer[: newline + 1]
                    if discarding:
                        discarding = False
                        continue
                    self._take_line(line, name, log)
                if len(buffer) > limit and not discarding:
                    self._write_oversized(bytes(buffer), log)
                    discarding = True
                if discarding:
                    buffer.clear()
            if buffer and not discarding:
                self._take_line(bytes(buffer), name, log)
        finally:
            self._pumps_running -= 1
            if self._pumps_running == 0:
                self._pumps_done.set()
            with contextlib.suppress(trio.ClosedResourceError):
                await stream.aclose()

    def _write_oversized(self, line: bytes, log: _BoundedLog) -> None:
        limit = self.config.capture_line_limit
        log.write(line[:limit] + f"\n[cache-family: line truncated at {limit} bytes]\n".encode())
        self._oversized_lines += 1

    def _take_line(self, line: bytes, name: CaptureStream, log: _BoundedLog) -> None:
        if len(line) > self.config.capture_line_limit:
            self._write_oversized(line, log)
            return
        log.write(line)
        if self._marker_line is None:
            text = line.rstrip(b"\r\n").decode("utf-8", "replace")
            if self.config.readiness.is_listening_line(text, self.port):
                self._marker_line = (name, text)
                self._marker_or_exit.set()

    # -- readiness -----------------------------------------------------------------------

    async def wait_ready(
        self, startup_seconds: float, http: LoopbackHttp | None = None
    ) -> HostReady:
        """Marker, then readiness (``readiness_url``), all within ``startup_seconds``; ``http``
        is the host session's client (the cell's, shared with its prompt cut and rungs)."""
        if self.state != "spawned" or self._spawned_at is None or self.pid is None:
            raise RuntimeError(f"wait_ready() in state {self.state}")
        deadline = self._spawned_at + startup_seconds
        with trio.move_on_at(deadline):
            await self._marker_or_exit.wait()
        if self._marker_line is None:
            if self._exited.is_set():
                await self._fail(
                    "custody.child_exited",
                    f"host exited with {self.exit_code} before printing its listening line",
                )
            await self._fail(
                "custody.marker_timeout",
                f"no listening line for port {self.port} within {startup_seconds} s",
            )
        stream, line = self._marker_line
        await self._emit(
            HostMarkerSeen(
                label=self.config.label,
                pid=self.pid,
                stream=stream,
                line=line,
                after_seconds=trio.current_time() - self._spawned_at,
            )
        )
        attempts = 0
        last_problem = "no answer"
        client = http or LoopbackHttp()
        while trio.current_time() < deadline:
            if self._exited.is_set():
                await self._fail(
                    "custody.child_exited",
                    f"host exited with {self.exit_code} before it answered readiness",
                )
            attempts += 1
            try_seconds = min(HEALTH_TRY_SECONDS, max(deadline - trio.current_time(), 0.001))
            ok, problem = await _health_once(
                client, self.readiness_url, try_seconds, self.config.readiness.is_ready_answer
            )
            # A try the deadline cut short says nothing about the host; the answer it gave
            # before (say HTTP 503) is the one the refusal should name.
            cut_short = problem is None and try_seconds < HEALTH_TRY_SECONDS and attempts > 1
            if not cut_short:
                last_problem = problem or f"no answer within {try_seconds:.2f} s"
            if ok:
                self.state = "ready"
                ready = HostReady(
                    label=self.config.label,
                    pid=self.pid,
                    after_seconds=trio.current_time() - self._spawned_at,
                    health_attempts=attempts,
                )
                await self._emit(ready)
                return ready
            with trio.move_on_at(deadline):
                # A host that listens before its model is loaded answers 503 at first: try
                # again within a millisecond, then less and less often.
                await trio.sleep(min(HEALTH_GAP_SECONDS, HEALTH_FIRST_GAP_SECONDS * 2**attempts))
        await self._fail(
            "custody.readiness_failed",
            f"{self.readiness_url} did not answer ready within {startup_seconds} s"
            f" ({attempts} tries; last: {last_problem})",
        )

    # -- identity ------------------------------------------------------------------------

    def still_same(self) -> bool:
        """The spawned process is alive and is still the same process (pid + create time)."""
        if self.pid is None or self.create_time is None or self._exited.is_set():
            return False
        return still_same(self.pid, self.create_time)

    def replaced(self) -> bool:
        """True only when the host's pid now names another live process than the one
        spawned: a host that exited (on its own, on a signal, or ended by this custody) was
        not swapped, whether or not its exit has been reaped yet."""
        if self.pid is None or self.create_time is None:
            return False
        if self._exited.is_set() or self.state in ("terminating", "cleaned"):
            return False
        return pid_replaced(self.pid, self.create_time)

    # -- cleanup -------------------------------------------------------------------------

    def shorten_grace(self) -> None:
        """End the SIGTERM grace now (an operator's second interrupt): SIGKILL follows."""
        self._grace_shortened = True
        self._hurry.set()

    async def cleanup(self) -> HostCleanup:
        """End the host and everything it started; shielded, bounded and idempotent."""
        if self._outcome is not None:
            return self._outcome
        with trio.CancelScope(shield=True):
            async with self._spawning:  # a spawn in flight finishes first (see __init__)
                outcome = await self._cleanup()
        return outcome

    async def _cleanup(self) -> HostCleanup:
        if self._outcome is not None:
            return self._outcome
        started = trio.current_time()
        bounded = trio.move_on_after(self.config.cleanup_bound_seconds)
        progress = CleanupProgress()
        with bounded:
            await self._cleanup_steps(progress)
        outcome = HostCleanup(
            pid=self.pid,
            graceful=progress.graceful,
            forced=progress.forced,
            exit_code=self.exit_code,
            surviving_descendants=tuple(progress.surviving),
            port_free=progress.port_free,
            state_dir_removed=progress.state_dir_removed,
            elapsed_ms=(trio.current_time() - started) * 1000,
            escaped_descendants=tuple(progress.escaped),
            tagged_escapees=tuple(progress.tagged),
            capture_truncated=any(log.truncated for log in self._logs),
            oversized_lines=self._oversized_lines,
            grace_shortened=self._grace_shortened,
            bounded_out=bounded.cancelled_caught,
            state_dir_error=(progress.state_dir_error or "")[:2000] or None,
        )
        for log in self._logs:
            log.close()
        self._release_reservation()
        self._outcome = outcome
        self.state = "cleaned"
        await self._emit(HostCleaned(label=self.config.label, outcome=outcome))
        return outcome

    async def _cleanup_steps(self, progress: CleanupProgress) -> None:
        process = self._process
        if process is None:
            progress.graceful = True
        else:
            self.state = "terminating"
            self._remember_descendants()
            self.terminating.set()
            stopped = await stop_group(
                process,
                grace=self.config.grace_seconds,
                kill_wait=self.config.kill_wait_seconds,
                hurry=self._hurry,
            )
            if stopped.forced:
                progress.forced = True
            else:
                progress.graceful = True
            self.exit_code = stopped.returncode
            escaped, surviving = await end_identified(self._known_descendants)
            progress.escaped = escaped
            progress.surviving = surviving
            # Whatever the group and the recorded tree missed: a daemon that left both.
            tagged, tagged_surviving = await end_tagged(self.process_tag)
            progress.tagged = [pid for pid in tagged if pid not in escaped]
            progress.surviving += [pid for pid in tagged_surviving if pid not in surviving]
            with trio.move_on_after(2.0):
                await self._pumps_done.wait()
        self._release_reservation()
        progress.port_free = await _wait_port_free(self.port)
        async with trio.open_nursery() as alongside:
            if self._pumps_done.is_set():
                # Nothing writes the logs any more: their fsyncs (in ``_BoundedLog.close``)
                # run beside the state dir's removal instead of after it. Logs a pump may
                # still write are closed by ``_cleanup``, in the event loop's thread.
                for log in self._logs:
                    alongside.start_soon(trio.to_thread.run_sync, log.close)
            removed, error = await trio.to_thread.run_sync(remove_tree, self.state_dir)
        progress.state_dir_removed = removed
        progress.state_dir_error = error

    def _remember_descendants(self) -> None:
        """Record (pid, create time) of every descendant while they are still in the tree."""
        if self.pid is None:
            return
        self._known_descendants.update(descendants(self.pid))

    def note_descendants(self) -> None:
        """Refresh the descendant list (call at readiness and each rung); cleanup uses it."""
        self._remember_descendants()

    # -- faults and events ---------------------------------------------------------------

    def _refusal(self, code: str, message: str) -> Refused:
        hints = {
            "custody.child_exited": "read the host's stderr log; check the model and arguments",
            "custody.marker_timeout": "raise the startup budget or check the host dialect",
            "custody.readiness_failed": "the host listened but never became healthy; read its log",
            "custody.spawn_failed": "check that the binary exists and is executable",
        }
        return Refused.one(code, "$.host", message, hints.get(code, "read the host's logs"))

    async def _fault(self, code: str, message: str) -> None:
        self.state = "faulted"
        await self._emit(
            HostFaulted(
                label=self.config.label,
                code=code,
                message=message,
                pid=self.pid,
                exit_code=self.exit_code,
            )
        )

    async def _fail(self, code: str, message: str) -> NoReturn:
        await self._fault(code, message)
        raise self._refusal(code, message)

    async def _emit(self, event: HostEvent) -> None:
        if self._observe is not None:
            await self._observe(event)


@dataclass(slots=True)
class CleanupProgress:
    """What the cleanup steps confirmed so far; whatever they did not reach stays False."""

    graceful: bool = False
    forced: bool = False
    escaped: list[int] = field(default_factory=list)
    tagged: list[int] = field(default_factory=list)
    surviving: list[int] = field(default_factory=list)
    port_free: bool = False
    state_dir_removed: bool = False
    state_dir_error: str | None = None


@contextlib.asynccontextmanager
async def host_custody(config: HostConfig, observe: Observe | None = None) -> AsyncIterator[Host]:
    """Reserve, yield the host for launching, and always clean up on the way out.

    A busy port raises ``Refused`` (custody.port_busy) before anything exists on disk.
    """
    host = Host(config, observe)
    host.reserve()
    # The body's own exception is carried past the nursery so callers see it bare, not
    # wrapped in an ExceptionGroup by the nursery that runs the log pumps.
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            host._nursery = nursery
            try:
                yield host
            except BaseException as exc:
                body_error = exc
            finally:
                await host.cleanup()
                # Pumps still blocked on a pipe held open by something we could not end.
                nursery.cancel_scope.cancel()
    finally:
        host._release_reservation()
    if body_error is not None:
        raise body_error


async def _health_once(
    client: LoopbackHttp, url: str, seconds: float, ready: Callable[[object], bool]
) -> tuple[bool, str | None]:
    """(ready, the problem) for one readiness try; the problem is None when nothing answered."""
    try:
        with trio.fail_after(seconds):
            async with client.request("GET", url) as response:
                body = await response.read(HEALTH_BODY_LIMIT)
    except trio.TooSlowError:
        return False, None
    except HttpError as exc:
        return False, f"{type(exc).__name__}: {exc}"
    if response.status_code != 200:
        return False, f"HTTP {response.status_code}"
    try:
        answer = json.loads(body)
    except ValueError:
        return False, "health body is not JSON"
    if ready(answer):
        return True, "ok"
    return False, f"readiness said {body[:200]!r}"


async def _wait_port_free(port: int) -> bool:
    with trio.move_on_after(2.0):
        while not port_is_free(port):
            await trio.sleep(0.02)
        return True
    return port_is_free(port)


def make_private_dir(parent: str, label: str) -> str:
    """A fresh 0700 dir with home/, tmp/ and run/ inside, or OSError."""
    path = tempfile.mkdtemp(prefix=f"{label}-state-", dir=parent)
    for sub in ("home", "tmp", "run"):
        Path(path, sub).mkdir(mode=0o700)
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    if mode != 0o700:
        shutil.rmtree(path, ignore_errors=True)
        raise OSError(errno.EPERM, f"state dir mode is {mode:o}, not 700")
    return path


def remove_tree(path: str) -> tuple[bool, str | None]:
    if not path:
        return True, None
    error: str | None = None
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        error = f"{exc.filename}: {exc.strerror}"
    if os.path.lexists(path):
        return False, error or f"{path} still exists"
    return True, None
