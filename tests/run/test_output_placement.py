"""Where a run may write, and what a full disk leaves behind.

`run --output` inside the native build, the model cache or a toolkit tree is refused as
preparation refuses it (one overlap check). On a full disk the run says what failed,
removes its temporaries and never names a file it did not write. The full-disk tests use a
real tmpfs of a few hundred KiB (they need the right to mount, and skip without it); the
temporary's removal is also checked with a real write failure any user can cause
(RLIMIT_FSIZE).
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from signal_harness import start_stalled_run, stop, wait_exit

from cache_family.actors.audit.replay import replay
from cache_family.actors.run import matrix
from cache_family.actors.run.custody import port_is_free, still_same
from cache_family.cli import main
from cache_family.console import commands
from cache_family.schemas.journal import ChildSpawned, PortReserved, read_journal
from cache_family.schemas.matrix import MATRIX_FILENAME
from cache_family.system.publish import publish_fresh


def _prepared_trees(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    from run_harness import make_prepared

    prepared = make_prepared(tmp_path / "p")
    document = json.loads(prepared.read_bytes())
    return prepared, {
        "native_build": document["native_build"]["path"],
        "cache_root": document["cache_root"],
    }


@pytest.mark.parametrize(
    ("tree", "where"),
    [("native_build", "native_build.path"), ("cache_root", "cache_root")],
)
def test_run_output_inside_a_pinned_tree_is_refused_and_nothing_is_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tree: str, where: str
) -> None:
    prepared, trees = _prepared_trees(tmp_path)
    before = sorted(Path(trees[tree]).rglob("*"))
    out = Path(trees[tree]) / "run-out"
    assert main(["run", "--input", str(prepared), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"refused: run.output_not_disjoint at $.output: output {out} overlaps" in err
    assert f"(the prepared input's {where})" in err
    assert not out.exists()
    assert sorted(Path(trees[tree]).rglob("*")) == before


def test_a_symlink_into_the_build_does_not_hide_the_overlap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prepared, trees = _prepared_trees(tmp_path)
    door = tmp_path / "door"
    door.symlink_to(trees["native_build"], target_is_directory=True)
    out = door / "run-out"
    assert main(["run", "--input", str(prepared), "--output", str(out)]) == 2
    assert "run.output_not_disjoint" in capsys.readouterr().err
    assert not (Path(trees["native_build"]) / "run-out").exists()


# --- a write that fails ------------------------------------------------------------------


def test_a_failed_write_leaves_no_temporary_behind(tmp_path: Path) -> None:
    # RLIMIT_FSIZE makes the write itself fail (EFBIG), as a full disk makes it fail with
    # ENOSPC: the same path through publish_fresh, for any user.
    code = (
        "import errno, resource, signal, sys\n"
        "from cache_family.system.publish import publish_fresh\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "try:\n"
        "    publish_fresh(sys.argv[1], b'x' * 65536)\n"
        "except OSError as exc:\n"
        "    sys.exit(exc.errno)\n"
    )
    target = tmp_path / "receipt.json"
    ran = subprocess.run(
        [sys.executable, "-c", code, str(target)], capture_output=True, timeout=120, check=False
    )
    assert ran.returncode == errno.EFBIG, ran.stderr.decode()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 512 KiB tmpfs, unmounted afterwards; skips where mounting is not allowed."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k,mode=0755", "tmpfs", str(mount_point)],
        capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], timeout=60, check=False)


def _fill(disk: Path) -> None:
    """Take every free block of the tmpfs."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_publishing_on_a_full_disk_raises_enospc_and_leaves_nothing(tiny_disk: Path) -> None:
    _fill(tiny_disk)
    with pytest.raises(OSError) as failed:
        publish_fresh(str(tiny_disk / "cell.json"), b"{}" * 8192)
    assert failed.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["filler"]


def _absolute_paths(text: str) -> list[str]:
    return re.findall(r"(/[^\s;:()]+)", text)


async def test_a_run_that_fills_its_disk_says_so_and_names_no_missing_file(
    tmp_path: Path, tiny_disk: Path
) -> None:
    # The run writes into the tiny disk; once its host is mid-ladder the disk is filled and
    # the run interrupted, so the receipts, the journal's tail and the matrix find no room.
    run = await start_stalled_run(tmp_path, out=tiny_disk / "out")
    try:
        assert (await run.fifo.next_line()).startswith("stream ")
        # The run's private copy of the server is removed with its hosts; hard links keep its
        # blocks taken, so the disk stays full for the receipts and the matrix.
        kept = tiny_disk / "kept"
        kept.mkdir()
        copies = [p for p in run.out.rglob("*") if "exec-state-" in str(p) and p.is_file()]
        for index, path in enumerate(p for p in copies if not p.is_symlink()):
            os.link(path, kept / str(index))
        await trio.to_thread.run_sync(_fill, tiny_disk)
        run.process.send_signal(signal.SIGINT)
        code = await wait_exit(run.process)
    finally:
        stop(run)
    stdout = (run.logs / "run.stdout").read_text()
    stderr = (run.logs / "run.stderr").read_text()
    assert code == 130, stderr
    assert "Traceback" not in stderr
    assert "No space left on device" in stderr
    assert not (run.out / MATRIX_FILENAME).exists()
    assert f"no {MATRIX_FILENAME} could be written" in stdout
    for path in _absolute_paths(stdout):
        assert os.path.exists(path), f"the run named {path}, which does not exist"
    leftovers = [p for p in run.out.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []
    # The journal's last line may be torn (the disk filled mid-line): replay reports that;
    # its trusted lines still name every host, and none of them survived.
    read = read_journal((run.out / "journal.jsonl").read_bytes())
    spawned = [line.record for line in read.lines if isinstance(line.record, ChildSpawned)]
    assert spawned
    for child in spawned:
        assert not still_same(child.pid, child.create_time), f"host {child.pid} survived"
    for line in read.lines:
        if isinstance(line.record, PortReserved):
            assert port_is_free(line.record.port)


# --- an output parent that changes while the run starts ---------------------------------


def _stub_supervision(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Stop ``run`` right after it made its run directory (nothing is supervised)."""
    started: list[str] = []

    def supervise(admitted: matrix.AdmittedRun, **_: object) -> int:
        started.append(admitted.output)
        return 0

    monkeypatch.setattr(commands, "supervise_command", supervise)
    return started


def _flip_to_link(parent: Path, away: Path, target: str) -> None:
    os.rename(parent, away)
    parent.symlink_to(target, target_is_directory=True)


def test_a_parent_flipped_into_the_build_after_admission_gets_no_run_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared, trees = _prepared_trees(tmp_path)
    build = Path(trees["native_build"])
    before = sorted(build.rglob("*"))
    parent = tmp_path / "runs"
    parent.mkdir()
    started = _stub_supervision(monkeypatch)
    admit = commands.admit_run

    def admit_then_flip(*args: Any, **kwargs: Any) -> matrix.AdmittedRun:
        admitted = admit(*args, **kwargs)  # the parent was a real directory when checked
        _flip_to_link(parent, tmp_path / "runs-away", str(build))
        return admitted

    monkeypatch.setattr(commands, "admit_run", admit_then_flip)
    assert main(["run", "--input", str(prepared), "--output", str(parent / "out")]) == 2
    assert "refused: run.output_parent at $.output" in capsys.readouterr().err
    assert started == [] and sorted(build.rglob("*")) == before


def test_a_link_flipping_while_it_is_resolved_is_a_refusal_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared, _ = _prepared_trees(tmp_path)
    parent = tmp_path / "runs"
    parent.mkdir()
    started = _stub_supervision(monkeypatch)
    resolve = os.path.realpath

    def flipped_midway(path: Any, *args: Any, **kwargs: Any) -> str:
        # What os.path.realpath raises when a link it has lstat'ed is a directory again by
        # the time it reads the link (readlink: EINVAL).
        if os.fspath(path) == str(parent):
            raise OSError(errno.EINVAL, "Invalid argument", str(parent))
        return resolve(path, *args, **kwargs)

    monkeypatch.setattr(os.path, "realpath", flipped_midway)
    assert main(["run", "--input", str(prepared), "--output", str(parent / "out")]) == 2
    err = capsys.readouterr().err
    assert "refused: run.output_parent at $.output" in err and "Traceback" not in err
    assert started == [] and not (parent / "out").exists()


def test_an_output_parent_flipping_between_a_directory_and_a_link_never_lands_in_the_build(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the interleaving: each try makes its run directory in the real directory or
    is refused with a typed code; none lands in the build, none ends in a traceback."""
    prepared, trees = _prepared_trees(tmp_path)
    build = Path(trees["native_build"])
    before = sorted(build.rglob("*"))
    parent, away = tmp_path / "runs", tmp_path / "runs-away"
    parent.mkdir()
    started = _stub_supervision(monkeypatch)
    done = threading.Event()

    def flip() -> None:
        while not done.is_set():
            _flip_to_link(parent, away, str(build))
            parent.unlink()
            os.rename(away, parent)

    flipper = threading.Thread(target=flip)
    flipper.start()
    codes = []
    try:
        for index in range(40):
            codes.append(
                main(["run", "--input", str(prepared), "--output", str(parent / f"out-{index}")])
            )
    finally:
        done.set()
        flipper.join()
    assert set(codes) <= {0, 2}
    assert "Traceback" not in capsys.readouterr().err
    assert sorted(build.rglob("*")) == before
    made = {path.name for path in parent.iterdir()}
    assert made == {Path(output).name for output in started}


def test_a_parent_flipped_into_the_build_after_the_run_directory_is_made_moves_no_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack run's interleaving, made certain: an empty ``NATIVE/out`` made beforehand
    (an empty directory does not change the tree pin), and the output's parent flipped to a
    link into the build right after the run directory was made and checked, before the run
    opened its journal or its lock. Every write of the run goes through the directory handle
    opened when the directory was made: the run completes in the real directory, and nothing
    lands in the build."""
    prepared, trees = _prepared_trees(tmp_path)
    build = Path(trees["native_build"])
    (build / "out").mkdir()
    before = sorted(build.rglob("*"))
    parent, away = tmp_path / "runs", tmp_path / "runs-away"
    parent.mkdir()
    make = commands.make_fresh_dir

    def make_then_flip(*args: Any, **kwargs: Any) -> matrix.RunHandle:
        handle = make(*args, **kwargs)  # made and checked: the path names the new directory
        _flip_to_link(parent, away, str(build))
        return handle

    monkeypatch.setattr(commands, "make_fresh_dir", make_then_flip)
    code = main(["run", "--input", str(prepared), "--output", str(parent / "out"), "--quiet"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert sorted(build.rglob("*")) == before  # the empty out/ only: no journal, no lock
    real = away / "out"
    assert {"journal.jsonl", "run.lock", MATRIX_FILENAME} <= {p.name for p in real.iterdir()}
    assert replay(str(real)).exit_code == 0
    # What the run printed names the directory as the operator gave it, not the handle.
    assert f"completed: {parent / 'out' / MATRIX_FILENAME}" in out.out
    assert "/proc/" not in out.out + out.err
