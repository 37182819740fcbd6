"""The demo is the mission: ``./bootstrap demo`` runs the wrapper's sequence on the real parts.

Which families and use cases run is chosen only through the operator input and the wrapper's
corpus variable (``PLANS``). The old and new stage servers are the same oracle build one serving
option apart (the old never reuses a cached prefix); figures from the tiny random-weight zoo are
marked synthetic.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Final, TextIO

from cache_family.console import bench_sequence
from cache_family.console.refusals import say_failed
from cache_family.errors import Refused
from cache_family.exit_codes import ExitCode
from cache_family.oracles import native_build
from cache_family.oracles.demo_summary import summarize_run, summarize_workloads
from cache_family.oracles.native_parts import Parts, ensure_parts
from cache_family.oracles.real_model import RealModel, ensure_real_model
from cache_family.oracles.real_table import TABLE_NAME, render_real_table
from cache_family.schemas.corpus import default_corpus_path
from cache_family.schemas.examples import example_operator, example_plan

# Declared provenance only (never verified): the oracles are this project's source at the
# commit the operator checked out, which the demo does not know; the native commit is the
# llama.cpp commit of the build.
_UNKNOWN_COMMIT = "0" * 40
OLD_SERVER = "skippy-prefix-reuse-off"

OPERATOR_NAME = "operator.json"
CORPUS_NAME = "use-case-corpus.json"
# The workload run (issue 20): its own operator input, workload file and run directory.
WORKLOAD_OPERATOR_NAME = "operator-workloads.json"
WORKLOAD_FILE_NAME = "workloads.json"
WORKLOAD_RUN = "workloads"
#: One attention and one recurrent (hybrid) family of the zoo.
WORKLOAD_CASES: Final = ("llama", "qwen3next")
#: One overlap sweep (the default designed ratios; prompts long enough that the hybrid's
#: checkpoint rule reuses part of them) and one open-loop sweep (GuideLLM's: one at a time,
#: as fast as allowed, then rates between), small enough for the zoo on a shared host.
DEMO_WORKLOADS: Final[dict[str, Any]] = {
    "schema_version": 1,
    "prefix_overlap": {"prompt_tokens": 1024, "groups": 1, "requests": 4, "seed": 20},
    "open_loop": {
        "pattern": "poisson",
        "sweep": {"points": 2, "throughput_concurrency": 4},
        "requests": 100,
        "output_tokens": 4,
        "seed": 20,
        "over_saturation": {"window": 16, "min_in_flight": 8, "max_lateness_ms": 200},
    },
}


#: The bundled trace slice (package data, its NOTICE beside it) and the windows replayed:
#: the zoo's first 4 requests (46 distinct block ids, within the stage servers' chat
#: alphabet), 8 tokens a 512-token block; the trained model's first 10, 4 tokens a block.
TRACE_RESOURCE: Final = "corpus/traces/mooncake-conversation-head.jsonl"
DEMO_TRACE: Final[dict[str, Any]] = {"first": 4, "tokens_per_block": 8, "output_tokens_cap": 2}
REAL_TRACE: Final[dict[str, Any]] = {"first": 10, "tokens_per_block": 4, "output_tokens_cap": 4}


def with_trace(workloads: dict[str, Any], window: dict[str, Any]) -> dict[str, Any]:
    """The workload file with a ``trace`` section replaying ``window`` of the bundled slice."""
    path = Path(str(resources.files("cache_family").joinpath(TRACE_RESOURCE)))
    return {**workloads, "trace": {"path": str(path.resolve()), **window}}


# The trained model (issue 30): its own operator inputs, workload file and run directories.
REAL_OPERATOR_NAME = "operator-real.json"
REAL_SWEEP_OPERATOR_NAME = "operator-real-sweep.json"
REAL_WORKLOAD_OPERATOR_NAME = "operator-real-workloads.json"
REAL_WORKLOAD_FILE_NAME = "workloads-real.json"
REAL_RUN = "real"
REAL_SWEEP_RUN = "real-sweep"
REAL_WORKLOAD_RUN = "real-workloads"
#: The native ladder's output per request on the trained model: the stage arms' 16 (its
#: answers rarely stop early, and 128 tokens at CPU speed would dominate the row).
REAL_OUTPUT_TOKENS: Final = 16
#: Cold against hit below, at and above the model's 512-token sliding window.
REAL_PREFIX_SWEEP: Final = (256, 512, 1024, 2048)
#: The workloads on the trained model: an overlap sweep across its sliding window, two users'
#: two-turn sessions and a short open-loop sweep (its prompts are processed at ~200 tokens/s
#: on 2 loaded cores, so every size is small).
REAL_WORKLOADS: Final[dict[str, Any]] = {
    "schema_version": 1,
    "prefix_overlap": {"prompt_tokens": 1024, "groups": 1, "requests": 4, "seed": 30},
    "multi_turn": {
        "users": 2,
        "turns": 2,
        "system_prompt_tokens": 256,
        "user_context_tokens": 128,
        "question_tokens": 32,
        "answer_tokens": 16,
        "seed": 30,
    },
    "open_loop": {
        "pattern": "poisson",
        "sweep": {"points": 1, "throughput_concurrency": 2},
        "requests": 16,
        "output_tokens": 4,
        "seed": 30,
        "over_saturation": {"window": 8, "min_in_flight": 4, "max_lateness_ms": 2000},
    },
}


@dataclass(frozen=True, slots=True)
class DemoPlan:
    """Which rows the demo runs: ``cases`` () means every catalog preset, ``use_cases``
    None means the whole checked-in corpus. ``real`` adds the trained model: "row" one
    full-GGUF row beside the zoo's, "mission" the whole mission on it instead of the zoo."""

    name: str
    cases: tuple[str, ...]
    use_cases: tuple[str, ...] | None
    what: str
    real: str | None = None


PLANS: dict[str, DemoPlan] = {
    plan.name: plan
    for plan in (
        DemoPlan(
            "quick",
            ("qwen3_dense", "falcon_h1"),
            ("tool_calling",),
            "2 families (an attention and a recurrent one) and 1 use case: 4 rows",
        ),
        DemoPlan(
            "standard",
            (),
            ("tool_calling",),
            "every family in both matrices, 1 use case: 28 rows, and one row on the trained "
            "Gemma 3 270M",
            real="row",
        ),
        DemoPlan("full", (), None, "every family and every use case of the corpus: 126 rows"),
        DemoPlan(
            "real",
            (),
            ("tool_calling",),
            "the whole mission on the trained Gemma 3 270M instead of the zoo: both matrices "
            "(1 use case), a prefix sweep of 256/512/1024/2048 tokens, and the overlap, "
            "sessions and open-loop workloads on the native and both stage servers",
            real="mission",
        ),
    )
}
DEFAULT_PLAN = "standard"


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


def operator_input(
    parts: Parts,
    tools: Path,
    cases: tuple[str, ...] = (),
    *,
    real: RealModel | None = None,
    **plan: object,
) -> dict[str, Any]:
    """The operator input naming the installed tools under ``tools`` (an install OUTPUT),
    over the zoo or, with ``real``, the trained model's hub cache and catalog; ``plan``
    members replace the demo's defaults."""
    debug = tools.joinpath(*native_build.TOOLS_SUBDIR)
    native = tools / "native"
    catalog = parts.zoo_catalog if real is None else real.catalog
    catalog_sha = hashlib.sha256(catalog.read_bytes()).hexdigest()
    producer = json.loads((tools / "producer.json").read_text())
    native_commit = str(producer.get("source", {}).get("llama_cpp_commit", _UNKNOWN_COMMIT))
    members: dict[str, object] = {
        "cases": list(cases),
        "concurrency": [1, 2],
        "concurrent_requests": 4,
        "concurrent_output_tokens": 16,
    }
    members.update(plan)
    return example_operator(
        example_plan(
            str(parts.zoo_root if real is None else real.root),
            **members,
            catalog={"path": str(catalog), "sha256": catalog_sha},
            old_server={"path": str(debug / OLD_SERVER), "sha256": None},
            new_server={"path": str(debug / "skippy"), "sha256": None},
        ),
        correctness=str(debug / "skippy-correctness"),
        stage_server=str(debug / "skippy"),
        native_server=str(native / "bin" / native_build.SERVER_NAME),
        artifact_tool=str(debug / "skippy-package-builder"),
        native_build=str(native),
        old_source_commit=_UNKNOWN_COMMIT,
        new_source_commit=_UNKNOWN_COMMIT,
        native_source_commit=native_commit,
        borrow_resident_hits=False,
        cache_decoded_result_hits=False,
        environment={
            # One thread per host: on a small shared machine more threads than free cores make
            # llama.cpp's spinning thread pool many times slower, not faster.
            "OMP_NUM_THREADS": "1",
            "LLAMA_STAGE_BACKEND": "cpu",
        },
        execution_seconds=7200,
        # The trained model's correctness arm recomputes a 2,048-token prefix three times per
        # topology, at CPU speed on a shared host: it gets four times the zoo's budget.
        cell_seconds=300 if real is None else 1200,
        request_timeout_ms=60000,
        preparation_seconds=600,
    )


def corpus_subset(keys: tuple[str, ...] | None) -> bytes:
    """The checked-in corpus with only ``keys`` (in corpus order); None keeps all of it."""
    corpus = json.loads(Path(default_corpus_path()).read_bytes())
    if keys is not None:
        corpus["use_cases"] = [u for u in corpus["use_cases"] if u["key"] in keys]
    return (json.dumps(corpus, indent=2) + "\n").encode()


def bench_environment(
    environ: Mapping[str, str], operator: Path, corpus: Path, run_id: str
) -> dict[str, str]:
    """The caller's environment without any of the wrapper's own variables, then the demo's:
    its operator input and corpus, its tools already installed. The plan overrides keep the
    wrapper's defaults, the settings the combined report's wording states."""
    contract = {
        bench_sequence.RUNNER_ENV,
        bench_sequence.OPERATOR_ENV,
        bench_sequence.RUN_ID_ENV,
        bench_sequence.SKIP_BUILD_ENV,
        bench_sequence.BUILD_OUTPUT_ENV,
        bench_sequence.CORPUS_ENV,
        *(name for name, _, _ in bench_sequence.PLAN_OVERRIDES),
    }
    env = {name: value for name, value in environ.items() if name not in contract}
    env.update(
        {
            bench_sequence.OPERATOR_ENV: str(operator),
            bench_sequence.CORPUS_ENV: str(corpus),
            bench_sequence.SKIP_BUILD_ENV: "1",
            bench_sequence.RUN_ID_ENV: run_id,
        }
    )
    return env


def demo_steps(output: str) -> tuple[tuple[bench_sequence.Step, ...], tuple[str, ...]]:
    """What the demo runs after the wrapper's sequence (which ends with each run's report
    files): the replay of each run, which also regenerates those report files and compares
    them."""
    runner = bench_sequence.default_runner()
    steps: list[bench_sequence.Step] = []
    wrote: list[str] = []
    runs = [os.path.join(output, name) for name in ("full-gguf", "use-cases")]
    for run in runs:
        steps.append(
            bench_sequence.Step(
                f"replay {os.path.basename(run)}",
                (*runner, "replay", run),
                os.path.join(run, "journal.jsonl"),
                f"the lines above name what differs; `cache-family replay {run}` reruns the "
                "comparison (report it with the run directory)",
            )
        )
    return tuple(steps), tuple(wrote)


def runs_workloads(plan: DemoPlan) -> bool:
    """Every zoo plan but ``--quick`` adds the zoo's workload run (``--real`` has its own)."""
    return plan.name != "quick" and plan.real != "mission"


def workload_steps(
    output: str, operator: str, workloads: str
) -> tuple[tuple[bench_sequence.Step, ...], tuple[str, ...]]:
    """The zoo's workload run (not in ``--quick``)."""
    return measured_run_steps(output, WORKLOAD_RUN, operator, workloads)


def measured_run_steps(
    output: str,
    name: str,
    operator: str,
    workloads: str | None = None,
    *,
    native_output_tokens: int | None = None,
) -> tuple[tuple[bench_sequence.Step, ...], tuple[str, ...]]:
    """One run beside the wrapper's two: ``prepare-full`` (with the workload file, if any,
    and the native ladder's output length, if given), ``run``, its report files and its
    replay, into ``OUT/<name>``."""
    runner = bench_sequence.default_runner()
    prepared_dir = os.path.join(output, f"{name}-input")
    prepared = os.path.join(prepared_dir, bench_sequence.PREPARED_JSON)
    run = os.path.join(output, name)
    again = "fix what the refusal above names, then rerun the demo into a fresh directory"
    with_workloads: tuple[str, ...] = ("--workloads", workloads) if workloads is not None else ()
    if native_output_tokens is not None:
        with_workloads += ("--native-output-tokens", str(native_output_tokens))
    steps = (
        bench_sequence.Step(
            f"prepare-full {name}",
            (
                *runner,
                *("prepare-full", "--input", operator, "--output", prepared_dir),
                *with_workloads,
            ),
            prepared_dir,
            again,
        ),
        bench_sequence.Step(
            f"run {name}",
            (*runner, "run", "--input", prepared, "--output", run),
            run,
            again,
            needs=(prepared,),
            needs_next=f"the {name} preparation above did not write its input",
        ),
        bench_sequence.Step(
            f"report-run {name}",
            (*runner, "report-run", run),
            run,
            f"fix what the refusal above names, then rerun `cache-family report-run {run}`",
        ),
        bench_sequence.Step(
            f"replay {name}",
            (*runner, "replay", run),
            os.path.join(run, "journal.jsonl"),
            f"the lines above name what differs; `cache-family replay {run}` reruns it",
        ),
    )
    return steps, (f"Wrote run report: {os.path.join(run, 'report.html')}",)


def real_steps(
    out: Path, output: str, parts: Parts, tools: Path, real: RealModel, plan: DemoPlan
) -> tuple[tuple[bench_sequence.Step, ...], tuple[str, ...]]:
    """The trained model's runs. Beside the zoo ("row"): one full-GGUF row, every host arm
    on a short ladder. As the mission ("mission"; the wrapper's sequence already ran both
    matrices on it): the prefix sweep, then the workloads on the native and stage servers."""

    def write(name: str, document: dict[str, Any]) -> str:
        path = out / name
        path.write_text(json.dumps(document, indent=2) + "\n")
        return str(path)

    cases = (real.key,)
    if plan.real == "row":
        operator = write(REAL_OPERATOR_NAME, operator_input(parts, tools, cases, real=real))
        return measured_run_steps(
            output, REAL_RUN, operator, native_output_tokens=REAL_OUTPUT_TOKENS
        )
    sweep = write(
        REAL_SWEEP_OPERATOR_NAME,
        operator_input(
            parts, tools, cases, real=real, prefix_sweep=list(REAL_PREFIX_SWEEP), llama_repeats=5
        ),
    )
    steps, wrote = measured_run_steps(
        output, REAL_SWEEP_RUN, sweep, native_output_tokens=REAL_OUTPUT_TOKENS
    )
    workload_operator = write(
        REAL_WORKLOAD_OPERATOR_NAME, operator_input(parts, tools, cases, real=real)
    )
    workloads = out / REAL_WORKLOAD_FILE_NAME
    workloads.write_text(json.dumps(with_trace(REAL_WORKLOADS, REAL_TRACE), indent=2) + "\n")
    more, more_wrote = measured_run_steps(
        output,
        REAL_WORKLOAD_RUN,
        workload_operator,
        str(workloads),
        native_output_tokens=REAL_OUTPUT_TOKENS,
    )
    return steps + more, wrote + more_wrote


def campaign_steps(
    output: str, hosts: int
) -> tuple[tuple[bench_sequence.Step, ...], tuple[str, ...]]:
    """``--hosts N``: the full-GGUF rows again as a campaign on a local Ray cluster of N
    labelled, separated test hosts (rows back through the object store), merged, then the
    campaign's replay."""
    runner = bench_sequence.default_runner()
    prepared = os.path.join(output, "full-input", bench_sequence.PREPARED_JSON)
    campaign = os.path.join(output, "campaign")
    steps = (
        bench_sequence.Step(
            f"campaign on {hosts} local hosts",
            (
                *runner,
                "campaign",
                "--input",
                prepared,
                "--output",
                campaign,
                "--ray",
                "local",
                "--hosts",
                str(hosts),
            ),
            campaign,
            "read the campaign report and each row's log under rows/, fix the cause, then "
            "rerun the demo into a fresh directory",
            needs=(prepared,),
            needs_next="the full-GGUF preparation above did not write its input",
        ),
        bench_sequence.Step(
            "replay campaign",
            (*runner, "replay", campaign),
            os.path.join(campaign, "campaign-journal.jsonl"),
            f"the lines above name what differs; `cache-family replay {campaign}` reruns it",
        ),
    )
    return steps, (f"Wrote campaign report: {os.path.join(campaign, 'campaign-report.md')}",)


def _say(progress: TextIO, text: str) -> None:
    print(f"demo: {text}", file=progress, flush=True)


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPU(s)"


def run_demo(
    out: Path,
    progress: TextIO,
    *,
    plan: DemoPlan | None = None,
    quiet: bool = False,
    stdout: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
    hosts: int | None = None,
) -> int:
    """Build or reuse the parts, write the operator input, run the sequence; the exit code."""
    plan = plan or PLANS[DEFAULT_PLAN]
    stdout = sys.stdout if stdout is None else stdout
    started = time.monotonic()
    _say(progress, f"plan {plan.name}: {plan.what}; {_load()}")
    real: RealModel | None = None
    try:
        parts = ensure_parts(progress)
        if plan.real is not None:
            real = ensure_real_model(progress)
        out.mkdir(parents=True)
        tools = out / "tools"
        _say(progress, "install the native build and the reference workload oracles")
        native_build.install(tools, progress, tools=True)
    except Refused as refused:
        for refusal in refused.refusals:
            print(f"refused: {refusal.line()}", file=progress)
        say_failed(
            progress,
            "demo",
            "the real parts could not be built or installed",
            f"the refusals above; {out if out.exists() else 'nothing was written'}",
            "fix what each refusal names, then run `./bootstrap demo` again",
        )
        return ExitCode.PRECONDITION
    operator = out / OPERATOR_NAME
    if plan.real == "mission" and real is not None:
        document = operator_input(parts, tools, (real.key,), real=real)
    else:
        document = operator_input(parts, tools, plan.cases)
    operator.write_text(json.dumps(document, indent=2) + "\n")
    corpus = out / CORPUS_NAME
    corpus.write_bytes(corpus_subset(plan.use_cases))
    _say(progress, f"operator input {operator} (old and new stage servers bound)")
    env = bench_environment(os.environ if environ is None else environ, operator, corpus, out.name)
    try:
        bench = bench_sequence.plan_bench(str(out), env, quiet=quiet)
    except bench_sequence.BenchRefused as refused:
        say_failed(progress, "demo", refused.refusal.line(), refused.evidence, refused.refusal.hint)
        return ExitCode.PRECONDITION
    extra, wrote = demo_steps(bench.output)
    if runs_workloads(plan):
        workload_operator = out / WORKLOAD_OPERATOR_NAME
        workload_operator.write_text(
            json.dumps(operator_input(parts, tools, WORKLOAD_CASES), indent=2) + "\n"
        )
        workload_file = out / WORKLOAD_FILE_NAME
        workload_file.write_text(
            json.dumps(with_trace(DEMO_WORKLOADS, DEMO_TRACE), indent=2) + "\n"
        )
        more, more_wrote = workload_steps(bench.output, str(workload_operator), str(workload_file))
        extra, wrote = extra + more, wrote + more_wrote
    if real is not None:
        more, more_wrote = real_steps(out, bench.output, parts, tools, real, plan)
        extra, wrote = extra + more, wrote + more_wrote
    if hosts is not None:
        more, more_wrote = campaign_steps(bench.output, hosts)
        extra, wrote = extra + more, wrote + more_wrote
    bench = dataclasses.replace(bench, steps=bench.steps + extra, wrote=bench.wrote + wrote)
    code = bench_sequence.run_bench(bench, env, stdout, progress, quiet=quiet)
    if code != 0:
        return code
    for run in ("full-gguf", "use-cases", WORKLOAD_RUN, REAL_RUN, REAL_SWEEP_RUN):
        summarize_run(out / run, progress)
    summarize_run(out / REAL_WORKLOAD_RUN, progress)
    summarize_workloads(out / WORKLOAD_RUN, progress)
    summarize_workloads(out / REAL_WORKLOAD_RUN, progress)
    if plan.real == "mission":
        table = out / TABLE_NAME
        table.write_text(render_real_table(out / REAL_SWEEP_RUN))
        _say(progress, f"the trained model's prefix sweep, as README's table: {table}")
    minutes = (time.monotonic() - started) / 60
    _say(progress, f"done in {minutes:.1f} min ({_load()}); everything is under {out}")
    return ExitCode.OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="./bootstrap demo",
        description="Run the wrapper's whole sequence on the real llama-server and the tiny "
        "model zoo; print where readme-tables.md and report.html are. Default plan: "
        f"{PLANS[DEFAULT_PLAN].what}.",
    )
    parser.add_argument(
        "output", nargs="?", metavar="OUT", help="a fresh directory (default out/demo-<time>)"
    )
    choice = parser.add_mutually_exclusive_group()
    for name, plan in PLANS.items():
        if name != DEFAULT_PLAN:
            choice.add_argument(
                f"--{name}",
                dest="plan",
                action="store_const",
                const=name,
                help=plan.what,
            )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress; failures and the closing lines only"
    )
    parser.add_argument(
        "--hosts",
        type=int,
        choices=range(1, 9),
        metavar="N",
        help="also run the full-GGUF rows as a campaign on a local Ray cluster of N labelled "
        "test hosts, each in its own network namespace with its own work directory (no "
        "shared directory, no route out; needs root), merge it and replay it",
    )
    parser.set_defaults(plan=DEFAULT_PLAN)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.output:
        out = Path(args.output).absolute()
    else:
        out = _repo_root() / "out" / time.strftime("demo-%Y%m%d-%H%M%S")
    if out.exists():
        say_failed(
            sys.stderr,
            "demo",
            f"{out} already exists",
            str(out),
            "give a fresh directory, or none for out/demo-<time>",
        )
        return ExitCode.REFUSED
    return run_demo(out, sys.stderr, plan=PLANS[args.plan], quiet=args.quiet, hosts=args.hosts)


if __name__ == "__main__":
    raise SystemExit(main())
