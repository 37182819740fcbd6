"""Journal anchoring (issue 12, item 5): what a finished journal refuses after its end, fields
no reader knows, the head an auditor holds apart from the run directory, and the head's
OpenSSH signature.

The run directories are written by the real journal writer and receipt publication
(``test_replay.build_run``); ``ssh-keygen`` is the real OpenSSH tool. Forgeries are built the
way an attacker with write access would: re-chain every line and recompute the seal, which
needs no secret.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from replay_harness import build_run, journal_lines, rechain, write_lines

from cache_family.actors.audit.head_signature import (
    SIGNATURE_FILENAME,
    SIGNATURE_NAMESPACE,
    head_line,
    sign_head,
)
from cache_family.actors.audit.replay import HeadCheck, replay
from cache_family.schemas.journal import (
    Fault,
    JournalChain,
    Record,
    RowOpened,
    decode_line,
)

SSH_KEYGEN = shutil.which("ssh-keygen", path="/usr/bin:/bin")
needs_ssh_keygen = pytest.mark.skipif(
    SSH_KEYGEN is None,
    reason="SKIPPED LOUDLY: ssh-keygen (OpenSSH client tools) is not installed, so head "
    "signing cannot be tested here; install openssh-client",
)
IDENTITY = "auditor@example.org"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    build_run(out)
    return out


def head_of(run_dir: Path) -> str:
    return hashlib.sha256(journal_lines(run_dir)[-1]).hexdigest()


def seal_codes(report: Any) -> list[str]:
    return [
        line.split("refused: ", 1)[1].split(" at ", 1)[0]
        for line in report.lines
        if line.startswith("journal: seal broken: refused: ")
    ]


def refusal_codes(report: Any) -> list[str]:
    return [
        line.split("refused: ", 1)[1].split(" at ", 1)[0]
        for line in report.lines
        if line.startswith("journal: refused: ")
    ]


# --- refuse records after the final seal ------------------------------------------------------


def test_a_chained_record_after_the_final_seal_is_a_typed_refusal(run_dir: Path) -> None:
    lines = journal_lines(run_dir)
    last = decode_line(lines[-1])
    chain = JournalChain(next_seq=last.seq + 1, prev=hashlib.sha256(lines[-1]).hexdigest())
    forged: Record = Fault(cell_id=None, kind="internal", detail="appended later")
    _, data = chain.line(forged, mono_ns=last.mono_ns + 1, wall_ns=last.wall_ns + 1)
    (run_dir / "journal.jsonl").write_bytes(b"".join(line + b"\n" for line in lines) + data)
    report = replay(str(run_dir))
    assert report.exit_code == 1
    assert seal_codes(report) == ["journal.seal.trailing_record"]
    assert f"$.journal[{last.seq}]" in next(ln for ln in report.lines if "trailing" in ln)


def test_a_record_slipped_between_the_matrix_and_a_recomputed_seal_is_refused(
    run_dir: Path,
) -> None:
    """The seal's digest needs no secret: a record inserted after the matrix's publication,
    with the seal recomputed, is consistent in itself and is refused by position."""
    lines = journal_lines(run_dir)
    assert b'"scope":"matrix"' in lines[-2]
    matrix = decode_line(lines[-2])
    extra = msgspec.json.decode(lines[-2])
    extra["record"] = msgspec.to_builtins(Fault(cell_id=None, kind="internal", detail="late"))
    extra["seq"] = matrix.seq + 1
    sealed = decode_line(lines[-1])
    moved_seal = msgspec.json.decode(lines[-1])
    moved_seal["seq"] = sealed.seq + 1
    forged = [*lines[:-1], msgspec.json.encode(extra), msgspec.json.encode(moved_seal)]
    write_lines(run_dir, rechain(forged))
    report = replay(str(run_dir))
    assert report.exit_code == 1
    assert seal_codes(report) == ["journal.matrix.trailing_record"]


# --- replay is strict about unknown fields ------------------------------------------------------


@pytest.mark.parametrize(
    ("tag", "where"),
    [
        pytest.param("transition", ("record",), id="record"),
        pytest.param("rung_completed", ("record", "tally"), id="nested-rung-facts"),
        pytest.param("cleanup_outcome", ("record", "cleanup"), id="nested-host-cleanup"),
    ],
)
def test_an_unknown_field_in_a_rechained_journal_is_refused(
    run_dir: Path, tag: str, where: tuple[str, ...]
) -> None:
    lines = journal_lines(run_dir)
    target = next(i for i, raw in enumerate(lines) if f'"type":"{tag}"'.encode() in raw)

    def add_field(index: int, obj: dict[str, Any]) -> None:
        if index == target:
            node = obj
            for key in where:
                node = node[key]
            node["smuggled"] = "unnoticed"

    write_lines(run_dir, rechain(lines, add_field))
    report = replay(str(run_dir))
    assert report.exit_code == 2 and report.unreadable
    [line] = [ln for ln in report.lines if ln.startswith("unreadable: ")]
    assert line.startswith(f"unreadable: journal.record.unknown_field at $.journal[{target}]")
    assert "field `smuggled`" in line


def test_an_edit_of_the_last_lines_clock_is_caught_by_the_seal_over_its_own_line(
    run_dir: Path,
) -> None:
    """Why this holds: the seal's digest covers the bytes before it AND its own line (with the
    digest blank), so the clocks of the last line are inside what it vouches for."""
    lines = journal_lines(run_dir)
    edited = lines[-1].replace(b'"mono_ns":', b'"mono_ns":9', 1)
    assert decode_line(edited).record == decode_line(lines[-1]).record
    write_lines(run_dir, [*lines[:-1], edited])
    report = replay(str(run_dir))
    assert report.exit_code == 1 and seal_codes(report) == ["journal.seal.digest"]


# --- the head, printed and expected -------------------------------------------------------------


def test_replay_prints_the_head_in_the_runs_words_and_accepts_it_as_expected(
    run_dir: Path,
) -> None:
    head = head_of(run_dir)
    report = replay(str(run_dir), head=HeadCheck(expect_head=head))
    assert report.exit_code == 0, report.lines
    assert head_line(head) in report.lines
    assert report.lines[-1].startswith("replay: identical")


def test_a_rechained_refolded_journal_replays_clean_and_only_the_expected_head_catches_it(
    run_dir: Path,
) -> None:
    head = head_of(run_dir)
    lines = journal_lines(run_dir)

    def shift_clock(index: int, obj: dict[str, Any]) -> None:
        if index == 3:
            obj["wall_ns"] += 1

    write_lines(run_dir, rechain(lines, shift_clock))
    assert replay(str(run_dir)).exit_code == 0  # consistent in itself: the limit of replay
    report = replay(str(run_dir), head=HeadCheck(expect_head=head))
    assert report.exit_code == 1
    assert refusal_codes(report) == ["replay.head.mismatch"]
    assert "rewritten or replaced" in next(ln for ln in report.lines if "head.mismatch" in ln)


def test_a_head_followed_by_more_lines_says_records_were_appended(run_dir: Path) -> None:
    head = head_of(run_dir)
    lines = journal_lines(run_dir)
    last = decode_line(lines[-1])
    chain = JournalChain(next_seq=last.seq + 1, prev=head)
    _, data = chain.line(RowOpened(row_index=9, row_key="x", case_key="x"), mono_ns=1, wall_ns=1)
    (run_dir / "journal.jsonl").write_bytes(b"".join(ln + b"\n" for ln in lines) + data)
    report = replay(str(run_dir), head=HeadCheck(expect_head=head))
    assert "replay.head.mismatch" in refusal_codes(report)
    assert any("goes on for 1 line(s) after the expected head" in ln for ln in report.lines)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "cache-family"), *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
        timeout=120,
        check=False,
    )


def test_replay_expect_head_on_the_command_line(run_dir: Path) -> None:
    head = head_of(run_dir)
    ok = cli("replay", str(run_dir), "--expect-head", head)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert head_line(head) in ok.stdout.splitlines()
    wrong = cli("replay", str(run_dir), "--expect-head", "f" * 64)
    assert wrong.returncode == 1
    assert "journal: refused: replay.head.mismatch at $.journal" in wrong.stdout
    malformed = cli("replay", str(run_dir), "--expect-head", head.upper())
    assert malformed.returncode == 2
    assert "refused: cli.usage at --expect-head" in malformed.stderr


# --- the head's signature (OpenSSH) -------------------------------------------------------------


def keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """A fresh unencrypted ed25519 key and an allowed-signers file naming IDENTITY for it."""
    assert SSH_KEYGEN is not None
    key = directory / name
    subprocess.run(
        [SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)],
        env={"PATH": "/usr/bin:/bin"},
        check=True,
        capture_output=True,
        timeout=60,
    )
    public = (directory / f"{name}.pub").read_text().split()
    signers = directory / f"{name}.allowed"
    signers.write_text(f'{IDENTITY} namespaces="{SIGNATURE_NAMESPACE}" {public[0]} {public[1]}\n')
    return key, signers


@needs_ssh_keygen
def test_a_signed_head_verifies_and_a_rewritten_chain_does_not(
    run_dir: Path, tmp_path: Path
) -> None:
    key, signers = keypair(tmp_path, "operator")
    _, other_signers = keypair(tmp_path, "stranger")
    sign_head(str(run_dir), str(key), head_of(run_dir))
    assert (run_dir / SIGNATURE_FILENAME).read_bytes().startswith(b"-----BEGIN SSH SIGNATURE")
    check = HeadCheck(allowed_signers=str(signers), signer_identity=IDENTITY)
    good = replay(str(run_dir), head=check)
    assert good.exit_code == 0, good.lines
    assert f"journal: head signed by {IDENTITY!r}: verified" in good.lines

    stranger = replay(
        str(run_dir), head=HeadCheck(allowed_signers=str(other_signers), signer_identity=IDENTITY)
    )
    assert refusal_codes(stranger) == ["replay.signature.invalid"]

    def shift_clock(index: int, obj: dict[str, Any]) -> None:
        if index == 2:
            obj["mono_ns"] += 1

    write_lines(run_dir, rechain(journal_lines(run_dir), shift_clock))
    forged = replay(str(run_dir), head=check)
    assert forged.exit_code == 1
    assert refusal_codes(forged) == ["replay.signature.invalid"]

    os.unlink(run_dir / SIGNATURE_FILENAME)
    assert refusal_codes(replay(str(run_dir), head=check)) == ["replay.signature.missing"]


@needs_ssh_keygen
def test_run_signs_its_head_and_replay_verifies_it_through_the_cli(tmp_path: Path) -> None:
    """A real ``cache-family run`` (FAKE host) with ``--sign-key``: the signature lies beside
    the journal, the head is still the last line, and replay verifies both."""
    from run_harness import make_prepared

    prepared = make_prepared(tmp_path / "prep")
    key, signers = keypair(tmp_path, "operator")
    out = tmp_path / "out"
    ran = cli("run", "--input", str(prepared), "--output", str(out), "--sign-key", str(key))
    assert ran.returncode == 0, ran.stderr
    head = hashlib.sha256((out / "journal.jsonl").read_bytes().splitlines()[-1]).hexdigest()
    assert ran.stdout.splitlines()[-1] == head_line(head)
    assert f"journal head signed: {out / SIGNATURE_FILENAME}" in ran.stderr
    verified = cli(
        "replay", str(out), "--expect-head", head,
        "--allowed-signers", str(signers), "--signer-identity", IDENTITY,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stdout
    assert f"journal: head signed by {IDENTITY!r}: verified" in verified.stdout
    lonely = cli("replay", str(out), "--allowed-signers", str(signers))
    assert lonely.returncode == 2 and "go together" in lonely.stderr


@needs_ssh_keygen
def test_a_key_that_cannot_sign_refuses_the_run_before_anything_is_written(
    tmp_path: Path,
) -> None:
    from run_harness import make_prepared

    prepared = make_prepared(tmp_path / "prep")
    not_a_key = tmp_path / "not-a-key"
    not_a_key.write_text("this is no private key\n")
    out = tmp_path / "out"
    ran = cli("run", "--input", str(prepared), "--output", str(out), "--sign-key", str(not_a_key))
    assert ran.returncode == 2
    assert "refused: journal.sign.failed at $.sign_key" in ran.stderr
    assert not out.exists()
