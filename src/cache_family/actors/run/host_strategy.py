"""The host-kind strategy: everything the cell actor asks of a kind of server. What every layer
may read of a kind (readiness path, dialect, sizing, metrics path) is its ``HostKindFacts``
(``schemas/host_kinds.py``); the strategy adds what only an actor does: the command line, the
environment, the load client, and the answers a kind gives per cell (readiness, metrics path,
whether prompts go in its template, its reuse rule). ``actors/run/hosts.py`` holds one per kind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cache_family.actors.run import stage_host
from cache_family.actors.run.load import LoadRun
from cache_family.schemas.arms import HostKind
from cache_family.schemas.host_kinds import HostKindFacts, HostReadiness, host_readiness
from cache_family.schemas.measurement import CacheExpectation
from cache_family.states.cache_reuse import cache_expectation
from cache_family.states.plans import CellPlan

# (plan, the private copy of the binary, port, the admitted dialect, the cell's dir) -> argv.
Argv = Callable[[CellPlan, str, int, stage_host.CliAdmitted | None, str], list[str]]
# (plan, request, LoadRun's keyword arguments) -> one measured rung's load client.
Load = Callable[..., LoadRun]


@dataclass(frozen=True, slots=True)
class HostKindStrategy:
    facts: HostKindFacts
    # What the host's environment gets beyond the operator's and custody's.
    environment: Mapping[str, str]
    argv: Argv
    load_run: Load

    @property
    def kind(self) -> HostKind:
        return self.facts.kind

    @property
    def readiness_path(self) -> str:
        return self.facts.readiness_path

    @property
    def reads_cli(self) -> bool:
        return self.facts.reads_cli

    def readiness(self, plan: CellPlan, admitted: stage_host.CliAdmitted | None) -> HostReadiness:
        """How custody sees this cell's host ready: a stage server by the dialect its help
        admitted, its model id and lanes."""
        dialect = admitted.dialect if admitted is not None else "llama-server"
        return host_readiness(dialect, model_id=plan.model_id, lane_count=plan.lanes)

    def metrics_path(self, _plan: CellPlan) -> str | None:
        """Where the cell's host serves Prometheus metrics (None: it serves none)."""
        return self.facts.metrics_path

    def wraps_prompt_in_template(self, _plan: CellPlan) -> bool:
        """The cell's prompts go as chat messages inside the host's template."""
        return self.facts.wraps_prompt_in_template

    def expectation(self, plan: CellPlan, sliding_window: int | None) -> CacheExpectation:
        """The reuse rule the cell's rungs are judged by: llama.cpp's (exact prefix or
        checkpoints) by the model's architecture."""
        return cache_expectation(plan.architecture, plan.lanes, sliding_window)
