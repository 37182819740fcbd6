"""An OpenAI-compatible server the operator declares (``HostKind.OPENAI``): how it is started
from its pinned parts, which dialects it speaks, how it is seen ready and what reuse it
promises. The pinned parts themselves are the host profile's (``HostProfile.binary``: the
server binary or the interpreter of a pinned tree; ``native_build``: its build or interpreter
tree; ``model``: a GGUF file or a model directory); this is the rest of the declaration.

No I/O here: the strategy that launches it is ``actors/run/openai_host.py``."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cache_family.errors import Refusal, Refused
from cache_family.schemas.host_kinds import lists_model
from cache_family.schemas.refusal_codes import RefusalCode

OpenAIDialect = Literal["completions", "chat"]

# What an argument may name; the product fills each in for every cell.
PLACEHOLDERS: Final = ("port", "host", "model", "model_id", "lanes", "ctx_size")
_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")
LOOPBACK: Final = "127.0.0.1"
# Addresses that would make the server listen beyond this machine.
_WIDE_ADDRESSES: Final = frozenset({"0.0.0.0", "::", "[::]", "*"})  # noqa: S104 (refused, not bound)


def _codes(*codes: RefusalCode) -> Mapping[str, RefusalCode]:
    return {code.code: code for code in codes}


OPENAI_HOST_REFUSAL_CODES: Final = _codes(
    RefusalCode(
        "openai_host.shape",
        "the declaration is not the documented object (a member missing, unknown or mistyped)",
        "declare schema_version 1, module, args, dialects, block_size, "
        "metrics_path and listening_text, as docs/architecture.md shows",
    ),
    RefusalCode(
        "openai_host.args.unknown_placeholder",
        "an argument names a placeholder the product does not fill in",
        "use only {port}, {host}, {model}, {model_id}, {lanes} and {ctx_size}",
    ),
    RefusalCode(
        "openai_host.args.no_port",
        "no argument carries {port}: the product cannot give the server its port",
        "pass the port as {port} (the product reserves a fresh loopback port per cell)",
    ),
    RefusalCode(
        "openai_host.args.beyond_loopback",
        "an argument names an address beyond this machine",
        "pass the bind address as {host}: every host listens on 127.0.0.1 only",
    ),
    RefusalCode(
        "openai_host.dialects.empty_or_repeated",
        "dialects is empty or names a dialect twice",
        'name "completions", "chat" or both, once each',
    ),
    RefusalCode(
        "openai_host.block_size.range",
        "block_size is not between 1 and 65536",
        "give the server's reuse granularity in tokens (1 for exact-prefix reuse)",
    ),
    RefusalCode(
        "openai_host.metrics_path.not_absolute",
        "metrics_path does not start with /",
        "give the metrics path as the server routes it, e.g. /metrics, or null",
    ),
    RefusalCode(
        "openai_host.listening_text.no_port",
        "listening_text does not carry {port}",
        "give the text the server prints once it listens, with its port as {port}",
    ),
)


class OpenAIServing(BaseModel):
    """The declaration beyond the pins."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, hide_input_in_errors=True)

    schema_version: Literal[1]
    # Started as ``<binary> -m <module> <args>`` (an interpreter tree's Python), or, None,
    # as ``<binary> <args>``.
    module: Annotated[
        str | None, Field(description="run as `<binary> -m <module>`; null = `<binary>` alone")
    ]
    args: Annotated[
        list[str],
        Field(
            description="arguments; {port} required, {host}, {model}, {model_id}, {lanes} "
            "and {ctx_size} filled in per cell; no address beyond loopback"
        ),
    ]
    # Completions first where both are spoken: the ladder sends the cut prompt as it is.
    dialects: Annotated[
        list[OpenAIDialect],
        Field(description="each once; the ladder uses completions where given, workloads chat"),
    ]
    # Reuse is whole blocks of this many tokens of the common prefix (1: exact prefix).
    block_size: Annotated[
        int, Field(strict=True, description="1..=65536; reuse granularity in tokens")
    ]
    # Prometheus exposition (read around every rung); None: it serves none.
    metrics_path: Annotated[
        str | None, Field(description="starts with /; Prometheus metrics; null = none")
    ]
    # Text of the line the server prints once it listens, with its port as ``{port}``.
    listening_text: Annotated[
        str, Field(description="carries {port}; printed once the server listens")
    ]

    @property
    def ladder_dialect(self) -> OpenAIDialect:
        return "completions" if "completions" in self.dialects else "chat"


def serving_refusals(serving: OpenAIServing) -> list[Refusal]:
    """Everything wrong with a declaration that decoded."""
    found: list[Refusal] = []

    def refuse(code: str, path: str, message: str) -> None:
        found.append(Refusal(code, path, message, OPENAI_HOST_REFUSAL_CODES[code].hint))

    named = [(i, name) for i, arg in enumerate(serving.args) for name in _PLACEHOLDER.findall(arg)]
    for index, name in named:
        if name not in PLACEHOLDERS:
            refuse(
                "openai_host.args.unknown_placeholder",
                f"$.args[{index}]",
                f"{{{name}}} is not a placeholder the product fills in",
            )
    if not any(name == "port" for _, name in named):
        refuse("openai_host.args.no_port", "$.args", "no argument carries {port}")
    for index, arg in enumerate(serving.args):
        if arg in _WIDE_ADDRESSES or any(arg.endswith("=" + wide) for wide in _WIDE_ADDRESSES):
            refuse(
                "openai_host.args.beyond_loopback",
                f"$.args[{index}]",
                f"{arg!r} would listen beyond this machine",
            )
    if not serving.dialects or len(set(serving.dialects)) != len(serving.dialects):
        refuse(
            "openai_host.dialects.empty_or_repeated",
            "$.dialects",
            f"dialects {serving.dialects} must name each dialect at most once, at least one",
        )
    if not 1 <= serving.block_size <= 65536:
        refuse(
            "openai_host.block_size.range",
            "$.block_size",
            f"block_size {serving.block_size} is outside 1..65536",
        )
    if serving.metrics_path is not None and not serving.metrics_path.startswith("/"):
        refuse(
            "openai_host.metrics_path.not_absolute",
            "$.metrics_path",
            f"metrics_path {serving.metrics_path!r} does not start with /",
        )
    if "{port}" not in serving.listening_text:
        refuse(
            "openai_host.listening_text.no_port",
            "$.listening_text",
            "listening_text does not carry {port}",
        )
    return found


def admit_serving(document: object) -> OpenAIServing:
    """The declaration of ``document`` (a decoded JSON object), or Refused with every problem."""
    try:
        serving = OpenAIServing.model_validate(document)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = "$" + "".join(
            f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]
        )
        shape = OPENAI_HOST_REFUSAL_CODES["openai_host.shape"]
        raise Refused.one(shape.code, where, first["msg"], shape.hint) from None
    found = serving_refusals(serving)
    if found:
        raise Refused(tuple(found))
    return serving


def openai_argv(
    serving: OpenAIServing,
    binary: str,
    *,
    port: int,
    model: str,
    model_id: str,
    lanes: int,
    ctx_size: int,
) -> list[str]:
    """The exact command line of one cell's server: each placeholder filled in, nothing else
    of an argument touched (braces that name no placeholder stay as they are)."""
    values: dict[str, Any] = {
        "port": port,
        "host": LOOPBACK,
        "model": model,
        "model_id": model_id,
        "lanes": lanes,
        "ctx_size": ctx_size,
    }

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        return str(values[name]) if name in values else match.group(0)

    module = ["-m", serving.module] if serving.module is not None else []
    return [binary, *module, *(_PLACEHOLDER.sub(fill, arg) for arg in serving.args)]


@dataclass(frozen=True, slots=True)
class OpenAIReadiness:
    """Its declared listening line (as a substring, its port filled in), then ``/v1/models``
    listing its model id."""

    listening_text: str
    model_id: str
    path: str = "/v1/models"

    def is_listening_line(self, line: str, port: int) -> bool:
        return self.listening_text.replace("{port}", str(port)) in line

    def is_ready_answer(self, answer: object) -> bool:
        return lists_model(answer, self.model_id)
