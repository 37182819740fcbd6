"""A cell of ``--requests`` requests (default 1,000,000) through the real cell path, with the
time and the peak RSS of each part (issue 13, item 6).

What runs is the cell actor's own rung (``CellActor._rung``): the real load actor's closed
loop at concurrency 64, each row streamed to the cell's ``requests.jsonl`` as its request
ends and tallied, the rung's ``rung_rows`` and ``rung_completed`` records through the real
``JournalWriter``; then ``publish_cell_receipt`` folds and publishes ``cell.json`` and, in its
own interpreter, ``replay`` re-folds it, streams the rows file against every digest the
journal holds and re-tallies it. Two drives:

* ``loopback`` (``--http-requests``, default 10,000): every request is a real HTTP exchange
  with the bench's calibration server (``bench/calibration_server.py``, a child process on
  127.0.0.1, zero TTFT and inter-token interval, one token).
* ``after the network`` (``--requests`` and a tenth of it): the load actor's exchange is
  replaced by an immediate answer built from a canned final event by the actor's own
  ``_completed_row``; everything after the socket is the real code. This gives the memory
  per request (the RSS difference of the two sizes over the requests between them).

The host's identity is a stand-in (no llama-server runs): nothing above reads more of it than
its base URL, pid and create time. Each part runs in its own interpreter so its peak RSS is
its own. ``--append`` writes the figures to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from _results import emit_figures, load_average, record

from cache_family.actors.audit.replay import replay
from cache_family.actors.journal.writer import JournalWriter, journal_path, publish_cell_receipt
from cache_family.actors.run.cell import CellActor
from cache_family.actors.run.context import RunContext, RunStop
from cache_family.actors.run.load import LOAD_DIALECTS, BenchmarkPrompt, LoadRun, _Exchange
from cache_family.schemas.arms import NATIVE_CONCURRENT
from cache_family.schemas.journal import CellOpened, RungPlan
from cache_family.schemas.measurement import RequestRow
from cache_family.schemas.receipts import decode_cell_receipt
from cache_family.states.budgets import Budgets
from cache_family.states.cache_reuse import cache_expectation
from cache_family.states.plans import CellPlan, PromptChoice
from cache_family.system.http import LoopbackHttp

CELL = "cell-0000/native-concurrent"
CELL_DIR = "cell-0000/sweep-native-concurrent"
CONCURRENCY = 64
PROMPT = "the quick brown fox " * 8


def peak_rss_mib() -> float:
    """This interpreter's peak RSS (``VmHWM``)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


class _HostIdentity:
    """What the cell's rung reads of its host: where it listens and who it is."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.pid = os.getpid()
        self.create_time = 1.0
        self.port = int(base_url.rsplit(":", 1)[1])

    def still_same(self) -> bool:
        return True

    def replaced(self) -> bool:
        return False


class _AfterTheNetwork(LoadRun):
    """The load actor with its exchange answered at once: a canned llama-server final event
    goes through the actor's own validation and row building."""

    async def _exchange(self, client: LoopbackHttp, request_id: int) -> RequestRow:
        started = self.clock()
        await trio.lowlevel.checkpoint()
        exchange = _Exchange(started=started, ttft=self.clock(), content=["x"], first_chunk="x")
        exchange.ended = self.clock()
        final: dict[str, Any] = {
            "stop": True,
            "truncated": False,
            "tokens_predicted": 1,
            "tokens_evaluated": 41,
            "stop_type": "limit",
            "id_slot": request_id % CONCURRENCY,
            "timings": {
                "prompt_n": 1,
                "prompt_ms": 0.5,
                "predicted_n": 1,
                "predicted_ms": 0.25,
                "cache_n": 40,
            },
        }
        return self._completed_row(request_id, self.excluded_warmup(request_id), exchange, final)


def _after_the_network(request: Any, _model_id: str, **load: Any) -> LoadRun:
    return _AfterTheNetwork(request, **load)


def run_part(run_dir: str, requests: int, base_url: str | None) -> None:
    """One rung of the cell, journaled, then its receipt published; prints seconds and
    peak RSS after the rung and after publishing, and the file sizes."""
    if base_url is None:
        # The native kind's ladder client is its request dialect's (``LOAD_DIALECTS``).
        LOAD_DIALECTS["completion"] = _after_the_network  # type: ignore[index]
    plan = CellPlan(
        cell_id=CELL,
        cell_dir=CELL_DIR,
        row_index=0,
        row_key="bench-p40",
        arm=NATIVE_CONCURRENT,
        rungs=(RungPlan(concurrency=CONCURRENCY, requests=requests),),
        output_tokens=1,
        lanes=CONCURRENCY,
        ctx_size=CONCURRENCY * 128,
        n_gpu_layers=0,
        prefix_tokens=40,
        ttft_slo_ms=30.0,
        tpot_slo_ms=5.0,
        profile=None,
        prompt=PromptChoice(PROMPT, "fixed-corpus-entry", "bench", "0" * 64, "bench"),
        pins=(),
        architecture="llama",
    )
    figures: list[float] = []

    async def main() -> None:
        writer = JournalWriter(journal_path(run_dir))
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            ctx = RunContext(
                writer=writer,
                run_dir=run_dir,
                budgets=Budgets(run_deadline=math.inf, cell_seconds=1e9, request_timeout_ms=60_000),
                stop=RunStop(run_deadline=math.inf),
            )
            actor = CellActor(plan, ctx)
            actor.host = _HostIdentity(base_url or "http://127.0.0.1:9")  # type: ignore[assignment]
            digest = hashlib.sha256(PROMPT.encode()).hexdigest()
            actor.prompt = BenchmarkPrompt(PROMPT, 41, digest)
            os.makedirs(actor.cell_path)
            await writer.append(
                CellOpened(
                    cell_id=plan.cell_id,
                    row_index=plan.row_index,
                    row_key=plan.row_key,
                    arm=plan.arm.name,
                    cohort=plan.arm.cohort,
                    cell_dir=plan.cell_dir,
                    measurement_kind=plan.arm.kind.value,
                    rungs=plan.rungs,
                    ttft_slo_ms=plan.ttft_slo_ms,
                    tpot_slo_ms=plan.tpot_slo_ms,
                    cache_expectation=cache_expectation(plan.architecture, plan.lanes),
                )
            )
            start = time.perf_counter()
            outcome = await actor._rung(0, plan.rungs[0])
            assert outcome.status == "completed", outcome.stop_reason
            figures.extend([time.perf_counter() - start, peak_rss_mib()])
            start = time.perf_counter()
            await publish_cell_receipt(writer, run_dir, CELL, f"{CELL_DIR}/cell.json")
            figures.extend([time.perf_counter() - start, peak_rss_mib()])
            await writer.aclose()

    trio.run(main)
    cell = Path(run_dir, CELL_DIR, "cell.json")
    receipt = decode_cell_receipt(cell.read_bytes())
    rung = receipt.measurement.rungs[0]
    assert rung.rung_summary is not None and rung.rung_summary.complete
    rows_path = os.path.join(run_dir, CELL_DIR, "requests.jsonl")
    sizes = [os.path.getsize(journal_path(run_dir)), cell.stat().st_size]
    print(*figures, *(size / 2**20 for size in sizes), os.path.getsize(rows_path) / 2**20)


def replay_part(run_dir: str) -> None:
    """``replay`` of the run; prints seconds and peak RSS."""
    start = time.perf_counter()
    report = replay(run_dir)
    seconds = time.perf_counter() - start
    assert f"{CELL_DIR}/cell.json" in report.identical and not report.mismatched, report.lines
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


def _calibration_server() -> tuple[subprocess.Popen[str], str]:
    server = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("calibration_server.py")),
            *("--port", "0", "--ttft-ms", "0", "--itl-ms", "0", "--tokens", "1"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONPATH": os.pathsep.join(sys.path),
        },
    )
    assert server.stdout is not None
    line = server.stdout.readline().strip()
    assert line.startswith("listening http://127.0.0.1:"), line
    return server, line.split()[1]


def _cell(scratch: str, name: str, requests: int, base_url: str | None) -> list[float]:
    run_dir = os.path.join(scratch, name)
    os.makedirs(run_dir)
    extra = ("--base-url", base_url) if base_url else ()
    figures = _child("--part", "run", "--dir", run_dir, "--requests", str(requests), *extra)
    return figures + _child("--part", "replay", "--dir", run_dir)


def _describe(requests: int, drive: str, f: list[float]) -> str:
    (
        rung_s,
        rung_rss,
        publish_s,
        publish_rss,
        journal_mib,
        cell_mib,
        rows_mib,
        replay_s,
        replay_rss,
    ) = f
    rate = requests / rung_s
    return (
        f"{requests:,} requests, {drive}: rung {rung_s:.1f} s ({rate:,.0f} requests/s),"
        f" peak RSS {rung_rss:.0f} MiB; fold + publish {publish_s:.1f} s, peak RSS"
        f" {publish_rss:.0f} MiB; replay (re-fold, stream and re-tally the rows file)"
        f" {replay_s:.1f} s, peak RSS {replay_rss:.0f} MiB; journal {journal_mib:.3f} MiB,"
        f" cell.json {cell_mib:.3f} MiB, requests.jsonl {rows_mib:.0f} MiB"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--http-requests", type=int, default=10_000)
    parser.add_argument("--dir", help="where the run goes (default: a fresh temporary directory)")
    parser.add_argument("--append", action="store_true", help="record in bench/RESULTS.md")
    parser.add_argument("--part", choices=("run", "replay"), help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part == "run":
        run_part(args.dir, args.requests, args.base_url)
        return 0
    if args.part == "replay":
        replay_part(args.dir)
        return 0
    load_before = load_average()
    small = max(args.requests // 10, 1)
    lines = []
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        server, base_url = _calibration_server()
        try:
            loopback = _cell(scratch, "loopback", args.http_requests, base_url)
        finally:
            server.terminate()
            server.wait(timeout=10)
        lines.append(_describe(args.http_requests, "real loopback HTTP", loopback))
        print(lines[-1], flush=True)
        few = _cell(scratch, "small", small, None)
        lines.append(_describe(small, "after the network", few))
        print(lines[-1], flush=True)
        many = _cell(scratch, "large", args.requests, None)
        lines.append(_describe(args.requests, "after the network", many))
        print(lines[-1], flush=True)
    per_request = [(many[i] - few[i]) * 2**20 / (args.requests - small) for i in (1, 3, 8)]
    lines.append(
        "peak RSS per further request (between the two sizes after the network): rung "
        f"{per_request[0]:.1f} bytes, fold + publish {per_request[1]:.1f} bytes, replay "
        f"{per_request[2]:.1f} bytes"
    )
    print(lines[-1])
    emit_figures(
        {
            "requests": args.requests,
            "run_s": many[0] + many[2],
            "run_rss_mib": max(many[1], many[3]),
            "replay_s": many[7],
            "replay_rss_mib": many[8],
            "bytes_per_further_request": max(per_request),
        }
    )
    if args.append:
        record(
            "A million-request cell through journal, fold and replay",
            "\n".join(f"- {line}" for line in lines),
            argv=sys.argv,
            load_before=load_before,
            recipe="bench-million-cell",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
