"""The bounded line reader: lines as written, overlong ones cut, size capped, hashed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from cache_family.errors import Refused
from cache_family.system.line_file import BoundedLines


def _lines(path: Path, **limits: int) -> BoundedLines:
    return BoundedLines(
        str(path),
        max_bytes=limits.get("max_bytes", 1 << 20),
        max_line_bytes=limits.get("max_line_bytes", 8),
        what="trace",
        json_path="$.trace",
    )


def test_lines_come_numbered_and_the_bytes_are_hashed(tmp_path: Path) -> None:
    data = b"a\nbb\n\n" + b"x" * 20 + b"\nlast"
    path = tmp_path / "t.jsonl"
    path.write_bytes(data)
    reader = _lines(path)
    assert list(reader) == [(1, b"a"), (2, b"bb"), (3, b""), (4, b"x" * 9), (5, b"last")]
    assert reader.sha256 == hashlib.sha256(data).hexdigest()
    assert reader.size == len(data)


def test_a_line_across_chunks_is_whole(tmp_path: Path) -> None:
    # Lines longer than the reader's 1 MiB chunk still come out whole when within the limit.
    long = b"y" * (1 << 20) + b"z"
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"a\n" + long + b"\nb\n")
    reader = _lines(path, max_bytes=4 << 20, max_line_bytes=2 << 20)
    assert list(reader) == [(1, b"a"), (2, long), (3, b"b")]


def test_too_large_relative_and_symlinked_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"0123456789\n")
    with pytest.raises(Refused) as caught:
        list(_lines(path, max_bytes=10))
    assert caught.value.codes == ["file.too_large"]
    with pytest.raises(Refused) as caught:
        _lines(Path("t.jsonl"))
    assert caught.value.codes == ["file.not_absolute"]
    link = tmp_path / "link.jsonl"
    link.symlink_to(path)
    with pytest.raises(Refused) as caught:
        list(_lines(link))
    assert caught.value.codes == ["file.symlink"]
