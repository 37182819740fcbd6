"""The ``state-handoff.json`` report: the reference's members plus informative extras.

The verdict is decided here from what the session measured; the report is published
atomically at a fresh path, so a reader never sees half of it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from cache_family.oracles import llama_bindings, native_build
from cache_family.oracles.correctness.session import HandoffArgs, Measured
from cache_family.states.handoff import MODE
from cache_family.system.publish import publish_fresh

#: A hit's logits against an uninterrupted decode with the same batch split (K tokens, then
#: the suffix): the handoff is exact, so only float noise is allowed (measured: 0.0).
HIT_LOGITS_TOLERANCE: Final = 1e-5
EVIDENCE: Final = "reference-oracle"


def _mean(values: Sequence[float]) -> float:
    total = 0.0
    for value in values:
        total += value
    return total / len(values) if values else 0.0


def build_report(args: HandoffArgs, seen: Measured, failure: str | None) -> dict[str, Any]:
    """The report, in the reference's members plus informative extras."""
    repeats_done = len(seen.hit_tokens)
    # A hit is judged against what the same computation gives without a handoff (the K-token
    # prefix, then the suffix); whether that split decode also picks the one-batch recompute's
    # token is the suffix-prefill capability, reported apart: on a tiny random model a near tie
    # between two logits can flip it with no cache involved.
    token_ok = (
        repeats_done == args.repeats
        and seen.split_token is not None
        and all(t == seen.split_token for t in seen.hit_tokens)
    )
    done = repeats_done == args.repeats
    logits_ok = done and all(d <= HIT_LOGITS_TOLERANCE for d in seen.split_diffs)
    split_ok = seen.split_token is not None and seen.split_token == seen.baseline_token
    recompute_ok = bool(seen.recompute_tokens) and all(
        t == seen.baseline_token for t in seen.recompute_tokens
    )
    matches = token_ok and logits_ok and recompute_ok
    reason = failure
    if reason is None and not matches:
        broken = [
            name
            for name, ok in (
                ("predicted_token", token_ok),
                ("cache_hit_logits", logits_ok),
                ("recompute_token", recompute_ok),
            )
            if not ok
        ]
        reason = f"mismatch: the {', '.join(broken)} check failed"
    pairs = [i + d for i, d in zip(seen.import_ms, seen.decode_ms, strict=True)]
    benchmark = seen.benchmark
    pin = native_build.source_pin()
    report: dict[str, Any] = {
        "mode": MODE,
        "status": "pass" if reason is None else "fail",
        "reason": reason,
        "matches": matches,
        "predicted_token_matches": token_ok,
        "cache_hit_matches": logits_ok,
        "suffix_prefill_matches": split_ok,
        "model_identity": {
            "model_id": args.model_id,
            "model_path": str(args.model),
            "load_mode": args.load_mode,
            **seen.model_facts,
        },
        "state_payload_kind": args.payload,
        "topology": args.topology,
        "stage_index": args.stage_index,
        "layer_start": args.layer_start_state,
        "layer_end": args.layer_end_state,
        "model_layer_end": args.layer_end,
        "state_scope": "all-layers",
        "requested_prefix_token_count": args.prefix_tokens,
        "benchmark_prompt_token_count": len(benchmark.tokens) if benchmark else 0,
        "prompt_token_count": benchmark.prompt_token_count if benchmark else 0,
        "benchmark_prompt_text": benchmark.text if benchmark else "",
        "activation_width": args.activation_width,
        "cache_hit_repeats": args.repeats,
        "cache_hit_import_ms": seen.import_ms,
        "cache_hit_decode_ms": seen.decode_ms,
        "cache_hit_total_ms": _mean(pairs),
        "recompute_total_ms": _mean(seen.recompute_ms),
        "recompute_ms": seen.recompute_ms,
        "baseline_token": seen.baseline_token,
        "cache_hit_tokens": seen.hit_tokens,
        "cache_hit_logits_max_abs_diff": seen.split_diffs,
        "recompute_logits_max_abs_diff": seen.baseline_diffs,
        "cache_hit_logits_tolerance": HIT_LOGITS_TOLERANCE,
        "suffix_prefill_token": seen.split_token,
        "state_bytes": seen.state_bytes,
        "cache_storage_bytes": seen.state_bytes,
        "resident_state_bytes": seen.resident_state_bytes,
        "payload_digest": {"kv_bytes": seen.kv_bytes, "recurrent_bytes": seen.recurrent_bytes},
        "payload_sha256": seen.payload_sha256,
        "state_export_ms": seen.export_ms,
        "borrowed_resident_hits": repeats_done if args.payload == "resident-kv" else 0,
        "native_seq_remapped": args.payload == "resident-kv",
        "source_native_seq_id": 0,
        "restore_native_seq_id": 1 if args.payload == "resident-kv" else 0,
        "options": {
            "borrow_resident_hits": args.borrow_resident_hits,
            "cache_decoded_result_hits": args.cache_decoded_result_hits,
            "runtime_lane_count": args.lanes,
            "n_gpu_layers": args.n_gpu_layers,
            "ctx_size": args.ctx_size,
            "stage_server_bin": str(args.stage_server_bin),
            "source_bind_addr": args.source_bind_addr,
            "restore_bind_addr": args.restore_bind_addr,
        },
        "fault_injection": seen.fault_injection,
        "package": seen.package,
        "evidence": EVIDENCE,
        "oracle": {
            "implementation": "cache-family-bench reference oracle, in-process llama.cpp",
            "llama_cpp_commit": pin.llama_cpp_commit,
            "bindings": llama_bindings.requirement(),
        },
        # After the reference's members and the earlier extras, so their order stays.
        "threads": seen.threads.count,
        "threads_source": seen.threads.source,
    }
    return report


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Publish the report atomically at a fresh path (a reader never sees half of it)."""
    publish_fresh(str(path), (json.dumps(report, indent=2, allow_nan=False) + "\n").encode())


def _finite(report: dict[str, Any]) -> dict[str, Any]:
    """JSON has no infinity: a diverged logits difference is reported as null."""
    for member in ("cache_hit_logits_max_abs_diff", "recompute_logits_max_abs_diff"):
        report[member] = [d if np.isfinite(d) else None for d in report[member]]
    return report
