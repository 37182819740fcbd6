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

``--clients ours aiperf`` replays the same window with each client back to back as its own
process against the same server (AIPerf from ``just bench-peers-install``): ours as above,
AIPerf's ``mooncake_trace`` input on ``--fixed-schedule`` from the window written already
scaled (each request's scaled prompt length as ``input_length``, its capped answer as
``output_length``, its hash ids, its scaled timestamp in ms; ``--isl-block-size`` the tokens a
block). Both are measured the same way at the server: each request's receipt is its arrival,
lateness is each arrival (in order) minus its place on the scaled schedule anchored at the
first arrival (and again placed so the earliest arrival is on time); client CPU is the
client's process tree (``/proc``, sampled every ``--cpu-sample-s``) from the first arrival to
the last answer, over the requests the server finished, and the whole process's
(``os.wait4``: start-up included). Beside them each client's own lateness figure, named for
what it is. ``--clients ours ours-base aiperf --base-src DIR`` also runs ours from another
source tree (``DIR``: its ``src``, e.g. from ``git archive REV src``): a before / after in one
run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

import trio
from _results import emit_figures, load_average, machine, read_figures, record
from bench_peers import (
    aiperf_trace_command,
    aiperf_trace_lateness_ms,
    aiperf_trace_rows,
    hub_cache_tokenizer,
)
from open_loop_bench import (
    TOKENIZER_DIR,
    _child_env,
    _server_call,
    run_client,
    served_figures,
)

from cache_family.actors.audit.trace_file import read_trace, trace_scaling
from cache_family.actors.run.trace_replay import run_trace
from cache_family.actors.run.workload_dialects import WorkloadHost
from cache_family.schemas.journal import JournalLine, Record
from cache_family.schemas.workload import REQUESTS_MAX, WorkloadFile, validate_workload_object
from cache_family.schemas.workload_records import (
    TraceReceipt,
    TraceReplayed,
    TraceRequestReplayed,
)
from cache_family.states.metrics import percentile
from cache_family.states.trace import TraceRequest, TraceScaling
from cache_family.states.trace_fold import trace_receipt
from cache_family.states.workload_fold import fold_workload
from cache_family.system.http import LoopbackHttp

HERE = Path(__file__).resolve().parent
TTFT_MS, ITL_MS = 20.0, 5.0
CELL = "bench/native-trace"
#: ``--no-stop``: the over-saturation stop's every limit at its largest, so that the whole
#: window is sent (as a peer without such a stop sends it).
NEVER_STOP: Final = {
    "window": REQUESTS_MAX,
    "min_in_flight": REQUESTS_MAX,
    "max_lateness_ms": 3_600_000,
    "max_in_flight": REQUESTS_MAX,
}


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


def trace_workloads(args: argparse.Namespace) -> WorkloadFile:
    """The workload file replaying the arguments' window (the trace pinned as read)."""
    trace = str(Path(args.trace).resolve())
    sha256 = hashlib.sha256(Path(trace).read_bytes()).hexdigest()
    return validate_workload_object(
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
                **({"over_saturation": NEVER_STOP} if args.no_stop else {}),
            },
        }
    )


def replay(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = trace_workloads(args)
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


# --- side by side with AIPerf's mooncake_trace replay -----------------------------------------

CLIENT_NAMES = ("ours", "ours-base", "aiperf")


def scaled_trace_lines(requests: list[TraceRequest], scaling: TraceScaling) -> list[bytes]:
    """The window as a Mooncake trace already scaled, for a replayer that cannot scale it:
    each request's scaled prompt length, capped answer and hash ids, its timestamp (ms) the
    scaled offset from the window's first request. Read with ``tokens_per_block`` tokens a
    block, its prompts share exactly the blocks the scaled window's do."""
    offsets = scaling.send_offsets(requests)
    return [
        json.dumps(
            {
                "timestamp": round(1000 * offset, 6),
                "input_length": scaling.prompt_tokens(request),
                "output_length": scaling.output_tokens(request),
                "hash_ids": list(request.hash_ids),
            }
        ).encode()
        for request, offset in zip(requests, offsets, strict=True)
    ]


def _client_argv(
    client: str, base_url: str, args: argparse.Namespace, out: Path, scaled: list[bytes]
) -> tuple[list[str], dict[str, str]]:
    env = _child_env()
    if client in ("ours", "ours-base"):
        if client == "ours-base":
            if args.base_src is None:
                raise SystemExit("--clients ours-base needs --base-src DIR")
            env |= {"PYTHONPATH": str(Path(args.base_src).resolve())}
        argv = [
            sys.executable, str(Path(__file__).resolve()), "--child", "--url", base_url,
            "--trace", str(Path(args.trace).resolve()), "--first", str(args.first),
            "--tokens-per-block", str(args.tokens_per_block),
            "--time-scale", f"{args.time_scale!r}",
            "--output-tokens-cap", str(args.output_tokens_cap),
            "--lru-capacity-tokens", str(args.lru_capacity_tokens),
            *(["--no-stop"] if args.no_stop else []),
        ]  # fmt: skip
        return argv, env
    window = out / "scaled-window.jsonl"
    window.write_bytes(b"".join(line + b"\n" for line in scaled))
    hf_home = out / "hf"
    name = hub_cache_tokenizer(TOKENIZER_DIR, hf_home)
    argv = aiperf_trace_command(
        HERE / ".venv-aiperf", base_url, window, args.tokens_per_block, out, name
    )
    offline = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return argv, env | offline


def _own_figures(client: str, printed: str, out: Path, schedule: list[float]) -> dict[str, Any]:
    if client in ("ours", "ours-base"):
        figures = (read_figures(printed) or {}).get("trace") or {}
        return {
            "own_p50_ms": figures.get("lateness_p50_ms"),
            "own_p99_ms": figures.get("lateness_p99_ms"),
            "own_what": "send start - scaled schedule, trio clock",
            "own_cpu_ms_per_request": figures.get("client_cpu_ms_per_request"),
            "checked": figures.get("checked"),
            "mismatches": figures.get("mismatches"),
            "note": f"stopped: {figures['stop_reason']} after {figures.get('sent')} sends"
            if figures.get("stop_reason")
            else "",
        }
    rows = aiperf_trace_rows(out)
    late = aiperf_trace_lateness_ms(rows, schedule)
    return {
        "own_p50_ms": percentile(late, 50),
        "own_p99_ms": percentile(late, 99),
        "own_what": "request_start - (first line's credit_issued + the line's scaled "
        "timestamp): it exports no schedule time",
        "client_errors": sum(1 for r in rows if r["error"]),
        "checked": 0,
    }


def measure_trace_client(
    client: str,
    base_url: str,
    args: argparse.Namespace,
    schedule: list[float],
    scaled: list[bytes],
) -> dict[str, Any]:
    """One client replaying the window, as its own process, measured at the server."""
    _server_call(base_url, "DELETE", "/stamps")
    result: dict[str, Any] = {"client": client}
    with tempfile.TemporaryDirectory(prefix=f"trace-{client}-") as tmp:
        out = Path(tmp)
        argv, env = _client_argv(client, base_url, args, out, scaled)
        timeout_s = 3 * (schedule[-1] if schedule else 0) + 300
        ran, sampler, printed = run_client(
            argv, env, out, timeout_s=timeout_s, cpu_sample_s=args.cpu_sample_s
        )
        result |= ran
        if ran["exit"] == 0:
            try:
                result |= _own_figures(client, printed, out, schedule)
            except (OSError, ValueError, KeyError) as exc:
                result["note"] = f"its export unread: {exc!r}"
    return result | served_figures(base_url, schedule, sampler, result["whole_cpu_s"])


def render_side_by_side(result: dict[str, Any], args: argparse.Namespace, command: str) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [
        f"command: {command}",
        f"machine: {result['machine']}; server CPUs {result['server_cpus']}, client CPUs "
        f"{result['client_cpus']} (each client and its every process on them)",
        f"calibration server: {TTFT_MS:g} ms to first token, {ITL_MS:g} ms per token; trace "
        f"window: first {args.first} requests of `{Path(args.trace).name}`, each 512-token "
        f"block as {args.tokens_per_block} tokens, replay time = trace time × "
        f"{args.time_scale:g} ({result['span_s']:.1f} s of sends), answers capped at "
        f"{args.output_tokens_cap} tokens; ours: over-saturation stop "
        f"{'off (--no-stop)' if args.no_stop else 'on (the workload default)'}; CPU sampled "
        f"every {args.cpu_sample_s:g} s",
        "",
        "| client | scheduled | arrived (finished) | server lateness p50 / p99, first-anchored "
        "| p99, earliest-anchored | client's own lateness p50 / p99 | CPU / request, window "
        "| CPU / request, whole process | checked per request | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in result["rows"]:
        cells = [
            row["client"],
            str(row.get("scheduled", "-")),
            f"{row.get('arrivals', 0)} ({row.get('finished', 0)})",
            f"{ms(row.get('first_p50_ms'))} / {ms(row.get('first_p99_ms'))} ms",
            f"{ms(row.get('earliest_p99_ms'))} ms",
            f"{ms(row.get('own_p50_ms'))} / {ms(row.get('own_p99_ms'))} ms",
            f"{ms(row.get('window_cpu_ms_per_request'))} ms",
            f"{ms(row.get('whole_cpu_ms_per_request'))} ms",
            str(row.get("checked", "-")),
            row.get("note", "") or "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    owns = {row["client"]: row.get("own_what") for row in result["rows"] if row.get("own_what")}
    lines += [
        "",
        "Server lateness: each request's arrival at the server (in order) minus its place on "
        "the scaled schedule anchored at the first arrival; earliest-anchored: the schedule "
        "placed so that no arrival is early. CPU / request, window: the client's process tree "
        "from the first arrival to the last answer over the finished requests; whole process: "
        "start-up (AIPerf's services, tokenizer and prompt synthesis; our trace read) "
        "included. Checked per request: requests whose server prompt count was held to the "
        "designed prompt and whose reuse was judged against the trace's design (AIPerf checks "
        "none per request). Client's own lateness: "
        + "; ".join(f"{name}: {what}" for name, what in sorted(owns.items()))
        + ".",
    ]
    return "\n".join(lines)


def main_side_by_side(
    args: argparse.Namespace, base_url: str, server_cpus: set[int] | None
) -> dict[str, Any]:
    spec = trace_workloads(args).trace
    assert spec is not None
    requests, _ = read_trace(spec)
    scaling = trace_scaling(spec)
    schedule = list(scaling.send_offsets(requests))
    scaled = scaled_trace_lines(requests, scaling)
    rows = []
    for client in args.clients:
        print(f"trace replay: {client} ...", file=sys.stderr, flush=True)
        rows.append(measure_trace_client(client, base_url, args, schedule, scaled))
    return {
        "machine": machine(),
        "server_cpus": sorted(server_cpus) if server_cpus else "unpinned",
        "client_cpus": sorted(os.sched_getaffinity(0)),
        "span_s": schedule[-1] if schedule else 0.0,
        "rows": rows,
    }


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
    parser.add_argument(
        "--clients",
        nargs="+",
        choices=CLIENT_NAMES,
        help="side by side: each client as its own process, measured at the server",
    )
    parser.add_argument(
        "--cpu-sample-s", type=float, default=0.5, help="with --clients: CPU sampling period"
    )
    parser.add_argument(
        "--no-stop", action="store_true", help="send the whole window (no over-saturation stop)"
    )
    parser.add_argument(
        "--base-src",
        help="with --clients ours-base: a source tree (its src/ directory, e.g. from "
        "`git archive REV src`) that client imports cache_family from",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        emit_figures({"trace": replay(args.url, args)})
        return 0
    load_before = load_average()
    cpus = sorted(os.sched_getaffinity(0))
    server_cpus = {cpus[0]} if len(cpus) > 1 else None
    server, base_url = start_server(server_cpus)
    try:
        if server_cpus:
            os.sched_setaffinity(0, set(cpus[1:]))
        if args.clients:
            side = main_side_by_side(args, base_url, server_cpus)
        else:
            result = replay(base_url, args)
    finally:
        server.terminate()
        server.wait(timeout=10)
    command = " ".join([".venv/bin/python", "bench/trace_replay.py", *(argv or sys.argv[1:])])
    if args.clients:
        text = render_side_by_side(side, args, command)
        print(text)
        emit_figures({"trace_side_by_side": side["rows"]})
        if args.append:
            record(
                "Trace replay side by side with AIPerf's mooncake_trace (issue 27)",
                text,
                notes=args.notes,
                argv=[sys.argv[0], *(argv or sys.argv[1:])],
                load_before=load_before,
            )
        return 0
    result |= {
        "machine": machine(),
        "server_cpus": sorted(server_cpus) if server_cpus else "unpinned",
        "client_cpus": sorted(os.sched_getaffinity(0)),
    }
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
