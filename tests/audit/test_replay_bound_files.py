"""Replay against what the run bound, after the attack run: a receipt is held to its
``run_files`` digest too, ``report-files.json`` deleted alone differs, and a publication's
leftover temporary file (a writer killed mid-link, its directory moved aside by a resume) is
named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replay_harness import build_run, journal_lines, rechain, write_lines

from cache_family.actors.audit.replay import replay
from cache_family.cli import main as cli_main
from cache_family.schemas.journal import RunFilesBound, decode_line

ROW_RECEIPT = "cell-0000/row.json"


def test_a_receipt_is_held_to_its_run_files_digest(tmp_path: Path) -> None:
    """A re-chained journal whose ``run_files`` record binds the row receipt with another
    digest than the receipt's bytes (which still match their publication and re-fold): the
    two records of the journal disagree about the file, and replay says so."""
    build_run(tmp_path)
    assert replay(str(tmp_path)).exit_code == 0
    lines = journal_lines(tmp_path)

    def other_digest(index: int, obj: dict[str, Any]) -> None:
        if isinstance(decode_line(lines[index]).record, RunFilesBound):
            for entry in obj["record"]["files"]:
                if entry["path"] == ROW_RECEIPT:
                    entry["sha256"] = "0" * 64

    write_lines(tmp_path, rechain(lines, other_digest))
    report = replay(str(tmp_path))
    assert report.mismatched == [ROW_RECEIPT], report.lines
    assert any(
        line.startswith(f"DIFFERS {ROW_RECEIPT}: replay.file.changed: ") for line in report.lines
    )
    assert f"identical {ROW_RECEIPT} (seq" in "\n".join(report.lines)  # its own checks hold
    assert report.exit_code == 1


def test_report_files_json_deleted_alone_differs(tmp_path: Path) -> None:
    build_run(tmp_path, synthetic=True)
    assert cli_main(["report-run", str(tmp_path)]) == 0
    assert replay(str(tmp_path)).exit_code == 0
    (tmp_path / "report-files.json").unlink()
    report = replay(str(tmp_path))
    assert report.exit_code == 1 and report.mismatched == ["report-files.json"]
    assert any("replay.report.manifest_missing" in line for line in report.lines)


def test_a_publications_leftover_temporary_is_named(tmp_path: Path) -> None:
    """A SIGKILL between writing ``.cli-admission.json.<token>.tmp`` and linking it left the
    file; a resume moved its cell aside and the resumed run bound it. Replay names it."""
    aside = tmp_path / "superseded" / "attempt-1" / "cell-0000" / "skippy-new"
    aside.mkdir(parents=True)
    leftover = aside / ".cli-admission.json.0123456789ab.tmp"
    leftover.write_bytes(b'{"dialect": "llama-se')
    build_run(tmp_path)
    report = replay(str(tmp_path))
    assert report.exit_code == 0  # the run bound it as it found it: no difference
    relative = str(leftover.relative_to(tmp_path))
    assert any(
        line.startswith(f"run files: note: {relative}: replay.file.leftover_temporary: ")
        for line in report.lines
    ), report.lines
