"""What each host kind is, as every layer may read it (no I/O): how it is seen to be ready,
which request dialect it speaks, which of the prepared tasks size its cells, where it serves
metrics and what the report says of it. ``actors/run/hosts.py`` wraps these facts with what
only an actor can do for the kind (its command line, environment and load client).

Nothing outside this module and the strategies asks which kind a host is: a question about a
server is a field here, answered once per kind."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Literal, Protocol

from cache_family.schemas import stage_server
from cache_family.schemas.arms import HostKind
from cache_family.schemas.measurement import HostDialect

# llama-server's own ``/completion`` (token ids accepted), or OpenAI chat (text messages in the
# server's template).
RequestDialect = Literal["completion", "chat"]
# Which of the prepared row's tasks size a kind's cells: the native baselines' (serial runs,
# the concurrent ladder, --parallel) or the paired serving task's (runtime lanes, shared ctx).
TaskSource = Literal["baselines", "paired"]


class HostReadiness(Protocol):
    """How custody sees one host become ready: the line it prints once it listens, then the
    path it answers ready on and the answer that means ready."""

    @property
    def path(self) -> str: ...

    def is_listening_line(self, line: str, port: int) -> bool: ...

    def is_ready_answer(self, answer: object) -> bool: ...


# llama.cpp's common log may prefix each line with "<min>.<s>.<ms>.<us> <level> " (this build
# does by default); only that exact shape is stripped before the marker must match exactly.
_COMMON_LOG_PREFIX = re.compile(r"\d+\.\d{2}\.\d{3}\.\d{3} [DIWE] ")


def llama_server_listening_marker(port: int) -> str:
    """The exact line llama-server prints once it listens (llama.cpp tools/server/server.cpp)."""
    # SRV_INF pads the function name to 12 columns; "llama_server" is exactly 12.
    return f"srv  llama_server: listening on http://127.0.0.1:{port}"


@dataclass(frozen=True, slots=True)
class LlamaServerReadiness:
    """llama-server: its listening line, then ``/health`` answering ``{"status": "ok"}``."""

    path: str = "/health"

    def is_listening_line(self, line: str, port: int) -> bool:
        prefix = _COMMON_LOG_PREFIX.match(line)
        body = line[prefix.end() :] if prefix else line
        return body == llama_server_listening_marker(port)

    def is_ready_answer(self, answer: object) -> bool:
        return isinstance(answer, dict) and answer.get("status") == "ok"


def lists_model(answer: object, model_id: str) -> bool:
    """An OpenAI ``/v1/models`` answer that lists ``model_id``."""
    if not isinstance(answer, dict):
        return False
    data = answer.get("data")
    return isinstance(data, list) and any(
        isinstance(m, dict) and m.get("id") == model_id for m in data
    )


@dataclass(frozen=True, slots=True)
class StageServerReadiness:
    """A stage server: its dialect's listening line (``schemas/stage_server.py``), then
    ``/v1/models`` listing its model id."""

    dialect: stage_server.Dialect
    model_id: str
    lane_count: int
    path: str = "/v1/models"

    def is_listening_line(self, line: str, port: int) -> bool:
        return stage_server.is_listening_line(
            self.dialect,
            line,
            port,
            model_id=self.model_id,
            generation_concurrency=self.lane_count,
        )

    def is_ready_answer(self, answer: object) -> bool:
        return lists_model(answer, self.model_id)


LLAMA_SERVER_READINESS: Final = LlamaServerReadiness()


def _stage_readiness(dialect: stage_server.Dialect) -> Callable[[str, int], HostReadiness]:
    def readiness(model_id: str, lane_count: int) -> HostReadiness:
        return StageServerReadiness(dialect, model_id, lane_count)

    return readiness


# Each dialect's readiness, given the host's model id and lane count.
_READINESS: Final[Mapping[HostDialect, Callable[[str, int], HostReadiness]]] = {
    "llama-server": lambda _model_id, _lanes: LLAMA_SERVER_READINESS,
    "current": _stage_readiness("current"),
    "legacy": _stage_readiness("legacy"),
}


def host_readiness(
    dialect: HostDialect, *, model_id: str = "", lane_count: int = 1
) -> HostReadiness:
    """The readiness of a host speaking ``dialect``."""
    return _READINESS[dialect](model_id, lane_count)


def listening_marker(dialect: Literal["llama-server"], port: int) -> str:
    """The exact line a llama-server prints once it listens (the only dialect whose line is one
    fixed text)."""
    del dialect
    return llama_server_listening_marker(port)


def is_listening_line(
    dialect: HostDialect, line: str, port: int, *, model_id: str = "", lane_count: int = 1
) -> bool:
    """Whether ``line`` (without its newline) is the listening line of a host speaking
    ``dialect`` on ``port``."""
    readiness = host_readiness(dialect, model_id=model_id, lane_count=lane_count)
    return readiness.is_listening_line(line, port)


@dataclass(frozen=True, slots=True)
class HostKindFacts:
    kind: HostKind
    # How the report names a host of the kind.
    label: str
    request_dialect: RequestDialect
    # Journaled with the ``ready`` record: where readiness was confirmed.
    readiness_path: str
    # Which prepared tasks size the kind's cells.
    sized_by: TaskSource
    # Prompts go as chat messages inside the host's template: each request's prompt count is
    # held to the template's tokens around the cut prompt, and a sessions host gets room for
    # the template around every message.
    wraps_prompt_in_template: bool
    # The host's dialect is read from its help before launch (a stage server's CLI).
    reads_cli: bool
    # Where the host serves Prometheus metrics; None: it serves none (its reads journal "none").
    metrics_path: str | None
    # Its workload receipts list every request's server prompt time (the paired comparison
    # bootstraps them).
    receipt_lists_prompt_times: bool
    # How a profile refusal names the kind's profile: the kind's own word, or (None) the arm.
    profile_word: str | None
    # The last words of a model-pin disagreement (the row's observed model follows).
    model_disagreement: str
    # The prepared tool pin the kind's server binary must match (None: the profile's own pin).
    server_tool: Literal["native_server"] | None
    # Its requests name the profile's model id (llama-server serves its one model to any).
    names_model: bool


HOST_KIND_FACTS: Final[Mapping[HostKind, HostKindFacts]] = {
    # llama-server of the pinned llama.cpp build: ``/completion``, readiness on ``/health``,
    # metrics on ``/metrics`` (launched with ``--metrics``).
    HostKind.NATIVE: HostKindFacts(
        kind=HostKind.NATIVE,
        label="llama-server",
        request_dialect="completion",
        readiness_path=LLAMA_SERVER_READINESS.path,
        sized_by="baselines",
        wraps_prompt_in_template=False,
        reads_cli=False,
        metrics_path="/metrics",
        receipt_lists_prompt_times=False,
        profile_word="native",
        model_disagreement="the row observed",
        server_tool="native_server",
        names_model=False,
    ),
    # A Skippy stage server: OpenAI chat with its model id, readiness on ``/v1/models``, its
    # dialect read from its help; it serves no ``/metrics`` (``oracles/stage_server.py`` routes
    # only the OpenAI endpoints).
    HostKind.STAGE: HostKindFacts(
        kind=HostKind.STAGE,
        label="stage server",
        request_dialect="chat",
        readiness_path="/v1/models",
        sized_by="paired",
        wraps_prompt_in_template=True,
        reads_cli=True,
        metrics_path=None,
        receipt_lists_prompt_times=True,
        profile_word=None,
        model_disagreement="the row",
        server_tool=None,
        names_model=True,
    ),
    # A declared OpenAI-compatible server (``schemas/openai_host.py``): readiness on
    # ``/v1/models``, sized as the native ladder so the two pair rung for rung; its workloads
    # go as chat; its metrics path and ladder dialect are its declaration's.
    HostKind.OPENAI: HostKindFacts(
        kind=HostKind.OPENAI,
        label="OpenAI-compatible server",
        request_dialect="chat",
        readiness_path="/v1/models",
        sized_by="baselines",
        wraps_prompt_in_template=True,
        reads_cli=False,
        metrics_path=None,
        receipt_lists_prompt_times=True,
        profile_word="openai",
        model_disagreement="the row observed",
        server_tool=None,
        names_model=True,
    ),
}


def host_kind_facts(kind: HostKind) -> HostKindFacts:
    return HOST_KIND_FACTS[kind]
