"""A Skippy stage server as a cell's host: its dialect, its ``stage.json`` and its command line.

The dialect is read from the binary's own help (reference ``skippy_cli_admission``): ``<bin>
serve --help`` exiting 0 is the current dialect, else ``<bin> serve-openai --help`` exiting 0
the legacy one, else the binary is refused. Each probe is capped at 5 s; the binary's pin is
re-checked around the probes, so the dialect is the pinned bytes' (the cell actor reads it
once per run for each pinned binary).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import trio

from cache_family.errors import Refused
from cache_family.schemas.measurement import HostDialect
from cache_family.schemas.stage_server import CURRENT_COMMAND, LEGACY_COMMAND

PROBE_SECONDS: Final = 5.0
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


@dataclass(frozen=True, slots=True)
class CliAdmitted:
    dialect: HostDialect  # current | legacy
    probes: tuple[Probe, ...]

    @property
    def command(self) -> str:
        return CURRENT_COMMAND if self.dialect == "current" else LEGACY_COMMAND


def _refused(binary: str, why: str) -> Refused:
    return Refused.one(
        "stage.cli_refused",
        "$.stage_server",
        f"{binary}: {why}",
        f"give a stage server whose `serve --help` or `{LEGACY_COMMAND} --help` exits 0",
    )


async def _probe(binary: str, command: str, env: Mapping[str, str], cwd: str) -> Probe:
    exit_code: int | None = None
    utf8 = True
    with trio.move_on_after(PROBE_SECONDS):
        done = await trio.run_process(
            [binary, command, "--help"],
            stdin=subprocess.DEVNULL,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=dict(env),
            cwd=cwd,
        )
        exit_code = done.returncode
        for stream in (done.stdout, done.stderr):
            try:
                stream[:PROBE_OUTPUT_LIMIT].decode("utf-8")
            except UnicodeDecodeError:
                utf8 = False
    return Probe(command, exit_code, utf8)


async def admit_cli(
    binary: str,
    env: Mapping[str, str],
    cwd: str,
    same_bytes: Callable[[], Awaitable[bool]],
) -> CliAdmitted:
    """The dialect of ``binary``, or ``stage.cli_refused``."""
    probes: list[Probe] = []
    for command, dialect in ((CURRENT_COMMAND, "current"), (LEGACY_COMMAND, "legacy")):
        if not await same_bytes():
            raise _refused(binary, "its bytes differ from the pinned stage server")
        probe = await _probe(binary, command, env, cwd)
        probes.append(probe)
        if not await same_bytes():
            raise _refused(binary, "its bytes changed while its help was read")
        if probe.exit_code == 0 and probe.utf8:
            return CliAdmitted(dialect, tuple(probes))  # type: ignore[arg-type]
    shown = ", ".join(f"`{p.command} --help` exit {p.exit_code}" for p in probes)
    raise _refused(binary, f"neither dialect answers ({shown})")


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
