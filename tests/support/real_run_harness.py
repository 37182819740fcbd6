"""Helpers several test modules share (they were in test_run_integration.py)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from hub_fixture import plan_document

from cache_family.oracles import native_build
from cache_family.oracles.native_parts import Parts

CLI = Path(sys.executable).parent / "cache-family"


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLI), *args],
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "HOME": str(cwd)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def operator_for(parts: Parts, tools: Path, root: Path, cases: list[str]) -> Path:
    debug = tools.joinpath(*native_build.TOOLS_SUBDIR)
    native = tools / "native"
    plan = plan_document(
        parts.zoo_root,
        cases=cases,
        catalog={"path": str(parts.zoo_catalog), "sha256": sha256_of(parts.zoo_catalog)},
        concurrency=[1, 2],
        concurrent_requests=2,
        llama_repeats=3,
    )
    document: dict[str, Any] = {
        "schema_version": 1,
        "plan": plan,
        # The reference workload oracles, installed as an operator names Skippy's tools.
        "correctness": str(debug / "skippy-correctness"),
        "stage_server": str(debug / "skippy"),
        "native_server": str(native / "bin" / native_build.SERVER_NAME),
        "artifact_tool": None,
        "native_build": str(native),
        "old_source_commit": "1" * 40,
        "new_source_commit": "2" * 40,
        "native_source_commit": "3" * 40,
        # One thread for the server, so the load client keeps the other core (2-core host).
        "environment": {"OMP_NUM_THREADS": "1"},
        "toolkit_directories": {},
        "execution_seconds": 1800,
        "cell_seconds": 300,
        "request_timeout_ms": 60000,
        "preparation_seconds": 300,
    }
    path = root / "operator.json"
    path.write_text(json.dumps(document))
    return path


def prepare_then_run(
    parts: Parts, tools: Path, root: Path, cases: list[str], verb: str
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """``verb`` (prepare-full or prepare-use-cases) then ``run``, both succeeding: the run
    directory and the run's completed process."""
    operator = operator_for(parts, tools, root, cases)
    prepared_dir = root / "prepared"
    prepare = cli(verb, "--input", str(operator), "--output", str(prepared_dir), cwd=root)
    assert prepare.returncode == 0, prepare.stderr
    out = root / "run"
    prepared = prepared_dir / "cache-family-input.json"
    ran = cli("run", "--input", str(prepared), "--output", str(out), cwd=root)
    assert ran.returncode == 0, ran.stderr
    return out, ran


#: The old stage server of the paired tests: the demo's oracle with prefix reuse off.
OLD = "skippy-prefix-reuse-off"


def paired_operator(parts: Parts, tools: Path, root: Path, cases: list[str], **plan: Any) -> Path:
    """An operator input with old and new stage servers bound (``plan`` overrides members)."""
    debug = tools.joinpath(*native_build.TOOLS_SUBDIR)
    native = tools / "native"
    members: dict[str, Any] = {
        "cases": cases,
        "catalog": {"path": str(parts.zoo_catalog), "sha256": sha256_of(parts.zoo_catalog)},
        "concurrency": [1, 2],
        "concurrent_requests": 2,
        "concurrent_output_tokens": 8,
        "llama_repeats": 2,
        "old_server": {"path": str(debug / OLD), "sha256": None},
        "new_server": {"path": str(debug / "skippy"), "sha256": None},
        **plan,
    }
    document: dict[str, Any] = {
        "schema_version": 1,
        "plan": plan_document(parts.zoo_root, **members),
        "correctness": str(debug / "skippy-correctness"),
        "stage_server": str(debug / "skippy"),
        "native_server": str(native / "bin" / native_build.SERVER_NAME),
        "artifact_tool": None,
        "native_build": str(native),
        "old_source_commit": "1" * 40,
        "new_source_commit": "2" * 40,
        "native_source_commit": "3" * 40,
        "environment": {"OMP_NUM_THREADS": "1"},
        "toolkit_directories": {},
        "execution_seconds": 1800,
        "cell_seconds": 300,
        "request_timeout_ms": 60000,
        "preparation_seconds": 300,
    }
    path = root / "operator.json"
    path.write_text(json.dumps(document))
    return path


def prepare_and_run(
    operator: Path, root: Path, verb: str = "prepare-full", *extra: str
) -> tuple[Path, int, str]:
    """``verb`` then ``run``: the run directory, the run's exit code and its stderr (the run
    may fail; the preparation must not)."""
    prepared = root / "prepared"
    done = cli(verb, "--input", str(operator), "--output", str(prepared), *extra, cwd=root)
    assert done.returncode == 0, done.stderr
    out = root / "run"
    ran = cli(
        "run",
        "--input",
        str(prepared / "cache-family-input.json"),
        "--output",
        str(out),
        cwd=root,
    )
    return out, ran.returncode, ran.stderr
