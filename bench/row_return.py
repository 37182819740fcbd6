"""The added time per row of the object-store return against the shared-directory path.

    .venv/bin/python bench/row_return.py [--row RUN_DIR | --prepared PATH] [--journal-mib 100]
        [--repeats 3] [--work DIR] [--json]

Needs root: it starts one separated test host (``campaign --ray local``'s, its own network
namespace and work directory) and measures, side by side in one run, for two sealed rows:

* a zoo row: ``--row`` (a sealed ``cache-family run --rows KEY`` directory), else the first
  row of ``--prepared`` run once here, else the zoo's first full-GGUF row prepared as the
  demo prepares it;
* a synthetic row: that row with its journal grown to ``--journal-mib`` MiB (its first line's
  ``input_path``, which nothing folds, padded; the chain and seal made again); it replays
  identical, so both paths accept it.

For each, the time from the row sealed on its node to the row verified under the campaign's
``rows/``: through the shared directory, the driver's verification of the row in place
(``arrival.arrive_in_place``: the node wrote it there as it would have written it anywhere);
through the object store, the node's packing (hashing every file and chunk), the chunks'
transfer (the first with the task, the others by tasks pinned to the node), the driver's
writes and checks and the same verification (``arrival.arrive_through_store``). The median of
``--repeats`` of each, taken alternately, and their difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from cache_family.actors.campaign.arrival import arrive_in_place, arrive_through_store
from cache_family.actors.campaign.local_cluster import enter_loopback_namespace, local_cluster
from cache_family.actors.campaign.merge import Missing
from cache_family.actors.campaign.row_return import DEFAULT_CHUNK_BYTES, pack_on_node, read_chunk
from cache_family.schemas.campaign import decode_manifest
from cache_family.schemas.journal import (
    JOURNAL_FILENAME,
    JournalChain,
    JournalSealed,
    RowsSelected,
    RunStarted,
    read_journal,
)

CLI = str(Path(sys.executable).parent / "cache-family")
MIB = 1024 * 1024


def zoo_row(work: Path, prepared: Path | None) -> Path:
    if prepared is None:
        sys.path.insert(0, str(Path(__file__).parent))
        from campaign_driver import prepare_zoo

        prepared = prepare_zoo(work, ("qwen3_dense",))
    key = subprocess.run(
        [CLI, "run", "--input", str(prepared), "--dry-run"], capture_output=True, text=True,
        check=True,
    ).stdout.split()[0]  # fmt: skip
    row = work / "zoo-row"
    subprocess.run(
        [CLI, "run", "--input", str(prepared), "--output", str(row), "--rows", key, "--quiet"],
        check=False,
    )
    return row


def grown(row: Path, target: Path, journal_bytes: int) -> Path:
    """A copy of ``row`` whose journal holds ``journal_bytes``: its ``run_started`` line made
    long (its ``input_path``, which nothing folds, padded), every line chained again and the
    seal made again over every byte; seq numbers, receipts and files are unchanged."""
    shutil.copytree(row, target, symlinks=True)
    (target / "journal.head.sig").unlink(missing_ok=True)
    read = read_journal((row / JOURNAL_FILENAME).read_bytes())
    *lines, last = read.lines
    assert isinstance(last.record, JournalSealed) and isinstance(lines[0].record, RunStarted)
    size = len((row / JOURNAL_FILENAME).read_bytes())
    padded = msgspec.structs.replace(
        lines[0].record, input_path="/" + "p" * max(journal_bytes - size, 0)
    )
    chain = JournalChain()
    out = bytearray()
    for line in [msgspec.structs.replace(lines[0], record=padded), *lines[1:]]:
        out += chain.encode(line.record, mono_ns=line.mono_ns, wall_ns=line.wall_ns)
    seal = msgspec.structs.replace(
        last.record, through_seq=chain.next_seq - 1, head_sha256=chain.prev, digest=""
    )
    _, sealed = chain.seal(
        seal, hashlib.sha256(bytes(out)), mono_ns=last.mono_ns, wall_ns=last.wall_ns
    )
    (target / JOURNAL_FILENAME).write_bytes(bytes(out) + sealed)
    return target


def row_identity(row: Path) -> tuple[str, int, str]:
    records = [line.record for line in read_journal((row / JOURNAL_FILENAME).read_bytes()).lines]
    started, selected = records[0], records[1]
    assert isinstance(started, RunStarted) and isinstance(selected, RowsSelected)
    return selected.row_keys[0], started.planned_rows[0].index, started.request_sha256


def pack_task(row_dir: str, key: str, chunk_bytes: int) -> dict[str, object]:
    import ray

    return {
        **pack_on_node(row_dir, key, chunk_bytes),
        "hostname": "bench",
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_row_dir": row_dir,
    }


def chunk_task(row_dir: str, manifest: bytes, index: int) -> bytes:
    return read_chunk(row_dir, decode_manifest(manifest), index)


def measure(ray: Any, node_dir: str, row: Path, campaign: Path, repeats: int) -> dict[str, object]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    key, index, prepared_sha = row_identity(row)
    on_node = os.path.join(node_dir, row.name)
    shutil.copytree(row, on_node, symlinks=True)
    shared = campaign / "shared"
    (shared / "rows").mkdir(parents=True)
    shutil.copytree(row, shared / "rows" / "row-0000", symlinks=True)
    store = campaign / "store"
    (store / "rows").mkdir(parents=True)
    node_id = ray.get(ray.remote(lambda: ray.get_runtime_context().get_node_id())
                      .options(resources={"cf.row": 1}).remote())  # fmt: skip
    pinned = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    pack = ray.remote(pack_task).options(num_cpus=0, scheduling_strategy=pinned)
    fetch_chunk = ray.remote(chunk_task).options(num_cpus=0, scheduling_strategy=pinned)
    times: dict[str, list[float]] = {"shared": [], "object_store": []}
    size = 0
    for _ in range(repeats):
        started = time.monotonic()
        arrived = arrive_in_place(str(shared), "row-0000", key, index, None, "shared-output")
        times["shared"].append(time.monotonic() - started)
        assert arrived is not None and not isinstance(arrived, Missing), arrived

        started = time.monotonic()
        result = ray.get(pack.remote(on_node, key, DEFAULT_CHUNK_BYTES))

        def fetch(chunk: int, result: dict[str, object] = result) -> bytes:
            return bytes(ray.get(fetch_chunk.remote(on_node, result["manifest"], chunk)))

        arrived = arrive_through_store(result, str(store), "row-0000", key, index,
                                       prepared_sha, fetch)  # fmt: skip
        times["object_store"].append(time.monotonic() - started)
        assert not isinstance(arrived, Missing), arrived
        size = arrived.record.size
        shutil.rmtree(store / "rows" / "row-0000")
    shared_s = statistics.median(times["shared"])
    store_s = statistics.median(times["object_store"])
    return {
        "row": key,
        "bytes": size,
        "journal_bytes": (row / JOURNAL_FILENAME).stat().st_size,
        "chunks": -(-size // DEFAULT_CHUNK_BYTES),
        "shared_seconds": shared_s,
        "object_store_seconds": store_s,
        "added_seconds": store_s - shared_s,
        "samples": times,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--row", type=Path)
    parser.add_argument("--prepared", type=Path)
    parser.add_argument("--journal-mib", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="cfrr-"))
    work.mkdir(parents=True, exist_ok=True)
    row = args.row or zoo_row(work, args.prepared)
    big = grown(row, work / "grown-row", args.journal_mib * MIB)
    load_before = os.getloadavg()[0]
    parent = enter_loopback_namespace()
    import ray

    figures: dict[str, object] = {"cpus": os.cpu_count(), "load_average_before": load_before}
    with local_cluster(str(work / "ray"), 1, parent) as cluster:
        ray.init(address=cluster.address, _node_ip_address=cluster.node_ip_address,
                 log_to_driver=False, logging_level="ERROR")  # fmt: skip
        try:
            node_dir = cluster.members[0].work_dir
            figures["zoo_row"] = measure(ray, node_dir, row, work / "c-zoo", args.repeats)
            figures["grown_row"] = measure(ray, node_dir, big, work / "c-big", args.repeats)
        finally:
            ray.shutdown()
    figures["load_average_after"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"{figures['cpus']} CPU(s); load average {load_before:.2f} before, "
          f"{figures['load_average_after']:.2f} after; medians of {args.repeats}")  # fmt: skip
    print("| row | bytes | chunks | shared directory s | object store s | added s |")
    print("|---|---|---|---|---|---|")
    for name in ("zoo_row", "grown_row"):
        f: Any = figures[name]
        label = (
            "zoo row" if name == "zoo_row" else f"zoo row, journal grown to {args.journal_mib} MiB"
        )
        print(f"| {label} (`{f['row']}`) | {f['bytes']:,} | {f['chunks']} | "
              f"{f['shared_seconds']:.3f} | {f['object_store_seconds']:.3f} | "
              f"{f['added_seconds']:+.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
