"""The correctness oracle on the real parts: libllama of the native build, the zoo's GGUF models.

Each test runs ``python -m cache_family.oracles.correctness state-handoff`` as a real child with
an explicit environment and reads the report it wrote. A passing report must also pass the
run's gate (``states/handoff.py``) for the zoo preset it ran. Tiny random-weight models: the
timings prove the mechanism, not performance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from cache_family.oracles import correctness, llama_bindings, native_build, package_builder
from cache_family.oracles.native_parts import SKIP_NATIVE_ENV, Parts
from cache_family.states.handoff import (
    RUNTIME_SLICE_TOPOLOGIES,
    HandoffExpectation,
    handoff_report_refusals,
    topology_range,
)
from cache_family.system.hashing import sha256_file

pytestmark = pytest.mark.native

PREFIX = 24
REPEATS = 3
RESIDENT = "llama"  # plain attention: resident-kv
RECURRENT = "qwen3next"  # hybrid gated delta net + attention: kv-recurrent


@pytest.fixture(scope="module")
def parts(native_parts: Parts) -> Parts:
    """The real parts plus the bindings, which ``just native-parts`` installs."""
    if not llama_bindings.installed():
        message = f"{llama_bindings.requirement()} is not installed; run `just native-parts`"
        if os.environ.get(SKIP_NATIVE_ENV) == "1":
            pytest.skip(message)
        pytest.fail(message, pytrace=False)
    return native_parts


def preset(parts: Parts, key: str) -> dict[str, Any]:
    for entry in parts.catalog()["presets"]:
        if entry["key"] == key:
            return dict(entry)
    raise LookupError(key)


def run_oracle(
    parts: Parts,
    tmp_path: Path,
    key: str,
    *,
    payload: str | None = None,
    topology: str = "one-stage",
    fault: bool = False,
    extra: tuple[str, ...] = (),
    override: list[str] | None = None,
    command: tuple[str, ...] = (sys.executable, "-m", "cache_family.oracles.correctness"),
    env_changes: dict[str, str | None] | None = None,
) -> tuple[int, dict[str, Any], str]:
    """Run the oracle on a zoo preset; ``override`` replaces flag values (pairs), ``command``
    the program, and ``env_changes`` sets (or, with None, removes) environment variables."""
    entry = preset(parts, key)
    layers = int(entry["layer_end"])
    start, end, stage = topology_range(topology, layers)
    report = (
        Path(tempfile.mkdtemp(prefix=f"{key}-{topology}-", dir=tmp_path)) / "state-handoff.json"
    )
    argv = [
        *command, "state-handoff",
        "--model", str(parts.model_path(key)),
        "--model-id", str(entry["model_id"]),
        "--stage-server-bin", str(parts.llama_server),
        "--layer-end", str(layers),
        "--ctx-size", str(entry["ctx"]),
        "--n-gpu-layers=0",
        "--activation-width", str(entry["activation_width"]),
        "--stage-load-mode", "runtime-slice",
        "--state-layer-start", str(start),
        "--state-layer-end", str(end),
        "--state-stage-index", str(stage),
        "--state-payload-kind", payload or str(entry["payload"]),
        "--prefix-token-count", str(PREFIX),
        "--cache-hit-repeats", str(REPEATS),
        "--runtime-lane-count", "1",
        "--source-bind-addr", "127.0.0.1:40001",
        "--restore-bind-addr", "127.0.0.1:40002",
        "--report-out", str(report),
        *extra,
    ]  # fmt: skip
    pairs = override or []
    for flag, value in zip(pairs[::2], pairs[1::2], strict=True):
        argv[argv.index(flag) + 1] = value
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
        llama_bindings.STAGE_BUILD_ENV: str(parts.native_build),
    }
    if fault:
        env[correctness.FAULT_ENV] = "1"
    for name, value in (env_changes or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, check=False)
    output = done.stdout + done.stderr
    if done.returncode == 2:
        assert not report.exists()
        return 2, {}, output
    assert report.is_file(), f"no report (exit {done.returncode}): {done.stderr[-2000:]}"
    return done.returncode, json.loads(report.read_text()), output


def expectation(parts: Parts, key: str, topology: str) -> HandoffExpectation:
    entry = preset(parts, key)
    return HandoffExpectation(
        model_id=str(entry["model_id"]),
        payload=entry["payload"],
        topology=topology,
        layer_end=int(entry["layer_end"]),
        activation_width=int(entry["activation_width"]),
        prefix_tokens=PREFIX,
        repeats=REPEATS,
    )


def assert_passed(parts: Parts, key: str, topology: str, code: int, report: dict[str, Any]) -> None:
    assert code == 0, report.get("reason")
    assert report["status"] == "pass", report["reason"]
    assert handoff_report_refusals(report, expectation(parts, key, topology)) == []
    assert report["cache_storage_bytes"] > 0
    assert len(report["cache_hit_import_ms"]) == REPEATS
    assert len(report["cache_hit_decode_ms"]) == REPEATS
    assert report["cache_hit_tokens"] == [report["baseline_token"]] * REPEATS
    assert report["evidence"] == "reference-oracle"


def test_resident_kv_family_passes_on_every_topology(parts: Parts, tmp_path: Path) -> None:
    for topology in RUNTIME_SLICE_TOPOLOGIES:
        code, report, _ = run_oracle(parts, tmp_path, RESIDENT, topology=topology)
        assert_passed(parts, RESIDENT, topology, code, report)
        assert report["state_payload_kind"] == "resident-kv"
        assert report["native_seq_remapped"] is True
        assert report["payload_digest"] == {
            "kv_bytes": report["cache_storage_bytes"],
            "recurrent_bytes": 0,
        }


def test_kv_recurrent_family_passes(parts: Parts, tmp_path: Path) -> None:
    code, report, output = run_oracle(parts, tmp_path, RECURRENT, topology="split-final")
    assert_passed(parts, RECURRENT, "split-final", code, report)
    assert report["model_identity"]["hybrid"] is True
    digest = report["payload_digest"]
    assert digest["recurrent_bytes"] > 0
    assert digest["kv_bytes"] + digest["recurrent_bytes"] == report["cache_storage_bytes"]
    assert report["benchmark_prompt_text"] not in output  # the prompt is never printed


def test_altered_state_bytes_fail_the_token_or_logits_check(parts: Parts, tmp_path: Path) -> None:
    code, report, _ = run_oracle(parts, tmp_path, RECURRENT, fault=True)
    assert code == 1
    assert report["status"] == "fail"
    assert report["fault_injection"].startswith("altered")
    assert report["cache_hit_matches"] is False  # the exact same-split logits check bites
    assert report["matches"] is False
    assert report["reason"].startswith("mismatch:")
    refusals = handoff_report_refusals(report, expectation(parts, RECURRENT, "one-stage"))
    assert "handoff.status" in [r.code for r in refusals]


def test_resident_kv_on_a_recurrent_model_fails_with_its_reason(
    parts: Parts, tmp_path: Path
) -> None:
    code, report, _ = run_oracle(parts, tmp_path, RECURRENT, payload="resident-kv")
    assert code == 1
    assert report["status"] == "fail"
    assert report["reason"].startswith("payload.unsupported:")
    assert report["matches"] is False
    assert report["cache_hit_import_ms"] == []


def test_a_given_prompt_is_cut_to_exactly_k_plus_one_tokens(parts: Parts, tmp_path: Path) -> None:
    prompt = "the quick brown fox jumps over the lazy dog and keeps running far away"
    code, report, output = run_oracle(parts, tmp_path, RESIDENT, extra=("--prompt", prompt))
    assert code == 0, report["reason"]
    assert report["benchmark_prompt_token_count"] == PREFIX + 1
    assert report["benchmark_prompt_text"]
    assert report["benchmark_prompt_text"] in " ".join([prompt] * 8)
    assert prompt not in output


def write_layer_package(source: Path, out: Path, model_id: str) -> int:
    """A schema-1 layer package of ``source``, written by the package builder; its layer count."""
    return package_builder.write_package(source, out, model_id, created_at_unix_secs=0).layer_count


def test_package_stage1_loads_a_layer_package(parts: Parts, tmp_path: Path) -> None:
    entry = preset(parts, RESIDENT)
    package = tmp_path / "package"
    layers = write_layer_package(parts.model_path(RESIDENT), package, str(entry["model_id"]))
    assert layers >= 4
    args = [
        "--model", str(package),
        "--stage-load-mode", "layer-package",
        "--state-layer-start", "3",
        "--state-layer-end", "4",
        "--state-stage-index", "1",
    ]  # fmt: skip
    code, report, _ = run_oracle(parts, tmp_path, RESIDENT, override=args)
    assert code == 0, report["reason"]
    assert (report["layer_start"], report["layer_end"], report["stage_index"]) == (3, 4, 1)
    assert report["topology"] == "package-stage1"
    assert report["package"]["layer_count"] == layers
    # a tampered part is refused before anything is loaded
    layer = package / "layers" / "layer-003.gguf"
    layer.write_bytes(layer.read_bytes()[:-1] + b"\0")
    code, _, output = run_oracle(parts, tmp_path, RESIDENT, override=args)
    assert code == 2
    assert "refused: correctness.package" in output
    assert "layers/layer-003.gguf has SHA-256" in output
    # a part that matches its manifest digest but is no GGUF is refused too, never a traceback
    manifest_path = package / correctness.PACKAGE_MANIFEST
    manifest = json.loads(manifest_path.read_text())
    layer.write_bytes(b"not a gguf file")
    manifest["layers"][3]["sha256"] = sha256_file(layer)
    manifest["layers"][3]["artifact_bytes"] = layer.stat().st_size
    manifest_path.write_text(json.dumps(manifest))
    code, _, output = run_oracle(parts, tmp_path, RESIDENT, override=args)
    assert code == 2
    assert "refused: correctness.package" in output
    assert "not a readable GGUF" in output
    assert "Traceback" not in output


def test_a_model_llama_cpp_cannot_load_fails_with_its_reason(parts: Parts, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF but not really")
    code, report, _ = run_oracle(parts, tmp_path, RESIDENT, override=["--model", str(broken)])
    assert code == 1
    assert report["status"] == "fail"
    assert report["reason"].startswith("model.load_failed:")
    assert report["benchmark_prompt_text"] == ""


def test_outside_a_run_the_launcher_finds_its_own_native_build(
    parts: Parts, tmp_path: Path
) -> None:
    """``skippy-correctness`` called by hand: no LLAMA_STAGE_BUILD_DIR, only the build its
    launcher names (as the stage-server oracle finds llama-server), and no thread setting."""
    tool = next(t for t in native_build.ORACLE_TOOLS if t.module == "correctness")
    launcher = tmp_path / tool.name
    launcher.write_text(
        native_build.launcher_script(
            tool, sys.executable, parts.native_build, native_build.package_source_sha256()
        )
    )
    launcher.chmod(0o755)
    unset = {llama_bindings.STAGE_BUILD_ENV: None, correctness.THREADS_ENV: None}
    code, report, output = run_oracle(
        parts, tmp_path, RESIDENT, command=(str(launcher),), env_changes=unset
    )
    assert "bindings.library_unset" not in output
    assert_passed(parts, RESIDENT, "one-stage", code, report)
    assert (report["threads"], report["threads_source"]) == (1, "default")


def test_the_thread_count_comes_from_the_shared_environment(parts: Parts, tmp_path: Path) -> None:
    code, report, _ = run_oracle(
        parts, tmp_path, RESIDENT, env_changes={correctness.THREADS_ENV: "2"}
    )
    assert_passed(parts, RESIDENT, "one-stage", code, report)
    assert (report["threads"], report["threads_source"]) == (2, "OMP_NUM_THREADS")
