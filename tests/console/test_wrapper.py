"""The wrapper (scripts/skippy-cache-family-bench.sh and `cache-family bench`): order, argv,
environment contract and exit-code propagation, against a scripted fake runner.

Both entry points run as real child processes; the runner is the scripted fake
``fake_hosts/fake_bench_runner_scripted.py`` given as MESH_LLM_AUTOMATION_BIN.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from cache_family.console import bench_sequence
from cache_family.console.bench_sequence import (
    BenchPlan,
    Step,
    default_runner,
    plan_bench,
    run_bench,
)
from cache_family.schemas.corpus import default_corpus_path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "skippy-cache-family-bench.sh"
FAKE = (
    Path(__file__).resolve().parents[1] / "support" / "fake_hosts" / "fake_bench_runner_scripted.py"
)
ENTRIES = ("script", "python")


class Fakes:
    """A directory holding the scripted runner (and a scripted `just`) and their call log."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "fakes"
        self.dir.mkdir()
        source = FAKE.read_text()
        for name in ("runner", "just"):
            path = self.dir / name
            path.write_text(f"#!{sys.executable}\n{source}")
            path.chmod(path.stat().st_mode | stat.S_IXUSR)
        self.runner = str(self.dir / "runner")

    def script(self, **fault: object) -> None:
        (self.dir / "script.json").write_text(json.dumps(fault))

    def calls(self) -> list[dict[str, object]]:
        log = self.dir / "calls.jsonl"
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines()]

    def argvs(self) -> list[list[str]]:
        return [call["argv"] for call in self.calls()]  # type: ignore[misc]


@pytest.fixture
def fakes(tmp_path: Path) -> Fakes:
    return Fakes(tmp_path)


@pytest.fixture
def operator(tmp_path: Path) -> str:
    path = tmp_path / "operator.json"
    path.write_text("{}")  # the scripted runner never reads it
    return str(path)


def base_env(fakes: Fakes, operator: str, **extra: str) -> dict[str, str]:
    env = {
        "PATH": f"{fakes.dir}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
        "HOME": os.environ.get("HOME", "/root"),
        "MESH_LLM_AUTOMATION_BIN": fakes.runner,
        "SKIPPY_CACHE_OPERATOR_INPUT": operator,
        "SKIPPY_CACHE_SKIP_BUILD": "1",
    }
    env.update(extra)
    return env


def bench(
    entry: str, env: dict[str, str], *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    if entry == "script":
        argv = ["bash", str(SCRIPT), *args]
    else:
        argv = [sys.executable, "-m", "cache_family.cli", "bench", *args]
    return subprocess.run(
        argv, env=env, cwd=cwd, capture_output=True, text=True, check=False, timeout=300
    )


def expected_runner_argvs(
    out: str, operator: str, corpus: str, common: list[str]
) -> list[list[str]]:
    return [
        ["automation", "cache-family-run", "prepare-full", "--input", operator,
         "--output", f"{out}/full-input", *common],
        ["automation", "cache-family-run", "--input", f"{out}/full-input/cache-family-input.json",
         "--output", f"{out}/full-gguf"],
        ["automation", "cache-family-run", "prepare-use-cases", "--input", operator,
         "--output", f"{out}/usecase-input", *common],
        ["automation", "cache-family-run", "--input",
         f"{out}/usecase-input/cache-family-input.json", "--output", f"{out}/use-cases"],
        ["automation", "cache-family-report",
         "--input", f"{out}/full-gguf/production-cache-bench.json",
         "--input", f"{out}/use-cases/production-cache-bench.json",
         "--use-case-corpus", corpus, "--output", f"{out}/readme-tables.md"],
        ["report-run", f"{out}/full-gguf"],
        ["report-run", f"{out}/use-cases"],
    ]  # fmt: skip


def defaults(corpus: str) -> list[str]:
    return [
        "--use-case-corpus", corpus, "--prefix-tokens", "128", "--runtime-lane-count", "1",
        "--llama-parallel", "1", "--llama-repeats", "3", "--cache-hit-repeats", "3",
    ]  # fmt: skip


def assert_failure_block(stderr: str) -> None:
    """Every exit path but success says what failed, where the evidence is, what to do next."""
    lines = [line for line in stderr.splitlines() if line.startswith("bench: ")]
    tail = lines[-3:]
    assert [line.split(":", 2)[1].strip() for line in tail] == ["failed", "evidence", "next"], (
        stderr
    )
    assert all(len(line.split(":", 2)[2].strip()) > 0 for line in tail)


@pytest.mark.parametrize("entry", ENTRIES)
def test_runs_the_steps_in_order_with_the_reference_argv_and_reports_each_run(
    entry: str, fakes: Fakes, operator: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = bench(entry, base_env(fakes, operator), str(out))
    assert result.returncode == 0, result.stderr
    corpus = default_corpus_path()
    assert fakes.argvs() == expected_runner_argvs(str(out), operator, corpus, defaults(corpus))
    assert result.stdout.splitlines() == [
        f"Wrote {out}/readme-tables.md",  # the report step's own line
        # report-run's own lines, one run after the other
        f"Wrote {out}/full-gguf/report.md",
        f"Wrote {out}/full-gguf/report.html",
        f"Wrote {out}/use-cases/report.md",
        f"Wrote {out}/use-cases/report.html",
        f"Wrote raw full-GGUF results: {out}/full-gguf/production-cache-bench.json",
        f"Wrote raw use-case results: {out}/use-cases/production-cache-bench.json",
        f"Wrote README tables: {out}/readme-tables.md",
        f"Wrote run report: {out}/full-gguf/report.html",
        f"Wrote run report: {out}/use-cases/report.html",
    ]
    assert (out / "readme-tables.md").read_text() == "scripted tables\n"
    for run in ("full-gguf", "use-cases"):
        assert "<svg" in (out / run / "report.html").read_text()
        assert (out / run / "report.md").is_file()
        assert list((out / run / "plots").glob("*.svg"))
    log = (out / "bench-steps.log").read_text()
    assert [m for m in re.findall(r" (\S+(?: \S+)?): exit (\d+)", log)] == [
        ("prepare-full", "0"),
        ("run full-gguf", "0"),
        ("prepare-use-cases", "0"),
        ("run use-cases", "0"),
        ("report", "0"),
        ("report-run full-gguf", "0"),
        ("report-run use-cases", "0"),
    ]


@pytest.mark.parametrize("entry", ENTRIES)
def test_overrides_and_corpus_reach_both_preparations_and_the_report(
    entry: str, fakes: Fakes, operator: str, tmp_path: Path
) -> None:
    corpus = str(tmp_path / "my-corpus.json")
    env = base_env(
        fakes,
        operator,
        SKIPPY_CACHE_USECASE_CORPUS=corpus,
        PREFIX_TOKENS="64",
        RUNTIME_LANE_COUNT="2",
        LLAMA_PARALLEL="4",
        LLAMA_REPEATS="5",
        CACHE_HIT_REPEATS="",  # empty means the default, as ${VAR:-3}
    )
    out = tmp_path / "out"
    result = bench(entry, env, str(out))
    assert result.returncode == 0, result.stderr
    common = [
        "--use-case-corpus", corpus, "--prefix-tokens", "64", "--runtime-lane-count", "2",
        "--llama-parallel", "4", "--llama-repeats", "5", "--cache-hit-repeats", "3",
    ]  # fmt: skip
    assert fakes.argvs() == expected_runner_argvs(str(out), operator, corpus, common)


def test_native_output_tokens_reach_both_preparations_only_when_set(
    fakes: Fakes, operator: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    env = base_env(fakes, operator, NATIVE_OUTPUT_TOKENS="16")
    result = bench("python", env, str(out))
    assert result.returncode == 0, result.stderr
    corpus = default_corpus_path()
    common = [*defaults(corpus), "--native-output-tokens", "16"]
    assert fakes.argvs() == expected_runner_argvs(str(out), operator, corpus, common)


@pytest.mark.parametrize(
    ("entry", "failing"), [("script", 2), *[("python", n) for n in range(1, 8)]]
)
def test_a_failing_step_stops_the_sequence_with_its_exit_code(
    entry: str, failing: int, fakes: Fakes, operator: str, tmp_path: Path
) -> None:
    code = 40 + failing
    fakes.script(fail_call=failing, exit=code)
    out = tmp_path / "out"
    result = bench(entry, base_env(fakes, operator), str(out))
    assert result.returncode == code
    assert len(fakes.calls()) == failing  # nothing after the failing step ran
    assert "Wrote raw" not in result.stdout
    assert_failure_block(result.stderr)
    assert f"exited with code {code}" in result.stderr
    assert str(out / "bench-steps.log") in result.stderr


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_run_without_production_json_stops_before_the_report(
    entry: str, fakes: Fakes, operator: str, tmp_path: Path
) -> None:
    fakes.script(no_production=True)
    out = tmp_path / "out"
    result = bench(entry, base_env(fakes, operator), str(out))
    assert result.returncode == 3
    assert [argv[1] for argv in fakes.argvs()] == ["cache-family-run"] * 4
    assert_failure_block(result.stderr)
    assert f"{out}/full-gguf/production-cache-bench.json" in result.stderr
    assert not (out / "readme-tables.md").exists()


def test_a_preparation_without_its_prepared_input_stops_before_the_run(
    fakes: Fakes, operator: str, tmp_path: Path
) -> None:
    fakes.script(no_prepared=True)
    out = tmp_path / "out"
    result = bench("python", base_env(fakes, operator), str(out))
    assert result.returncode == 3
    assert len(fakes.calls()) == 1
    assert_failure_block(result.stderr)
    assert f"{out}/full-input/cache-family-input.json" in result.stderr
    assert f"read the observations and logs in {out}/full-input" in result.stderr


@pytest.mark.parametrize(
    ("entry", "runner"),
    [
        ("script", ""),
        ("script", "relative/runner"),
        ("python", ""),
        ("python", "relative/runner"),
        ("python", "/nonexistent/runner"),
        ("python", "NOT_EXECUTABLE"),
        ("python", "DIRECTORY"),
    ],
)
def test_automation_bin_set_at_all_must_be_an_absolute_executable(
    entry: str, runner: str, fakes: Fakes, operator: str, tmp_path: Path
) -> None:
    if runner == "NOT_EXECUTABLE":
        runner = str(tmp_path / "plain")
        Path(runner).write_text("#!/bin/sh\n")
    elif runner == "DIRECTORY":
        runner = str(tmp_path)
    out = tmp_path / "out"
    result = bench(entry, base_env(fakes, operator, MESH_LLM_AUTOMATION_BIN=runner), str(out))
    assert result.returncode == 1
    assert "MESH_LLM_AUTOMATION_BIN" in result.stderr
    assert_failure_block(result.stderr)
    assert not out.exists()  # refused before anything was created


@pytest.mark.parametrize(
    ("entry", "value"),
    [
        ("script", None),
        ("script", "operator.json"),
        ("python", None),
        ("python", ""),
        ("python", "operator.json"),
        ("python", "/nonexistent/operator.json"),
        ("python", "DIRECTORY"),
    ],
)
def test_operator_input_must_be_an_absolute_regular_file(
    entry: str, value: str | None, fakes: Fakes, operator: str, tmp_path: Path
) -> None:
    env = base_env(fakes, operator)
    if value is None:
        del env["SKIPPY_CACHE_OPERATOR_INPUT"]
    else:
        env["SKIPPY_CACHE_OPERATOR_INPUT"] = str(tmp_path) if value == "DIRECTORY" else value
    out = tmp_path / "out"
    result = bench(entry, env, str(out), cwd=tmp_path)  # operator.json exists relative to cwd
    assert result.returncode == 1
    assert "SKIPPY_CACHE_OPERATOR_INPUT" in result.stderr
    assert_failure_block(result.stderr)
    assert fakes.calls() == []
    assert not out.exists()


@pytest.mark.parametrize(
    ("entry", "skip", "build_output"),
    [
        ("script", None, None),
        ("python", None, None),
        ("python", "0", None),
        ("python", None, "TOOLS"),
    ],
)
def test_builds_the_tools_first_unless_skipped(
    entry: str,
    skip: str | None,
    build_output: str | None,
    fakes: Fakes,
    operator: str,
    tmp_path: Path,
) -> None:
    env = base_env(fakes, operator)
    del env["SKIPPY_CACHE_SKIP_BUILD"]
    if skip is not None:
        env["SKIPPY_CACHE_SKIP_BUILD"] = skip
    out = tmp_path / "out"
    tools = str(tmp_path / "my-tools") if build_output else f"{out}/tools"
    if build_output:
        env["SKIPPY_CACHE_BUILD_OUTPUT"] = tools
    result = bench(entry, env, str(out))
    assert result.returncode == 0, result.stderr
    calls = fakes.calls()
    assert [call["role"] for call in calls] == ["just"] + ["runner"] * 7
    assert calls[0]["argv"] == [
        "--justfile",
        str(ROOT / "justfile"),
        "skippy-workload-oracles-build",
        tools,
    ]


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_failing_build_stops_before_preparation(
    entry: str, fakes: Fakes, operator: str, tmp_path: Path
) -> None:
    env = base_env(fakes, operator, SKIPPY_CACHE_SKIP_BUILD="")
    fakes.script(fail_call=1, exit=9)
    out = tmp_path / "out"
    result = bench(entry, env, str(out))
    assert result.returncode == 9
    assert [call["role"] for call in fakes.calls()] == ["just"]
    assert_failure_block(result.stderr)
    assert "SKIPPY_CACHE_SKIP_BUILD=1" in result.stderr  # the way around a build of one's own


@pytest.mark.parametrize("entry", ENTRIES)
def test_run_id_names_the_default_output_directory(entry: str, fakes: Fakes, operator: str) -> None:
    run_id = f"test-{uuid.uuid4().hex}"
    out = Path(f"/tmp/skippy-cache-family-bench-{run_id}")
    try:
        result = bench(entry, base_env(fakes, operator, SKIPPY_CACHE_RUN_ID=run_id))
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[-3:] == [
            f"Wrote README tables: {out}/readme-tables.md",
            f"Wrote run report: {out}/full-gguf/report.html",
            f"Wrote run report: {out}/use-cases/report.html",
        ]
        assert (out / "readme-tables.md").is_file()
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_without_run_id_the_output_directory_is_timestamped(fakes: Fakes, operator: str) -> None:
    result = bench("python", base_env(fakes, operator))
    last = result.stdout.splitlines()[-1] if result.stdout else ""
    match = re.fullmatch(
        r"Wrote run report: (/tmp/skippy-cache-family-bench-\d{8}-\d{6})/use-cases/report\.html",
        last,
    )
    try:
        assert result.returncode == 0, result.stderr
        assert match is not None, result.stdout
    finally:
        if match is not None:
            shutil.rmtree(match.group(1), ignore_errors=True)


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_relative_output_directory_is_made_absolute_and_may_exist(
    entry: str, fakes: Fakes, operator: str, tmp_path: Path
) -> None:
    (tmp_path / "rel-out").mkdir()  # mkdir -p semantics: an existing directory is fine
    result = bench(entry, base_env(fakes, operator), "rel-out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path.resolve() / "rel-out"
    assert fakes.argvs()[0][6] == f"{out}/full-input"


def test_an_output_directory_that_cannot_be_created_is_a_precondition_failure(
    fakes: Fakes, operator: str, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "out"
    result = bench("python", base_env(fakes, operator), str(out))
    assert result.returncode == 1
    assert_failure_block(result.stderr)
    assert f"cannot create the output directory {out}" in result.stderr
    assert fakes.calls() == []


def test_steps_get_an_explicit_environment(fakes: Fakes, operator: str, tmp_path: Path) -> None:
    env = base_env(fakes, operator, BENCH_TEST_SECRET="do-not-pass", LANG="C.UTF-8")
    result = bench("python", env, str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    for call in fakes.calls():
        names = call["env"]
        assert "BENCH_TEST_SECRET" not in names  # type: ignore[operator]
        assert "MESH_LLM_AUTOMATION_BIN" not in names  # type: ignore[operator]
        assert "LANG" in names  # type: ignore[operator]


def test_the_default_runner_is_this_interpreters_cache_family(operator: str) -> None:
    plan = plan_bench(
        "/tmp/x", {"SKIPPY_CACHE_OPERATOR_INPUT": operator, "SKIPPY_CACHE_SKIP_BUILD": "1"}
    )
    assert default_runner() == (sys.executable, "-m", "cache_family.cli")
    assert [step.argv[:3] for step in plan.steps] == [default_runner()] * 7


def test_a_real_preparation_refusal_stops_at_step_one(tmp_path: Path) -> None:
    """The real cache-family as runner: preparation refuses an empty operator input (exit 2)."""
    operator = tmp_path / "operator.json"
    operator.write_text("{}")
    env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": os.environ.get("HOME", "/root"),
        "SKIPPY_CACHE_OPERATOR_INPUT": str(operator),
        "SKIPPY_CACHE_SKIP_BUILD": "1",
    }
    out = tmp_path / "out"
    result = bench("python", env, str(out))
    assert result.returncode == 2, result.stderr
    assert "refused: " in result.stderr  # preparation's own refusal lines
    assert_failure_block(result.stderr)
    assert "step 1 of 7 (prepare-full) exited with code 2" in result.stderr
    assert f"cache-family validate --input {operator}" in result.stderr
    assert not (out / "full-gguf").exists()


@pytest.mark.parametrize("entry", ENTRIES)
def test_sigterm_reaches_the_running_step_and_stops_the_sequence(
    entry: str, fakes: Fakes, operator: str, tmp_path: Path
) -> None:
    """A real child: SIGTERM sent to the wrapper alone is forwarded to the running step."""
    fakes.script(hang_call=2)
    argv = (
        ["bash", str(SCRIPT)]
        if entry == "script"
        else [sys.executable, "-m", "cache_family.cli", "bench"]
    )
    with subprocess.Popen(
        [*argv, str(tmp_path / "out")],
        env=base_env(fakes, operator),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "scripted fake: waiting\n"  # step 2 is running
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM  # the step's own end, not the wrapper's
    calls = fakes.calls()
    assert len(calls) == 2
    assert not psutil.pid_exists(int(calls[1]["pid"]))  # type: ignore[call-overload]
    assert "Wrote raw" not in stdout
    assert_failure_block(stderr)


class SignalledWhileStarting:
    """FAULT INJECTION: ``subprocess.Popen`` as the wrapper sees it, with a SIGTERM to the
    wrapper itself arriving while the step is being started (before the wrapper knows it)."""

    def __init__(self) -> None:
        self.real_popen = subprocess.Popen
        self.started: list[subprocess.Popen[bytes]] = []

    def __call__(self, *args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before the next line
        child: subprocess.Popen[bytes] = self.real_popen(*args, **kwargs)  # type: ignore[call-overload]
        self.started.append(child)
        return child


def test_a_signal_while_a_step_is_starting_still_reaches_that_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    popen = SignalledWhileStarting()
    monkeypatch.setattr(bench_sequence.subprocess, "Popen", popen)
    sleeper = (sys.executable, "-c", "import time; time.sleep(120)")
    step = Step(name="hang", argv=sleeper, evidence=str(tmp_path / "none"), next_step="rerun")
    plan = BenchPlan(str(tmp_path / "out"), "run", "corpus", (step, step), ())
    out, err = io.StringIO(), io.StringIO()
    code = run_bench(plan, {"PATH": os.defpath}, out, err, quiet=True)
    assert code == 128 + signal.SIGTERM  # the step ended on the forwarded signal
    [child] = popen.started  # and the sequence stopped there
    assert child.returncode == -signal.SIGTERM
    assert "exited with code 143" in err.getvalue()


@pytest.mark.parametrize("entry", ENTRIES)
def test_quiet_reaches_both_runs_and_leaves_out_the_step_lines(
    entry: str, fakes: Fakes, operator: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = bench(entry, base_env(fakes, operator), str(out), "--quiet")
    assert result.returncode == 0, result.stderr
    runs = [argv for argv in fakes.argvs() if "cache-family-run" in argv and "--quiet" in argv]
    assert [argv[argv.index("--output") + 1] for argv in runs] == [
        f"{out}/full-gguf",
        f"{out}/use-cases",
    ]
    assert all(argv.count("--quiet") == 0 for argv in fakes.argvs() if argv not in runs)
    assert "bench: step" not in result.stderr
    assert result.stdout.splitlines()[-3:] == [
        f"Wrote README tables: {out}/readme-tables.md",
        f"Wrote run report: {out}/full-gguf/report.html",
        f"Wrote run report: {out}/use-cases/report.html",
    ]
