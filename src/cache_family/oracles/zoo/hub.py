"""Write models into a Hugging Face hub cache tree, the way huggingface_hub lays it out.

``models--ORG--NAME/blobs/<sha256>`` holds the bytes, ``snapshots/<REV>/<path>`` is a
relative symlink into ``blobs/`` (``../../blobs/<sha256>``, one more ``..`` per
sub-directory), and ``refs/main`` names the revision. Split shards sit next to each other in
one snapshot directory, so llama.cpp finds a split model's siblings from the first shard's
path exactly as it would in a real download.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

_REPO_DIR = re.compile(r"^models--[^/]+--[^/]+$")
_REVISION = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class SnapshotPath:
    """A catalog ``snapshot_relative`` split into its parts."""

    repo_dir: str  # models--ORG--NAME
    revision: str
    inner: PurePosixPath  # path inside the snapshot; empty for a directory snapshot

    @classmethod
    def parse(cls, snapshot_relative: str) -> SnapshotPath:
        parts = PurePosixPath(snapshot_relative).parts
        if len(parts) < 3 or parts[1] != "snapshots" or not _REPO_DIR.match(parts[0]):
            raise ValueError(f"{snapshot_relative!r} is not models--ORG--NAME/snapshots/REV/...")
        if not _REVISION.match(parts[2]):
            raise ValueError(f"{snapshot_relative!r} has no 40-hex revision")
        if any(p in ("..", ".") for p in parts):
            raise ValueError(f"{snapshot_relative!r} must not contain . or ..")
        return cls(parts[0], parts[2], PurePosixPath(*parts[3:]))

    @property
    def is_directory(self) -> bool:
        return self.inner == PurePosixPath()


@dataclass(frozen=True)
class HubFile:
    snapshot_path: str  # relative to the cache root, through the snapshot symlink
    blob_path: str  # relative to the cache root
    sha256: str
    size: int


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def place_in_snapshot(target: SnapshotPath, staging: Path, file: Path) -> PurePosixPath:
    """Where a staged file lands inside the snapshot (see ``base`` for the rule)."""
    absolute = file if file.is_absolute() else staging / file
    relative = PurePosixPath(absolute.relative_to(staging).as_posix())
    if target.is_directory:
        return relative
    inner_dir = target.inner.parent
    if relative.parts[: len(inner_dir.parts)] == inner_dir.parts:
        return relative
    return inner_dir / relative


def _atomic_symlink(link: Path, target: str) -> None:
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(target)
    tmp.replace(link)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def publish_snapshot(
    cache_root: Path, snapshot_relative: str, staging: Path, files: tuple[Path, ...]
) -> list[HubFile]:
    """Move staged files into blobs and link them from the snapshot; returns what was linked.

    Staging must be on the cache root's file system (blobs are moved, not copied). A blob that
    already exists with the same digest is kept; links and ``refs/main`` are replaced
    atomically, so rebuilding the zoo over an existing one is safe.
    """
    target = SnapshotPath.parse(snapshot_relative)
    repo = cache_root / target.repo_dir
    blobs = repo / "blobs"
    snapshot = repo / "snapshots" / target.revision
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    linked: list[HubFile] = []
    for file in files:
        staged = file if file.is_absolute() else staging / file
        inside = place_in_snapshot(target, staging, staged)
        digest = sha256_file(staged)
        size = staged.stat().st_size
        blob = blobs / digest
        if blob.is_file() and blob.stat().st_size == size:
            staged.unlink()
        else:
            staged.replace(blob)
        link = snapshot / Path(*inside.parts)
        link.parent.mkdir(parents=True, exist_ok=True)
        up = "/".join([".."] * (len(inside.parts) + 1))
        _atomic_symlink(link, f"{up}/blobs/{digest}")
        linked.append(
            HubFile(
                snapshot_path=str(link.relative_to(cache_root)),
                blob_path=str(blob.relative_to(cache_root)),
                sha256=digest,
                size=size,
            )
        )
    _atomic_text(repo / "refs" / "main", target.revision)
    return linked
