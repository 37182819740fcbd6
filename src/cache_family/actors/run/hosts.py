"""One strategy per host kind (``actors/run/host_strategy.py``): the native llama-server, the
Skippy stage servers and a declared OpenAI-compatible server (``actors/run/openai_host.py``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Final

from cache_family.actors.run import stage_host
from cache_family.actors.run.host_strategy import HostKindStrategy, Load
from cache_family.actors.run.load import LOAD_DIALECTS, LoadRun
from cache_family.actors.run.openai_host import OPENAI_STRATEGY
from cache_family.schemas.arms import HostKind
from cache_family.schemas.host_kinds import HOST_KIND_FACTS, RequestDialect
from cache_family.schemas.measurement import LoadRequest
from cache_family.states.plans import CellPlan, llama_server_argv


def _native_argv(
    plan: CellPlan, binary: str, port: int, _admitted: object, _cell_path: str
) -> list[str]:
    return llama_server_argv(plan, binary, port)


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


def _load_in(dialect: RequestDialect) -> Load:
    """A kind's ladder client: its request dialect's load client (``LOAD_DIALECTS``)."""

    def load_run(plan: CellPlan, request: LoadRequest, **load: Any) -> LoadRun:
        return LOAD_DIALECTS[dialect](request, plan.model_id, **load)

    return load_run


HOST_KINDS: Final[Mapping[HostKind, HostKindStrategy]] = {
    HostKind.NATIVE: HostKindStrategy(
        HOST_KIND_FACTS[HostKind.NATIVE],
        {},
        _native_argv,
        _load_in(HOST_KIND_FACTS[HostKind.NATIVE].request_dialect),
    ),
    # Its config is written beside the cell (``stage.json``).
    HostKind.STAGE: HostKindStrategy(
        HOST_KIND_FACTS[HostKind.STAGE],
        stage_host.STAGE_ENVIRONMENT,
        _stage_argv,
        _load_in(HOST_KIND_FACTS[HostKind.STAGE].request_dialect),
    ),
    HostKind.OPENAI: OPENAI_STRATEGY,
}
