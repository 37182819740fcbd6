"""Pinned files and trees are watched between their two hashes (inotify): a byte flipped and
restored, an attribute changed, a link re-pointed and back, an entry added to a tree and
removed: each is seen; reading is not a change."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fake_hosts.fake_custody import FakeHostScript, fake_child_runner, fake_opener
from fake_hosts.fake_llama_http import Reply
from run_harness import autojump_clock, cell, make_prepared, records, row  # noqa: F401

from cache_family.actors.audit.replay import replay
from cache_family.actors.run.context import HostSettings
from cache_family.actors.run.matrix import admit_run, supervise
from cache_family.console.progress import RunProgress
from cache_family.schemas.journal import PinObserved
from cache_family.system.child import ChildCommand, ChildEnded, OnSpawn
from cache_family.system.pin_watch import PinWatch, WatchedPin


def flip_and_restore(path: Path, offset: int = 10) -> None:
    """Flip one byte in place and put it back: the bytes (and a later hash) are as before."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        original = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([original[0] ^ 0xFF]))
        handle.flush()
        handle.seek(offset)
        handle.write(original)


def test_a_byte_flipped_and_restored_is_seen_and_reading_is_not(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(range(256)))
    before = model.read_bytes()
    with PinWatch([WatchedPin("model", str(model), tree=False)]) as watch:
        assert model.read_bytes() == before and watch.changes() == []
        flip_and_restore(model)
        assert model.read_bytes() == before
        assert watch.changes() == ["model"]
        assert watch.unwatched == []


def test_a_link_re_pointed_and_back_and_an_attribute_change_are_seen(tmp_path: Path) -> None:
    blob, other = tmp_path / "blob", tmp_path / "other"
    blob.write_bytes(b"one")
    other.write_bytes(b"two")
    link = tmp_path / "model.gguf"
    link.symlink_to(blob)
    with PinWatch([WatchedPin("model", str(link), tree=False)]) as watch:
        spare = tmp_path / "spare"
        spare.symlink_to(other)
        os.replace(spare, link)
        spare.symlink_to(blob)
        os.replace(spare, link)
        assert watch.changes() == ["model"]
    with PinWatch([WatchedPin("model", str(link), tree=False)]) as watch:
        os.chmod(blob, 0o600)
        assert watch.changes() == ["model"]


def test_an_entry_added_to_a_nested_tree_and_removed_is_seen(tmp_path: Path) -> None:
    tree = tmp_path / "build"
    (tree / "lib" / "deep").mkdir(parents=True)
    (tree / "lib" / "deep" / "libx.so").write_bytes(b"x")
    pins = [WatchedPin("native_build", str(tree), tree=True)]
    with PinWatch(pins) as watch:
        extra = tree / "lib" / "deep" / "libevil.so"
        extra.write_bytes(b"evil")
        extra.unlink()
        assert watch.changes() == ["native_build"]
    with PinWatch(pins) as watch:
        flip_and_restore(tree / "lib" / "deep" / "libx.so", offset=0)
        assert watch.changes() == ["native_build"]


def test_a_pin_missing_when_the_watch_begins_is_left_to_the_hashes(tmp_path: Path) -> None:
    present = tmp_path / "present"
    present.write_bytes(b"p")
    absent = tmp_path / "absent"
    pins = [
        WatchedPin("gone", str(absent), tree=False),
        WatchedPin("present", str(present), tree=False),
    ]
    with PinWatch(pins) as watch:
        assert watch.changes() == [] and watch.unwatched == [str(absent)]
        present.write_bytes(b"q")
        assert watch.changes() == ["present"]


# --- a whole row (FAKE hosts and correctness child, real pinned files, hashing and watch) ---


async def run_row(
    tmp_path: Path,
    *,
    during_correctness: Callable[[Path], None] | None = None,
    during_ladder: Callable[[Path], None] | None = None,
) -> Path:
    """One prepared row run by the real matrix, row, correctness and cell actors; the
    correctness child and the hosts are FAKES, whose hooks touch the pinned model."""
    input_path = make_prepared(tmp_path / "p")
    out = tmp_path / "out"
    admitted = admit_run(str(input_path), str(out))
    os.mkdir(admitted.output)
    profiles = admitted.prepared.profile(admitted.prepared.rows[0].key)
    assert profiles is not None and profiles.native is not None
    model = Path(profiles.native.model)
    os.chmod(os.path.realpath(model), 0o644)  # before the run: the hooks write in place
    correctness = fake_child_runner()

    async def child_runner(command: ChildCommand, on_spawn: OnSpawn) -> ChildEnded:
        ended = await correctness(command, on_spawn)
        if during_correctness is not None:
            during_correctness(model)
        return ended

    touched: list[int] = []

    def reply(index: int, _body: dict[str, Any]) -> Reply:
        if during_ladder is not None and not touched:
            touched.append(index)
            during_ladder(model)
        return Reply(first_token_delay=0.01, token_delay=0.0)

    hosts = HostSettings(
        host_opener=fake_opener(FakeHostScript(reply=reply)), child_runner=child_runner
    )
    await supervise(admitted, hosts, RunProgress(io.StringIO(), 1, synthetic=True))
    return out


@pytest.mark.usefixtures("autojump_clock")
async def test_a_model_flipped_and_restored_during_a_cell_is_drift(tmp_path: Path) -> None:
    out = await run_row(tmp_path, during_ladder=flip_and_restore)
    serial = cell(out, "native-serial")
    assert serial.status == "incomplete" and not serial.accepted_for_parity
    assert serial.pins_drifted
    [fault] = [f for f in serial.faults if f.kind == "pin_drift"]
    assert "model" in fault.detail and fault.state == "post-verify"
    # The bytes are as pinned again: every hash matched; only the watch saw the change.
    assert all(r.observed_sha256 == r.expected_sha256 for r in records(out, PinObserved))
    assert cell(out, "sweep-native-concurrent").status == "completed"  # after the restore
    assert replay(str(out)).exit_code == 0


@pytest.mark.usefixtures("autojump_clock")
async def test_a_model_flipped_and_restored_during_correctness_fails_the_gate(
    tmp_path: Path,
) -> None:
    out = await run_row(tmp_path, during_correctness=flip_and_restore)
    receipt = row(out)
    assert receipt.status != "completed"
    assert receipt.correctness.status != "completed"
    assert (receipt.correctness.reason or "").startswith("pin_drift: model")
    assert not (out / "cell-0000" / "native-serial" / "cell.json").exists()
    assert replay(str(out)).exit_code == 0
