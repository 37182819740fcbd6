"""Every file of a run directory, bound by SHA-256: what the run binds and what replay checks.

Bound by ``run_files``, journaled before the matrix is published: every regular file of the run
directory except the journal, the matrix (its ``receipt_published`` binds it), the lock, the
head's signature and what ``report-run`` writes (replay regenerates those). A journal from
before ``run_files`` binds no file list: replay says so and stays able to check it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from cache_family.schemas.journal import JOURNAL_FILENAME, BoundFile
from cache_family.schemas.matrix import MATRIX_FILENAME
from cache_family.system.run_lock import LOCK_NAME

# Files at the top of the run directory that are never bound (see the module docstring).
HEAD_SIGNATURE_NAME: Final = "journal.head.sig"
REPORT_MANIFEST_NAME: Final = "report-files.json"
# What report-run writes into the run directory (report/run_report.py names them).
REPORT_NAMES: Final = frozenset(("report.md", "report.html", REPORT_MANIFEST_NAME))
REPORT_DIRS: Final = frozenset(("plots",))
UNBOUND_NAMES: Final = frozenset(
    {JOURNAL_FILENAME, MATRIX_FILENAME, LOCK_NAME, HEAD_SIGNATURE_NAME} | REPORT_NAMES
)
_CHUNK: Final = 1 << 20


def _hash(path: str) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _entries(root: str) -> Iterator[tuple[str, str]]:
    """(relative path, full path) of every entry that is not a directory, sorted, without
    following links; the unbound names at the top are left out."""
    for directory, dirs, files in os.walk(root, followlinks=False):
        top = directory == root
        if top:
            dirs[:] = [d for d in dirs if d not in REPORT_DIRS]
        dirs.sort()
        # A link to a directory is listed by os.walk among the directories: it is an entry.
        names = sorted(files + [d for d in dirs if os.path.islink(os.path.join(directory, d))])
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(directory, d))]
        for name in names:
            if top and name in UNBOUND_NAMES:
                continue
            full = os.path.join(directory, name)
            yield os.path.relpath(full, root), full


def entry_state(full: str) -> tuple[str, int]:
    """(SHA-256, size) of a regular file; for a link, a directory or another kind of entry,
    or one that cannot be read, what it is instead (so it is still found replaced or
    removed)."""
    try:
        if os.path.islink(full):
            return f"link: {os.readlink(full)}", 0
        if os.path.isdir(full):
            return "directory", 0
        if not os.path.isfile(full):
            return "not a regular file", 0
        return _hash(full)
    except OSError as exc:
        return f"unreadable: {exc.strerror}", 0


def bind_run_files(root: str) -> tuple[BoundFile, ...]:
    """Every file of the run directory, hashed (run it in a thread: it reads them all)."""
    bound: list[BoundFile] = []
    for relative, full in _entries(root):
        sha256, size = entry_state(full)
        bound.append(BoundFile(path=relative, sha256=sha256, size=size))
    return tuple(bound)


@dataclass(frozen=True, slots=True)
class FileProblem:
    """One file that does not match the bound list: ``code`` is stable."""

    code: str
    path: str
    detail: str


def check_run_files(root: str, bound: Sequence[BoundFile]) -> list[FileProblem]:
    """The run directory against the bound list: every bound file present with its bytes,
    and no other file (``replay.file.changed``, ``replay.file.missing``,
    ``replay.file.unbound``)."""
    return compare_entries(dict(_entries(root)), bound)


def compare_entries(present: Mapping[str, str], bound: Sequence[BoundFile]) -> list[FileProblem]:
    """What is there now (relative path -> full path) against a bound list."""
    expected = {entry.path: entry for entry in bound}
    problems: list[FileProblem] = []
    for relative, entry in expected.items():
        full = present.get(relative)
        if full is None:
            problems.append(FileProblem("replay.file.missing", relative, "bound, now gone"))
            continue
        sha256, size = entry_state(full)
        if sha256 != entry.sha256:
            problems.append(
                FileProblem(
                    "replay.file.changed",
                    relative,
                    f"now {sha256} ({size} bytes); bound as {entry.sha256} ({entry.size} bytes)",
                )
            )
    problems += [
        FileProblem("replay.file.unbound", relative, "not among the files the run bound")
        for relative in present
        if relative not in expected
    ]
    return problems


# --- report-run's files -------------------------------------------------------------------


def report_manifest(files: Mapping[str, bytes]) -> bytes:
    """``report-files.json``: the SHA-256 of every file ``report-run`` wrote, so replay can
    tell which of them are gone and which are extra (it regenerates the files themselves)."""
    document = {
        "report_files": {
            name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())
        }
    }
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode("utf-8")


def report_entries(root: str) -> list[str]:
    """What of report-run's output lies in the run directory now (relative paths): its named
    files and every entry under its plot directory."""
    found = [name for name in sorted(REPORT_NAMES) if os.path.lexists(os.path.join(root, name))]
    for directory in sorted(REPORT_DIRS):
        top = os.path.join(root, directory)
        if not os.path.lexists(top):
            continue
        if os.path.islink(top) or not os.path.isdir(top):
            found.append(directory)
            continue
        for here, dirs, files in os.walk(top, followlinks=False):
            dirs.sort()
            for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(here, d))]):
                found.append(os.path.relpath(os.path.join(here, name), root))
    return found
