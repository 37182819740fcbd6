"""The state-handoff correctness report: topology layer ranges and the gate that accepts
a report.

The run accepts a ``state-handoff.json`` only when ``handoff_report_refusals`` finds nothing
(spec ``correctness-report.md``, "The gate").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from cache_family.errors import Refusal, Refused

Payload = Literal["resident-kv", "kv-recurrent"]
PAYLOADS: Final[tuple[Payload, ...]] = ("resident-kv", "kv-recurrent")
LoadMode = Literal["runtime-slice", "layer-package"]
LOAD_MODES: Final[tuple[LoadMode, ...]] = ("runtime-slice", "layer-package")

SPLIT_TOPOLOGIES: Final = ("split-stage0", "split-middle", "split-final")
RUNTIME_SLICE_TOPOLOGIES: Final = ("one-stage", *SPLIT_TOPOLOGIES)
PACKAGE_TOPOLOGY: Final = "package-stage1"
#: The only layer package the reference plans: DeepSeek3, state layers 3..4 at stage 1.
PACKAGE_RANGE: Final = (3, 4, 1)
PACKAGE_LAYER_COUNT: Final = 61

MODE: Final = "state-handoff"
PROMPT_TEXT_MAX_BYTES: Final = 65_536
MEAN_RELATIVE_TOLERANCE: Final = 1e-8

MATCH_FLAGS: Final = ("matches", "predicted_token_matches", "cache_hit_matches")
COUNT_FIELDS: Final = (
    "stage_index",
    "layer_start",
    "layer_end",
    "requested_prefix_token_count",
    "benchmark_prompt_token_count",
    "activation_width",
    "cache_hit_repeats",
)
SAMPLE_FIELDS: Final = ("cache_hit_import_ms", "cache_hit_decode_ms")
TOTAL_FIELDS: Final = ("recompute_total_ms", "cache_hit_total_ms")


def topology_range(topology: str, layer_end: int) -> tuple[int, int, int]:
    """``(layer_start, layer_end, stage_index)`` of a topology for a model of ``layer_end`` layers.

    f = L/3 and s = 2(L/3) + (2(L mod 3))/3 in integer division; the split stages need L >= 3.
    The package stage's range is fixed; whether the package has the layers is the caller's check.
    """
    if layer_end < 1:
        raise Refused.one(
            "handoff.layer_end",
            "$.layer_end",
            f"a model has at least one layer, not {layer_end}",
            "pass the model's block count",
        )
    if topology == "one-stage":
        return (0, layer_end, 0)
    if topology == PACKAGE_TOPOLOGY:
        return PACKAGE_RANGE
    if topology not in SPLIT_TOPOLOGIES:
        raise Refused.one(
            "handoff.topology",
            "$.topology",
            f"unknown topology {topology!r}",
            f"use one of {', '.join((*RUNTIME_SLICE_TOPOLOGIES, PACKAGE_TOPOLOGY))}",
        )
    if layer_end < 3:
        raise Refused.one(
            "handoff.split_too_small",
            "$.layer_end",
            f"a three-stage split needs at least 3 layers, the model has {layer_end}",
            "run the one-stage topology only",
        )
    first = layer_end // 3
    second = 2 * (layer_end // 3) + (2 * (layer_end % 3)) // 3
    return {
        "split-stage0": (0, first, 0),
        "split-middle": (first, second, 1),
        "split-final": (second, layer_end, 2),
    }[topology]


def topology_of(
    load_mode: LoadMode, layer_end: int, start: int, end: int, stage: int
) -> str | None:
    """The topology whose range is ``(start, end, stage)`` for this load mode, or None."""
    if load_mode == "layer-package":
        candidates: Sequence[str] = (PACKAGE_TOPOLOGY,)
    else:
        candidates = RUNTIME_SLICE_TOPOLOGIES if layer_end >= 3 else ("one-stage",)
    for name in candidates:
        if layer_end >= 1 and topology_range(name, layer_end) == (start, end, stage):
            return name
    return None


@dataclass(frozen=True, slots=True)
class HandoffExpectation:
    """What the run planned for one topology row: the values the report must echo."""

    model_id: str
    payload: Payload
    topology: str
    layer_end: int
    activation_width: int
    prefix_tokens: int
    repeats: int
    #: The reference plans package-stage1 only for the 61-layer DeepSeek3 package; a
    #: synthetic zoo package with fewer layers passes its own count.
    package_layer_count: int = PACKAGE_LAYER_COUNT


def _unsigned(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def handoff_report_refusals(
    report: Mapping[str, object], expect: HandoffExpectation
) -> list[Refusal]:
    """Every reason the gate refuses ``report`` for ``expect`` (empty list: accepted)."""
    out: list[Refusal] = []

    def refuse(code: str, member: str, message: str, hint: str) -> None:
        out.append(Refusal(f"handoff.{code}", f"$.{member}" if member else "$", message, hint))

    def rerun(what: str) -> str:
        return f"the correctness tool must report {what}; re-run it or fix the tool"

    for member in ("mode", "status", "state_payload_kind", "benchmark_prompt_text"):
        if not isinstance(report.get(member), str):
            refuse("type", member, f"{member} is absent or not a string", rerun("a string"))
    for member in MATCH_FLAGS:
        if not isinstance(report.get(member), bool):
            refuse("type", member, f"{member} is absent or not a boolean", rerun("a boolean"))
    for member in COUNT_FIELDS:
        if not _unsigned(report.get(member)):
            refuse("type", member, f"{member} is absent or not an unsigned integer", rerun("it"))
    for member in TOTAL_FIELDS:
        if not _number(report.get(member)):
            refuse("type", member, f"{member} is absent or not a number", rerun("a number"))
    samples: dict[str, list[float]] = {}
    for member in SAMPLE_FIELDS:
        value = report.get(member)
        if isinstance(value, list) and all(_number(v) for v in value):
            samples[member] = [float(v) for v in value]
        else:
            refuse("type", member, f"{member} is absent or not an array of numbers", rerun("it"))
    identity = report.get("model_identity")
    if not isinstance(identity, Mapping) or not isinstance(identity.get("model_id"), str):
        refuse("type", "model_identity", "model_identity.model_id is absent", rerun("it"))
    elif identity["model_id"] != expect.model_id:
        refuse(
            "model_id",
            "model_identity.model_id",
            f"model id {identity['model_id']!r} is not the row's {expect.model_id!r}",
            "the tool ran another model; check the correctness input",
        )
    if out:
        return out  # the value checks below assume the types

    if report["mode"] != MODE:
        refuse("mode", "mode", f"mode is {report['mode']!r}, not {MODE!r}", rerun(repr(MODE)))
    if report["status"] != "pass":
        reason = report.get("reason")
        why = f" ({reason})" if isinstance(reason, str) and reason else ""
        refuse("status", "status", f"status is {report['status']!r}{why}", "see the report")
    for member in MATCH_FLAGS:
        if report[member] is not True:
            refuse("mismatch", member, f"{member} is false", "the restored state diverged")
    if report["state_payload_kind"] != expect.payload:
        refuse(
            "payload",
            "state_payload_kind",
            f"payload {report['state_payload_kind']!r} is not the family's {expect.payload!r}",
            "the family's catalog payload decides the kind",
        )
    if expect.topology == PACKAGE_TOPOLOGY and expect.layer_end != expect.package_layer_count:
        refuse(
            "range",
            "layer_start",
            f"package-stage1 needs the {expect.package_layer_count}-layer package, not "
            f"{expect.layer_end} layers",
            "package-stage1 is planned only for the DeepSeek3 layer package",
        )
    else:
        try:
            want = topology_range(expect.topology, expect.layer_end)
        except Refused as refused:
            out.extend(refused.refusals)
        else:
            got = (report["layer_start"], report["layer_end"], report["stage_index"])
            if got != want:
                refuse(
                    "range",
                    "layer_start",
                    f"range (layer_start, layer_end, stage_index) {got} is not "
                    f"{expect.topology}'s {want}",
                    "the tool must run the topology's layer range",
                )
    if report["activation_width"] != expect.activation_width:
        refuse(
            "activation_width",
            "activation_width",
            f"activation width {report['activation_width']} is not the admitted "
            f"{expect.activation_width}",
            "the tool ran a model of another width",
        )
    if report["requested_prefix_token_count"] != expect.prefix_tokens:
        refuse(
            "prefix",
            "requested_prefix_token_count",
            f"prefix {report['requested_prefix_token_count']} is not {expect.prefix_tokens}",
            rerun("the requested prefix"),
        )
    if report["benchmark_prompt_token_count"] != expect.prefix_tokens + 1:
        refuse(
            "prompt_tokens",
            "benchmark_prompt_token_count",
            f"benchmark prompt has {report['benchmark_prompt_token_count']} tokens, not "
            f"prefix + 1 = {expect.prefix_tokens + 1}",
            rerun("K prefix tokens plus one suffix token"),
        )
    text = report["benchmark_prompt_text"]
    assert isinstance(text, str)
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if not 0 < size <= PROMPT_TEXT_MAX_BYTES:
        refuse(
            "prompt_text",
            "benchmark_prompt_text",
            f"benchmark prompt text has {size} bytes; 1..{PROMPT_TEXT_MAX_BYTES} are accepted",
            rerun("the prompt it accepted"),
        )
    out.extend(_timing_refusals(report, samples, expect.repeats))
    return out


def _timing_refusals(
    report: Mapping[str, object], samples: Mapping[str, list[float]], repeats: int
) -> list[Refusal]:
    out: list[Refusal] = []
    if report["cache_hit_repeats"] != repeats or repeats < 1:
        out.append(
            Refusal(
                "handoff.repeats",
                "$.cache_hit_repeats",
                f"cache_hit_repeats {report['cache_hit_repeats']} is not the planned {repeats}",
                "run the planned number of cache-hit repeats (at least one)",
            )
        )
        return out
    imports, decodes = samples["cache_hit_import_ms"], samples["cache_hit_decode_ms"]
    for member, values in samples.items():
        if len(values) != repeats:
            out.append(
                Refusal(
                    "handoff.samples",
                    f"$.{member}",
                    f"{member} has {len(values)} samples, not {repeats}",
                    "record one sample per cache-hit repeat",
                )
            )
    named = [(f"{m}[{i}]", v) for m, vs in samples.items() for i, v in enumerate(vs)]
    named += [(m, float(report[m])) for m in TOTAL_FIELDS]  # type: ignore[arg-type]
    for where, value in named:
        if not (math.isfinite(value) and value >= 0):
            out.append(
                Refusal(
                    "handoff.timing",
                    f"$.{where}",
                    f"{where} is {value}, not a finite non-negative number",
                    "the tool's clock readings must be finite and non-negative",
                )
            )
    if out:
        return out
    total = 0.0
    for imported, decoded in zip(imports, decodes, strict=True):
        total += imported + decoded
    mean = total / repeats
    reported = float(report["cache_hit_total_ms"])  # type: ignore[arg-type]
    if not math.isfinite(total) or abs(mean - reported) > MEAN_RELATIVE_TOLERANCE * max(
        abs(mean), 1.0
    ):
        out.append(
            Refusal(
                "handoff.total",
                "$.cache_hit_total_ms",
                f"cache_hit_total_ms {reported} is not the mean {mean} of import + decode",
                "cache_hit_total_ms is the mean of the per-repeat import + decode sums",
            )
        )
    return out
