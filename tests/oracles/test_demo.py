"""The demo is the mission: the wrapper's whole sequence on the real parts, with its plans
chosen through the operator input and the wrapper's corpus variable only."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cache_family.console import bench_sequence
from cache_family.oracles.demo import (
    DEFAULT_PLAN,
    PLANS,
    bench_environment,
    corpus_subset,
    demo_steps,
    main,
)
from cache_family.schemas.catalog import packaged_catalog
from cache_family.schemas.corpus import default_corpus_path
from cache_family.schemas.examples import example_operator, example_plan
from cache_family.schemas.operator import validate_operator_object


def test_the_quick_plan_is_a_few_families_and_one_use_case() -> None:
    quick = PLANS["quick"]
    assert 2 <= len(quick.cases) <= 3 and quick.use_cases is not None
    assert len(json.loads(corpus_subset(quick.use_cases))["use_cases"]) == 1
    assert PLANS[DEFAULT_PLAN].cases == ()  # the default plans every family


@pytest.mark.parametrize("name", sorted(PLANS))
def test_each_plan_is_an_operator_input_the_validator_accepts(name: str) -> None:
    plan = PLANS[name]
    keys = {preset.key for preset in packaged_catalog().catalog.presets}
    assert set(plan.cases) <= keys
    document = example_operator(example_plan(cases=list(plan.cases)))
    assert validate_operator_object(document).plan.cases == list(plan.cases)


def test_the_corpus_subset_keeps_the_checked_in_entries_byte_for_byte() -> None:
    full = json.loads(Path(default_corpus_path()).read_bytes())
    assert json.loads(corpus_subset(None)) == full
    [kept] = json.loads(corpus_subset(("text_to_sql",)))["use_cases"]
    assert kept == next(u for u in full["use_cases"] if u["key"] == "text_to_sql")


def test_the_demo_overrides_every_wrapper_variable_the_caller_set(tmp_path: Path) -> None:
    caller = {
        "PATH": "/usr/bin",
        "MESH_LLM_AUTOMATION_BIN": "/elsewhere/runner",
        "SKIPPY_CACHE_USECASE_CORPUS": "/elsewhere/corpus.json",
        "LLAMA_PARALLEL": "8",
        "SKIPPY_CACHE_BUILD_OUTPUT": "/elsewhere/tools",
    }
    env = bench_environment(caller, tmp_path / "operator.json", tmp_path / "c.json", "run-1")
    assert env == {
        "PATH": "/usr/bin",
        "SKIPPY_CACHE_OPERATOR_INPUT": str(tmp_path / "operator.json"),
        "SKIPPY_CACHE_USECASE_CORPUS": str(tmp_path / "c.json"),
        "SKIPPY_CACHE_SKIP_BUILD": "1",
        "SKIPPY_CACHE_RUN_ID": "run-1",
    }


def test_after_the_wrapper_and_its_run_reports_each_run_is_replayed(tmp_path: Path) -> None:
    steps, wrote = demo_steps(str(tmp_path))
    runner = bench_sequence.default_runner()
    assert [step.argv[len(runner) :] for step in steps] == [
        ("replay", f"{tmp_path}/full-gguf"),
        ("replay", f"{tmp_path}/use-cases"),
    ]
    assert wrote == ()  # the wrapper's own closing lines name the run reports


def test_an_existing_output_is_refused_with_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert [line.split(":")[1].strip() for line in err[-3:]] == ["failed", "evidence", "next"]


@pytest.mark.native
def test_the_demo_runs_the_wrapper_end_to_end_and_prints_where_the_reports_are(
    demo_standard: Path,
) -> None:
    stdout = (demo_standard / "demo-stdout.txt").read_text().splitlines()
    assert stdout[-7:] == [
        f"Wrote raw full-GGUF results: {demo_standard}/full-gguf/production-cache-bench.json",
        f"Wrote raw use-case results: {demo_standard}/use-cases/production-cache-bench.json",
        f"Wrote README tables: {demo_standard}/readme-tables.md",
        f"Wrote run report: {demo_standard}/full-gguf/report.html",
        f"Wrote run report: {demo_standard}/use-cases/report.html",
        # The workload run (not in --quick): an overlap and an open-loop sweep.
        f"Wrote run report: {demo_standard}/workloads/report.html",
        # One full-GGUF row on the trained Gemma 3 270M, every host arm on a short ladder.
        f"Wrote run report: {demo_standard}/real/report.html",
    ]
    tables = (demo_standard / "readme-tables.md").read_text()
    for heading in ("Full-GGUF llama-server vs Skippy", "Use-Case Benchmark Matrix"):
        assert f"### {heading}" in tables
    assert "| Tool calling |" in tables  # the one use case of the plan
    for run in ("full-gguf", "use-cases", "workloads"):
        assert (demo_standard / run / "report.html").is_file()
        assert list((demo_standard / run / "plots").glob("*.svg"))
    # Every step exited 0, the replays last (after report-run, so they also regenerated and
    # compared the report files): replay exits 0 only when everything is identical.
    log = (demo_standard / bench_sequence.STEP_LOG).read_text()
    assert re.findall(r" ([a-z-]+(?: [a-z-]+)?): exit (\d+)$", log, re.M) == [
        (name, "0")
        for name in (
            "prepare-full", "run full-gguf", "prepare-use-cases", "run use-cases", "report",
            "report-run full-gguf", "report-run use-cases", "replay full-gguf",
            "replay use-cases", "prepare-full workloads", "run workloads",
            "report-run workloads", "replay workloads", "prepare-full real", "run real",
            "report-run real", "replay real",
        )
    ]  # fmt: skip
    assert "demo: done in " in (demo_standard / "demo-stderr.txt").read_text()
    real = json.loads((demo_standard / "real" / "cache-family-matrix.json").read_text())
    assert real["status"] == "completed" and not real["catalog"]["synthetic"]
    [row] = real["rows"]
    receipt = json.loads((demo_standard / "real" / row["result"]["evidence"]).read_text())
    assert [o["arm"] for o in receipt["observations"]] == [
        "native-serial", "native-concurrent", "skippy-old", "skippy-new",
    ]  # fmt: skip
    assert receipt["evidence_class"].startswith("real model hugginllam/gemma-3-270m")
    operator = json.loads((demo_standard / "operator.json").read_text())
    assert operator["plan"]["old_server"]["path"].endswith("/skippy-prefix-reuse-off")
    assert operator["plan"]["new_server"]["path"].endswith("/skippy")


def test_quiet_leaves_out_the_step_lines(tmp_path: Path) -> None:
    plan = bench_sequence.plan_bench(
        str(tmp_path),
        {"SKIPPY_CACHE_OPERATOR_INPUT": __file__, "SKIPPY_CACHE_SKIP_BUILD": "1"},
        quiet=True,
    )
    runs = [step.argv for step in plan.steps if step.name.startswith("run ")]
    assert len(runs) == 2 and all(argv[-1] == "--quiet" for argv in runs)
