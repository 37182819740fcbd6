"""Pins: SHA-256 of a file's bytes, or of a directory tree, hashed under a budget.

Every hash runs in 1 MiB chunks and asks its ``Budget`` between chunks, so cancellation stops it
within one chunk. Tree pin (reference "Tree pin"): regular files by relative POSIX path sorted
bytewise, each as the 8-byte big-endian path length, the path and the raw digest, into one
SHA-256; a tree must be complete (depth at most 32, at most 10 000 entries, symlinks only to
files inside it, no special files, at least one file).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cache_family.errors import Refusal, Refused
from cache_family.schemas.bounded import open_regular_file
from cache_family.system.hashing import sha256_stream
from cache_family.system.hashing_progress import NullProgress, ProgressSink

TREE_MAX_DEPTH = 32
TREE_MAX_ENTRIES = 10_000


class Budget:
    """A deadline on a monotonic clock plus a cancellation flag, shared with hashing threads.

    ``cancel`` may be called from any thread or a signal handler's delegate; hashing threads
    notice it at their next chunk boundary.
    """

    def __init__(self, deadline: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.deadline = deadline
        self._clock = clock
        self._cancelled = threading.Event()

    @classmethod
    def seconds(cls, seconds: float, *, clock: Callable[[], float] = time.monotonic) -> Budget:
        return cls(clock() + seconds, clock=clock)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def expired(self) -> bool:
        return self._clock() >= self.deadline

    def remaining(self) -> float:
        return self.deadline - self._clock()

    def check(self, where: str) -> None:
        """Refuse if cancelled or past the deadline; ``where`` names what was being done."""
        if self._cancelled.is_set():
            raise Refused.one(
                "budget.cancelled",
                where,
                "cancelled while hashing",
                "run preparation again when it may finish",
            )
        if self._clock() >= self.deadline:
            raise Refused.one(
                "budget.deadline_expired",
                where,
                "the preparation deadline passed while hashing",
                "raise preparation_seconds or hash fewer or smaller files",
            )


@dataclass(frozen=True, slots=True)
class FilePin:
    path: str
    sha256: str
    size: int


@dataclass(frozen=True, slots=True)
class TreePin:
    path: str
    sha256: str
    files: int
    size: int


def _resolved(
    path: str, *, family: Literal["pin", "tree"], what: str, json_path: str
) -> tuple[str, os.stat_result]:
    """``path`` with every symlink resolved, and the status of what it names; refused as
    ``<family>.missing`` or ``<family>.unreadable`` when it does not resolve."""
    try:
        canonical = os.path.realpath(path, strict=True)
        return canonical, os.stat(canonical)
    except FileNotFoundError:
        raise Refused.one(
            f"{family}.missing",
            json_path,
            f"{what} {path} does not exist",
            "check the path",
        ) from None
    except OSError as exc:
        raise Refused.one(
            f"{family}.unreadable",
            json_path,
            f"{what} {path} cannot be resolved: {exc.strerror}",
            "check the path and its permissions",
        ) from None


def canonical_regular_file(path: str, *, what: str, json_path: str) -> str:
    """Resolve every symlink and refuse anything but an existing regular file."""
    if not Path(path).is_absolute():
        raise Refused.one(
            "pin.not_absolute",
            json_path,
            f"{what} path {path!r} is not absolute",
            "give an absolute path",
        )
    canonical, info = _resolved(path, family="pin", what=what, json_path=json_path)
    if not stat.S_ISREG(info.st_mode):
        raise Refused.one(
            "pin.not_regular",
            json_path,
            f"{what} {path} resolves to {canonical}, which is not a regular file",
            "point at a regular file (not a directory, FIFO or device)",
        )
    return canonical


def hash_file(
    path: str,
    budget: Budget,
    *,
    json_path: str = "$",
    progress: ProgressSink | None = None,
    stop: threading.Event | None = None,
) -> FilePin:
    """SHA-256 of a regular file's bytes in 1 MiB chunks, asking the budget at every chunk.

    ``stop`` lets a sibling thread's failure end this hash early; the refusal then says so.
    """
    sink = progress or NullProgress()
    budget.check(json_path)

    def before_chunk() -> None:
        if stop is not None and stop.is_set():
            raise Refused.one(
                "pin.aborted",
                json_path,
                f"hashing {path} stopped because another pin was refused",
                "fix the other refusal and run again",
            )
        budget.check(json_path)

    with open_regular_file(path, subject=path, json_path=json_path) as (fd, _):
        try:
            with os.fdopen(fd, "rb", buffering=0, closefd=False) as stream:
                sha256, size = sha256_stream(
                    stream, before_chunk=before_chunk, after_chunk=sink.advance
                )
        except OSError as exc:
            raise Refused.one(
                "file.unreadable",
                json_path,
                f"{path} could not be read: {exc.strerror}",
                "check the file and the disk",
            ) from None
    budget.check(json_path)
    return FilePin(path=path, sha256=sha256, size=size)


@dataclass(frozen=True, slots=True)
class HashJob:
    path: str
    json_path: str


def hash_files(
    jobs: Sequence[HashJob],
    budget: Budget,
    *,
    progress: ProgressSink | None = None,
    workers: int | None = None,
) -> list[FilePin]:
    """Hash several files in parallel threads; results in the order of ``jobs``.

    The first refusal stops the other threads at their next chunk; every refusal that is not
    merely that consequence is reported together.
    """
    if not jobs:
        return []
    sink = progress or NullProgress()
    total = 0
    for job in jobs:
        with contextlib.suppress(OSError):  # hash_file reports a missing file itself
            total += Path(job.path).stat().st_size
    count = max(1, min(len(jobs), workers or os.cpu_count() or 1))
    stop = threading.Event()

    def run(job: HashJob) -> FilePin | Refused:
        try:
            return hash_file(job.path, budget, json_path=job.json_path, progress=sink, stop=stop)
        except Refused as refused:
            stop.set()
            return refused

    sink.begin(len(jobs), total)
    try:
        if count == 1:
            outcomes = [run(job) for job in jobs]
        else:
            with ThreadPoolExecutor(max_workers=count, thread_name_prefix="pin") as pool:
                outcomes = list(pool.map(run, jobs))
    finally:
        sink.end()
    refusals: list[Refusal] = []
    for outcome in outcomes:
        if isinstance(outcome, Refused):
            refusals.extend(outcome.refusals)
    if refusals:
        # Cancellation or the deadline stops every thread alike: one refusal says it.
        budget_refusals = [r for r in refusals if r.code.startswith("budget.")]
        if budget_refusals:
            raise Refused((budget_refusals[0],))
        primary = [r for r in refusals if r.code != "pin.aborted"]
        raise Refused(tuple(_dedupe(primary or refusals)))
    return [outcome for outcome in outcomes if isinstance(outcome, FilePin)]


def _dedupe(refusals: Sequence[Refusal]) -> Iterator[Refusal]:
    seen: set[tuple[str, str]] = set()
    for refusal in refusals:
        key = (refusal.code, refusal.path)
        if key not in seen:
            seen.add(key)
            yield refusal


@dataclass(frozen=True, slots=True)
class TreeFile:
    relative: bytes
    source: str


def list_tree(root: str, *, json_path: str = "$") -> tuple[str, list[TreeFile]]:
    """Canonicalize ``root`` and list its files, refusing an incomplete tree (all reasons)."""
    canonical, info = _resolved(root, family="tree", what="directory", json_path=json_path)
    if not stat.S_ISDIR(info.st_mode):
        raise Refused.one(
            "tree.not_directory",
            json_path,
            f"{root} is not a directory",
            "point at the directory itself",
        )
    refusals: list[Refusal] = []
    files: list[TreeFile] = []
    entries = 0

    def refuse(code: str, message: str, hint: str) -> None:
        refusals.append(Refusal(code, json_path, message, hint))

    stack: list[tuple[str, tuple[str, ...]]] = [(canonical, ())]
    while stack:
        directory, parts = stack.pop()
        try:
            with os.scandir(directory) as listing:
                children = sorted(listing, key=lambda entry: entry.name)
        except OSError as exc:
            refuse(
                "tree.unreadable",
                f"{directory} cannot be listed: {exc.strerror}",
                "check permissions",
            )
            continue
        for entry in children:
            entries += 1
            if entries > TREE_MAX_ENTRIES:
                refuse(
                    "tree.too_many_entries",
                    f"{root} has more than {TREE_MAX_ENTRIES} entries",
                    "pin a smaller directory",
                )
                raise Refused(tuple(refusals))
            rel_parts = (*parts, entry.name)
            relative = "/".join(rel_parts)
            if len(rel_parts) > TREE_MAX_DEPTH:
                refuse(
                    "tree.too_deep",
                    f"{relative} is deeper than {TREE_MAX_DEPTH} levels",
                    "pin a shallower directory",
                )
                continue
            if entry.is_symlink():
                target = os.path.realpath(entry.path)
                inside = os.path.commonpath([canonical, target]) == canonical
                if not inside:
                    refuse(
                        "tree.symlink_outside",
                        f"{relative} links to {target}, outside {canonical}",
                        "copy the target into the tree or pin the tree it lives in",
                    )
                elif not Path(target).is_file():
                    refuse(
                        "tree.symlink_not_file",
                        f"{relative} links to {target}, which is not a regular file",
                        "a pinned tree's symlinks must name regular files inside it",
                    )
                else:
                    files.append(TreeFile(os.fsencode(relative), target))
                continue
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError as exc:
                refuse(
                    "tree.unreadable",
                    f"{relative} cannot be examined: {exc.strerror}",
                    "check permissions",
                )
                continue
            if stat.S_ISDIR(mode):
                stack.append((entry.path, rel_parts))
            elif stat.S_ISREG(mode):
                files.append(TreeFile(os.fsencode(relative), entry.path))
            else:
                refuse(
                    "tree.special_file",
                    f"{relative} is a special file (FIFO, socket or device)",
                    "a pinned tree holds only regular files, directories and file links",
                )
    if not files and not refusals:
        refuse("tree.empty", f"{root} holds no regular file", "pin a directory with files")
    if refusals:
        raise Refused(tuple(refusals))
    files.sort(key=lambda item: item.relative)
    return canonical, files


def pin_tree(
    root: str,
    budget: Budget,
    *,
    json_path: str = "$",
    progress: ProgressSink | None = None,
    workers: int | None = None,
) -> TreePin:
    """Check completeness and compute the tree pin of ``root``."""
    canonical, files = list_tree(root, json_path=json_path)
    budget.check(json_path)
    # A link and its target (lib/libllama.so -> libllama.so.0.0.1) are one file: hash it once,
    # reported under the first name that reaches it.
    first_names: dict[str, str] = {}
    for item in files:
        first_names.setdefault(item.source, item.relative.decode(errors="replace"))
    jobs = [HashJob(source, f"{json_path}:{name}") for source, name in first_names.items()]
    pins = hash_files(jobs, budget, progress=progress, workers=workers)
    by_source = {job.path: pin for job, pin in zip(jobs, pins, strict=True)}
    return TreePin(
        path=canonical,
        sha256=tree_digest(
            (item.relative, bytes.fromhex(by_source[item.source].sha256)) for item in files
        ),
        files=len(files),
        size=sum(by_source[item.source].size for item in files),
    )


def tree_digest(entries: Iterable[tuple[bytes, bytes]]) -> str:
    """Fold (relative path bytes, raw 32-byte digest) pairs, already sorted, into the pin."""
    total = hashlib.sha256()
    for relative, digest in entries:
        total.update(len(relative).to_bytes(8, "big"))
        total.update(relative)
        total.update(digest)
    return total.hexdigest()


# --- identity of a pinned file across a row ------------------------------------------------

# A file whose change time is this recent when it is hashed may still be written within the
# same timestamp tick without its identity changing (the file system stamps times coarsely):
# it is not held, so the next verification hashes it again.
RACY_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """What a write, truncation, replacement or re-link of a file changes."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, info: os.stat_result) -> FileIdentity:
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)

    def differences(self, other: FileIdentity) -> str:
        names = ("device", "inode", "size", "mtime_ns", "ctime_ns")
        return ", ".join(
            f"{name} {getattr(self, name)} -> {getattr(other, name)}"
            for name in names
            if getattr(self, name) != getattr(other, name)
        )


class HeldFile:
    """An open descriptor on a pinned file, held across a row, and the file's identity when
    it was opened. Holding the descriptor keeps the inode alive, so its number cannot be
    reused by another file while the row runs."""

    __slots__ = ("fd", "identity", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.identity = FileIdentity.of(os.fstat(self.fd))
        except OSError:
            os.close(self.fd)
            raise

    def change(self) -> str | None:
        """Why the file at ``path`` may no longer hold the bytes it held when opened (a write,
        a truncation, a replacement, a removal), or None when its identity is unchanged: the
        held descriptor's ``fstat`` and the path's ``stat`` both still give it."""
        held = FileIdentity.of(os.fstat(self.fd))
        if held != self.identity:
            changed = self.identity.differences(held)
            return f"{self.path} was written since it was hashed ({changed})"
        try:
            named = FileIdentity.of(os.stat(self.path))
        except OSError as exc:
            return f"{self.path} cannot be examined now: {exc.strerror or exc}"
        if named != self.identity:
            return (
                f"{self.path} names another file than the one hashed "
                f"({self.identity.differences(named)})"
            )
        return None

    def settled(self, racy_seconds: float, now_ns: int) -> bool:
        """Old enough that a later write must change its change time (see ``RACY_SECONDS``)."""
        newest = max(self.identity.mtime_ns, self.identity.ctime_ns)
        return now_ns - newest >= racy_seconds * 1e9

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


# A tree is held by one descriptor per directory and file; a larger one (a toolkit, say) is
# not held, and is hashed in full at every verification, so that a row never takes the
# descriptors its hosts' clients need.
HELD_TREE_LIMIT = 256


class HeldTree:
    """A pinned tree held across a row: its root as pinned, every directory under it and every
    file it pins (``HeldFile`` each), from one listing. A file written or replaced changes its
    own identity; a file or link added, removed, renamed or re-pointed changes its directory's
    (its entries are the directory's content); a root re-pointed names another directory.
    OSError (EMFILE) for a tree of more than ``HELD_TREE_LIMIT`` directories and files."""

    __slots__ = ("held", "path")

    def __init__(self, path: str, *, json_path: str = "$") -> None:
        canonical, files = list_tree(path, json_path=json_path)  # refused when incomplete
        self.path = path
        names = [path]
        stack = [canonical]
        while stack:  # list_tree bounded its depth and entries
            directory = stack.pop()
            if directory != canonical:
                names.append(directory)
            with os.scandir(directory) as listing:
                stack += [entry.path for entry in listing if entry.is_dir(follow_symlinks=False)]
        names += sorted({item.source for item in files})
        if len(names) > HELD_TREE_LIMIT:
            raise OSError(errno.EMFILE, f"more than {HELD_TREE_LIMIT} entries to hold", path)
        self.held: list[HeldFile] = []
        try:
            for name in names:
                self.held.append(HeldFile(name))
        except OSError:
            self.close()
            raise

    def change(self) -> str | None:
        """The first held directory or file whose identity changed, or None."""
        for held in self.held:
            problem = held.change()
            if problem is not None:
                return problem
        return None

    def settled(self, racy_seconds: float, now_ns: int) -> bool:
        return all(held.settled(racy_seconds, now_ns) for held in self.held)

    def close(self) -> None:
        for held in self.held:
            held.close()
