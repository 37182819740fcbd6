"""`cache-family report` end to end as a child process: both spellings, stdout and file output,
the reference's last-occurrence options, and a refusal that leaves the output alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cache_family.cli import main, normalize_argv

ROOT = Path(__file__).resolve().parents[2]
PRODUCERS = ROOT / "tests" / "support" / "golden" / "report" / "producers"
INPUTS = ["production-cache-bench-a.json", "production-cache-bench-b.json"]
EXPECTED = (PRODUCERS / "expected.md").read_bytes()


def child(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8"}
    return subprocess.run(
        [sys.executable, "-m", "cache_family.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def copy_inputs(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    for name in [*INPUTS, "corpus.json"]:
        shutil.copyfile(PRODUCERS / name, work / name)
    return work


def test_writes_the_golden_text_creating_parents(tmp_path: Path) -> None:
    work = copy_inputs(tmp_path)
    args = ["report", "--input", INPUTS[0], "--input", INPUTS[1]]
    args += ["--use-case-corpus", "corpus.json", "--output", "out/deep/readme-tables.md"]
    done = child(args, work)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == "Wrote out/deep/readme-tables.md\n"
    assert (work / "out" / "deep" / "readme-tables.md").read_bytes() == EXPECTED
    assert os.listdir(work / "out" / "deep") == ["readme-tables.md"]


def test_replaces_an_existing_output(tmp_path: Path) -> None:
    work = copy_inputs(tmp_path)
    (work / "README.md").write_text("old tables\n")
    args = ["automation", "cache-family-report", "--input", INPUTS[0], "--input", INPUTS[1]]
    args += ["--use-case-corpus", "corpus.json", "--output", "README.md"]
    done = child(args, work)
    assert done.returncode == 0, done.stderr
    assert (work / "README.md").read_bytes() == EXPECTED


def test_without_output_prints_the_text(tmp_path: Path) -> None:
    work = copy_inputs(tmp_path)
    done = child(["report", *_inputs(), "--use-case-corpus", "corpus.json"], work)
    assert done.returncode == 0, done.stderr
    assert done.stdout == EXPECTED.decode("utf-8")
    assert sorted(os.listdir(work)) == sorted([*INPUTS, "corpus.json"])


def test_output_and_corpus_take_their_last_occurrence(tmp_path: Path) -> None:
    work = copy_inputs(tmp_path)
    (work / "other.json").write_text('{"use_cases": []}')
    args = ["report", *_inputs(), "--use-case-corpus", "other.json"]
    args += ["--use-case-corpus", "corpus.json", "--output", "first.md", "--output", "second.md"]
    done = child(args, work)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "Wrote second.md\n"
    assert not (work / "first.md").exists()
    assert (work / "second.md").read_bytes() == EXPECTED


def test_a_refusal_leaves_the_existing_output_byte_identical(tmp_path: Path) -> None:
    work = copy_inputs(tmp_path)
    (work / "bad.json").write_text('[{"family": "Llama", "prefix_tokens": 128.0}]')
    precious = b"# README\n\nhand-written\n"
    (work / "README.md").write_bytes(precious)
    done = child(["report", *_inputs(), "--input", "bad.json", "--output", "README.md"], work)
    assert done.returncode == 2
    assert done.stdout == ""
    assert (
        f"refused: report.type at $[0].prefix_tokens: {work / 'bad.json'}: expected an "
        "integer, got a number (hint: " in done.stderr
    )
    assert "Traceback" not in done.stderr
    assert (work / "README.md").read_bytes() == precious


def test_usage_errors_are_refused() -> None:
    assert normalize_argv(["automation", "cache-family-report", "--input", "/a"]) == [
        "report",
        "--input",
        "/a",
    ]
    for argv in (["report"], ["report", "--input", "/a.json", "positional"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 2


def test_help_lists_the_report_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "report" in capsys.readouterr().out


@pytest.mark.skipif(
    shutil.which("just", path=str(ROOT / ".venv" / "bin")) is None, reason="no just"
)
def test_the_just_recipe_reaches_the_report(tmp_path: Path) -> None:
    work = copy_inputs(tmp_path)
    just = shutil.which("just", path=str(ROOT / ".venv" / "bin"))
    assert just is not None
    output = work / "with space" / "readme-tables.md"
    args = [just, "--justfile", str(ROOT / "justfile"), "automation-run", "automation"]
    args += ["cache-family-report", "--input", str(work / INPUTS[0])]
    corpus = work / "corpus.json"
    args += ["--input", str(work / INPUTS[1]), "--use-case-corpus", str(corpus)]
    args += ["--output", str(output)]  # just runs recipes in the justfile's directory
    done = subprocess.run(
        args,
        cwd=work,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith(f"Wrote {output}\n")
    assert output.read_bytes() == EXPECTED.replace(b"`corpus.json`", f"`{corpus}`".encode())


def _inputs() -> list[str]:
    return [arg for name in INPUTS for arg in ("--input", name)]
