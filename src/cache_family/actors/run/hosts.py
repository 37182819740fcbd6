"""Host kinds: everything the cell actor does differently for a llama-server and a stage server.

A ``HostKindStrategy`` gives a host kind's command line, the environment added to the host's,
whether its dialect is read from its help before launch, the readiness URL journaled, and the
load client its rungs use. The cell actor asks the strategy of its arm's host kind
(``schemas/arms.py``) and has no branch of its own on the kind; a new host kind is a new
strategy here, in ``HOST_KINDS``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Final, Protocol

from cache_family.actors.run import stage_host
from cache_family.actors.run.load import LoadRun, OpenAIChatRun, RowSink
from cache_family.schemas.arms import HostKind
from cache_family.schemas.measurement import (
    CacheExpectation,
    HostDialect,
    LoadRequest,
    RequestRow,
)
from cache_family.states.plans import CellPlan, llama_server_argv
from cache_family.system.http import LoopbackHttp


class HostKindStrategy(Protocol):
    kind: HostKind
    # Journaled with the ``ready`` record: where readiness was confirmed.
    readiness_path: str
    # The host's dialect is read from its help in pin-verify (``stage_host.admit_cli``).
    reads_cli: bool

    def environment(self) -> Mapping[str, str]:
        """What the host's environment gets beyond the operator's and custody's."""
        ...

    def dialect(self, admitted: stage_host.CliAdmitted | None) -> HostDialect: ...

    def argv(
        self,
        plan: CellPlan,
        binary: str,
        port: int,
        admitted: stage_host.CliAdmitted | None,
        cell_path: str,
    ) -> list[str]:
        """The host's exact command line, running ``binary`` (the private copy)."""
        ...

    def load_run(
        self,
        plan: CellPlan,
        request: LoadRequest,
        *,
        deadline: float,
        sent: Sequence[RequestRow],
        client: LoopbackHttp,
        rows: RowSink,
        expectation: CacheExpectation,
    ) -> LoadRun:
        """One measured rung's load client."""
        ...


class NativeHost:
    """llama-server of the pinned llama.cpp build: ``/completion``, readiness on ``/health``."""

    kind = HostKind.NATIVE
    readiness_path = "/health"
    reads_cli = False

    def environment(self) -> Mapping[str, str]:
        return {}

    def dialect(self, admitted: stage_host.CliAdmitted | None) -> HostDialect:
        return "llama-server"

    def argv(
        self,
        plan: CellPlan,
        binary: str,
        port: int,
        admitted: stage_host.CliAdmitted | None,
        cell_path: str,
    ) -> list[str]:
        return llama_server_argv(plan, binary, port)

    def load_run(
        self,
        plan: CellPlan,
        request: LoadRequest,
        *,
        deadline: float,
        sent: Sequence[RequestRow],
        client: LoopbackHttp,
        rows: RowSink,
        expectation: CacheExpectation,
    ) -> LoadRun:
        return LoadRun(
            request,
            deadline=deadline,
            sent=sent,
            client=client,
            rows=rows,
            expectation=expectation,
        )


class StageHost:
    """A Skippy stage server: OpenAI chat with its model id, readiness on ``/v1/models``, its
    dialect read from its help, its config written beside the cell (``stage.json``)."""

    kind = HostKind.STAGE
    readiness_path = "/v1/models"
    reads_cli = True

    def environment(self) -> Mapping[str, str]:
        return stage_host.STAGE_ENVIRONMENT

    def dialect(self, admitted: stage_host.CliAdmitted | None) -> HostDialect:
        assert admitted is not None  # pin-verify read it before the host was configured
        return admitted.dialect

    def argv(
        self,
        plan: CellPlan,
        binary: str,
        port: int,
        admitted: stage_host.CliAdmitted | None,
        cell_path: str,
    ) -> list[str]:
        assert admitted is not None
        config = os.path.join(cell_path, stage_host.STAGE_CONFIG_NAME)
        return stage_host.stage_server_argv(binary, admitted, config, port, plan.lanes)

    def load_run(
        self,
        plan: CellPlan,
        request: LoadRequest,
        *,
        deadline: float,
        sent: Sequence[RequestRow],
        client: LoopbackHttp,
        rows: RowSink,
        expectation: CacheExpectation,
    ) -> LoadRun:
        return OpenAIChatRun(
            request,
            plan.model_id,
            deadline=deadline,
            sent=sent,
            client=client,
            rows=rows,
            expectation=expectation,
        )


HOST_KINDS: Final[Mapping[HostKind, HostKindStrategy]] = {
    HostKind.NATIVE: NativeHost(),
    HostKind.STAGE: StageHost(),
}
