"""Write models into a Hugging Face hub cache tree, the way huggingface_hub lays it out.

The zoo never replaces what it did not write: a ``Claim`` lists the paths that are its own,
``check_snapshot`` finds every conflict before anything is written and ``publish_snapshot``
checks again before each replacement.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from cache_family.errors import Refusal, Refused
from cache_family.system.hashing import sha256_file
from cache_family.system.publish import replace_atomically, replace_with_symlink

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


# --- what the zoo may replace -----------------------------------------------------------------

NOT_OURS = "zoo.cache_root_not_ours"
WRITE_FAILED = "zoo.write_failed"
CACHE_ROOT_JSON_PATH = "$.cache_root"
NOT_OURS_HINT = (
    "the zoo writes only into an empty or new directory, or over a zoo it wrote earlier "
    "(zoo-report.json lists its files); choose another --cache-root"
)


def link_target(snapshot_path: str, digest: str) -> str:
    """The relative link a snapshot file holds: up to the repository, then into ``blobs``."""
    inside = PurePosixPath(snapshot_path).parts[3:]
    return "/".join([".."] * (len(inside) + 1)) + f"/blobs/{digest}"


@dataclass
class Claim:
    """Paths under one cache root that are the zoo's own, relative to the root."""

    links: dict[str, str] = field(default_factory=dict)  # snapshot path -> the target written
    blobs: set[str] = field(default_factory=set)
    refs: set[str] = field(default_factory=set)

    def record(self, snapshot_path: str, digest: str) -> None:
        """A snapshot file the zoo wrote (or an earlier zoo recorded), with its blob and ref."""
        target = SnapshotPath.parse(snapshot_path)
        if target.is_directory:
            raise ValueError(f"{snapshot_path!r} names a snapshot directory, not a file")
        self.links[snapshot_path] = link_target(snapshot_path, digest)
        self.blobs.add(f"{target.repo_dir}/blobs/{digest}")
        self.refs.add(f"{target.repo_dir}/refs/main")

    def holds_link(self, cache_root: Path, path: Path) -> bool:
        """True when ``path`` is a link the zoo wrote and it still points where it was written."""
        expected = self.links.get(path.relative_to(cache_root).as_posix())
        return expected is not None and path.is_symlink() and os.readlink(path) == expected


def not_ours(path: Path, what: str) -> Refusal:
    return Refusal(NOT_OURS, CACHE_ROOT_JSON_PATH, f"{path} {what}", NOT_OURS_HINT)


def write_failed(error: OSError, what: str) -> Refused:
    where = error.filename if error.filename is not None else "the cache root"
    reason = error.strerror or type(error).__name__
    return Refused.one(
        WRITE_FAILED,
        CACHE_ROOT_JSON_PATH,
        f"could not write {what} at {where}: {reason}",
        "give a writable directory on a local file system with free space as --cache-root",
    )


def _dir_refusal(path: Path) -> Refusal | None:
    """A directory the writer enters must be absent or a real directory, never a link."""
    if path.is_symlink():
        return not_ours(path, "is a symlink where the zoo keeps a directory")
    if path.exists() and not path.is_dir():
        return not_ours(path, "is a file where the zoo keeps a directory")
    return None


def _snapshot_dirs(
    cache_root: Path, target: SnapshotPath, inside: Sequence[PurePosixPath]
) -> list[Path]:
    repo = cache_root / target.repo_dir
    snapshot = repo / "snapshots" / target.revision
    dirs = [repo, repo / "blobs", repo / "refs", repo / "snapshots", snapshot]
    for path in inside:
        for depth in range(1, len(path.parts)):
            dirs.append(snapshot.joinpath(*path.parts[:depth]))
    return list(dict.fromkeys(dirs))


def check_snapshot(
    cache_root: Path,
    snapshot_relative: str,
    inside: Sequence[PurePosixPath] | None,
    claim: Claim,
) -> list[Refusal]:
    """Every path a publish would replace that is not the zoo's own; writes nothing.

    ``inside`` lists the snapshot files to be linked, relative to the snapshot directory; None
    for a directory snapshot (a layer package), whose existing entries must all be the zoo's.
    """
    target = SnapshotPath.parse(snapshot_relative)
    repo = cache_root / target.repo_dir
    snapshot = repo / "snapshots" / target.revision
    for directory in _snapshot_dirs(cache_root, target, inside or ()):
        refusal = _dir_refusal(directory)
        if refusal is not None:
            return [refusal]  # nothing below a misplaced directory is worth checking
    refusals: list[Refusal] = []
    ref = repo / "refs" / "main"
    if (ref.is_symlink() or ref.exists()) and (
        ref.relative_to(cache_root).as_posix() not in claim.refs
        or ref.is_symlink()
        or not ref.is_file()
    ):
        refusals.append(not_ours(ref, "exists and the zoo did not write it"))
    if inside is None:
        for path in _entries(snapshot):
            if not claim.holds_link(cache_root, path):
                refusals.append(not_ours(path, "exists and the zoo did not write it"))
    else:
        for relative in inside:
            path = snapshot.joinpath(*relative.parts)
            if (path.is_symlink() or path.exists()) and not claim.holds_link(cache_root, path):
                refusals.append(not_ours(path, "exists and the zoo did not write it"))
    return refusals


def _entries(directory: Path) -> Iterator[Path]:
    """Everything under ``directory`` that is not a real directory (links to dirs included)."""
    if not directory.is_dir() or directory.is_symlink():
        return
    for parent, dirnames, filenames in os.walk(directory):
        base = Path(parent)
        for name in dirnames:
            if (base / name).is_symlink():
                yield base / name
        for name in filenames:
            yield base / name


def _is_blob_of(path: Path, digest: str, size: int) -> bool:
    """An existing regular file holding exactly the bytes named ``digest``."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size == size and sha256_file(path) == digest


def publish_snapshot(
    cache_root: Path,
    snapshot_relative: str,
    staging: Path,
    files: tuple[Path, ...],
    claim: Claim | None = None,
) -> list[HubFile]:
    """Move staged files into blobs and link them from the snapshot; returns what was linked.

    Staging must be on the cache root's file system (blobs are moved, not copied). A blob that
    already holds the same bytes is kept; a link, blob or ``refs/main`` in the way is replaced
    (atomically) only when ``claim`` says the zoo wrote it, so rebuilding the zoo over its own
    earlier output is safe and nothing else is ever replaced. Refuses before moving anything.
    """
    claim = Claim() if claim is None else claim
    target = SnapshotPath.parse(snapshot_relative)
    repo = cache_root / target.repo_dir
    blobs = repo / "blobs"
    snapshot = repo / "snapshots" / target.revision
    planned: list[tuple[Path, PurePosixPath, str, int]] = []
    try:
        for file in files:
            staged = file if file.is_absolute() else staging / file
            planned.append(
                (
                    staged,
                    place_in_snapshot(target, staging, staged),
                    sha256_file(staged),
                    staged.stat().st_size,
                )
            )
    except OSError as error:
        raise write_failed(error, "a staged model file") from None
    inside = None if target.is_directory else [p for _, p, _, _ in planned]
    refusals = check_snapshot(cache_root, snapshot_relative, inside, claim)
    if not refusals:
        for _, _, digest, size in planned:
            blob = blobs / digest
            exists = blob.is_symlink() or blob.exists()
            claimed = blob.relative_to(cache_root).as_posix() in claim.blobs
            if exists and not claimed and not _is_blob_of(blob, digest, size):
                refusals.append(not_ours(blob, "holds other bytes and the zoo did not write it"))
    if refusals:
        raise Refused(tuple(refusals))
    linked: list[HubFile] = []
    try:
        blobs.mkdir(parents=True, exist_ok=True)
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        for staged, placed, digest, size in planned:
            blob = blobs / digest
            if _is_blob_of(blob, digest, size):
                staged.unlink()
            else:
                staged.replace(blob)
            link = snapshot.joinpath(*placed.parts)
            link.parent.mkdir(parents=True, exist_ok=True)
            snapshot_path = link.relative_to(cache_root).as_posix()
            replace_with_symlink(link, link_target(snapshot_path, digest))
            claim.record(snapshot_path, digest)
            linked.append(
                HubFile(
                    snapshot_path=snapshot_path,
                    blob_path=blob.relative_to(cache_root).as_posix(),
                    sha256=digest,
                    size=size,
                )
            )
        replace_atomically(repo / "refs" / "main", target.revision.encode())
    except OSError as error:
        raise write_failed(error, f"the snapshot {snapshot_relative}") from None
    return linked


def remove_snapshot(
    cache_root: Path,
    snapshot_relative: str,
    inside: Sequence[PurePosixPath] | None,
    claim: Claim,
) -> None:
    """Remove the zoo's own links at a snapshot (an older zoo's model that is no longer built).

    Refuses, removing nothing, if anything there is not the zoo's; blobs stay (they are
    content-addressed and harmless); emptied directories go.
    """
    refusals = check_snapshot(cache_root, snapshot_relative, inside, claim)
    if refusals:
        raise Refused(tuple(refusals))
    target = SnapshotPath.parse(snapshot_relative)
    snapshot = cache_root / target.repo_dir / "snapshots" / target.revision
    if inside is None:
        doomed = list(_entries(snapshot))
    else:
        doomed = [snapshot.joinpath(*p.parts) for p in inside]
    try:
        for path in doomed:
            if path.is_symlink():
                path.unlink()
        if inside is None and snapshot.is_dir():
            for parent, _, _ in os.walk(snapshot, topdown=False):
                with contextlib.suppress(OSError):  # a directory still holding files stays
                    os.rmdir(parent)
    except OSError as error:
        raise write_failed(error, f"the snapshot {snapshot_relative}") from None
