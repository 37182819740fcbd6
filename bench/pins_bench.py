"""Pin cost per cell for a 100 GiB multi-shard model: identity checks against full re-hashes
(issue 13, item 5), measured side by side in one run.

The model is ``--shards`` sparse files (``os.truncate``: no disk space is used) adding up to
``--model-gib``. A full hash of it is timed on ``--hash-gib`` of the same sparse bytes with
the run's own hashing (``run_context.hash_pins``, threads over the shards as in a real cell)
and extrapolated to the whole model, unless ``--hash-gib`` is the model size. The identity
check is timed on the whole model: ``RowPins`` holding every shard, as after a row's first
verification (its first hash is the one the full-hash figure prices, so it is not repeated).

Run with ``just bench-pins`` (``--append`` writes the figures to bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import trio

from cache_family.actors.run.context import PinResult, RowPins, hash_pins
from cache_family.states.plans import PinTarget

GIB = 1024**3
RESULTS = Path(__file__).with_name("RESULTS.md")


def sparse_shards(root: Path, count: int, total: int) -> list[Path]:
    size = total // count
    paths = []
    for index in range(count):
        path = root / f"model-{index + 1:05d}-of-{count:05d}.gguf"
        with open(path, "wb") as stream:
            stream.truncate(size)
        paths.append(path)
    return paths


async def full_hash_seconds(targets: Sequence[PinTarget]) -> tuple[float, list[PinResult]]:
    start = time.perf_counter()
    results = await hash_pins(targets, 3600.0)
    return time.perf_counter() - start, results


async def identity_seconds(targets: Sequence[PinTarget], cells: int) -> list[float]:
    """Seconds of each verification (two per cell) once the row holds every shard."""

    async def already_hashed(batch: Sequence[PinTarget], seconds: float) -> list[PinResult]:
        del seconds
        return [PinResult(target, target.expected_sha256) for target in batch]

    pins = RowPins(already_hashed, racy_seconds=0)
    await pins.verify(targets, 60.0)
    times = []
    for _ in range(2 * cells):
        start = time.perf_counter()
        results = await pins.verify(targets, 60.0)
        times.append(time.perf_counter() - start)
        assert all(r.verified_by == "identity" and r.matches for r in results)
    pins.close()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-gib", type=float, default=100.0)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--hash-gib", type=float, default=4.0)
    parser.add_argument("--cells", type=int, default=4, help="cells per row (4: all arms)")
    parser.add_argument("--append", action="store_true", help="append the figures to RESULTS.md")
    args = parser.parse_args()
    out: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        out.append(text)

    with tempfile.TemporaryDirectory(prefix="pins-bench-", dir=os.getcwd()) as tmp:
        root = Path(tmp)
        free = shutil.disk_usage(root).free
        say(f"free disk where the sparse shards live: {free / GIB:.1f} GiB (sparse: none used)")
        model = sparse_shards(root, args.shards, int(args.model_gib * GIB))
        # The same shard count at a smaller size: the threads work as they would on the model.
        sample_dir = root / "sample"
        sample_dir.mkdir()
        sample = sparse_shards(sample_dir, args.shards, int(args.hash_gib * GIB))
        sample_targets = [PinTarget(f"shard:{p.name}", str(p), "", "file") for p in sample]
        hash_s, results = trio.run(full_hash_seconds, sample_targets)
        assert all(result.observed_sha256 is not None for result in results)
        sample_bytes = sum(os.path.getsize(p) for p in sample)
        rate = sample_bytes / hash_s
        model_bytes = sum(os.path.getsize(p) for p in model)
        full_model_s = model_bytes / rate
        measured = "measured" if sample_bytes >= model_bytes else "extrapolated"
        say(
            f"full hash: {rate / GIB:.2f} GiB/s over {sample_bytes / GIB:.1f} GiB "
            f"({args.shards} sparse shards, hash_pins threads); the {model_bytes / GIB:.0f} GiB "
            f"model in {args.shards} shards: {full_model_s:.0f} s ({measured})"
        )
        # Held as after the row's first verification (priced by the full hash above).
        targets = [PinTarget(f"shard:{p.name}", str(p), "0" * 64, "file") for p in model]
        times = trio.run(identity_seconds, targets, 50)
        check_s = statistics.median(times)
        say(
            f"identity check of all {args.shards} shards (one verification): median "
            f"{check_s * 1e6:.0f} us, max {max(times) * 1e6:.0f} us over {len(times)} "
            f"verifications"
        )
        cells = args.cells
        per_cell_rehash = 2 * full_model_s
        row_rehash = cells * per_cell_rehash
        row_identity = 2 * full_model_s + 2 * cells * check_s
        say(
            f"per cell (a pre- and a post-verify): full re-hash {per_cell_rehash:.0f} s, "
            f"identity checks {2 * check_s * 1e3:.2f} ms "
            f"({per_cell_rehash / (2 * check_s):,.0f}x less)"
        )
        say(
            f"per row of {cells} cells: re-hash at every verification {row_rehash:.0f} s, "
            f"first and last hash + identity checks {row_identity:.0f} s "
            f"(saves {row_rehash - row_identity:.0f} s; every further cell adds "
            f"{per_cell_rehash:.0f} s against {2 * check_s * 1e3:.2f} ms)"
        )
    if args.append:
        _append_results(out)
    return 0


def _append_results(out: list[str]) -> None:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    header = (
        f"\n## Pin cost per cell, 100 GiB sparse model ({dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M}"
        f" UTC)\n\nCommand: `{' '.join(['python', *sys.argv])}` (`just bench-pins`); machine: "
        f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}; load average {load}.\n\n"
    )
    with RESULTS.open("a", encoding="utf-8") as stream:
        stream.write(header + "".join(f"- {line}\n" for line in out))


if __name__ == "__main__":
    raise SystemExit(main())
