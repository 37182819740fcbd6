"""Helpers several test modules share (they were in test_cli_validate.py)."""

from __future__ import annotations

from typing import Any

from cache_family.schemas.examples import example_operator, example_plan

C40 = "c0ffee" * 6 + "c0ff"


def valid_document() -> dict[str, Any]:
    document = example_operator(
        example_plan(
            "/data/hf/hub",
            cases=["llama", "qwen3_dense"],
            prefix_tokens=128,
            n_gpu_layers=0,
            cache_hit_repeats=3,
            concurrency=[1, 2, 4],
        ),
        correctness="/tools/skippy-correctness",
        stage_server="/tools/skippy",
        native_server="/tools/native/bin/llama-server",
        artifact_tool=None,
        native_build="/tools/native",
        old_source_commit=C40,
        new_source_commit=C40,
        native_source_commit=C40,
        environment={"OMP_NUM_THREADS": "4"},
        execution_seconds=3600,
        cell_seconds=600,
        request_timeout_ms=60000,
        preparation_seconds=600,
    )
    del document["toolkit_directories"]  # an optional member may be left out
    return document
