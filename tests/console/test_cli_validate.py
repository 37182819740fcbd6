"""`cache-family validate`: exit 0 when valid, 2 with every refusal (code, path, hint) when not."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from operator_documents import C40, valid_document  # noqa: F401

from cache_family.cli import main
from cache_family.exit_codes import ExitCode

SECRET = "hf_s3cr3t_never_printed"


def refused_document() -> dict[str, Any]:
    doc = valid_document()
    doc["plan"]["concurrency"] = [4, 1, 2]
    doc["environment"] = {"HF_TOKEN": SECRET}
    doc["cell_seconds"] = 5
    return doc


EXPECTED_REFUSALS = [
    ("plan.concurrency.not_ascending", "$.plan.concurrency", "use [1, 2, 4]"),
    ("operator.environment.secret_name", "$.environment.HF_TOKEN", None),
    ("operator.budget.out_of_range", "$.cell_seconds", "use a whole number from 15 to 3600"),
]


def write(tmp_path: Path, doc: dict[str, Any] | bytes, name: str = "op.json") -> Path:
    path = tmp_path / name
    path.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    return path


def test_valid_input_exits_0_and_names_the_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, valid_document())
    assert main(["validate", "--input", str(path)]) == ExitCode.OK
    out = capsys.readouterr().out
    assert out.startswith(f"valid: {path}")
    assert hashlib.sha256(path.read_bytes()).hexdigest() in out


def test_refused_input_exits_2_and_prints_every_refusal_with_code_path_and_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, refused_document())
    assert main(["validate", "--input", str(path)]) == ExitCode.REFUSED
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("refused: ")]
    assert len(lines) == len(EXPECTED_REFUSALS)
    for line, (code, where, hint) in zip(lines, EXPECTED_REFUSALS, strict=True):
        assert line.startswith(f"refused: {code} at {where}: ")
        assert "(hint: " in line
        if hint is not None:
            assert line.endswith(f"(hint: {hint})")
    assert SECRET not in captured.out + captured.err


def test_json_verdicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path, valid_document(), "good.json")
    assert main(["validate", "--input", str(good), "--json"]) == ExitCode.OK
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["valid"] is True and verdict["refusals"] == []

    bad = write(tmp_path, refused_document(), "bad.json")
    assert main(["validate", "--input", str(bad), "--json"]) == ExitCode.REFUSED
    captured = capsys.readouterr()
    verdict = json.loads(captured.out)
    assert verdict["valid"] is False
    assert [(r["code"], r["path"]) for r in verdict["refusals"]] == [
        (code, where) for code, where, _ in EXPECTED_REFUSALS
    ]
    for refusal in verdict["refusals"]:
        assert set(refusal) == {"code", "path", "message", "hint"}
        assert refusal["message"] and refusal["hint"]
    assert SECRET not in captured.out + captured.err


@pytest.mark.parametrize(
    ("content", "code"),
    [
        (b'{"schema_version": 1,', "operator.json.decode"),
        (b"[1, 2]", "operator.type"),
        (b'{"schema_version": 1, "schema_version": 1}', "operator.json.duplicate_key"),
    ],
)
def test_undecodable_documents_are_refused_not_raised(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, code: str
) -> None:
    path = write(tmp_path, content)
    assert main(["validate", "--input", str(path), "--json"]) == ExitCode.REFUSED
    codes = [r["code"] for r in json.loads(capsys.readouterr().out)["refusals"]]
    assert code in codes


@pytest.mark.parametrize(
    ("path", "code"),
    [("/ops/op.json/", "cli.path.trailing_slash"), ("", "cli.path.empty")],
)
def test_a_path_refused_with_json_is_a_json_verdict_on_stdout(
    capsys: pytest.CaptureFixture[str], path: str, code: str
) -> None:
    # The path is refused while the arguments are parsed; stdout stayed empty.
    assert main(["validate", "--json", "--input", path]) == ExitCode.REFUSED
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["valid"] is False
    assert [(r["code"], r["path"]) for r in verdict["refusals"]] == [(code, "--input")]


def test_a_missing_file_is_a_refusal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--input", str(tmp_path / "absent.json")]) == ExitCode.REFUSED
    assert "refused: file.missing" in capsys.readouterr().err


def _installed_command() -> Path:
    command = Path(sys.executable).parent / "cache-family"
    if not command.exists():
        pytest.fail(f"{command} is missing: install the package into the venv (pip install -e .)")
    return command


def test_the_installed_command_validates_in_a_real_process(tmp_path: Path) -> None:
    command = _installed_command()
    env = {"PATH": str(command.parent), "LC_ALL": "C.UTF-8"}
    good = write(tmp_path, valid_document(), "good.json")
    ran = subprocess.run(
        [str(command), "validate", "--input", str(good)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert (ran.returncode, ran.stderr) == (ExitCode.OK, "")
    assert ran.stdout.startswith("valid: ")

    bad = write(tmp_path, refused_document(), "bad.json")
    ran = subprocess.run(
        [str(command), "validate", "--input", str(bad), "--json"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert ran.returncode == ExitCode.REFUSED
    assert "Traceback" not in ran.stderr
    verdict = json.loads(ran.stdout)
    assert [r["code"] for r in verdict["refusals"]] == [c for c, _, _ in EXPECTED_REFUSALS]
    assert SECRET not in ran.stdout + ran.stderr
