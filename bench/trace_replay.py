"""A window of a Mooncake-format trace, scaled, replayed against the calibration server with
the per-request check: sender lateness and client CPU per request.

The calibration server runs as its own process (``bench/calibration_server.py``, 20 ms to the
first token, then 5 ms per token; it counts a token-id prompt as its ids and reuses nothing).
This process runs the trace workload's own runner (``actors/run/trace_replay.py``: the trace
read and checked line by line, prompts written token-exact, designed reuse under an infinite
and an LRU cache, the open-loop sender on the scaled timestamps, one ``/completion`` of token
ids per request), journaling into memory, then folds the receipt (every request judged).
Lateness is each send's start minus its scheduled time on trio's clock; client CPU is this
process's user + system time over the replay, divided by the requests it completed; the fold's
CPU is reported apart. With two or more CPUs the server is pinned to the first and the client
to the rest.

    .venv/bin/python bench/trace_replay.py \\
        --trace ../shared/data/traces/mooncake-conversation.jsonl \\
        [--first 2000] [--tokens-per-block 16] [--time-scale 0.02] [--append]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio
from _results import load_average, machine, record

from cache_family.actors.run.trace_replay import run_trace
from cache_family.actors.run.workloads import WorkloadHost
from cache_family.schemas.journal import JournalLine, Record
from cache_family.schemas.workload import validate_workload_object
from cache_family.schemas.workload_records import (
    TraceReceipt,
    TraceReplayed,
    TraceRequestReplayed,
)
from cache_family.states.trace_fold import trace_receipt
from cache_family.states.workload_fold import fold_workload
from cache_family.system.http import LoopbackHttp

HERE = Path(__file__).resolve().parent
TTFT_MS, ITL_MS = 20.0, 5.0
CELL = "bench/native-trace"


def start_server(cpus: set[int] | None) -> tuple[subprocess.Popen[str], str]:
    argv = [
        sys.executable,
        str(HERE / "calibration_server.py"),
        *("--port", "0", "--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS)),
    ]
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        text=True,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if not line.startswith("listening "):
        process.kill()
        raise SystemExit(f"the calibration server did not start: {line!r}")
    return process, line.removeprefix("listening ")


def replay(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    trace = str(Path(args.trace).resolve())
    sha256 = hashlib.sha256(Path(trace).read_bytes()).hexdigest()
    spec = validate_workload_object(
        {
            "schema_version": 1,
            "trace": {
                "path": trace,
                "sha256": sha256,
                "first": args.first,
                "tokens_per_block": args.tokens_per_block,
                "time_scale": args.time_scale,
                "output_tokens_cap": args.output_tokens_cap,
                "lru_capacity_tokens": args.lru_capacity_tokens,
            },
        }
    )
    journaled: list[Record] = []

    async def journal(record: Record) -> None:
        journaled.append(record)

    async def main() -> bool:
        host = WorkloadHost(
            cell_id=CELL,
            base_url=base_url,
            http=LoopbackHttp(),
            journal=journal,
            deadline=trio.current_time() + 3600,
            request_timeout_ms=60_000,
            architecture="llama",
            workloads=spec,
            workloads_sha256="",
            prompt_text="",
            ignore_eos=True,
        )
        return await run_trace(host)

    cpu_before, wall_before = time.process_time(), time.monotonic()
    finished = trio.run(main)
    cpu, wall = time.process_time() - cpu_before, time.monotonic() - wall_before
    [replayed] = [r for r in journaled if isinstance(r, TraceReplayed)]
    sent = [r for r in journaled if isinstance(r, TraceRequestReplayed)]
    fold_before = time.process_time()
    receipt = trace_receipt(replayed, sent)
    fold_cpu = time.process_time() - fold_before
    lines = [
        JournalLine(seq=seq, mono_ns=0, wall_ns=0, prev="", record=record)
        for seq, record in enumerate(journaled, start=1)
    ]
    whole = fold_workload(lines, CELL)
    assert isinstance(whole.trace, TraceReceipt) and whole.trace == receipt
    checked = sum(
        1
        for r in receipt.requests
        if r.achieved_tokens is not None and r.verdict != "workload.prompt.token_count_mismatch"
    )
    completed = replayed.completed
    return {
        "finished": finished,
        "requests": replayed.requests,
        "distinct_ids": replayed.distinct_ids,
        "sent": replayed.launched,
        "completed": completed,
        "checked": checked,
        "mismatches": len(receipt.token_count_mismatches),
        "span_s": max(r.scheduled_s for r in receipt.requests),
        "wall_s": wall,
        "lateness_p50_ms": replayed.lateness_p50_ms,
        "lateness_p99_ms": replayed.lateness_p99_ms,
        "lateness_max_ms": replayed.lateness_max_ms,
        "client_cpu_ms_per_request": 1000 * cpu / completed if completed else None,
        "fold_cpu_ms_per_request": 1000 * fold_cpu / len(receipt.requests),
        "prompt_tokens": sum(r.prompt_tokens for r in receipt.requests),
        "designed_infinite_tokens": sum(r.designed_infinite_tokens for r in receipt.requests),
        "designed_lru_tokens": sum(r.designed_lru_tokens or 0 for r in receipt.requests),
        "stop_reason": replayed.stop_reason,
    }


def _shown(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)


def render(result: dict[str, Any], args: argparse.Namespace, command: str) -> str:
    r = result
    designed = 100 * r["designed_infinite_tokens"] / r["prompt_tokens"]
    lru = 100 * r["designed_lru_tokens"] / r["prompt_tokens"]
    return "\n".join(
        [
            f"command: {command}",
            f"machine: {result['machine']}; server CPUs {result['server_cpus']}, client CPUs "
            f"{result['client_cpus']}",
            f"calibration server: {TTFT_MS:g} ms to first token, {ITL_MS:g} ms per token; "
            f"trace window: first {args.first} requests of `{Path(args.trace).name}` "
            f"({r['distinct_ids']} distinct block ids), each 512-token block as "
            f"{args.tokens_per_block} tokens, replay time = trace time × {args.time_scale:g} "
            f"({r['span_s']:.1f} s of sends), answers capped at {args.output_tokens_cap} tokens; "
            f"designed reuse {designed:.1f} % of prompt tokens (infinite cache), {lru:.1f} % "
            f"(LRU of {args.lru_capacity_tokens} tokens)",
            "",
            "| requests | sent | completed | checked per request | count mismatches "
            "| lateness p50 | lateness p99 | lateness max | client CPU / request "
            "| fold CPU / request | wall | stop |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            f"| {r['requests']} | {r['sent']} | {r['completed']} | {r['checked']} | "
            f"{r['mismatches']} | {_shown(r['lateness_p50_ms'], '{:.3f} ms')} | "
            f"{_shown(r['lateness_p99_ms'], '{:.3f} ms')} | "
            f"{_shown(r['lateness_max_ms'], '{:.3f} ms')} | "
            f"{_shown(r['client_cpu_ms_per_request'], '{:.3f} ms')} | "
            f"{r['fold_cpu_ms_per_request']:.3f} ms | {r['wall_s']:.1f} s | "
            f"{r['stop_reason'] or '-'} |",
            "",
            "Checked per request: answered with the server's prompt count equal to the designed "
            "token-id prompt and judged against its designed reuse (the calibration server "
            "reuses nothing: every request with designed reuse is a loss naming its last "
            "sender). Client CPU covers reading and checking the trace, writing the prompts, "
            "the designed reuse, the sends and the journal records; the fold (every request "
            "judged into the receipt) is reported apart.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, help="a Mooncake-format trace file")
    parser.add_argument("--first", type=int, default=2000)
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument("--time-scale", type=float, default=0.02)
    parser.add_argument("--output-tokens-cap", type=int, default=4)
    parser.add_argument("--lru-capacity-tokens", type=int, default=65_536)
    parser.add_argument("--append", action="store_true", help="record in bench/RESULTS.md")
    parser.add_argument("--notes", default="")
    args = parser.parse_args(argv)
    load_before = load_average()
    cpus = sorted(os.sched_getaffinity(0))
    server_cpus = {cpus[0]} if len(cpus) > 1 else None
    server, base_url = start_server(server_cpus)
    try:
        if server_cpus:
            os.sched_setaffinity(0, set(cpus[1:]))
        result = replay(base_url, args)
    finally:
        server.terminate()
        server.wait(timeout=10)
    result |= {
        "machine": machine(),
        "server_cpus": sorted(server_cpus) if server_cpus else "unpinned",
        "client_cpus": sorted(os.sched_getaffinity(0)),
    }
    command = " ".join([".venv/bin/python", "bench/trace_replay.py", *(argv or sys.argv[1:])])
    text = render(result, args, command)
    print(text)
    if args.append:
        record(
            "Trace replay against the calibration server (issue 27)",
            text,
            notes=args.notes,
            argv=[sys.argv[0], *(argv or sys.argv[1:])],
            load_before=load_before,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
