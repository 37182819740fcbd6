"""``skippy-correctness state-handoff``'s command line: the reference flags, typed refusals, help.

No llama.cpp here: every case is decided before the bindings load (they load lazily, so
``cache-family`` and these refusals work on a machine without them).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from cache_family.errors import Refused
from cache_family.oracles import correctness, llama_bindings, native_build


@pytest.fixture
def reference_argv(tmp_path: Path) -> list[str]:
    """The harness's command line, in its order, for split-middle of a 28-layer model."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    server = tmp_path / "skippy"
    server.write_text("#!/bin/sh\n")
    return [
        "state-handoff",
        "--model", str(model),
        "--model-id", "Qwen/Qwen3-0.6B:Q8_0",
        "--stage-server-bin", str(server),
        "--layer-end", "28",
        "--ctx-size", "512",
        "--n-gpu-layers=0",
        "--activation-width", "1024",
        "--stage-load-mode", "runtime-slice",
        "--state-layer-start", "9",
        "--state-layer-end", "18",
        "--state-stage-index", "1",
        "--state-payload-kind", "resident-kv",
        "--prefix-token-count", "128",
        "--cache-hit-repeats", "3",
        "--runtime-lane-count", "1",
        "--source-bind-addr", "127.0.0.1:40001",
        "--restore-bind-addr", "127.0.0.1:40002",
        "--report-out", str(tmp_path / "state-handoff.json"),
        "--borrow-resident-hits",
        "--cache-decoded-result-hits",
        "--prompt", "-a prompt that starts with a dash",
    ]  # fmt: skip


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert correctness.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("refused: correctness."), err
    return err


def test_the_reference_command_line_parses(reference_argv: list[str]) -> None:
    args = correctness.parse_args(reference_argv)
    assert args is not None
    assert args.topology == "split-middle"
    assert (args.layer_start_state, args.layer_end_state, args.stage_index) == (9, 18, 1)
    assert args.n_gpu_layers == 0
    assert args.borrow_resident_hits and args.cache_decoded_result_hits
    assert args.prompt == "-a prompt that starts with a dash"
    without_options = reference_argv[: reference_argv.index("--borrow-resident-hits")]
    parsed = correctness.parse_args(without_options)
    assert parsed is not None
    assert parsed.prompt is None
    assert not parsed.borrow_resident_hits


def test_unknown_flags_and_abbreviations_are_refused(
    reference_argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused([*reference_argv, "--telemetry-level", "debug"], capsys)
    assert "correctness.argv.unknown_flag at $.argv[" in err
    assert "--telemetry-level" in err
    abbreviated = [w if w != "--model-id" else "--model-i" for w in reference_argv]
    assert "correctness.argv.unknown_flag" in refused(abbreviated, capsys)
    assert "correctness.argv.unknown_argument" in refused([*reference_argv, "stray"], capsys)
    assert "correctness.argv.command" in refused(["serve", *reference_argv[1:]], capsys)
    assert "correctness.argv.command" in refused([], capsys)


def test_a_flag_given_twice_or_without_its_value_is_refused(
    reference_argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert "correctness.argv.duplicate" in refused([*reference_argv, "--ctx-size", "64"], capsys)
    assert "correctness.argv.missing_value" in refused([*reference_argv, "--ctx-size"], capsys)
    missing = reference_argv[: reference_argv.index("--report-out")]
    err = refused(missing, capsys)
    assert "correctness.argv.invalid" in err
    assert "--report-out" in err


@pytest.mark.parametrize(
    ("flag", "value", "code"),
    [
        ("--state-layer-end", "19", "correctness.range"),  # not split-middle of 28 layers
        ("--stage-load-mode", "layer-package", "correctness.range"),
        ("--ctx-size", "128", "correctness.context"),  # 128 + 1 tokens do not fit
        ("--source-bind-addr", "0.0.0.0:40001", "correctness.argv.invalid"),
        ("--cache-hit-repeats", "0", "correctness.argv.invalid"),
        ("--state-payload-kind", "resident", "correctness.argv.invalid"),
        ("--layer-end", "x", "correctness.argv.invalid"),
        ("--model", "relative.gguf", "correctness.argv.invalid"),
        ("--model", "/nonexistent/model.gguf", "correctness.model"),
        ("--model-id", "has space", "correctness.argv.invalid"),
        ("--report-out", "/nonexistent/dir/state-handoff.json", "correctness.report_out"),
        ("--prompt", "   ", "correctness.prompt"),
        ("--report-out", __file__, "correctness.report_out"),  # exists: reports are fresh
    ],
)
def test_inconsistent_values_are_refused_before_loading(
    reference_argv: list[str], flag: str, value: str, code: str
) -> None:
    argv = list(reference_argv)
    argv[argv.index(flag) + 1] = value
    with pytest.raises(Refused) as caught:
        correctness.parse_args(argv)
    assert code in caught.value.codes


def test_help_describes_the_checks_and_the_fault_injection(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert correctness.main(["state-handoff", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--state-payload-kind", "--report-out", "--borrow-resident-hits", "--prompt"):
        assert flag in text
    assert "FAULT INJECTION" in text
    assert correctness.FAULT_ENV in text
    assert str(correctness.HIT_LOGITS_TOLERANCE) in text
    assert correctness.main(["--help"]) == 0


def test_the_module_runs_as_a_command_without_loading_the_bindings() -> None:
    """A real child: ``python -m ... --help`` works, and importing the oracle loads no llama.cpp."""
    shown = subprocess.run(
        [sys.executable, "-m", "cache_family.oracles.correctness", "state-handoff", "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert "state-handoff" in shown.stdout
    probe = (
        "import sys, cache_family.cli, cache_family.oracles.correctness; "
        "print('llama_cpp' in sys.modules)"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert loaded.stdout.strip() == "False"


def test_the_library_directory_comes_from_the_environment(tmp_path: Path) -> None:
    with pytest.raises(Refused) as unset:
        llama_bindings.library_dir({})
    assert unset.value.codes == ["bindings.library_unset"]
    with pytest.raises(Refused) as absent:
        llama_bindings.library_dir({llama_bindings.STAGE_BUILD_ENV: str(tmp_path)})
    assert absent.value.codes == ["bindings.library_absent"]
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libllama.so").write_bytes(b"")
    found = llama_bindings.library_dir({llama_bindings.STAGE_BUILD_ENV: str(tmp_path)})
    assert found == (tmp_path / "lib").resolve()
    bindings_only = llama_bindings.library_dir({llama_bindings.LIB_PATH_ENV: str(tmp_path / "lib")})
    assert bindings_only == found
    with pytest.raises(Refused) as stage_build_first:
        llama_bindings.library_dir(
            {
                llama_bindings.LIB_PATH_ENV: str(tmp_path / "lib"),
                llama_bindings.STAGE_BUILD_ENV: "/x",
            }
        )
    assert stage_build_first.value.codes == ["bindings.library_absent"]


def test_fault_injection_alters_only_the_tail() -> None:
    payload = bytes(range(256)) * 4
    altered = correctness.alter_state_bytes(payload)
    assert len(altered) == len(payload)
    span = len(payload) // 16
    assert altered[:-span] == payload[:-span]
    assert all(a != b for a, b in zip(altered[-span:], payload[-span:], strict=True))


def test_the_launchers_native_build_is_found_without_the_runs(tmp_path: Path) -> None:
    """Outside a run only the launcher's CACHE_FAMILY_ORACLE_NATIVE names the build."""
    launchers = tmp_path / "launcher-native"
    (launchers / "lib").mkdir(parents=True)
    (launchers / "lib" / "libllama.so").write_bytes(b"")
    only_launcher = {native_build.ORACLE_NATIVE_ENV: str(launchers)}
    assert llama_bindings.library_dir(only_launcher) == (launchers / "lib").resolve()
    # the run's build, and an explicit library directory, come before the launcher's
    with pytest.raises(Refused) as run_first:
        llama_bindings.library_dir({**only_launcher, llama_bindings.STAGE_BUILD_ENV: "/x"})
    assert run_first.value.codes == ["bindings.library_absent"]
    with pytest.raises(Refused) as explicit_first:
        llama_bindings.library_dir({**only_launcher, llama_bindings.LIB_PATH_ENV: "/x"})
    assert explicit_first.value.codes == ["bindings.library_absent"]
    with pytest.raises(Refused) as unset:
        llama_bindings.library_dir({})
    assert native_build.ORACLE_NATIVE_ENV in unset.value.refusals[0].message


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"OMP_NUM_THREADS": "3"}, correctness.Threads(3, "OMP_NUM_THREADS")),
        ({"OMP_NUM_THREADS": "1"}, correctness.Threads(1, "OMP_NUM_THREADS")),
        ({}, correctness.Threads(1, "default")),
        ({"OMP_NUM_THREADS": ""}, correctness.Threads(1, "default")),
        ({"OMP_NUM_THREADS": "0"}, correctness.Threads(1, "default")),
        ({"OMP_NUM_THREADS": "-2"}, correctness.Threads(1, "default")),
        ({"OMP_NUM_THREADS": "two"}, correctness.Threads(1, "default")),
        ({"OMP_NUM_THREADS": "1.5"}, correctness.Threads(1, "default")),
    ],
)
def test_the_thread_count_is_the_shared_environments_else_one(
    environ: dict[str, str], expected: correctness.Threads
) -> None:
    assert correctness.oracle_threads(environ) == expected


class _FakeLlama:
    """Just the llama.cpp calls a session makes to load a model and open a context."""

    def __init__(self) -> None:
        self.contexts: list[SimpleNamespace] = []

    def llama_model_default_params(self) -> SimpleNamespace:
        return SimpleNamespace(n_gpu_layers=None)

    def llama_model_load_from_file(self, path: bytes, params: SimpleNamespace) -> object:
        return object()

    def llama_model_get_vocab(self, model: object) -> object:
        return object()

    def llama_vocab_n_tokens(self, vocab: object) -> int:
        return 32

    def llama_context_default_params(self) -> SimpleNamespace:
        return SimpleNamespace(n_threads=None, n_threads_batch=None)

    def llama_init_from_model(self, model: object, params: SimpleNamespace) -> SimpleNamespace:
        self.contexts.append(params)
        return params

    def llama_free(self, ctx: object) -> None:
        pass

    def llama_model_free(self, model: object) -> None:
        pass


@pytest.mark.parametrize("threads", [None, 3])
def test_every_context_runs_on_the_sessions_thread_count(
    threads: int | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A thread count in this process's environment must not leak past the one the session got.
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    lib = _FakeLlama()
    given = {} if threads is None else {"threads": threads}
    session = correctness.Session(lib, tmp_path / "model.gguf", 0, **given)
    session.context(64, 8, 1)
    session.context(64, 8, 2)
    session.close()
    want = threads or 1
    assert [(p.n_threads, p.n_threads_batch) for p in lib.contexts] == [(want, want)] * 2


def test_the_report_records_the_thread_count(reference_argv: list[str]) -> None:
    args = correctness.parse_args(reference_argv)
    assert args is not None
    given = correctness.Threads(3, "OMP_NUM_THREADS")
    report = correctness.build_report(args, correctness.Measured(threads=given), None)
    assert (report["threads"], report["threads_source"]) == (3, "OMP_NUM_THREADS")
    # new members go last, so the reference's members keep their places
    assert list(report)[-2:] == ["threads", "threads_source"]
    plain = correctness.build_report(args, correctness.Measured(), None)
    assert (plain["threads"], plain["threads_source"]) == (1, "default")
