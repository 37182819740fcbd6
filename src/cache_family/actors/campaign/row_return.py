"""A sealed row through Ray's object store: packed on the node that ran it, received and
verified by the driver before it is placed under the campaign's ``rows/``.

The row's files travel as one byte stream cut into chunks of at most ``chunk_bytes``: the
first comes back with the row's task, the others by tasks pinned to the same node, one
chunk in memory at a time. Nothing the node says is trusted: each chunk is checked against
the manifest, each file against the manifest, and the whole row as ``merge`` checks a shard
(replay, the journal head, every file its journal binds).

The staging directory becomes ``rows/row-NNNN`` only after every check; any refusal removes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Final, TypedDict

import msgspec

from cache_family.actors.audit.run_files import entry_state
from cache_family.actors.campaign.merge import ShardRead, read_shard
from cache_family.actors.campaign.resume import STAGING_PREFIX
from cache_family.actors.journal.writer import JOURNAL_READ_LIMIT
from cache_family.errors import Refusal, Refused
from cache_family.schemas.bounded import MIB, read_bounded
from cache_family.schemas.campaign import RowManifest, decode_manifest, encode_manifest
from cache_family.schemas.journal import (
    JOURNAL_FILENAME,
    BoundFile,
    JournalSealed,
    RunFilesBound,
    read_journal,
)
from cache_family.schemas.matrix import MATRIX_FILENAME
from cache_family.system.publish import fsync_dir, publish_fresh

DEFAULT_CHUNK_BYTES: Final = 8 * MIB
# The largest chunk a node may name (the driver holds one chunk in memory at a time).
MAX_CHUNK_BYTES: Final = 64 * MIB
# A row larger than this is refused on its node and by the driver (the driver's disk and
# the object store are bounded too).
ROW_MAX_BYTES: Final = 4096 * MIB
# Where a node runs its rows when no shared --output is used (set on the node's Ray
# processes; a private directory under the system's temporary directory otherwise).
NODE_WORK_DIR_ENV: Final = "CACHE_FAMILY_NODE_WORK_DIR"
INPUT_NAME: Final = "cache-family-input.json"


def _refused(code: str, where: str, message: str, hint: str) -> Refused:
    return Refused((Refusal(code, f"$.rows[{where!r}]", message, hint),))


# --- on the node ------------------------------------------------------------------------------


def node_work_dir(environ: dict[str, str]) -> str:
    found = environ.get(NODE_WORK_DIR_ENV)
    if found:
        return found
    return os.path.join(tempfile.gettempdir(), f"cache-family-node-{os.getuid()}")


def place_input(directory: str, data: bytes, sha256: str) -> str:
    """The prepared input's bytes as a file of the node's work directory, checked against the
    SHA-256 the driver read (the pins inside it are re-hashed by the row's own run)."""
    found = hashlib.sha256(data).hexdigest()
    if found != sha256:
        raise _refused(
            "campaign.row.input_mismatch",
            directory,
            f"the prepared input arrived with sha256 {found}, not {sha256}",
            "the object store corrupted the task's input; resume the campaign",
        )
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, INPUT_NAME)
    if os.path.exists(path):
        if read_bounded(path, len(data) + 1, what="prepared input").sha256 == sha256:
            return path
        os.unlink(path)
    publish_fresh(path, data, mode=0o600)
    return path


def row_files(run_dir: str) -> tuple[str, tuple[BoundFile, ...]]:
    """The sealed row's journal head and files: its journal, its matrix and every file its
    last ``run_files`` record binds, each hashed as it is on disk now."""
    raw = read_bounded(os.path.join(run_dir, JOURNAL_FILENAME), JOURNAL_READ_LIMIT, what="journal")
    read = read_journal(raw.data)
    records = [line.record for line in read.lines]
    if read.chain_break is not None or not records or not isinstance(records[-1], JournalSealed):
        raise _refused(
            "campaign.row.unsealed",
            run_dir,
            f"{run_dir}'s journal is not sealed",
            "the row's run did not finish; see its log",
        )
    bound = next((r for r in reversed(records) if isinstance(r, RunFilesBound)), None)
    names = (
        [JOURNAL_FILENAME, MATRIX_FILENAME, *(f.path for f in bound.files)]
        if bound
        else [
            JOURNAL_FILENAME,
            MATRIX_FILENAME,
        ]
    )
    files = []
    for name in names:
        sha256, size = entry_state(os.path.join(run_dir, name))
        files.append(BoundFile(path=name, sha256=sha256, size=size))
    return read.line_sha256s[-1], tuple(files)


def _stream(run_dir: str, files: tuple[BoundFile, ...], start: int, length: int) -> bytes:
    """``length`` bytes of the row's stream from ``start``."""
    out = bytearray()
    offset = 0
    for entry in files:
        end = offset + entry.size
        if end > start and offset < start + length:
            with open(os.path.join(run_dir, entry.path), "rb") as handle:
                handle.seek(max(start - offset, 0))
                out += handle.read(min(end, start + length) - max(start, offset))
        offset = end
    return bytes(out)


def pack_row(run_dir: str, row_key: str, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> RowManifest:
    """The manifest of the sealed row in ``run_dir``; raises ``Refused`` past the bound."""
    head, files = row_files(run_dir)
    total = sum(f.size for f in files)
    if total > ROW_MAX_BYTES:
        raise _refused(
            "campaign.row.too_large",
            row_key,
            f"the row's files hold {total} bytes, more than {ROW_MAX_BYTES}",
            "run the campaign with --output on storage every node shares",
        )
    shas = tuple(
        hashlib.sha256(_stream(run_dir, files, start, chunk_bytes)).hexdigest()
        for start in range(0, total, chunk_bytes)
    )
    return RowManifest(
        row_key=row_key,
        journal_head=head,
        files=files,
        total_bytes=total,
        chunk_bytes=chunk_bytes,
        chunk_sha256s=shas,
    )


def read_chunk(run_dir: str, manifest: RowManifest, index: int) -> bytes:
    """Chunk ``index`` of the row's stream (a task pinned to the row's node asks)."""
    return _stream(run_dir, manifest.files, index * manifest.chunk_bytes, manifest.chunk_bytes)


class Packed(TypedDict):
    manifest: bytes
    first_chunk: bytes
    chunks: int


def pack_on_node(run_dir: str, row_key: str, chunk_bytes: int) -> Packed:
    """What the row's task returns of a sealed row: the manifest and the first chunk."""
    manifest = pack_row(run_dir, row_key, chunk_bytes=chunk_bytes)
    return {
        "manifest": encode_manifest(manifest),
        "chunks": len(manifest.chunk_sha256s),
        "first_chunk": read_chunk(run_dir, manifest, 0) if manifest.chunk_sha256s else b"",
    }


# --- on the driver ----------------------------------------------------------------------------


def _safe(path: str) -> bool:
    parts = path.split("/")
    return (
        bool(path)
        and not os.path.isabs(path)
        and all(part not in ("", ".", "..") for part in parts)
        and "\0" not in path
    )


def check_manifest(data: bytes, row_key: str, max_bytes: int = ROW_MAX_BYTES) -> RowManifest:
    """Decode the node's manifest strictly and check it is self-consistent and bounded."""
    try:
        manifest = decode_manifest(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _refused(
            "campaign.row.malformed",
            row_key,
            f"the row's manifest does not decode ({exc})",
            "the node runs another version of cache-family; install the same one everywhere",
        ) from None
    paths = [f.path for f in manifest.files]
    total = sum(f.size for f in manifest.files)
    chunks = -(-total // manifest.chunk_bytes) if manifest.chunk_bytes > 0 else -1
    problems = []
    if manifest.row_key != row_key:
        problems.append(f"it names row {manifest.row_key}")
    if not all(_safe(p) for p in paths) or len(set(paths)) != len(paths):
        problems.append("a file path is absolute, climbs out, is empty or repeats")
    if paths[:2] != [JOURNAL_FILENAME, MATRIX_FILENAME]:
        problems.append("it does not start with the journal and the matrix")
    if any(f.size < 0 for f in manifest.files) or total != manifest.total_bytes:
        problems.append("its sizes do not add up")
    if chunks != len(manifest.chunk_sha256s):
        problems.append("its chunk count does not match its size")
    if manifest.chunk_bytes > MAX_CHUNK_BYTES:
        problems.append(f"its chunks are larger than {MAX_CHUNK_BYTES} bytes")
    if problems:
        raise _refused(
            "campaign.row.malformed",
            row_key,
            "the row's manifest is not consistent: " + "; ".join(problems),
            "the node's reply was forged or corrupted; resume the campaign to run the row again",
        )
    if total > max_bytes:
        raise _refused(
            "campaign.row.too_large",
            row_key,
            f"the row's files hold {total} bytes, more than {max_bytes}",
            "run the campaign with --output on storage every node shares",
        )
    return manifest


def _write_stream(staging: str, manifest: RowManifest, chunks: Iterator[bytes]) -> None:
    """Make the row's files, then fill them chunk by chunk; a chunk that is not the one the
    manifest names is refused before a byte of it is written."""
    spans: list[tuple[int, int, str]] = []
    offset = 0
    for entry in manifest.files:
        path = os.path.join(staging, entry.path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "xb"):
            pass
        spans.append((offset, offset + entry.size, path))
        offset += entry.size
    for index, chunk in enumerate(chunks):
        start = index * manifest.chunk_bytes
        expected = min(manifest.chunk_bytes, manifest.total_bytes - start)
        if len(chunk) != expected or (
            hashlib.sha256(chunk).hexdigest() != manifest.chunk_sha256s[index]
        ):
            raise _refused(
                "campaign.row.chunk_corrupt",
                manifest.row_key,
                f"chunk {index} of {len(manifest.chunk_sha256s)} arrived with other bytes "
                "than the node hashed",
                "the row stays incomplete; `campaign --resume` runs it again",
            )
        end = start + len(chunk)
        for file_start, file_end, path in spans:
            if file_end <= start or file_start >= end:
                continue
            with open(path, "r+b") as handle:
                handle.seek(max(start, file_start) - file_start)
                handle.write(chunk[max(start, file_start) - start : min(end, file_end) - start])


def receive_row(
    manifest_data: bytes,
    first_chunk: bytes,
    fetch_chunk: Callable[[int], bytes],
    rows_dir: str,
    name: str,
    *,
    row_key: str,
    prepared_sha256: str,
    max_bytes: int = ROW_MAX_BYTES,
) -> tuple[ShardRead, RowManifest]:
    """Verify the row's bytes as they arrive, then the row as ``merge`` verifies a shard, and
    only then place it as ``rows_dir/name``; raises ``Refused`` (nothing placed)."""
    manifest = check_manifest(manifest_data, row_key, max_bytes)
    staging = os.path.join(rows_dir, STAGING_PREFIX + name)
    target = os.path.join(rows_dir, name)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:

        def chunks() -> Iterator[bytes]:
            for index in range(len(manifest.chunk_sha256s)):
                yield first_chunk if index == 0 else fetch_chunk(index)

        try:
            _write_stream(staging, manifest, chunks())
        except OSError as exc:
            raise _refused(
                "campaign.row.malformed",
                row_key,
                f"the row's files cannot be laid out as its manifest names them ({exc})",
                "the node's reply was forged or corrupted; resume the campaign",
            ) from None
        _check_files(staging, manifest)
        shard = _verified(staging, manifest, row_key, prepared_sha256)
        os.rename(staging, target)
        fsync_dir(rows_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dataclasses.replace(shard, root=target), manifest


def _check_files(staging: str, manifest: RowManifest) -> None:
    for entry in manifest.files:
        if entry_state(os.path.join(staging, entry.path)) != (entry.sha256, entry.size):
            raise _refused(
                "campaign.row.file_mismatch",
                manifest.row_key,
                f"{entry.path} arrived with other bytes than the manifest names",
                "the row stays incomplete; `campaign --resume` runs it again",
            )


def _verified(root: str, manifest: RowManifest, row_key: str, prepared_sha256: str) -> ShardRead:
    try:
        shard = read_shard(root)
    except Refused as refused:
        why = "; ".join(r.message for r in refused.refusals)
        raise _refused(
            "campaign.row.unverified",
            row_key,
            f"the row does not replay identical: {why}",
            "the row's bytes were forged or edited; `campaign --resume` runs it again",
        ) from None
    keys = shard.selected.row_keys if shard.selected is not None else None
    problems = []
    if shard.head != manifest.journal_head:
        problems.append(f"its journal head is {shard.head}, the node said {manifest.journal_head}")
    if shard.started.request_sha256 != prepared_sha256:
        problems.append(f"it ran a prepared input with sha256 {shard.started.request_sha256}")
    if keys != (row_key,):
        problems.append(f"it ran rows {keys}, not {row_key}")
    if problems:
        raise _refused(
            "campaign.row.forged",
            row_key,
            "the row is not the one asked for: " + "; ".join(problems),
            "the row stays incomplete; `campaign --resume` runs it again",
        )
    return shard
