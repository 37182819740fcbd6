"""Every file of a campaign directory that no shard journal or merged receipt vouches for
(its request, the local cluster's evidence, the rows' logs, directories), bound by SHA-256
in the campaign journal as a run binds its own (``campaign_files``), and checked by replay."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Sequence
from typing import Final

from cache_family.actors.audit.run_files import FileProblem, compare_entries, entry_state
from cache_family.schemas.campaign import CAMPAIGN_JOURNAL
from cache_family.schemas.journal import BoundFile

# Ray's own session files (logs, sockets) under the local cluster's session directory: Ray's
# processes write them, some after the cluster was shut down, so they are never bound.
RAY_SESSION_DIR: Final = "ray"


def _entries(
    root: str, merged: Collection[str], shards: Collection[str]
) -> Iterator[tuple[str, str]]:
    """(relative path, full path) of every entry under ``root``, sorted, links not followed:
    directories too (an empty planted one is found), a shard's directory as one entry (its
    own journal binds what is inside), the journal, the merged files and Ray's session files
    left out."""
    shard_dirs = {os.path.realpath(shard) for shard in shards}
    for directory, dirs, files in os.walk(root, followlinks=False):
        top = directory == root
        dirs.sort()
        descend: list[str] = []
        for name in dirs:
            full = os.path.join(directory, name)
            if top and name == RAY_SESSION_DIR:
                continue
            yield os.path.relpath(full, root), full
            if not os.path.islink(full) and os.path.realpath(full) not in shard_dirs:
                descend.append(name)
        dirs[:] = descend
        for name in sorted(files):
            full = os.path.join(directory, name)
            relative = os.path.relpath(full, root)
            if top and name == CAMPAIGN_JOURNAL:
                continue
            if relative in merged:
                continue
            yield relative, full


def bind_campaign_files(
    root: str, merged: Collection[str], shards: Sequence[str]
) -> tuple[BoundFile, ...]:
    """Every entry of the campaign directory but its journal, its ``merged`` files (their
    ``campaign_receipt`` records bind them), the inside of its ``shards`` and Ray's session."""
    bound: list[BoundFile] = []
    for relative, full in _entries(root, merged, shards):
        sha256, size = entry_state(full)
        bound.append(BoundFile(path=relative, sha256=sha256, size=size))
    return tuple(bound)


def check_campaign_files(
    root: str, bound: Sequence[BoundFile], merged: Collection[str], shards: Sequence[str]
) -> list[FileProblem]:
    """The campaign directory against its bound list: an edited, missing or extra entry."""
    return compare_entries(dict(_entries(root, merged, shards)), bound)
