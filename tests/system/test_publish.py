"""Atomic publication: fresh (no-clobber) with revocation of only the file we wrote, and
replacing writes that never leave a partial file or a temporary name behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cache_family.errors import Refused
from cache_family.system.publish import (
    publish_fresh,
    replace_atomically,
    replace_with_symlink,
    revoke,
)


def test_publish_writes_the_bytes_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "receipt.json"
    published = publish_fresh(str(target), b'{"ok": true}\n')
    assert target.read_bytes() == b'{"ok": true}\n'
    assert os.listdir(tmp_path) == ["receipt.json"]
    assert published.still_ours()


def test_an_existing_file_is_refused_and_left_untouched(tmp_path: Path) -> None:
    target = tmp_path / "receipt.json"
    target.write_text("foreign")
    with pytest.raises(Refused) as refused:
        publish_fresh(str(target), b"ours")
    assert refused.value.codes == ["publish.exists"]
    assert target.read_text() == "foreign"
    assert os.listdir(tmp_path) == ["receipt.json"]


def test_revoke_removes_our_file(tmp_path: Path) -> None:
    target = tmp_path / "input.json"
    published = publish_fresh(str(target), b"ours")
    assert revoke(published) is True
    assert not target.exists()
    assert revoke(published) is False


def test_revoke_never_removes_a_file_written_after_ours(tmp_path: Path) -> None:
    target = tmp_path / "input.json"
    published = publish_fresh(str(target), b"ours")
    target.unlink()
    # Same path, possibly the same recycled inode number: still not ours.
    target.write_bytes(b"foreign, longer than ours")
    assert not published.still_ours()
    assert revoke(published) is False
    assert target.read_bytes() == b"foreign, longer than ours"


def test_revoke_ignores_a_same_size_replacement(tmp_path: Path) -> None:
    target = tmp_path / "input.json"
    published = publish_fresh(str(target), b"ours")
    target.unlink()
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, b"them")
    os.close(fd)
    # Timestamps differ even when size and (recycled) inode agree.
    os.utime(target, ns=(published.mtime_ns + 1_000_000, published.mtime_ns + 1_000_000))
    assert revoke(published) is False
    assert target.read_bytes() == b"them"


def test_replace_atomically_replaces_the_bytes_and_leaves_no_temporary_file(
    tmp_path: Path,
) -> None:
    target = tmp_path / "producer.json"
    target.write_bytes(b"old")
    replace_atomically(target, b"new", mode=0o600)
    assert target.read_bytes() == b"new"
    assert target.stat().st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == ["producer.json"]


def test_replacing_a_symlink_replaces_the_link_not_its_target(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"not ours")
    target = tmp_path / "catalog.json"
    target.symlink_to(elsewhere)
    replace_atomically(target, b"ours")
    assert not target.is_symlink() and target.read_bytes() == b"ours"
    assert elsewhere.read_bytes() == b"not ours"


def test_a_failed_replacement_leaves_no_temporary_file(tmp_path: Path) -> None:
    occupied = tmp_path / "report.json"
    occupied.mkdir()
    with pytest.raises(IsADirectoryError):
        replace_atomically(occupied, b"data")
    assert os.listdir(tmp_path) == ["report.json"]


def test_a_failed_link_replacement_leaves_no_temporary_link(tmp_path: Path) -> None:
    occupied = tmp_path / "m.gguf"
    occupied.mkdir()
    with pytest.raises(IsADirectoryError):
        replace_with_symlink(occupied, "../../blobs/x")
    assert os.listdir(tmp_path) == ["m.gguf"]


def test_replace_with_symlink_points_an_existing_link_elsewhere(tmp_path: Path) -> None:
    link = tmp_path / "libllama.so"
    link.symlink_to("old-target")
    replace_with_symlink(link, "libllama.so.0")
    assert os.readlink(link) == "libllama.so.0"
    assert os.listdir(tmp_path) == ["libllama.so"]
