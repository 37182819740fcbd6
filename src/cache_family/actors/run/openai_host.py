"""A declared OpenAI-compatible server as a host (``HostKind.OPENAI``): launched from its
profile's pinned parts with its declared arguments (``schemas/openai_host.py``), seen ready by
its declared listening line and ``/v1/models``, sent the ladder in its declared dialect
(``/v1/completions`` where it speaks it, else chat), its reuse read per request from
``usage.prompt_tokens_details.cached_tokens`` and judged by whole blocks of its declared size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Final

from cache_family.actors.run import stage_host
from cache_family.actors.run.host_strategy import HostKindStrategy
from cache_family.actors.run.load import (
    LoadRun,
    OpenAIChatRun,
)
from cache_family.schemas.arms import HostKind
from cache_family.schemas.host_kinds import HOST_KIND_FACTS, HostReadiness
from cache_family.schemas.measurement import CacheExpectation, LoadRequest
from cache_family.schemas.openai_host import OpenAIReadiness, OpenAIServing, openai_argv
from cache_family.states.cache_reuse import block_expectation
from cache_family.states.plans import CellPlan


def _serving(plan: CellPlan) -> OpenAIServing:
    profile = plan.profile
    assert profile is not None and profile.openai is not None  # pin-verify refused otherwise
    return profile.openai


def openai_completions_body(
    model_id: str, prompt: str, max_tokens: int, *, ignore_eos: bool = False
) -> dict[str, Any]:
    """A streamed, greedy, seeded ``/v1/completions`` request with usage; ``ignore_eos`` only
    for a synthetic catalog's random-weight models, as on every other dialect's body."""
    body: dict[str, Any] = {
        "model": model_id,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


class OpenAICompletionsRun(OpenAIChatRun):
    """A ladder rung against ``POST /v1/completions``: the cut prompt as sent text, the answer
    read as a chat stream's (each choice's ``text`` is its content)."""

    endpoint: ClassVar[str] = "/v1/completions"

    def _body(self) -> dict[str, Any]:
        return openai_completions_body(
            self.model_id,
            self.request.prompt,
            self.request.output_tokens,
            ignore_eos=self.request.ignore_eos,
        )


def _argv(
    plan: CellPlan,
    binary: str,
    port: int,
    _admitted: stage_host.CliAdmitted | None,
    _cell_path: str,
) -> list[str]:
    profile = plan.profile
    assert profile is not None
    return openai_argv(
        _serving(plan),
        binary,
        port=port,
        model=profile.model,
        model_id=plan.model_id,
        lanes=plan.lanes,
        ctx_size=plan.ctx_size,
    )


def _load(plan: CellPlan, request: LoadRequest, **load: Any) -> LoadRun:
    if _serving(plan).ladder_dialect == "completions":
        return OpenAICompletionsRun(request, plan.model_id, **load)
    return OpenAIChatRun(request, plan.model_id, **load)


@dataclass(frozen=True, slots=True)
class OpenAIHostStrategy(HostKindStrategy):
    """The kind's answers per cell come from the cell's declaration."""

    def readiness(self, plan: CellPlan, admitted: stage_host.CliAdmitted | None) -> HostReadiness:
        return OpenAIReadiness(_serving(plan).listening_text, plan.model_id)

    def metrics_path(self, plan: CellPlan) -> str | None:
        return _serving(plan).metrics_path

    def wraps_prompt_in_template(self, plan: CellPlan) -> bool:
        # A workload goes as chat; the ladder in the dialect it is sent.
        return plan.arm.workload or _serving(plan).ladder_dialect == "chat"

    def expectation(self, plan: CellPlan, sliding_window: int | None) -> CacheExpectation:
        return block_expectation(_serving(plan).block_size, plan.lanes)


OPENAI_STRATEGY: Final = OpenAIHostStrategy(HOST_KIND_FACTS[HostKind.OPENAI], {}, _argv, _load)
