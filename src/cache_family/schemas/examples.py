"""A complete, valid operator input (reference §1) as a plain JSON object, every member given.

The reference example with real hex for placeholders and no paired old/new servers; tests start
from it and change what they test.
"""

from __future__ import annotations

from typing import Any, Final

EXAMPLE_COMMIT: Final = "0123456789abcdef0123456789abcdef01234567"
EXAMPLE_SHA256_COMMIT: Final = "0123456789abcdef" * 4


def example_plan(cache_root: str = "/data/hf/hub", **members: object) -> dict[str, Any]:
    """A valid plan input (reference §2) over ``cache_root``; ``members`` replace or add."""
    plan: dict[str, Any] = {
        "schema_version": 1,
        "cache_root": cache_root,
        "cases": [],
        "use_cases": [],
        "corpus": None,
        "prefix_sweep": [],
        "prefix_tokens": None,
        "n_gpu_layers": None,
        "cache_hit_repeats": None,
        "runtime_lane_count": 1,
        "serving_ctx_size": None,
        "concurrency": [1, 2, 4, 8],
        "concurrent_requests": 16,
        "concurrent_output_tokens": 32,
        "llama_parallel": 1,
        "llama_repeats": 3,
        "ttft_slo_ms": 2000,
        "tpot_slo_ms": 100,
        "skip_llama_server": False,
        "old_server": None,
        "new_server": None,
        "model_sha256": {},
    }
    plan.update(members)
    return plan


def example_operator(plan: dict[str, Any] | None = None, **members: object) -> dict[str, Any]:
    """A valid operator input around ``plan`` (default :func:`example_plan`); ``members``
    replace or add top-level members."""
    document: dict[str, Any] = {
        "schema_version": 1,
        "plan": example_plan() if plan is None else plan,
        "correctness": "/t/cargo/debug/skippy-correctness",
        "stage_server": "/t/cargo/debug/skippy",
        "native_server": "/t/native/bin/llama-server",
        "artifact_tool": "/t/cargo/debug/skippy-package-builder",
        "native_build": "/t/native",
        "old_source_commit": EXAMPLE_COMMIT,
        "new_source_commit": EXAMPLE_COMMIT,
        "native_source_commit": EXAMPLE_SHA256_COMMIT,
        "environment": {"OMP_NUM_THREADS": "8", "LLAMA_STAGE_BACKEND": "cpu"},
        "toolkit_directories": {},
        "execution_seconds": 7200,
        "cell_seconds": 900,
        "request_timeout_ms": 120000,
        "preparation_seconds": 1800,
    }
    document.update(members)
    return document
