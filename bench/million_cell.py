"""A cell of ``--requests`` requests (default 1,000,000) through the journal, the fold, the
publisher and replay, with the time and the peak RSS of each part (issue 13, item 6).

What runs is the real code from the journal on: every request is journaled as the cell actor
journals it (one ``request_outcome`` record each, through ``JournalWriter``), the cell's
``rung_completed`` follows, then ``publish_cell_receipt`` folds ``cell.json`` (rows past
``INLINE_ROWS_MAX`` go to ``requests.jsonl``, published first) and ``replay`` re-reads the
journal, re-folds, compares the bytes and streams the rows file against its digest. The rows
are synthetic and no host answers them: the load actor, which still holds a rung's rows until
it ends, is not part of this figure.

Each part runs in its own interpreter so its peak RSS is its own. ``--append`` writes the
figures to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from cache_family.actors.journal import JournalWriter, journal_path, publish_cell_receipt
from cache_family.actors.replay import replay
from cache_family.schemas.journal import CellOpened, RequestOutcome, RungCompleted, RungPlan
from cache_family.schemas.measurement import RequestRow, ServerTimings
from cache_family.schemas.receipts import decode_cell_receipt

RESULTS = Path(__file__).with_name("RESULTS.md")
CELL = "cell-0000/native-concurrent"
CONCURRENCY = 64


def peak_rss_mib() -> float:
    """This interpreter's peak RSS (``VmHWM``)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _row(i: int) -> RequestRow:
    return RequestRow(
        request_id=i,
        status="completed",
        elapsed_ms=40.0 + (i % 97) * 0.25,
        ttft_ms=10.0 + (i % 89) * 0.125,
        tpot_ms=2.0 + (i % 13) * 0.0625,
        tokens_predicted=16,
        tokens_evaluated=40,
        timings=ServerTimings(prompt_n=40, cache_n=32, predicted_n=16),
        stop_type="limit",
    )


def run_part(run_dir: str, requests: int) -> None:
    """Journal the cell and publish its receipt; prints seconds, peak RSS, file sizes."""

    async def main() -> None:
        writer = JournalWriter(journal_path(run_dir))
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            await writer.append(
                CellOpened(
                    cell_id=CELL,
                    row_index=0,
                    row_key="bench-p128",
                    arm="native-concurrent",
                    cohort="native-concurrent",
                    cell_dir=CELL,
                    measurement_kind="concurrent",
                    rungs=(RungPlan(concurrency=CONCURRENCY, requests=requests),),
                    ttft_slo_ms=30.0,
                    tpot_slo_ms=5.0,
                )
            )
            for i in range(requests):
                writer.append_nowait(
                    RequestOutcome(cell_id=CELL, rung_index=0, concurrency=CONCURRENCY, row=_row(i))
                )
            await writer.append(
                RungCompleted(
                    cell_id=CELL,
                    rung_index=0,
                    concurrency=CONCURRENCY,
                    requested_requests=requests,
                    status="completed",
                    makespan_seconds=requests / 900,
                    prompt_sha256="4" * 64,
                    output_tokens=16,
                    host_pid=1,
                    host_create_time=1.0,
                )
            )
            os.makedirs(os.path.join(run_dir, CELL))
            await publish_cell_receipt(writer, run_dir, CELL, f"{CELL}/cell.json")
            await writer.aclose()

    start = time.perf_counter()
    trio.run(main)
    seconds = time.perf_counter() - start
    cell = Path(run_dir, CELL, "cell.json")
    receipt = decode_cell_receipt(cell.read_bytes())
    rows_file = receipt.measurement.rows_file
    assert rows_file is not None and rows_file.count == requests, "rows were not moved"
    sizes = [
        os.path.getsize(journal_path(run_dir)),
        cell.stat().st_size,
        os.path.getsize(os.path.join(run_dir, CELL, rows_file.path)),
    ]
    print(seconds, peak_rss_mib(), *(size / 2**20 for size in sizes))


def replay_part(run_dir: str) -> None:
    """``replay`` of the run; prints seconds and peak RSS."""
    start = time.perf_counter()
    report = replay(run_dir)
    seconds = time.perf_counter() - start
    assert f"{CELL}/cell.json" in report.identical and not report.mismatched, report.lines
    print(seconds, peak_rss_mib())


def _child(*args: str) -> list[float]:
    done = subprocess.run(
        [sys.executable, __file__, *args],
        check=True,
        capture_output=True,
        text=True,
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONPATH": os.pathsep.join(sys.path),
        },
    )
    return [float(x) for x in done.stdout.split()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--dir", help="where the run goes (default: a fresh temporary directory)")
    parser.add_argument("--append", action="store_true", help="record in bench/RESULTS.md")
    parser.add_argument("--part", choices=("run", "replay"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part == "run":
        run_part(args.dir, args.requests)
        return 0
    if args.part == "replay":
        replay_part(args.dir)
        return 0
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        run_dir = os.path.join(scratch, "run")
        os.makedirs(run_dir)
        run_s, run_rss, journal_mib, cell_mib, rows_mib = _child(
            "--part", "run", "--dir", run_dir, "--requests", str(args.requests)
        )
        replay_s, replay_rss = _child("--part", "replay", "--dir", run_dir)
    line = (
        f"{args.requests:,}-request cell: journal + fold + publish {run_s:.1f} s, peak RSS "
        f"{run_rss:.0f} MiB; replay (read, re-fold, compare, stream the rows file) "
        f"{replay_s:.1f} s, peak RSS {replay_rss:.0f} MiB; journal {journal_mib:.0f} MiB, "
        f"cell.json {cell_mib:.3f} MiB, requests.jsonl {rows_mib:.0f} MiB"
    )
    print(line)
    if args.append:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        header = (
            f"\n## A million-request cell through journal, fold and replay "
            f"({dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC)\n\n"
            f"Command: `{' '.join(['python', *sys.argv])}`; machine: {platform.machine()}, "
            f"{os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python "
            f"{platform.python_version()}; load average {load}.\n\n"
        )
        with RESULTS.open("a", encoding="utf-8") as stream:
            stream.write(header + f"- {line}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
