"""A sealed row through the object store, without Ray: the node's packing and the driver's
receiving of a real row (``cache-family run --rows KEY`` against the FAKE llama-server of
``run_harness.make_prepared``), with the chunks handed over in process. The Ray tests in
``test_campaign_ray.py`` carry the same bytes between separated hosts."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from run_harness import make_prepared

from cache_family.actors.audit.replay import replay
from cache_family.actors.campaign.arrival import arrive_through_store
from cache_family.actors.campaign.merge import Missing
from cache_family.actors.campaign.row_return import (
    STAGING_PREFIX,
    check_manifest,
    pack_row,
    place_input,
    read_chunk,
    receive_row,
)
from cache_family.errors import Refused
from cache_family.schemas.campaign import (
    RowManifest,
    decode_manifest,
    encode_manifest,
    files_digest,
)

CLI = Path(sys.executable).parent / "cache-family"
KEY = "qwen3_dense/none/16"
CHUNK = 4096


class Row:
    def __init__(self, root: Path) -> None:
        self.prepared = make_prepared(root / "p", prefix_sweep=[16])
        self.sha256 = hashlib.sha256(self.prepared.read_bytes()).hexdigest()
        self.dir = root / "row"
        done = subprocess.run(
            [str(CLI), "run", "--input", str(self.prepared), "--output", str(self.dir),
             "--rows", KEY, "--quiet"],
            env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=600,
            check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def row(tmp_path_factory: pytest.TempPathFactory) -> Row:
    return Row(tmp_path_factory.mktemp("row-return"))


def receive(
    row_dir: Path, manifest: RowManifest, rows: Path, fetch: object = None, *, sha256: str
) -> Path:
    rows.mkdir(exist_ok=True)
    fetched = fetch or (lambda index: read_chunk(str(row_dir), manifest, index))
    shard, _ = receive_row(
        encode_manifest(manifest), read_chunk(str(row_dir), manifest, 0), fetched,  # type: ignore[arg-type]
        str(rows), "row-0000", row_key=KEY, prepared_sha256=sha256,
    )  # fmt: skip
    return Path(shard.root)


def test_a_row_larger_than_the_chunk_size_arrives_whole_verified_and_placed(
    row: Row, tmp_path: Path
) -> None:
    manifest = pack_row(str(row.dir), KEY, chunk_bytes=CHUNK)
    assert manifest.total_bytes > 3 * CHUNK
    assert len(manifest.chunk_sha256s) == -(-manifest.total_bytes // CHUNK)
    asked: list[int] = []

    def fetch(index: int) -> bytes:
        asked.append(index)
        return read_chunk(str(row.dir), manifest, index)

    placed = receive(row.dir, manifest, tmp_path / "rows", fetch, sha256=row.sha256)
    # The first chunk came with the task; every other one was asked for once, in order.
    assert asked == list(range(1, len(manifest.chunk_sha256s)))
    assert placed == tmp_path / "rows" / "row-0000"
    for entry in manifest.files:
        assert (placed / entry.path).read_bytes() == (row.dir / entry.path).read_bytes()
    assert replay(str(placed)).exit_code == 0
    assert not (tmp_path / "rows" / f"{STAGING_PREFIX}row-0000").exists()


def refused_code(action: object) -> str:
    with pytest.raises(Refused) as caught:
        action()  # type: ignore[operator]
    (refusal,) = caught.value.refusals
    return refusal.code


def test_a_corrupted_chunk_is_refused_and_nothing_is_placed(row: Row, tmp_path: Path) -> None:
    manifest = pack_row(str(row.dir), KEY, chunk_bytes=CHUNK)

    def corrupted(index: int) -> bytes:
        data = bytearray(read_chunk(str(row.dir), manifest, index))
        if index == 2:
            data[17] ^= 0x01
        return bytes(data)

    code = refused_code(
        lambda: receive(row.dir, manifest, tmp_path / "rows", corrupted, sha256=row.sha256)
    )
    assert code == "campaign.row.chunk_corrupt"
    assert list((tmp_path / "rows").iterdir()) == []


def test_a_forged_row_is_refused_with_typed_codes(row: Row, tmp_path: Path) -> None:
    # Its bytes edited and the manifest made to match them: replay finds the edit.
    forged = Path(shutil.copytree(row.dir, tmp_path / "forged"))
    matrix = forged / "cache-family-matrix.json"
    matrix.write_bytes(matrix.read_bytes().replace(b'"completed"', b'"incomplete"', 1))
    manifest = pack_row(str(forged), KEY, chunk_bytes=CHUNK)
    code = refused_code(lambda: receive(forged, manifest, tmp_path / "rows", sha256=row.sha256))
    assert code == "campaign.row.unverified"
    # The true bytes under a manifest that names another head.
    honest = pack_row(str(row.dir), KEY, chunk_bytes=CHUNK)
    other_head = msgspec.structs.replace(honest, journal_head="0" * 64)
    code = refused_code(lambda: receive(row.dir, other_head, tmp_path / "rows", sha256=row.sha256))
    assert code == "campaign.row.forged"
    # The row of another prepared input than the campaign's.
    code = refused_code(lambda: receive(row.dir, honest, tmp_path / "rows", sha256="1" * 64))
    assert code == "campaign.row.forged"
    assert sorted(p.name for p in (tmp_path / "rows").iterdir()) == []


def test_a_manifest_that_climbs_out_or_does_not_add_up_is_malformed(row: Row) -> None:
    honest = pack_row(str(row.dir), KEY, chunk_bytes=CHUNK)
    first, *rest = honest.files
    climbing = msgspec.structs.replace(
        honest, files=(first, *rest[:-1], msgspec.structs.replace(rest[-1], path="../x"))
    )
    assert refused_code(lambda: check_manifest(encode_manifest(climbing), KEY)) == (
        "campaign.row.malformed"
    )
    short = msgspec.structs.replace(honest, chunk_sha256s=honest.chunk_sha256s[:-1])
    assert refused_code(lambda: check_manifest(encode_manifest(short), KEY)) == (
        "campaign.row.malformed"
    )
    huge = msgspec.structs.replace(
        honest, chunk_bytes=1 << 30, chunk_sha256s=honest.chunk_sha256s[:1]
    )
    assert refused_code(lambda: check_manifest(encode_manifest(huge), KEY)) == (
        "campaign.row.malformed"
    )
    assert refused_code(lambda: check_manifest(b'{"schema_version": 1}', KEY)) == (
        "campaign.row.malformed"
    )
    bounded = encode_manifest(honest)
    assert decode_manifest(bounded) == honest
    assert refused_code(lambda: check_manifest(bounded, KEY, max_bytes=CHUNK)) == (
        "campaign.row.too_large"
    )


def test_the_prepared_input_is_placed_on_the_node_only_with_its_sha256(
    row: Row, tmp_path: Path
) -> None:
    data = row.prepared.read_bytes()
    placed = place_input(str(tmp_path / "work"), data, row.sha256)
    assert Path(placed).read_bytes() == data
    assert place_input(str(tmp_path / "work"), data, row.sha256) == placed
    assert refused_code(lambda: place_input(str(tmp_path / "w2"), data[:-1], row.sha256)) == (
        "campaign.row.input_mismatch"
    )


def test_a_row_refused_on_arrival_is_missing_with_its_code_and_nothing_is_placed(
    row: Row, tmp_path: Path
) -> None:
    manifest = pack_row(str(row.dir), KEY, chunk_bytes=CHUNK)
    campaign = tmp_path / "campaign"
    (campaign / "rows").mkdir(parents=True)
    result = {
        "hostname": "node-a",
        "node_id": "f" * 56,
        "labels": {"cf.host": "host-0"},
        "returncode": 0,
        "log_tail": b"the row's log\n",
        "manifest": encode_manifest(manifest),
        "first_chunk": read_chunk(str(row.dir), manifest, 0),
    }

    def corrupted(index: int) -> bytes:
        return read_chunk(str(row.dir), manifest, index)[::-1]

    missing = arrive_through_store(result, str(campaign), "row-0000", KEY, 0, row.sha256, corrupted)
    assert isinstance(missing, Missing)
    assert missing.reason == "campaign.row.chunk_corrupt"
    assert missing.host is not None and missing.host.labels == {"cf.host": "host-0"}
    assert sorted(p.name for p in (campaign / "rows").iterdir()) == ["row-0000.log"]
    arrived = arrive_through_store(
        result, str(campaign), "row-0000", KEY, 0, row.sha256,
        lambda index: read_chunk(str(row.dir), manifest, index),
    )  # fmt: skip
    assert not isinstance(arrived, Missing)
    assert arrived.record.row_key == KEY and arrived.record.how == "object-store"
    assert arrived.record.journal_head == manifest.journal_head
    assert arrived.record.files_sha256 == files_digest(manifest.files)
    assert arrived.record.row_dir == "rows/row-0000"
