"""Atomic, no-clobber publication and revocation of only the file we wrote."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cache_family.actors.publish import publish_fresh, revoke
from cache_family.errors import Refused


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
