"""A Skippy stage server as a cell's host: its dialect, its ``stage.json`` and its command line.

The dialect is read from the pinned private copy's help (``serve --help`` exiting 0: current,
else ``serve-openai --help``: legacy, else refused), its pin re-checked around every probe. A
probe is a child in custody like a host, capped at 5 s; what it leaves running is ended and
reported (``CliAdmitted.left_behind``) and faults every cell relying on that admission.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import trio

from cache_family.errors import Refused
from cache_family.schemas.measurement import HostDialect
from cache_family.schemas.stage_server import CURRENT_COMMAND, LEGACY_COMMAND
from cache_family.system.child import ChildCommand, ChildEnded, ChildRunner, OnSpawn

PROBE_SECONDS: Final = 5.0
# A help probe has nothing to save: a short grace before SIGKILL.
PROBE_GRACE_SECONDS: Final = 1.0
PROBE_KILL_WAIT_SECONDS: Final = 1.0
PROBE_OUTPUT_LIMIT: Final = 1024 * 1024
STAGE_CONFIG_NAME: Final = "stage.json"
CLI_ADMISSION_NAME: Final = "cli-admission.json"
# What the reference adds to every stage server's environment.
STAGE_ENVIRONMENT: Final = {
    "SKIPPY_NATIVE_MTP_GREEDY_SAMPLING_FASTPATH": "1",
    "SKIPPY_TELEMETRY_STDERR": "1",
}


@dataclass(frozen=True, slots=True)
class Probe:
    command: str
    exit_code: int | None  # None: it did not end within its cap
    utf8: bool
    # How the probe's process ended (None: a probe not run as a supervised child, in tests).
    ended: ChildEnded | None = None

    @property
    def left_behind(self) -> str:
        """What the probe left running or could not end gracefully ("" when nothing)."""
        ended = self.ended
        if ended is None:
            return ""
        found = []
        if ended.outlived_by_group:
            found.append("its process group still ran after it exited")
        if ended.tagged_escapees:
            found.append(f"processes left its group: {list(ended.tagged_escapees)}")
        if ended.surviving_descendants:
            found.append(f"processes survived SIGKILL: {list(ended.surviving_descendants)}")
        if ended.forced:
            found.append("its group needed SIGKILL")
        return f"`{self.command} --help`: {'; '.join(found)}" if found else ""


@dataclass(frozen=True, slots=True)
class CliAdmitted:
    dialect: HostDialect  # current | legacy
    probes: tuple[Probe, ...]

    @property
    def command(self) -> str:
        return CURRENT_COMMAND if self.dialect == "current" else LEGACY_COMMAND

    @property
    def left_behind(self) -> str:
        """What the probes left running ("" when nothing): the cells that rely on this
        admission are not to be trusted (they are faulted)."""
        return "; ".join(found for probe in self.probes if (found := probe.left_behind))


def _refused(binary: str, why: str) -> Refused:
    return Refused.one(
        "stage.cli_refused",
        "$.stage_server",
        f"{binary}: {why}",
        f"give a stage server whose `serve --help` or `{LEGACY_COMMAND} --help` exits 0",
    )


@dataclass(frozen=True, slots=True)
class ProbeCustody:
    """How the probes run: ``runner`` (``system.child.run_child``) under the cell's
    ``process_tag``, each child journaled by ``on_spawn(argv, pid, create_time)`` before it
    runs, with its logs and working directory in the private ``probe_dir``."""

    runner: ChildRunner
    process_tag: str
    probe_dir: str
    on_spawn: Callable[[tuple[str, ...], int, float], Awaitable[None]]


async def _probe(
    binary: str, command: str, env: Mapping[str, str], custody: ProbeCustody, shown_as: str
) -> Probe:
    argv = (binary, command, "--help")
    logs = [os.path.join(custody.probe_dir, f"{command}.{name}.log") for name in ("out", "err")]

    async def spawned(pid: int, create_time: float) -> None:
        await custody.on_spawn(argv, pid, create_time)

    on_spawn: OnSpawn = spawned
    ended = await custody.runner(
        ChildCommand(
            argv=argv,
            env=env,
            cwd=custody.probe_dir,
            stdout_path=logs[0],
            stderr_path=logs[1],
            deadline=trio.current_time() + PROBE_SECONDS,
            grace_seconds=PROBE_GRACE_SECONDS,
            kill_wait_seconds=PROBE_KILL_WAIT_SECONDS,
            process_tag=custody.process_tag,
        ),
        on_spawn,
    )
    if ended.spawn_error is not None:
        raise _refused(shown_as, ended.spawn_error)
    utf8 = all(_utf8(path) for path in logs)
    exit_code = None if ended.timed_out else ended.exit_code
    return Probe(command, exit_code, utf8, ended)


def _utf8(path: str) -> bool:
    try:
        with open(path, "rb") as log:
            log.read(PROBE_OUTPUT_LIMIT).decode("utf-8")
    except UnicodeDecodeError:
        return False
    except OSError:
        return True  # the probe removed its own log: nothing left to judge
    return True


async def admit_cli(
    binary: str,
    env: Mapping[str, str],
    custody: ProbeCustody,
    same_bytes: Callable[[], Awaitable[bool]],
    *,
    pinned: str = "",
) -> CliAdmitted:
    """The dialect of ``binary`` (the private copy whose pin ``same_bytes`` checks), or
    ``stage.cli_refused`` naming ``pinned`` (the operator's path); the probes run in
    ``custody``."""
    shown_as = pinned or binary
    probes: list[Probe] = []
    for command, dialect in ((CURRENT_COMMAND, "current"), (LEGACY_COMMAND, "legacy")):
        if not await same_bytes():
            raise _refused(shown_as, "its bytes differ from the pinned stage server")
        probe = await _probe(binary, command, env, custody, shown_as)
        probes.append(probe)
        if not await same_bytes():
            raise _refused(shown_as, "its bytes changed while its help was read")
        if probe.exit_code == 0 and probe.utf8:
            return CliAdmitted(dialect, tuple(probes))  # type: ignore[arg-type]
    shown = ", ".join(f"`{p.command} --help` exit {p.exit_code}" for p in probes)
    left = "; ".join(found for p in probes if (found := p.left_behind))
    raise _refused(shown_as, f"neither dialect answers ({shown})" + (f"; {left}" if left else ""))


def cli_admission_document(binary: str, binary_sha256: str, admitted: CliAdmitted) -> bytes:
    document = {
        "schema_version": 1,
        "binary": binary,
        "binary_sha256": binary_sha256,
        "role": "Public",
        "dialect": "Current" if admitted.dialect == "current" else "Legacy",
        "qualification": False,
        "evidence": "bounded exact executable help observation",
        "probes": [
            {"command": p.command, "exit_code": p.exit_code, "utf8": p.utf8}
            for p in admitted.probes
        ],
    }
    return (json.dumps(document, indent=2) + "\n").encode()


def stage_config_document(
    *,
    model_id: str,
    model: str,
    model_sha256: str,
    layer_end: int,
    ctx_size: int,
    lane_count: int,
    n_gpu_layers: int,
) -> bytes:
    """The reference's ``stage.json`` for a single-stage serving cell."""
    config: dict[str, Any] = {
        "run_id": "cache-family-serving-cell",
        "topology_id": "cache-family-single-stage",
        "model_id": model_id,
        # The path as pinned, not its blob: a split GGUF's shards are found by their names.
        "model_path": model,
        "source_model_sha256": model_sha256,
        "stage_id": "stage-0",
        "stage_index": 0,
        "layer_start": 0,
        "layer_end": layer_end,
        "ctx_size": ctx_size,
        "lane_count": lane_count,
        "n_gpu_layers": n_gpu_layers,
        "load_mode": "runtime-slice",
        "execution_contract": "",
        "bind_addr": "127.0.0.1:0",
        "upstream": None,
        "downstream": None,
        "kv_server": None,
    }
    return (json.dumps(config, indent=2) + "\n").encode()


def stage_server_argv(
    binary: str, admitted: CliAdmitted, config_path: str, port: int, lanes: int
) -> list[str]:
    return [
        binary,
        admitted.command,
        "--config",
        config_path,
        "--bind-addr",
        f"127.0.0.1:{port}",
        "--generation-concurrency",
        str(lanes),
        "--telemetry-level",
        "debug",
    ]
