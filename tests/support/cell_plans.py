"""Helpers several test modules share (they were in test_cell_machine_property.py)."""

from __future__ import annotations

import os
from pathlib import Path

from cache_family.schemas.arms import NATIVE_CONCURRENT, NATIVE_SERIAL
from cache_family.schemas.journal import (
    RungPlan,
)
from cache_family.schemas.prepared import HostProfile
from cache_family.states.plans import CellPlan, PromptChoice, pin_targets


def host_profile(root: str) -> HostProfile:
    # The cell copies the binary and the native build before its pin check (the fake hasher
    # then answers for the copies), so both must exist; the fake hosts never execute them.
    Path(root, "build", "lib").mkdir(parents=True, exist_ok=True)
    Path(root, "llama-server").write_text("#!/bin/sh\nexit 0\n")
    return HostProfile(
        schema_version=1,
        host="native-baseline",
        binary=os.path.join(root, "llama-server"),
        binary_sha256="a" * 64,
        source_commit="0" * 40,
        native_build=os.path.join(root, "build"),
        native_build_sha256="b" * 64,
        model=os.path.join(root, "model.gguf"),
        model_sha256="c" * 64,
        artifact=None,
        model_id="tiny",
        layer_end=1,
        ctx_size=256,
        lane_count=2,
        n_gpu_layers=0,
        port=0,
        environment={},
        toolkit_directories={},
        worker={},
        startup_timeout_secs=30,
        execution_timeout_secs=60,
    )


def cell_plan(root: str, index: int, kind: str, profile: HostProfile | None) -> CellPlan:
    arm = NATIVE_SERIAL if kind == "serial" else NATIVE_CONCURRENT
    rungs = (
        (RungPlan(concurrency=1, requests=3),)
        if kind == "serial"
        else (
            RungPlan(concurrency=1, requests=2),
            RungPlan(concurrency=2, requests=3),
        )
    )
    return CellPlan(
        cell_id=f"cell-{index:04d}/{arm.name}",
        cell_dir=f"cell-{index:04d}/{arm.name}",
        row_index=index,
        row_key=f"tiny-p8-{index}",
        arm=arm,
        rungs=rungs,
        output_tokens=4,
        lanes=2,
        ctx_size=512,
        n_gpu_layers=0,
        prefix_tokens=8,
        ttft_slo_ms=2000.0,
        tpot_slo_ms=100.0,
        profile=profile,
        prompt=PromptChoice(
            text="the quick brown fox jumps over the lazy dog",
            source="use-case",
            corpus_path="/corpus.json",
            corpus_sha256="d" * 64,
            entry_key="chat",
        ),
        pins=pin_targets(profile) if profile is not None else (),
    )
