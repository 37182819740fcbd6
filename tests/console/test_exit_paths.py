"""Every failing exit of every command ends with the same three lines on stderr: what failed,
where its evidence is (a path), and what to do next."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cache_family.cli import main
from cache_family.schemas.examples import example_operator


def closing_lines(stderr: str, who: str) -> dict[str, str]:
    """The failed / evidence / next lines of ``who``, which must close stderr."""
    tail = stderr.splitlines()[-3:]
    prefix = f"{who}: "
    assert all(line.startswith(prefix) for line in tail), stderr
    parts = [line[len(prefix) :].split(": ", 1) for line in tail]
    assert [key for key, _ in parts] == ["failed", "evidence", "next"], stderr
    assert all(value.strip() for _, value in parts), stderr
    return dict((key, value) for key, value in parts)


def test_a_refused_run_says_nothing_was_written_and_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.json"
    out = tmp_path / "run"
    assert main(["run", "--input", str(missing), "--output", str(out)]) == 2
    lines = closing_lines(capsys.readouterr().err, "run")
    assert str(missing) in lines["evidence"] and "nothing was written" in lines["evidence"]
    assert not out.exists()


def test_quiet_and_json_events_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["run", "--input", "/a.json", "--output", "/b", "--quiet", "--json-events"])
    assert done.value.code == 2
    assert "cli.usage" in capsys.readouterr().err


def test_replay_of_a_directory_that_is_no_run_names_its_journal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["replay", str(tmp_path)])
    assert code == 2
    lines = closing_lines(capsys.readouterr().err, "replay")
    assert lines["evidence"] == str(tmp_path / "journal.jsonl")


def test_a_refused_report_leaves_its_output_untouched_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "production-cache-bench.json"
    bad.write_text("{not json")
    output = tmp_path / "readme-tables.md"
    output.write_text("earlier tables\n")
    assert main(["report", "--input", str(bad), "--output", str(output)]) == 2
    lines = closing_lines(capsys.readouterr().err, "report")
    assert f"{output} was left untouched" in lines["evidence"]
    assert output.read_text() == "earlier tables\n"


def test_a_refused_run_report_names_the_run_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report-run", str(tmp_path / "no-run")]) == 2
    lines = closing_lines(capsys.readouterr().err, "report-run")
    assert str(tmp_path / "no-run") in lines["evidence"]
    assert "replay" in lines["next"]


def test_a_refused_preparation_names_its_input_and_the_validator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    operator = tmp_path / "operator.json"
    operator.write_text(json.dumps({**example_operator(), "execution_seconds": -1}))
    out = tmp_path / "prepared"
    assert main(["prepare-full", "--input", str(operator), "--output", str(out)]) == 2
    lines = closing_lines(capsys.readouterr().err, "prepare-full")
    assert str(operator) in lines["evidence"] and "nothing was written" in lines["evidence"]
    assert f"cache-family validate --input {operator}" in lines["next"]
    assert not out.exists()


def test_an_invalid_operator_input_ends_validate_with_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    operator = tmp_path / "operator.json"
    operator.write_text(json.dumps({**example_operator(), "execution_seconds": -1}))
    assert main(["validate", "--input", str(operator)]) == 2
    assert closing_lines(capsys.readouterr().err, "validate")["evidence"] == str(operator)


def test_a_resume_of_a_directory_that_is_no_run_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--resume", str(tmp_path)]) == 2
    lines = closing_lines(capsys.readouterr().err, "run --resume")
    assert str(tmp_path) in lines["evidence"]
    assert list(tmp_path.iterdir()) == []
