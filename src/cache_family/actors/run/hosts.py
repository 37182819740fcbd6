"""Host kinds: everything the cell actor does differently for each kind of server. What every
layer may read of a kind (readiness, dialect, sizing, metrics path) is its ``HostKindFacts``
(``schemas/host_kinds.py``); the strategy adds what only an actor does: the command line, the
environment and the load client."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from cache_family.actors.run import stage_host
from cache_family.actors.run.load import LoadRun, OpenAIChatRun
from cache_family.schemas.arms import HostKind
from cache_family.schemas.host_kinds import (
    HOST_KIND_FACTS,
    HostKindFacts,
    HostReadiness,
    host_readiness,
)
from cache_family.schemas.measurement import CacheExpectation, LoadRequest
from cache_family.states.cache_reuse import cache_expectation
from cache_family.states.plans import CellPlan, llama_server_argv

# (plan, the private copy of the binary, port, the admitted dialect, the cell's dir) -> argv.
Argv = Callable[[CellPlan, str, int, stage_host.CliAdmitted | None, str], list[str]]
# (plan, request, LoadRun's keyword arguments) -> one measured rung's load client.
Load = Callable[..., LoadRun]


# (architecture, lanes, sliding window) -> the reuse rule a cell of the kind is judged by.
Expectation = Callable[[str | None, int | None, int | None], CacheExpectation]


@dataclass(frozen=True, slots=True)
class HostKindStrategy:
    facts: HostKindFacts
    # What the host's environment gets beyond the operator's and custody's.
    environment: Mapping[str, str]
    argv: Argv
    load_run: Load
    # llama.cpp's reuse rules (exact prefix, checkpoints) by the model's architecture.
    expectation: Expectation = cache_expectation

    @property
    def kind(self) -> HostKind:
        return self.facts.kind

    @property
    def readiness_path(self) -> str:
        return self.facts.readiness_path

    @property
    def reads_cli(self) -> bool:
        return self.facts.reads_cli

    @property
    def wraps_prompt_in_template(self) -> bool:
        return self.facts.wraps_prompt_in_template

    @property
    def metrics_path(self) -> str | None:
        return self.facts.metrics_path

    def readiness(self, plan: CellPlan, admitted: stage_host.CliAdmitted | None) -> HostReadiness:
        """How custody sees this cell's host ready: a stage server by the dialect its help
        admitted, its model id and lanes."""
        dialect = admitted.dialect if admitted is not None else "llama-server"
        return host_readiness(dialect, model_id=plan.model_id, lane_count=plan.lanes)


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
    HostKind.NATIVE: HostKindStrategy(
        HOST_KIND_FACTS[HostKind.NATIVE], {}, _native_argv, _native_load
    ),
    # Its config is written beside the cell (``stage.json``).
    HostKind.STAGE: HostKindStrategy(
        HOST_KIND_FACTS[HostKind.STAGE], stage_host.STAGE_ENVIRONMENT, _stage_argv, _stage_load
    ),
}
