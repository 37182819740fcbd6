"""Host kinds: everything the cell actor does differently for a llama-server and a stage server."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from cache_family.actors.run import stage_host
from cache_family.actors.run.load import LoadRun, OpenAIChatRun
from cache_family.schemas.arms import HostKind
from cache_family.schemas.measurement import HostDialect, LoadRequest
from cache_family.states.plans import CellPlan, llama_server_argv

# (plan, the private copy of the binary, port, the admitted dialect, the cell's dir) -> argv.
Argv = Callable[[CellPlan, str, int, stage_host.CliAdmitted | None, str], list[str]]
# (plan, request, LoadRun's keyword arguments) -> one measured rung's load client.
Load = Callable[..., LoadRun]


@dataclass(frozen=True, slots=True)
class HostKindStrategy:
    kind: HostKind
    # Journaled with the ``ready`` record: where readiness was confirmed.
    readiness_path: str
    # The host's dialect is read from its help in pin-verify (``stage_host.admit_cli``).
    reads_cli: bool
    # What the host's environment gets beyond the operator's and custody's.
    environment: Mapping[str, str]
    argv: Argv
    load_run: Load
    # Prompts go as chat messages inside the host's template: each request's prompt count is
    # held to the template's tokens around the cut prompt.
    wraps_prompt_in_template: bool = False
    # Where the host serves Prometheus metrics (read around every rung and workload point,
    # ``actors/run/server_metrics.py``); None: it serves none, and its reads journal "none".
    metrics_path: str | None = None

    def dialect(self, admitted: stage_host.CliAdmitted | None) -> HostDialect:
        return admitted.dialect if admitted is not None else "llama-server"


def _native_argv(
    plan: CellPlan, binary: str, port: int, _admitted: object, _cell_path: str
) -> list[str]:
    return llama_server_argv(plan, binary, port)


def _native_load(plan: CellPlan, request: LoadRequest, **load: Any) -> LoadRun:
    return LoadRun(request, **load)


def _stage_argv(
    plan: CellPlan,
    binary: str,
    port: int,
    admitted: stage_host.CliAdmitted | None,
    cell_path: str,
) -> list[str]:
    assert admitted is not None  # pin-verify read it before the host was configured
    config = os.path.join(cell_path, stage_host.STAGE_CONFIG_NAME)
    return stage_host.stage_server_argv(binary, admitted, config, port, plan.lanes)


def _stage_load(plan: CellPlan, request: LoadRequest, **load: Any) -> LoadRun:
    return OpenAIChatRun(request, plan.model_id, **load)


HOST_KINDS: Final[Mapping[HostKind, HostKindStrategy]] = {
    # llama-server of the pinned llama.cpp build: ``/completion``, readiness on ``/health``,
    # metrics on ``/metrics`` (launched with ``--metrics``).
    HostKind.NATIVE: HostKindStrategy(
        HostKind.NATIVE,
        "/health",
        False,
        {},
        _native_argv,
        _native_load,
        metrics_path="/metrics",
    ),
    # A Skippy stage server: OpenAI chat with its model id, readiness on ``/v1/models``, its
    # dialect read from its help, its config written beside the cell (``stage.json``); it
    # serves no ``/metrics`` (``oracles/stage_server.py`` routes only the OpenAI endpoints).
    HostKind.STAGE: HostKindStrategy(
        HostKind.STAGE,
        "/v1/models",
        True,
        stage_host.STAGE_ENVIRONMENT,
        _stage_argv,
        _stage_load,
        wraps_prompt_in_template=True,
    ),
}
