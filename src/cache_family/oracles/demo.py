"""The demo: the main job end to end on the embedded default (``./bootstrap demo``).

It builds or reuses the real parts (``llama-server`` from registry source and the tiny
model zoo as a Hugging Face hub cache), installs them with the reference workload oracles as
``skippy-workload-oracles-build`` lays them out (``out/tools``: ``native/``,
``cargo/debug/{skippy,skippy-correctness,skippy-package-builder}``, ``producer.json``), writes
an operator input naming those tools exactly as it would name real Skippy tools, then runs the
operator's own commands as child processes: ``validate``, ``prepare-full``, ``run`` and
``replay``. Everything lands in a fresh ``out/demo-<time>/`` directory.

Old and new stage servers are the same oracle build with one serving option apart: the old
arm (``skippy-prefix-reuse-off``) never reuses a cached prompt prefix, the new one (``skippy``)
does; ``producer.json`` records the option of each. All figures come from tiny random-weight
models: the receipts and the report mark them synthetic.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from cache_family.oracles import native_build
from cache_family.oracles.native_parts import Parts, ensure_parts
from cache_family.schemas.examples import example_operator, example_plan

# Declared provenance only (never verified): the oracles are this project's source at the
# commit the operator checked out, which the demo does not know; the native commit is the
# llama.cpp commit of the build.
_UNKNOWN_COMMIT = "0" * 40
OLD_SERVER = "skippy-prefix-reuse-off"


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


def operator_input(parts: Parts, tools: Path) -> dict[str, Any]:
    """The operator input naming the installed tools under ``tools`` (an install OUTPUT)."""
    debug = tools.joinpath(*native_build.TOOLS_SUBDIR)
    native = tools / "native"
    catalog_sha = hashlib.sha256(parts.zoo_catalog.read_bytes()).hexdigest()
    producer = json.loads((tools / "producer.json").read_text())
    native_commit = str(producer.get("source", {}).get("llama_cpp_commit", _UNKNOWN_COMMIT))
    return example_operator(
        example_plan(
            str(parts.zoo_root),
            concurrency=[1, 2],
            concurrent_requests=4,
            concurrent_output_tokens=16,
            llama_parallel=2,
            catalog={"path": str(parts.zoo_catalog), "sha256": catalog_sha},
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
        environment={"OMP_NUM_THREADS": "1", "LLAMA_STAGE_BACKEND": "cpu"},
        execution_seconds=3600,
        cell_seconds=300,
        request_timeout_ms=60000,
        preparation_seconds=600,
    )


def _step(title: str, argv: list[str], progress: TextIO) -> int:
    print(f"\ndemo: {title}\n  $ cache-family {' '.join(argv)}", file=progress, flush=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home())}
    if "CACHE_FAMILY_CACHE" in os.environ:
        env["CACHE_FAMILY_CACHE"] = os.environ["CACHE_FAMILY_CACHE"]
    return subprocess.run(
        [sys.executable, "-m", "cache_family.cli", *argv], env=env, check=False
    ).returncode


def run_demo(out: Path, progress: TextIO) -> int:
    parts = ensure_parts(progress)
    out.mkdir(parents=True)
    tools = out / "tools"
    print("\ndemo: install the native build and the reference workload oracles", file=progress)
    native_build.install(tools, progress, tools=True)
    operator_path = out / "operator.json"
    operator_path.write_text(json.dumps(operator_input(parts, tools), indent=2) + "\n")
    prepared = out / "full-input"
    run_dir = out / "full-gguf"
    steps: list[tuple[str, list[str], set[int]]] = [
        ("check the operator input", ["validate", "--input", str(operator_path)], {0}),
        (
            "observe bytes and plan every catalog row",
            ["prepare-full", "--input", str(operator_path), "--output", str(prepared)],
            {0},
        ),
        (
            "run every present row: correctness, native arms, old/new stage servers",
            ["run", "--input", str(prepared / "cache-family-input.json"), "--output", str(run_dir)],
            {0, 1},
        ),
        ("replay the journal and compare every receipt", ["replay", str(run_dir)], {0}),
    ]
    for title, argv, accepted in steps:
        code = _step(title, argv, progress)
        if code not in accepted:
            print(f"demo: stopped: `cache-family {argv[0]}` exited {code}", file=progress)
            return code
    _summarize(run_dir, progress)
    print(f"\ndemo: everything is under {out}", file=progress)
    return 0


_ARM_LABELS = {"native-concurrent": "native", "skippy-old": "old", "skippy-new": "new"}


def _arm_figures(row: dict[str, Any]) -> str:
    """Correctness, the serial warm median with its cache hits, each concurrent arm's rungs
    and the old/new parity, from row.json."""
    parts: list[str] = []
    for observation in row.get("observations", []):
        rungs: list[str] = []
        for rung in observation.get("rungs", []):
            serial = rung.get("serial_summary")
            summary = rung.get("rung_summary")
            if serial and serial.get("warm_median_ms") is not None:
                parts.append(
                    f"serial warm median {serial['warm_median_ms']:.1f} ms "
                    f"(cache_n min {serial.get('warm_cache_n_min')})"
                )
            elif summary and summary.get("throughput_requests_per_sec") is not None:
                rungs.append(
                    f"c{summary['concurrency']} {summary['throughput_requests_per_sec']:.1f} req/s"
                )
        if rungs:
            parts.append(f"{_ARM_LABELS.get(observation.get('arm'), '?')} {', '.join(rungs)}")
    parity = row.get("parity") or []
    if parity:
        accepted = sum(1 for p in parity if p.get("matches"))
        parts.append(
            f"parity {'accepted' if accepted == len(parity) else 'refused'} "
            f"({accepted}/{len(parity)} rungs)"
        )
    if not parts:
        reasons = {o.get("reason") for o in row.get("observations", []) if o.get("reason")}
        parts = sorted(str(r) for r in reasons) or [str(row.get("reason") or "")]
    correctness = row.get("correctness") or {}
    topologies = correctness.get("topologies") or []
    passed = sum(1 for t in topologies if t.get("status") == "pass")
    check = f"correctness {correctness.get('status')} ({passed}/{len(topologies)} topologies)"
    return "; ".join([check, *parts])


def _summarize(run_dir: Path, progress: TextIO) -> None:
    matrix_path = run_dir / "cache-family-matrix.json"
    if not matrix_path.is_file():
        return
    matrix = json.loads(matrix_path.read_text())
    catalog = matrix.get("catalog") or {}
    label = (
        " (synthetic catalog: plumbing evidence, not performance claims)"
        if catalog.get("synthetic")
        else ""
    )
    print(f"\ndemo: matrix status {matrix.get('status')}{label}", file=progress)
    for row in matrix.get("rows", []):
        result = row.get("result", {})
        figures = ""
        evidence = result.get("evidence")
        if evidence and (run_dir / evidence).is_file():
            figures = _arm_figures(json.loads((run_dir / evidence).read_text()))
        print(
            f"  {row.get('case', '?'):<14} p{row.get('prefix_tokens', '?'):<5} "
            f"{result.get('status', '?'):<11} {figures}",
            file=progress,
        )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args:
        out = Path(args[0]).absolute()
    else:
        out = _repo_root() / "out" / time.strftime("demo-%Y%m%d-%H%M%S")
    if out.exists():
        print(f"demo: {out} already exists; give a fresh directory", file=sys.stderr)
        return 2
    return run_demo(out, sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
