"""The correctness arm's decisions, pure: the tool's command line per topology, the verdict on
one topology (its child's end and the gate on its report) and the verdict on the stage.

The stage passes only when every planned topology passed the gate and every report carries the
same non-empty ``benchmark_prompt_text`` (spec ``correctness-report.md``); that text then drives
every later request of the row.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from cache_family.states.handoff import HandoffExpectation, handoff_report_refusals, topology_range

REPORT_NAME: Final = "state-handoff.json"
PASS: Final = "pass"  # noqa: S105 (an evidence status, not a secret)
FAILED_PROCESS: Final = "failed-process"
REFUSED: Final = "refused"
STAGE_COMPLETED: Final = "completed"
STAGE_FAILED: Final = "failed-or-incomplete"
STAGE_NOT_RUN: Final = "not-run"
PROMPT_FLAG: Final = "--prompt"


@dataclass(frozen=True, slots=True)
class CorrectnessSpec:
    """What the row asks of its correctness tool (the same for every topology)."""

    tool: str
    model: str
    model_id: str
    stage_server: str
    layer_end: int
    ctx_size: int
    n_gpu_layers: int
    activation_width: int
    load_mode: str
    payload: str
    prefix_tokens: int
    repeats: int
    lanes: int
    borrow_resident_hits: bool
    cache_decoded_result_hits: bool
    prompt: str | None
    topologies: tuple[str, ...]
    package_layer_count: int


def correctness_argv(
    spec: CorrectnessSpec, topology: str, report_out: str, source_port: int, restore_port: int
) -> list[str]:
    """The reference command line, in the harness's argument order."""
    start, end, stage = topology_range(topology, spec.layer_end)
    argv = [
        spec.tool,
        "state-handoff",
        "--model",
        spec.model,
        "--model-id",
        spec.model_id,
        "--stage-server-bin",
        spec.stage_server,
        "--layer-end",
        str(spec.layer_end),
        "--ctx-size",
        str(spec.ctx_size),
        f"--n-gpu-layers={spec.n_gpu_layers}",
        "--activation-width",
        str(spec.activation_width),
        "--stage-load-mode",
        spec.load_mode,
        "--state-layer-start",
        str(start),
        "--state-layer-end",
        str(end),
        "--state-stage-index",
        str(stage),
        "--state-payload-kind",
        spec.payload,
        "--prefix-token-count",
        str(spec.prefix_tokens),
        "--cache-hit-repeats",
        str(spec.repeats),
        "--runtime-lane-count",
        str(spec.lanes),
        "--source-bind-addr",
        f"127.0.0.1:{source_port}",
        "--restore-bind-addr",
        f"127.0.0.1:{restore_port}",
        "--report-out",
        report_out,
    ]
    if spec.borrow_resident_hits:
        argv.append("--borrow-resident-hits")
    if spec.cache_decoded_result_hits:
        argv.append("--cache-decoded-result-hits")
    if spec.prompt is not None:
        argv += [PROMPT_FLAG, spec.prompt]
    return argv


def redacted_argv(argv: Sequence[str]) -> list[str]:
    """The command line as records show it: the prompt is a secret in logs (reference)."""
    out = list(argv)
    for i, word in enumerate(out[:-1]):
        if word == PROMPT_FLAG:
            out[i + 1] = f"<redacted: {len(out[i + 1].encode())} bytes>"
    return out


def expectation(spec: CorrectnessSpec, topology: str) -> HandoffExpectation:
    return HandoffExpectation(
        model_id=spec.model_id,
        payload=spec.payload,  # type: ignore[arg-type]
        topology=topology,
        layer_end=spec.layer_end,
        activation_width=spec.activation_width,
        prefix_tokens=spec.prefix_tokens,
        repeats=spec.repeats,
        package_layer_count=spec.package_layer_count,
    )


@dataclass(frozen=True, slots=True)
class TopologyVerdict:
    """One topology as the journal records it. ``prompt_text`` is kept in memory only."""

    status: str  # pass | failed-process | refused
    reason: str | None = None
    refusal_codes: tuple[str, ...] = ()
    prompt_text: str | None = None
    prompt_sha256: str | None = None
    benchmark_prompt_token_count: int | None = None
    suffix_prefill_matches: bool | None = None
    cache_storage_bytes: int | None = None
    cache_hit_import_ms: tuple[float, ...] = ()
    cache_hit_decode_ms: tuple[float, ...] = ()
    cache_hit_total_ms: float | None = None
    recompute_total_ms: float | None = None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _floats(value: object) -> tuple[float, ...]:
    if not isinstance(value, list):
        return ()
    out = [_float(v) for v in value]
    return tuple(v for v in out if v is not None)


def judge_topology(
    process_problem: str | None, report_bytes: bytes | None, expect: HandoffExpectation
) -> TopologyVerdict:
    """``process_problem``: why the child was not clean (None: it exited 0 in time)."""
    if process_problem is not None:
        return TopologyVerdict(status=FAILED_PROCESS, reason=process_problem)
    if report_bytes is None:
        return TopologyVerdict(
            status=FAILED_PROCESS, reason=f"the tool exited 0 but wrote no {REPORT_NAME}"
        )
    try:
        report: Any = json.loads(report_bytes)
    except ValueError as exc:
        return TopologyVerdict(status=REFUSED, reason=f"{REPORT_NAME} is not JSON: {exc}")
    if not isinstance(report, Mapping):
        return TopologyVerdict(status=REFUSED, reason=f"{REPORT_NAME} is not a JSON object")
    refusals = handoff_report_refusals(report, expect)
    text = report.get("benchmark_prompt_text")
    prompt = text if isinstance(text, str) else None
    suffix = report.get("suffix_prefill_matches")
    figures: dict[str, Any] = {
        "prompt_sha256": hashlib.sha256(prompt.encode()).hexdigest() if prompt else None,
        "benchmark_prompt_token_count": _int(report.get("benchmark_prompt_token_count")),
        "suffix_prefill_matches": suffix if isinstance(suffix, bool) else None,
        "cache_storage_bytes": _int(report.get("cache_storage_bytes")),
        "cache_hit_import_ms": _floats(report.get("cache_hit_import_ms")),
        "cache_hit_decode_ms": _floats(report.get("cache_hit_decode_ms")),
        "cache_hit_total_ms": _float(report.get("cache_hit_total_ms")),
        "recompute_total_ms": _float(report.get("recompute_total_ms")),
    }
    if refusals:
        return TopologyVerdict(
            status=REFUSED,
            reason="; ".join(r.message for r in refusals)[:2000],
            refusal_codes=tuple(r.code for r in refusals),
            **figures,
        )
    return TopologyVerdict(status=PASS, prompt_text=prompt, **figures)


@dataclass(frozen=True, slots=True)
class StageVerdict:
    status: str  # completed | failed-or-incomplete | not-run
    reason: str | None = None
    prompt_text: str | None = None
    prompt_sha256: str | None = None
    prompt_token_count: int | None = None
    suffix_prefill_matches: bool | None = None


def judge_stage(planned: Sequence[str], ran: Sequence[tuple[str, TopologyVerdict]]) -> StageVerdict:
    """Accepted only with one row per planned topology, each passed, one shared prompt."""
    suffix = [v.suffix_prefill_matches for _, v in ran]
    suffix_all = all(s is True for s in suffix) if suffix and None not in suffix else None
    if [name for name, _ in ran] != list(planned) or not planned:
        return StageVerdict(STAGE_FAILED, "correctness_topologies_incomplete")
    failed = [(name, v) for name, v in ran if v.status != PASS]
    if failed:
        name, verdict = failed[0]
        kind = (
            "correctness_process_refused"
            if verdict.status == FAILED_PROCESS
            else "correctness_report_refused"
        )
        return StageVerdict(
            STAGE_FAILED,
            f"{kind}: {name}: {verdict.reason}"[:2000],
            suffix_prefill_matches=suffix_all,
        )
    texts = {v.prompt_text for _, v in ran}
    first = ran[0][1]
    if len(texts) != 1 or not first.prompt_text:
        return StageVerdict(
            STAGE_FAILED,
            "correctness_prompt_disagrees: the topologies accepted different benchmark prompts",
            suffix_prefill_matches=suffix_all,
        )
    return StageVerdict(
        STAGE_COMPLETED,
        None,
        prompt_text=first.prompt_text,
        prompt_sha256=first.prompt_sha256,
        prompt_token_count=first.benchmark_prompt_token_count,
        suffix_prefill_matches=suffix_all,
    )
