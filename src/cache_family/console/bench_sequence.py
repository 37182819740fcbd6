"""`cache-family bench`: both matrices, their combined README tables and each run's report
(``report-run``: report.md, report.html, plots), one step at a time.

This module is the one definition of the wrapper's sequence and environment contract (README,
"The wrapper"); ``scripts/skippy-cache-family-bench.sh`` only sets up ``.venv`` and execs this
command.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import cache_family
from cache_family.console.refusals import say_failed
from cache_family.errors import Refusal, Refused
from cache_family.exit_codes import ExitCode
from cache_family.schemas.corpus import default_corpus_path
from cache_family.system import interrupts

RUNNER_ENV = "MESH_LLM_AUTOMATION_BIN"
OPERATOR_ENV = "SKIPPY_CACHE_OPERATOR_INPUT"
RUN_ID_ENV = "SKIPPY_CACHE_RUN_ID"
SKIP_BUILD_ENV = "SKIPPY_CACHE_SKIP_BUILD"
BUILD_OUTPUT_ENV = "SKIPPY_CACHE_BUILD_OUTPUT"
CORPUS_ENV = "SKIPPY_CACHE_USECASE_CORPUS"

#: (environment variable, preparation option, default): passed to both preparations in order.
PLAN_OVERRIDES: tuple[tuple[str, str, str], ...] = (
    ("PREFIX_TOKENS", "--prefix-tokens", "128"),
    ("RUNTIME_LANE_COUNT", "--runtime-lane-count", "1"),
    ("LLAMA_PARALLEL", "--llama-parallel", "1"),
    ("LLAMA_REPEATS", "--llama-repeats", "3"),
    ("CACHE_HIT_REPEATS", "--cache-hit-repeats", "3"),
)

#: Passed to both preparations only when set (not a reference variable): the native ladder's
#: output tokens per request (``--native-output-tokens``), e.g. the stage arms' length.
NATIVE_OUTPUT_ENV = "NATIVE_OUTPUT_TOKENS"

DEFAULT_OUTPUT_PREFIX = "/tmp/skippy-cache-family-bench-"  # noqa: S108 - the reference's path
RUN_ID_FORMAT = "%Y%m%d-%H%M%S"
STEP_LOG = "bench-steps.log"
PRODUCTION_JSON = "production-cache-bench.json"
PREPARED_JSON = "cache-family-input.json"
TABLES = "readme-tables.md"
#: Each run's report (``report-run``: report.md, report.html and plots/ in the run directory).
RUN_REPORT = "report.html"

#: A wrapper precondition that fails (bad variable, missing tool): the reference's exit 1.
#: A run that exited 0 without the file the report needs: refused during work, output kept.

# Steps get this environment, not the caller's whole one: what the tools, the build (compiler,
# pip) and the live progress display read. Anything else must come through the operator input.
_PASSED_ENV = (
    "PATH",
    "HOME",
    "TMPDIR",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TERM",
    "COLORTERM",
    "NO_COLOR",
    "COLUMNS",
    "PYTHONPATH",
    "CACHE_FAMILY_CACHE",
    "SSL_CERT_FILE",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "CC",
    "CXX",
)


@dataclass(frozen=True, slots=True)
class Step:
    """One command of the sequence, with where its evidence lands and what to do if it fails."""

    name: str
    argv: tuple[str, ...]
    evidence: str
    next_step: str
    cwd: str | None = None
    needs: tuple[str, ...] = ()  # files a previous step must have written
    needs_next: str = ""  # what to do when one of them is missing


@dataclass(frozen=True, slots=True)
class BenchPlan:
    output: str
    run_id: str
    corpus: str
    steps: tuple[Step, ...]
    wrote: tuple[str, ...]  # the closing lines, as the reference prints them


class BenchRefused(Exception):
    """A wrapper precondition failed before any step ran (exit 1, like the reference)."""

    def __init__(self, refusal: Refusal, evidence: str) -> None:
        super().__init__(refusal.line())
        self.refusal = refusal
        self.evidence = evidence


def _refuse(code: str, where: str, message: str, hint: str, evidence: str) -> BenchRefused:
    return BenchRefused(Refusal(code, where, message, hint), evidence)


def repo_root() -> Path:
    """The source checkout this package runs from (its justfile holds the build recipe)."""
    # src/cache_family/__init__.py -> the checkout holding src/
    return Path(cache_family.__file__).resolve().parents[2]


def default_runner() -> tuple[str, ...]:
    """What ``just automation-run`` runs (``.venv/bin/cache-family``), without needing bash."""
    return (sys.executable, "-m", "cache_family.cli")


def _runner(environ: Mapping[str, str]) -> tuple[str, ...]:
    if RUNNER_ENV not in environ:
        return default_runner()
    value = environ[RUNNER_ENV]
    where = f"$env.{RUNNER_ENV}"
    shown = f"{RUNNER_ENV}={value!r}"
    evidence = f"{shown} in this process's environment"
    hint = f"set {RUNNER_ENV} to the absolute path of an executable, or unset it"
    if not value or not os.path.isabs(value):
        raise _refuse(
            "bench.runner.not_absolute", where, f"{shown} is not an absolute path", hint, evidence
        )
    if not os.path.isfile(value) or not os.access(value, os.X_OK):
        raise _refuse(
            "bench.runner.not_executable",
            where,
            f"{shown} is not an existing regular executable file",
            hint,
            value,
        )
    return (value,)


def _operator_input(environ: Mapping[str, str]) -> str:
    value = environ.get(OPERATOR_ENV, "")
    where = f"$env.{OPERATOR_ENV}"
    hint = (
        f"set {OPERATOR_ENV} to the absolute path of an operator JSON file "
        "(README: 'Operator input reference'; `cache-family validate --input FILE` checks one)"
    )
    if not value:
        raise _refuse(
            "bench.operator_input.unset",
            where,
            f"{OPERATOR_ENV} is not set",
            hint,
            f"{OPERATOR_ENV} is unset or empty in this process's environment",
        )
    if not os.path.isabs(value) or not os.path.isfile(value):
        raise _refuse(
            "bench.operator_input.not_a_file",
            where,
            f"{OPERATOR_ENV}={value!r} is not an absolute path of a regular file",
            hint,
            value,
        )
    return value


def _corpus(environ: Mapping[str, str]) -> str:
    chosen = environ.get(CORPUS_ENV)
    if chosen:
        return chosen  # passed verbatim: preparation and the report read and judge it
    try:
        return default_corpus_path()
    except Refused as refused:
        raise BenchRefused(refused.refusals[0], "cache_family/corpus/use-cases.json") from None


def _just(environ: Mapping[str, str]) -> str:
    # The venv's rust-just sits beside this interpreter when the venv is not activated.
    search = os.pathsep.join(
        p for p in (environ.get("PATH", ""), os.path.dirname(sys.executable)) if p
    )
    found = shutil.which("just", path=search)
    if found is None:
        raise _refuse(
            "bench.build.no_just",
            f"$env.{SKIP_BUILD_ENV}",
            "`just` is not on PATH, so the tools cannot be built",
            f"install the dev extras (`./bootstrap`), or build the tools yourself and set "
            f"{SKIP_BUILD_ENV}=1",
            f"PATH={search}",
        )
    return found


def step_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The explicit environment every step runs with."""
    env = {name: environ[name] for name in _PASSED_ENV if name in environ}
    env.setdefault("PATH", os.defpath)
    return env


def plan_bench(
    output_arg: str | None,
    environ: Mapping[str, str],
    *,
    justfile: Path | None = None,
    now: Callable[[], time.struct_time] = time.localtime,
    quiet: bool = False,
) -> BenchPlan:
    """Check the environment contract and lay out the steps; nothing is run or created.
    ``quiet`` is passed to both runs (``run --quiet``)."""
    runner = _runner(environ)
    operator = _operator_input(environ)
    run_id = environ.get(RUN_ID_ENV) or time.strftime(RUN_ID_FORMAT, now())
    output = os.path.abspath(output_arg or f"{DEFAULT_OUTPUT_PREFIX}{run_id}")
    corpus = _corpus(environ)
    common: list[str] = ["--use-case-corpus", corpus]
    for name, flag, default in PLAN_OVERRIDES:
        common += [flag, environ.get(name) or default]
    if environ.get(NATIVE_OUTPUT_ENV):
        common += ["--native-output-tokens", environ[NATIVE_OUTPUT_ENV]]
    run_flags = ("--quiet",) if quiet else ()
    steps: list[Step] = []
    if environ.get(SKIP_BUILD_ENV, "0") != "1":
        tools = environ.get(BUILD_OUTPUT_ENV) or os.path.join(output, "tools")
        justfile = justfile or repo_root() / "justfile"
        if not justfile.is_file():
            raise _refuse(
                "bench.build.no_justfile",
                f"$env.{SKIP_BUILD_ENV}",
                f"{justfile} does not exist: this cache-family is not run from a source checkout",
                f"build the tools with `python -m cache_family.oracles.native_build DIR` and set "
                f"{SKIP_BUILD_ENV}=1",
                str(justfile),
            )
        steps.append(
            Step(
                "build tools",
                (
                    _just(environ),
                    "--justfile",
                    str(justfile),
                    "skippy-workload-oracles-build",
                    tools,
                ),
                tools,
                f"fix what the build printed above and rerun; or build the tools elsewhere and "
                f"rerun with {SKIP_BUILD_ENV}=1",
                cwd=str(justfile.parent),
            )
        )
    fresh = "rerun with another OUTPUT_DIR (each step's directory must not exist yet)"
    for verb, prepared, run_dir in (
        ("prepare-full", "full-input", "full-gguf"),
        ("prepare-use-cases", "usecase-input", "use-cases"),
    ):
        prepared_dir = os.path.join(output, prepared)
        run_out = os.path.join(output, run_dir)
        prepared_json = os.path.join(prepared_dir, PREPARED_JSON)
        steps.append(
            Step(
                verb,
                (*runner, "automation", "cache-family-run", verb, "--input", operator,
                 "--output", prepared_dir, *common),
                prepared_dir,
                f"fix what the refusal above names (`cache-family validate --input {operator}` "
                f"lists every refusal of the operator input), then {fresh}",
            )
        )  # fmt: skip
        steps.append(
            Step(
                f"run {run_dir}",
                (*runner, "automation", "cache-family-run", "--input", prepared_json,
                 "--output", run_out, *run_flags),
                run_out,
                f"read the receipts and logs in {run_out} (`cache-family replay {run_out}` "
                f"verifies them), fix the cause, then {fresh}",
                needs=(prepared_json,),
                needs_next=f"read the observations and logs in {prepared_dir}, then {fresh}",
            )
        )  # fmt: skip
    full_json = os.path.join(output, "full-gguf", PRODUCTION_JSON)
    usecase_json = os.path.join(output, "use-cases", PRODUCTION_JSON)
    tables = os.path.join(output, TABLES)
    report_argv = (
        *runner, "automation", "cache-family-report", "--input", full_json,
        "--input", usecase_json, "--use-case-corpus", corpus, "--output", tables,
    )  # fmt: skip
    steps.append(
        Step(
            "report",
            report_argv,
            tables,
            "fix what the refusal above names, then rerun only this step: "
            + shlex.join(report_argv),
            needs=(full_json, usecase_json),
            needs_next="this cache-family's run does not publish that file yet; "
            "`cache-family report-run RUN_DIR` reports each run from its receipts",
        )
    )
    reports: list[str] = []
    for run_dir in ("full-gguf", "use-cases"):
        run_out = os.path.join(output, run_dir)
        steps.append(
            Step(
                f"report-run {run_dir}",
                (*runner, "report-run", run_out),
                run_out,
                "fix what the refusal above names, then rerun only this step: "
                + shlex.join((*runner, "report-run", run_out)),
            )
        )
        reports.append(f"Wrote run report: {os.path.join(run_out, RUN_REPORT)}")
    return BenchPlan(
        output=output,
        run_id=run_id,
        corpus=corpus,
        steps=tuple(steps),
        wrote=(
            f"Wrote raw full-GGUF results: {full_json}",
            f"Wrote raw use-case results: {usecase_json}",
            f"Wrote README tables: {tables}",
            *reports,
        ),
    )


class _Signals:
    """Forwards SIGINT/SIGTERM to the running step, which cleans up and exits on its own.

    A step in our process group already got a terminal's Ctrl-C; a second copy is what a
    second Ctrl-C would send anyway, and a SIGTERM sent to this process alone must reach it.
    """

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        # The one latch (system/interrupts.py); each signal is forwarded as it arrives.
        self._latch = interrupts.Latch(on_signal=lambda signum: self.forward())
        self._installed = self._latch.installed()

    @property
    def received(self) -> int | None:
        """The last signal received, if any."""
        return self._latch.last_signum

    def forward(self) -> None:
        """Send the signal received (if any) to the running step (if any)."""
        child = self.child
        if self.received is not None and child is not None and child.poll() is None:
            child.send_signal(self.received)

    def __enter__(self) -> _Signals:
        self._installed.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._installed.__exit__(None, None, None)


def _exit_code(returncode: int) -> int:
    """A child killed by signal N exits 128 + N, as a shell reports it."""
    return 128 - returncode if returncode < 0 else returncode


def _log(path: str, line: str) -> None:
    # The log is evidence, not a step: a full disk must not end a run it could only describe.
    try:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {line}\n")
    except OSError as exc:
        print(f"bench: warning: cannot append to {path}: {exc.strerror or exc}", file=sys.stderr)


def run_bench(
    plan: BenchPlan,
    environ: Mapping[str, str],
    out: TextIO,
    err: TextIO,
    *,
    quiet: bool = False,
) -> int:
    """Run the steps in order, stop at the first failure with its exit code; ``quiet``
    leaves out the line naming each step as it starts (failures are always printed)."""
    log = os.path.join(plan.output, STEP_LOG)
    try:
        os.makedirs(plan.output, exist_ok=True)
    except OSError as exc:
        say_failed(
            err,
            "bench",
            f"cannot create the output directory {plan.output}: {exc.strerror or exc}",
            plan.output,
            "pass a writable OUTPUT_DIR as the first argument",
        )
        return ExitCode.PRECONDITION
    _log(log, f"bench run id {plan.run_id}: {len(plan.steps)} steps into {plan.output}")
    env = step_environment(environ)
    total = len(plan.steps)
    with _Signals() as signals:
        for number, step in enumerate(plan.steps, start=1):
            where = f"step {number} of {total} ({step.name})"
            if signals.received is not None:
                _log(log, f"{step.name}: not started, interrupted")
                say_failed(
                    err,
                    "bench",
                    f"interrupted before {where}",
                    f"{plan.output}; commands and exit codes in {log}",
                    "rerun with another OUTPUT_DIR when ready",
                )
                return 128 + signals.received
            missing = [path for path in step.needs if not os.path.isfile(path)]
            if missing:
                _log(log, f"{step.name}: not started, missing {' '.join(missing)}")
                say_failed(
                    err,
                    "bench",
                    f"{where} not started: the previous step exited 0 but did not write "
                    f"{missing[0]}",
                    f"{os.path.dirname(missing[0])}; commands and exit codes in {log}",
                    step.needs_next,
                )
                return ExitCode.MISSING_OUTPUT
            if not quiet:
                print(f"bench: {where}: {shlex.join(step.argv)}", file=err, flush=True)
            _log(log, f"{step.name}: {shlex.join(step.argv)}")
            try:
                signals.child = subprocess.Popen(step.argv, env=env, cwd=step.cwd)
            except OSError as exc:
                code = 127 if isinstance(exc, FileNotFoundError) else 126
                _log(log, f"{step.name}: could not start: {exc.strerror or exc}")
                say_failed(
                    err,
                    "bench",
                    f"{where} could not start {step.argv[0]}: {exc.strerror or exc}",
                    f"{step.argv[0]}; commands and exit codes in {log}",
                    "check that the program exists and is executable, then rerun",
                )
                return code
            # A signal that came while the step was being started found no step to reach.
            signals.forward()
            code = _exit_code(signals.child.wait())
            signals.child = None
            _log(log, f"{step.name}: exit {code}")
            if code != 0:
                evidence = (
                    step.evidence
                    if os.path.lexists(step.evidence)
                    else f"{step.evidence} was not created; see the lines above"
                )
                say_failed(
                    err,
                    "bench",
                    f"{where} exited with code {code}",
                    f"{evidence}; commands and exit codes in {log}",
                    step.next_step,
                )
                return code
        if signals.received is not None:
            _log(log, "interrupted after the last step")
            say_failed(
                err,
                "bench",
                "interrupted after the last step",
                f"{plan.output}; commands and exit codes in {log}",
                "rerun with another OUTPUT_DIR when ready",
            )
            return 128 + signals.received
    for line in plan.wrote:
        print(line, file=out)
    out.flush()
    _log(log, "done")
    return 0


def bench_command(
    output_arg: str | None,
    environ: Mapping[str, str] | None = None,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    quiet: bool = False,
) -> int:
    """The ``bench`` verb: the exit code of the first failing step, else 0. ``quiet``:
    no progress from the runs and no step lines; failures and the closing lines remain.
    (No JSON events: every step's result line shares stdout with them.)"""
    env = os.environ if environ is None else environ
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        plan = plan_bench(output_arg, env, quiet=quiet)
    except BenchRefused as refused:
        say_failed(
            err,
            "bench",
            f"{refused.refusal.message} ({refused.refusal.code})",
            refused.evidence,
            refused.refusal.hint,
        )
        return ExitCode.PRECONDITION
    return run_bench(plan, env, out, err, quiet=quiet)
