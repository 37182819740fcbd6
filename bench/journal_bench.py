"""Journal and replay at scale, measured side by side in one run (issue 13, item 6).

Prints, each against its floor measured in the same run on the same disk:

* non-durable appends/s from one task through ``JournalWriter.append_nowait`` against a plain
  ``os.write`` loop of the same bytes, one line per call;
* durable transitions/s through ``await JournalWriter.append`` (one write and one fsync each)
  against a plain ``os.write`` + ``os.fsync`` loop;
* replay lines/s: ``read_journal`` (hash chain + typed decode) over the appended journal;
* a cell of ``--cell-requests`` requests: its rows streamed through ``RowStreamWriter`` and
  summarised with ``StreamingRungSummary``, then verified and re-summarised streaming the way
  replay does, with the peak RSS and the wall time of each step.

Run with ``just bench-journal`` (``--append`` writes the figures to bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
from _results import emit_figures, load_average, record

from cache_family.actors.journal.writer import JournalWriter
from cache_family.schemas.journal import (
    JournalChain,
    PinObserved,
    Transition,
    read_journal,
    seal_problems,
)
from cache_family.schemas.measurement import RequestRow


def _row(i: int) -> RequestRow:
    return RequestRow(
        request_id=i,
        status="completed",
        elapsed_ms=40.0 + (i % 97) * 0.25,
        ttft_ms=10.0 + (i % 89) * 0.125,
        tpot_ms=2.0 + (i % 13) * 0.0625,
        tokens_predicted=16,
    )


def _outcome(i: int) -> PinObserved:
    """An observation of about a request row's size (rows are no longer journaled: they
    stream to the cell's rows file), of a type old sources also know (``--ab``)."""
    return PinObserved(
        cell_id="cell-0000/native-serial",
        phase="before",
        name=f"shard:{i}",
        path=f"/models/model-{i:05}-of-99999.gguf",
        expected_sha256=f"{i:064x}",
        observed_sha256=f"{i:064x}",
    )


def _transition(i: int) -> Transition:
    return Transition(
        machine="cell",
        cell_id="cell-0000/native-serial",
        from_state=f"s{i}",
        event="step",
        to_state=f"s{i + 1}",
    )


def plain_writes(path: str, lines: list[bytes], *, sync: bool) -> float:
    """Seconds for one ``os.write`` (and ``os.fsync`` when ``sync``) per line."""
    return _plain_writes(path, lines, sync=sync)[0]


def _plain_writes(path: str, lines: list[bytes], *, sync: bool) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``plain_writes``."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start, cpu = time.perf_counter(), time.process_time()
        for data in lines:
            os.write(fd, data)
            if sync:
                os.fsync(fd)
        return time.perf_counter() - start, time.process_time() - cpu
    finally:
        os.close(fd)


def sample_lines(records: list[PinObserved] | list[Transition]) -> list[bytes]:
    chain = JournalChain()
    return [chain.line(r, mono_ns=i, wall_ns=i)[1] for i, r in enumerate(records)]


async def ours_appends(path: str, records: list[PinObserved]) -> float:
    """Seconds from the first append_nowait until everything is written (closed)."""
    return (await _ours_appends(path, records))[0]


async def _ours_appends(path: str, records: list[PinObserved]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``ours_appends``: on a machine shared
    with other work the CPU figure says what the code costs, the wall figure what it got."""
    async with trio.open_nursery() as nursery:
        writer = JournalWriter(path)
        await nursery.start(writer.run)
        start, cpu = time.perf_counter(), time.process_time()
        for record in records:
            writer.append_nowait(record)
        await writer.aclose()
        return time.perf_counter() - start, time.process_time() - cpu
    raise AssertionError("unreachable")


async def ours_durable(
    path: str, records: list[Transition], rounds: int, plain: str
) -> tuple[list[float], list[float]]:
    """Per round: seconds for ``records`` durable appends through the writer, and for the same
    lines written with a plain write+fsync loop right after (alternating, so that both see the
    same disk and load)."""
    lines = sample_lines(records)
    ours: list[float] = []
    floor: list[float] = []
    async with trio.open_nursery() as nursery:
        writer = JournalWriter(path)
        await nursery.start(writer.run)
        for _ in range(rounds):
            fsyncs = writer.fsync_count
            start = time.perf_counter()
            for record in records:
                await writer.append(record)
            ours.append(time.perf_counter() - start)
            assert writer.fsync_count - fsyncs == len(records)
            floor.append(plain_writes(plain, lines, sync=True))
        await writer.aclose()
    return ours, floor


def peak_rss_mib() -> float:
    """This process's peak RSS since its last exec (``VmHWM``; ``ru_maxrss`` would also count
    the pages of the parent it was forked from)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cell_only(requests: int, directory: str) -> None:
    """One rung of ``requests`` requests, as a run and a replay would treat it with the rows in
    their own file: each row written to ``requests.jsonl`` and counted into the rung summary
    as it ends, then the file streamed back, its digest verified and the summary re-folded.
    Prints one line: seconds to run+fold, seconds to replay, peak RSS (MiB), file MiB."""
    # Imported here: ``--ab`` runs this file against an older source tree without them.
    from cache_family.actors.journal.rows_file import RowFileWriter
    from cache_family.schemas.request_rows import RequestRowLine, stream_rows
    from cache_family.states.metrics import RungAccumulator

    path = os.path.join(directory, "requests.jsonl")
    start = time.perf_counter()
    writer = RowFileWriter(path, "cell-0000/sweep-native-concurrent/requests.jsonl")
    live = RungAccumulator(requests, compact=True, ttft_slo_ms=30.0, tpot_slo_ms=5.0)
    for i in range(requests):
        row = _row(i)
        writer.add(RequestRowLine(rung_index=0, concurrency=64, row=row))
        live.add(row, i)
    digest = writer.close()
    folded = live.summary(concurrency=64, makespan_seconds=requests / 900)
    run_s = time.perf_counter() - start
    del live
    start = time.perf_counter()
    again = RungAccumulator(requests, compact=True, ttft_slo_ms=30.0, tpot_slo_ms=5.0)
    for line in stream_rows(path, digest):
        again.add(line.row, line.row.request_id)
    replayed = again.summary(concurrency=64, makespan_seconds=requests / 900)
    replay_s = time.perf_counter() - start
    assert replayed == folded and digest.count == requests
    size = os.path.getsize(path) / 2**20
    print(f"{run_s:.3f} {replay_s:.3f} {peak_rss_mib():.1f} {size:.1f}")


def cell_in_child(requests: int, directory: str) -> tuple[float, float, float, float]:
    """``cell_only`` in a fresh interpreter, so its peak RSS is its own."""
    run_s, replay_s, rss, size = _child(["--cell-only", str(requests), "--dir", directory])
    return run_s, replay_s, rss, size


def _child(args: list[str], source: str | None = None) -> list[float]:
    path = os.pathsep.join([source, *sys.path] if source else sys.path)
    done = subprocess.run(
        [sys.executable, __file__, *args],
        check=True,
        capture_output=True,
        text=True,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": path},
    )
    return [float(x) for x in done.stdout.split()]


def appends_only(count: int, directory: str) -> None:
    """Appends/s and replay lines/s of whichever cache_family is importable (``--ab``)."""
    records = [_outcome(i) for i in range(count)]
    path = os.path.join(directory, f"ab-{os.getpid()}.jsonl")
    seconds, cpu_seconds = trio.run(_ours_appends, path, records)
    data = Path(path).read_bytes()
    # The best of three reads: one read is as short as a load spike on a shared machine.
    replay_s = replay_cpu = float("inf")
    for _ in range(3):
        start, cpu = time.perf_counter(), time.process_time()
        read = read_journal(data)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        lines = len(read.lines)
        del read
        replay_s, replay_cpu = min(replay_s, elapsed), min(replay_cpu, cpu)
    print(
        f"{count / seconds:.0f} {lines / replay_s:.0f} "
        f"{count / cpu_seconds:.0f} {lines / replay_cpu:.0f}"
    )
    os.unlink(path)


def against_baseline(source: str, count: int, rounds: int, directory: str) -> str:
    """Both sources' appends/s and replay lines/s, in alternating child processes."""
    mine: list[list[float]] = []
    base: list[list[float]] = []
    args = ["--appends-only", str(count), "--dir", directory]
    for _ in range(rounds):
        base.append(_child(args, source))
        mine.append(_child(args, str(Path(__file__).resolve().parents[1] / "src")))
    med = [statistics.median(column) for column in zip(*mine, strict=True)]
    old = [statistics.median(column) for column in zip(*base, strict=True)]
    return (
        f"against the source at {source} ({rounds} alternating child runs of {count:,} "
        f"appends, medians): appends {old[0]:,.0f}/s -> {med[0]:,.0f}/s "
        f"({med[0] / old[0]:.2f}x), replay {old[1]:,.0f} -> {med[1]:,.0f} lines/s "
        f"({med[1] / old[1]:.2f}x); per CPU second: appends {old[2]:,.0f} -> {med[2]:,.0f} "
        f"({med[2] / old[2]:.2f}x), replay {old[3]:,.0f} -> {med[3]:,.0f} "
        f"({med[3] / old[3]:.2f}x)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--appends", type=int, default=200_000)
    parser.add_argument("--durable", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--cell-requests", type=int, default=1_000_000)
    parser.add_argument(
        "--ab", metavar="SRC", help="also compare with another source tree's src (a baseline)"
    )
    parser.add_argument("--cell-only", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--appends-only", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--append", action="store_true", help="append the figures to RESULTS.md")
    args = parser.parse_args()
    if args.cell_only is not None:
        cell_only(args.cell_only, args.dir)
        return 0
    if args.appends_only is not None:
        appends_only(args.appends_only, args.dir)
        return 0
    out: list[str] = []
    figures: dict[str, float] = {}
    load_before = load_average()

    def say(text: str) -> None:
        print(text, flush=True)
        out.append(text)

    with tempfile.TemporaryDirectory(prefix="journal-bench-", dir=os.getcwd()) as tmp:
        records = [_outcome(i) for i in range(args.appends)]
        lines = sample_lines(records)
        plain, plain_cpu = _plain_writes(os.path.join(tmp, "plain.jsonl"), lines, sync=False)
        journal = os.path.join(tmp, "ours.jsonl")
        ours, ours_cpu = trio.run(_ours_appends, journal, records)
        plain_rate, ours_rate = len(lines) / plain, len(records) / ours
        figures.update(
            appends_per_s=ours_rate,
            plain_appends_per_s=plain_rate,
            appends_per_cpu_s=len(records) / ours_cpu,
        )
        say(
            f"non-durable appends: ours {ours_rate:,.0f}/s, plain write {plain_rate:,.0f}/s "
            f"(ours/plain {ours_rate / plain_rate:.2f}x; target >= 200,000/s); per CPU "
            f"second of this process: ours {len(records) / ours_cpu:,.0f}, plain write "
            f"{len(lines) / plain_cpu:,.0f}"
        )

        data = Path(journal).read_bytes()
        start, cpu = time.perf_counter(), time.process_time()
        read = read_journal(data)
        replay_s, replay_cpu = time.perf_counter() - start, time.process_time() - cpu
        assert read.chain_break is None and len(read.lines) == args.appends
        start, cpu = time.perf_counter(), time.process_time()
        assert not seal_problems(data, read)
        seal_s, seal_cpu = time.perf_counter() - start, time.process_time() - cpu
        count = len(read.lines)
        figures.update(
            replay_lines_per_s=count / replay_s, replay_lines_per_cpu_s=count / replay_cpu
        )
        say(
            f"replay (read_journal: chain + typed decode): {count / replay_s:,.0f} lines/s "
            f"({len(data) / 2**20:.1f} MiB; target >= 200,000/s), "
            f"{count / replay_cpu:,.0f} per CPU second; with replay's seal check "
            f"(seal_problems) too: {count / (replay_s + seal_s):,.0f} lines/s, "
            f"{count / (replay_cpu + seal_cpu):,.0f} per CPU second"
        )
        del read, data

        transitions = [_transition(i) for i in range(args.durable)]
        ours_s, plain_s = trio.run(
            ours_durable,
            os.path.join(tmp, "ours-sync.jsonl"),
            transitions,
            args.rounds,
            os.path.join(tmp, "plain-sync.jsonl"),
        )
        o_rate = len(transitions) / statistics.median(ours_s)
        p_rate = len(transitions) / statistics.median(plain_s)
        figures.update(durable_per_s=o_rate, plain_durable_per_s=p_rate)
        say(
            f"durable transitions: ours {o_rate:,.0f}/s, write+fsync {p_rate:,.0f}/s "
            f"(ours/plain {o_rate / p_rate:.2f}x, median of {args.rounds} alternating rounds "
            f"of {args.durable}; target >= 0.8x)"
        )
        floor_dir = os.path.join(tmp, "cell-small")
        os.mkdir(floor_dir)
        small = max(args.cell_requests // 10, 1)
        s_run, s_replay, s_rss, _ = cell_in_child(small, floor_dir)
        big_dir = os.path.join(tmp, "cell-big")
        os.mkdir(big_dir)
        b_run, b_replay, b_rss, b_size = cell_in_child(args.cell_requests, big_dir)
        say(
            f"cell of {args.cell_requests:,} requests (rows in requests.jsonl, {b_size:.0f} MiB; "
            f"fake in-process rows): run+fold {b_run:.1f} s, replay (stream, verify digest, "
            f"re-fold) {b_replay:.1f} s, peak RSS {b_rss:.0f} MiB; the same for "
            f"{small:,} requests: {s_run:.1f} s, {s_replay:.1f} s, {s_rss:.0f} MiB "
            f"({(b_rss - s_rss) * 2**20 / (args.cell_requests - small):.1f} bytes of RSS per "
            f"further request)"
        )
        if args.ab:
            say(against_baseline(args.ab, 100_000, 5, tmp))
    say(f"peak RSS of the journal part of the benchmark: {peak_rss_mib():.0f} MiB")
    emit_figures(figures)
    if args.append:
        record(
            "Journal and replay at scale",
            "\n".join(f"- {line}" for line in out),
            argv=sys.argv,
            load_before=load_before,
            recipe="bench-journal",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
