"""A row hashes each pinned file in full at most twice (its first verification and its last),
and checks the file's identity through a held descriptor at every verification in between;
a replacement, a write (even one that restores the mtime), a truncation or a re-pointed link
is still found, hashed again and reported as drift exactly as a full re-hash would."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
from fake_hosts.fake_custody import FakeHostScript, fake_child_runner, fake_opener
from run_harness import autojump_clock, cell, make_prepared, records, row  # noqa: F401

from cache_family.actors.audit.replay import replay
from cache_family.actors.run import row as row_actor
from cache_family.actors.run.cell import pin_records
from cache_family.actors.run.context import (
    HostSettings,
    PinResult,
    PinTarget,
    RowPins,
    hash_pins,
)
from cache_family.actors.run.matrix import admit_run, supervise
from cache_family.actors.run.private_exec import PrivateCopy, RowExec
from cache_family.console.progress import RunProgress
from cache_family.schemas.journal import PinDrift, PinObserved
from cache_family.system.child import ChildCommand, ChildEnded, OnSpawn
from cache_family.system.pins import HELD_TREE_LIMIT, Budget, pin_tree

CONTENT = b"GGUF" + bytes(range(256)) * 64


class CountingHasher:
    """The real ``hash_pins``, counting what it hashed."""

    def __init__(self) -> None:
        self.hashed: list[str] = []

    async def __call__(self, targets: Sequence[PinTarget], seconds: float) -> list[PinResult]:
        self.hashed += [target.name for target in targets]
        return await hash_pins(targets, seconds)


def model(tmp_path: Path, content: bytes = CONTENT) -> tuple[Path, PinTarget]:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    return path, PinTarget("model", str(path), hashlib.sha256(content).hexdigest(), "file")


async def verify(pins: RowPins, target: PinTarget, *, final: bool = False) -> PinResult:
    [result] = await pins.verify([target], 60.0, final=final)
    return result


async def test_a_row_hashes_an_unchanged_file_twice_whatever_its_cell_count(
    tmp_path: Path,
) -> None:
    _, target = model(tmp_path)
    tree = tmp_path / "build"
    tree.mkdir()
    (tree / "lib.so").write_bytes(b"lib")
    tree_sha = pin_tree(str(tree), Budget.seconds(60)).sha256
    tree_target = PinTarget("native_build", str(tree), tree_sha, "tree")
    hasher = CountingHasher()
    pins = RowPins(hasher, racy_seconds=0)
    first = await verify(pins, target)
    assert first.matches and first.verified_by == "sha256"
    for _ in range(10):  # five cells, before and after each
        result = await verify(pins, target)
        assert result.matches and result.verified_by == "identity"
    last = await verify(pins, target, final=True)
    assert last.matches and last.verified_by == "sha256"
    assert hasher.hashed == ["model", "model"]
    # A tree likewise: hashed first and last, its directories and files held in between.
    assert (await pins.verify([tree_target], 60.0))[0].verified_by == "sha256"
    for _ in range(10):
        [result] = await pins.verify([tree_target], 60.0)
        assert result.matches and result.verified_by == "identity"
    assert (await pins.verify([tree_target], 60.0, final=True))[0].verified_by == "sha256"
    assert hasher.hashed.count("native_build") == 2
    pins.close()


def build_tree(tmp_path: Path) -> tuple[Path, PinTarget]:
    """A small native build: a binary, a library and its version links, a nested dir."""
    tree = tmp_path / "native"
    (tree / "bin").mkdir(parents=True)
    (tree / "lib" / "plugins").mkdir(parents=True)
    (tree / "bin" / "server").write_bytes(b"\x7fELF server")
    (tree / "lib" / "libx.so.1.0").write_bytes(b"\x7fELF libx")
    (tree / "lib" / "libx.so").symlink_to("libx.so.1.0")
    (tree / "lib" / "libother.so").write_bytes(b"\x7fELF other")
    (tree / "lib" / "plugins" / "p.so").write_bytes(b"\x7fELF plugin")
    sha = pin_tree(str(tree), Budget.seconds(60)).sha256
    return tree, PinTarget("native_build", str(tree), sha, "tree")


def add_file(tree: Path) -> None:
    (tree / "lib" / "plugins" / "evil.so").write_bytes(b"\x7fELF evil")


def re_point_link(tree: Path) -> None:
    (tree / "lib" / "libx.so").unlink()
    (tree / "lib" / "libx.so").symlink_to("libother.so")


def write_library_keeping_mtime(tree: Path) -> None:
    write_in_place_keeping_mtime(tree / "lib" / "libx.so.1.0")


def rename_over(tree: Path) -> None:
    os.replace(tree / "lib" / "libother.so", tree / "lib" / "plugins" / "p.so")


def swap_the_root(tree: Path) -> None:
    twin = tree.with_name("twin")
    os.rename(tree, tree.with_name("old"))
    # The same bytes elsewhere, renamed into place: other directories, other inodes.
    shutil.copytree(tree.with_name("old"), twin, symlinks=True)
    os.rename(twin, tree)


@pytest.mark.parametrize(
    "change",
    [add_file, re_point_link, write_library_keeping_mtime, rename_over, swap_the_root],
)
async def test_a_held_tree_finds_every_change_and_hashes_it_again(
    tmp_path: Path, change: object
) -> None:
    tree, target = build_tree(tmp_path)
    hasher = CountingHasher()
    pins = RowPins(hasher, racy_seconds=0)
    assert (await pins.verify([target], 60.0))[0].verified_by == "sha256"
    assert (await pins.verify([target], 60.0))[0].verified_by == "identity"
    change(tree)  # type: ignore[operator]
    [result] = await pins.verify([target], 60.0)
    assert result.verified_by == "sha256" and hasher.hashed == ["native_build"] * 2
    if change is swap_the_root:
        assert result.matches  # the same bytes: hashed again, and they still match
    else:
        assert not result.matches
    pins.close()


async def test_a_tree_too_large_to_hold_is_hashed_at_every_verification(
    tmp_path: Path,
) -> None:
    tree = tmp_path / "toolkit"
    tree.mkdir()
    for index in range(HELD_TREE_LIMIT):
        (tree / f"f{index:04d}").write_bytes(b"%d" % index)
    target = PinTarget(
        "toolkit:t", str(tree), pin_tree(str(tree), Budget.seconds(60)).sha256, "tree"
    )
    hasher = CountingHasher()
    pins = RowPins(hasher, racy_seconds=0)
    for _ in range(3):
        [result] = await pins.verify([target], 60.0)
        assert result.matches and result.verified_by == "sha256"
    assert hasher.hashed == ["toolkit:t"] * 3
    pins.close()


async def drift_after(tmp_path: Path, change: object) -> tuple[PinResult, list[str]]:
    path, target = model(tmp_path)
    hasher = CountingHasher()
    pins = RowPins(hasher, racy_seconds=0)
    assert (await verify(pins, target)).matches
    assert (await verify(pins, target)).verified_by == "identity"
    change(path)  # type: ignore[operator]
    result = await verify(pins, target)
    pins.close()
    return result, hasher.hashed


def replace(path: Path) -> None:
    fresh = path.with_name("fresh")
    fresh.write_bytes(CONTENT[:-1] + b"X")
    os.replace(fresh, path)


def write_in_place_keeping_mtime(path: Path) -> None:
    info = os.stat(path)
    with open(path, "r+b") as stream:
        stream.seek(100)
        stream.write(b"\xff")
    # The mtime is restored; the ctime cannot be, and the held descriptor's fstat shows it.
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == info.st_mtime_ns


def truncate(path: Path) -> None:
    os.truncate(path, 10)


async def test_replacement_is_found_hashed_again_and_reported_as_drift(tmp_path: Path) -> None:
    result, hashed = await drift_after(tmp_path, replace)
    assert not result.matches and result.observed_sha256 is not None
    assert result.verified_by == "sha256" and hashed == ["model", "model"]
    assert isinstance(pin_records("c", "before", result)[-1], PinDrift)


async def test_write_in_place_that_restores_the_mtime_is_found(tmp_path: Path) -> None:
    result, hashed = await drift_after(tmp_path, write_in_place_keeping_mtime)
    assert not result.matches and hashed == ["model", "model"]
    assert isinstance(pin_records("c", "after", result)[-1], PinDrift)


async def test_truncation_is_found(tmp_path: Path) -> None:
    result, _ = await drift_after(tmp_path, truncate)
    assert not result.matches
    assert result.observed_sha256 == hashlib.sha256(CONTENT[:10]).hexdigest()


async def test_removal_is_found(tmp_path: Path) -> None:
    result, _ = await drift_after(tmp_path, os.unlink)
    assert not result.matches and result.observed_sha256 is None


async def test_a_rewrite_with_the_same_bytes_is_hashed_again_and_still_matches(
    tmp_path: Path,
) -> None:
    result, hashed = await drift_after(tmp_path, lambda path: path.write_bytes(CONTENT))
    assert result.matches and result.verified_by == "sha256" and hashed == ["model", "model"]


async def test_a_re_pointed_link_is_found(tmp_path: Path) -> None:
    real, _ = model(tmp_path)
    other = tmp_path / "other.gguf"
    other.write_bytes(CONTENT[::-1])
    link = tmp_path / "link.gguf"
    link.symlink_to(real)
    target = PinTarget("model", str(link), hashlib.sha256(CONTENT).hexdigest(), "file")
    pins = RowPins(CountingHasher(), racy_seconds=0)
    assert (await verify(pins, target)).matches
    link.unlink()
    link.symlink_to(other)
    assert not (await verify(pins, target)).matches
    pins.close()


async def test_a_file_changed_while_it_was_hashed_is_not_trusted(tmp_path: Path) -> None:
    path, target = model(tmp_path)

    async def hasher_that_races(targets: Sequence[PinTarget], seconds: float) -> list[PinResult]:
        results = await hash_pins(targets, seconds)
        truncate(path)  # after the bytes were read, before the identity is re-checked
        return results

    pins = RowPins(hasher_that_races, racy_seconds=0)
    result = await verify(pins, target)
    assert result.observed_sha256 is None and "changed while it was hashed" in result.problem
    pins.close()


async def test_a_freshly_changed_file_is_hashed_again_until_it_settles(tmp_path: Path) -> None:
    _, target = model(tmp_path)
    hasher = CountingHasher()
    pins = RowPins(hasher, racy_seconds=3600)  # written just now: within the racy window
    for _ in range(3):
        assert (await verify(pins, target)).verified_by == "sha256"
    assert hasher.hashed == ["model"] * 3
    pins.close()


async def test_close_releases_every_held_descriptor(tmp_path: Path) -> None:
    _, target = model(tmp_path)
    before = len(os.listdir("/proc/self/fd"))
    pins = RowPins(CountingHasher(), racy_seconds=0)
    await verify(pins, target)
    assert len(os.listdir("/proc/self/fd")) == before + 1
    pins.close()
    assert len(os.listdir("/proc/self/fd")) == before
    await trio.lowlevel.checkpoint()


# --- a whole row (FAKE hosts and correctness child, real pinned files and hashing) -----------


async def run_row(
    tmp_path: Path,
    *,
    after_correctness: object = None,
    after_first_host: object = None,
    correctness_seconds: float = 0.0,
    racy_seconds: float = 0.0,
) -> tuple[Path, CountingHasher]:
    input_path = make_prepared(tmp_path / "p")
    out = tmp_path / "out"
    admitted = admit_run(str(input_path), str(out))
    os.mkdir(admitted.output)
    profiles = admitted.prepared.profile(admitted.prepared.rows[0].key)
    assert profiles is not None and profiles.native is not None
    model_path = Path(profiles.native.model)
    correctness = fake_child_runner()

    async def child_runner(command: ChildCommand, on_spawn: OnSpawn) -> ChildEnded:
        await trio.sleep(correctness_seconds)  # the fake clock's: how long each tool runs
        ended = await correctness(command, on_spawn)
        return ended

    counting = CountingHasher()
    inner = fake_opener(FakeHostScript())
    ended: list[str] = []

    @contextlib.asynccontextmanager
    async def opener(config: Any, observe: Any) -> Any:
        async with inner(config, observe) as host:
            yield host
        if not ended and after_first_host is not None:
            after_first_host(out)  # type: ignore[operator]
        ended.append(config.label)

    hosts = HostSettings(
        host_opener=opener,
        pin_hasher=counting,
        child_runner=child_runner,
        # Seam: the files under test were just written, so no racy window is waited out.
        row_pins=lambda hasher: RowPins(hasher, racy_seconds=racy_seconds),
    )
    with pytest.MonkeyPatch.context() as patch:
        if after_correctness is not None:
            patch.setattr(row_actor, "RowExec", _after_correctness(after_correctness, model_path))
        await supervise(admitted, hosts, RunProgress(io.StringIO(), 1, synthetic=True))
    return out, counting


def _after_correctness(hook: Any, model_path: Path) -> type[RowExec]:
    """A ``RowExec`` that runs ``hook(model_path)`` when the first cell asks for its copy: the
    correctness arm (and its pin watch) has ended, the cell's watch and pin check not begun."""

    class HookedRowExec(RowExec):
        preparing = False

        def prepare(
            self, pairs: Iterable[tuple[str, str | None]]
        ) -> dict[tuple[str, str | None], PrivateCopy]:
            self.preparing = True  # the row's copies, made before its correctness arm
            try:
                return super().prepare(pairs)
            finally:
                self.preparing = False

        def copy_for(self, binary: str, native_build: str | None) -> PrivateCopy:
            nonlocal hook
            if hook is not None and not self.preparing:
                hook, run = None, hook
                run(model_path)
            return super().copy_for(binary, native_build)

    return HookedRowExec


def write_the_rows_copy_of_the_server(out: Path) -> None:
    [copy] = [p for p in out.glob("exec-state-*/**/fake-llama-server") if p.is_file()]
    os.chmod(copy, 0o700)
    write_in_place_keeping_mtime(copy)


@pytest.mark.usefixtures("autojump_clock")
async def test_a_write_to_the_rows_private_copy_between_cells_refuses_the_next_cell(
    tmp_path: Path,
) -> None:
    """The row's hosts run from one private copy, checked by identity between cells: a write
    to it after the first host ended is found, hashed again and the next cell is refused."""
    out, _ = await run_row(
        tmp_path, after_first_host=write_the_rows_copy_of_the_server, correctness_seconds=1.0
    )
    assert cell(out, "native-serial").status == "completed"
    concurrent = cell(out, "sweep-native-concurrent")
    assert concurrent.status == "failed" and concurrent.host is None
    assert [p.name for p in concurrent.before_identity if not p.matches] == ["binary"]
    by = [
        (r.cell_id, r.phase, r.verified_by)
        for r in records(out, PinObserved)
        if r.name == "binary" and r.phase in ("row", "before")
    ]
    # The row hashed its copy beside the correctness arm, the serial cell checked it by
    # identity; the concurrent cell found it changed and hashed it again.
    assert by == [
        ("cell-0000/private-copies", "row", "sha256"),
        ("cell-0000/native-serial", "before", "identity"),
        ("cell-0000/native-concurrent", "before", "sha256"),
    ]
    assert not list(out.glob("exec-state-*"))  # removed once the run's hosts have ended
    assert replay(str(out)).exit_code == 0


@pytest.mark.usefixtures("autojump_clock")
async def test_the_rows_copies_are_hashed_beside_a_correctness_arm_that_outlasts_their_settling(
    tmp_path: Path,
) -> None:
    """Copies made at the row's start settle while the correctness arm runs: the row hashes
    them then (journaled under its own scope), and every host cell checks them by identity."""
    out, _ = await run_row(tmp_path, correctness_seconds=1.0)
    by = [
        (r.cell_id, r.phase, r.name, r.verified_by)
        for r in records(out, PinObserved)
        if r.name in ("binary", "native_build") and r.phase in ("row", "before")
    ]
    assert by == [
        ("cell-0000/correctness", "before", "native_build", "sha256"),  # the pinned tree
        ("cell-0000/private-copies", "row", "binary", "sha256"),
        ("cell-0000/private-copies", "row", "native_build", "sha256"),
        ("cell-0000/native-serial", "before", "binary", "identity"),
        ("cell-0000/native-serial", "before", "native_build", "identity"),
        ("cell-0000/native-concurrent", "before", "binary", "identity"),
        ("cell-0000/native-concurrent", "before", "native_build", "identity"),
    ]
    copy = next(r.path for r in records(out, PinObserved) if r.phase == "row")
    assert "/exec-state-" in copy  # the bytes the host runs, not the pinned path
    assert cell(out, "native-serial").status == "completed"
    assert cell(out, "sweep-native-concurrent").status == "completed"
    assert row(out).status == "completed"
    assert replay(str(out)).exit_code == 0


@pytest.mark.usefixtures("autojump_clock")
async def test_copies_not_settled_when_the_correctness_arm_ends_are_left_to_the_first_cell(
    tmp_path: Path,
) -> None:
    out, _ = await run_row(tmp_path, correctness_seconds=0.5, racy_seconds=5.0)
    assert not [r for r in records(out, PinObserved) if r.phase == "row"]
    serial = [
        r.verified_by
        for r in records(out, PinObserved)
        if r.cell_id == "cell-0000/native-serial" and r.phase == "before" and r.name == "binary"
    ]
    assert serial == ["sha256"]
    assert row(out).status == "completed"
    assert replay(str(out)).exit_code == 0


@pytest.mark.usefixtures("autojump_clock")
async def test_a_row_hashes_its_model_twice_and_replays_identical(tmp_path: Path) -> None:
    out, hasher = await run_row(tmp_path)
    # The correctness arm's pins (first), the concurrent cell's post-verify (last).
    assert hasher.hashed.count("model") == 2
    serial = cell(out, "native-serial")
    assert serial.status == "completed" and not serial.pins_drifted
    by = {
        (r.cell_id, r.phase): r.verified_by for r in records(out, PinObserved) if r.name == "model"
    }
    assert by[("cell-0000/native-serial", "before")] == "identity"
    assert by[("cell-0000/native-concurrent", "after")] == "sha256"
    assert replay(str(out)).exit_code == 0


@pytest.mark.usefixtures("autojump_clock")
async def test_a_write_after_the_correctness_arm_fails_the_next_cell_as_drift(
    tmp_path: Path,
) -> None:
    out, _ = await run_row(tmp_path, after_correctness=write_in_place_keeping_mtime)
    serial = cell(out, "native-serial")
    assert serial.status == "failed" and serial.host is None
    assert [p.name for p in serial.before_identity if not p.matches] == ["model"]
    assert row(out).status != "completed"
    assert replay(str(out)).exit_code == 0
