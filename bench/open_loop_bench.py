"""Open-loop send lateness, achieved rate and client CPU per request, against the calibration
server.

The calibration server runs as its own process (``bench/calibration_server.py``, 20 ms to the
first token, then 5 ms per token, 4 tokens: 35 ms a request, few events, so the figures are the
sender's rather than the stream reader's); this process runs the open-loop
sender (``actors/run/open_loop.py``) with its production request code (``LoadRun`` per send,
streamed ``/completion``) at each target rate for a fixed duration, on a Poisson schedule
drawn from a fixed seed (``--pattern`` for the others). With two or more CPUs the server is
pinned to the first and the client to the rest. Lateness is each send's start minus its
scheduled time, on trio's clock; client CPU is this process's user + system time over the
rate's run, divided by the requests it completed.

    .venv/bin/python bench/open_loop_bench.py [--rates 50 200 500] [--duration 10] [--append]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio
from _results import emit_figures, load_average, machine, record

from cache_family.actors.run.open_loop import OpenLoopSender, completion_exchange
from cache_family.schemas.workload import OverSaturation
from cache_family.states.workloads import SaturationWatch, arrival_schedule

HERE = Path(__file__).resolve().parent
TTFT_MS, ITL_MS, TOKENS = 20.0, 5.0, 4


def start_server(cpus: set[int] | None) -> tuple[subprocess.Popen[str], str]:
    argv = [
        sys.executable,
        str(HERE / "calibration_server.py"),
        "--port",
        "0",
        "--ttft-ms",
        str(TTFT_MS),
        "--itl-ms",
        str(ITL_MS),
        "--tokens",
        str(TOKENS),
    ]
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if not line.startswith("listening "):
        process.kill()
        raise SystemExit(f"the calibration server did not start: {line!r}")
    return process, line.removeprefix("listening ")


async def one_rate(
    base_url: str,
    rate: float,
    duration: float,
    pattern: str,
    seed: int,
    stop: bool,
    spin_s: float,
) -> dict[str, Any]:
    burstiness = 1.0 if pattern == "gamma" else None
    schedule = arrival_schedule(
        pattern,  # type: ignore[arg-type]
        rate,
        seed=seed,
        duration_s=duration,
        burstiness=burstiness,
    )
    exchange = completion_exchange(
        base_url, "open-loop", output_tokens=TOKENS, request_timeout_ms=30_000
    )
    sender = OpenLoopSender(
        schedule,
        exchange,
        target_rate_per_s=rate,
        pattern=pattern,  # type: ignore[arg-type]
        burstiness=burstiness,
        watch=SaturationWatch(OverSaturation()) if stop else None,
        spin_s=spin_s,
    )
    cpu_before = time.process_time()
    outcome = await sender.run()
    cpu = time.process_time() - cpu_before
    completed = sum(1 for row in outcome.rows if row.status == "completed")
    late = outcome.lateness
    return {
        "target_rate_per_s": rate,
        "scheduled": outcome.scheduled,
        "sent": outcome.launched,
        "completed": completed,
        "achieved_rate_per_s": outcome.achieved_rate_per_s,
        "rate_error_pct": None if outcome.rate_error is None else 100 * outcome.rate_error,
        "lateness_p50_ms": None if late is None else late.p50_ms,
        "lateness_p99_ms": None if late is None else late.p99_ms,
        "lateness_max_ms": None if late is None else late.max_ms,
        "max_in_flight": max((s.in_flight for s in outcome.sends), default=0),
        "client_cpu_ms_per_request": 1000 * cpu / completed if completed else None,
        "ks": None if outcome.fit is None else outcome.fit.value,
        "ks_p": None if outcome.fit is None else outcome.fit.p_value,
        "stop_reason": outcome.stop_reason,
    }


def _shown(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)


def render(result: dict[str, Any], command: str) -> str:
    lines = [
        f"command: {command}",
        f"machine: {result['machine']}; server CPUs {result['server_cpus']}, client CPUs "
        f"{result['client_cpus']}",
        f"calibration server: {TTFT_MS:g} ms to first token, {ITL_MS:g} ms per token, "
        f"{TOKENS} tokens; {result['pattern']} arrivals, seed {result['seed']}, "
        f"{result['duration_s']:g} s per rate; over-saturation stop "
        f"{'on (default rule)' if result['stop'] else 'off'}; spin {result['spin_ms']:g} ms",
        "",
        "| target /s | scheduled | sent | completed | achieved /s | rate error | lateness p50 | "
        "lateness p99 | lateness max | max in flight | client CPU / request | KS (p) | stop |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in result["rates"]:
        cells = [
            f"{row['target_rate_per_s']:g}",
            str(row["scheduled"]),
            str(row["sent"]),
            str(row["completed"]),
            _shown(row["achieved_rate_per_s"], "{:.2f}"),
            _shown(row["rate_error_pct"], "{:+.2f} %"),
            _shown(row["lateness_p50_ms"], "{:.3f} ms"),
            _shown(row["lateness_p99_ms"], "{:.3f} ms"),
            _shown(row["lateness_max_ms"], "{:.3f} ms"),
            str(row["max_in_flight"]),
            _shown(row["client_cpu_ms_per_request"], "{:.3f} ms"),
            f"{_shown(row['ks'], '{:.4f}')} ({_shown(row['ks_p'], '{:.2g}')})",
            row["stop_reason"] or "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Sent: the schedule's sends made before the rate ended (an over-saturation stop ends it "
        "early); lateness, achieved rate and KS are over those sends. "
        "Rate error: achieved rate (sends between the first and the last) against the target; "
        "a Poisson schedule of a few seconds differs from its mean rate by itself (the KS "
        "statistic and its p-value say whether the sent gaps follow the drawn law).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[50.0, 200.0, 500.0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per rate")
    parser.add_argument("--pattern", choices=("constant", "poisson", "gamma"), default="poisson")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--spin-ms", type=float, default=0.0, help="watch the time this long before each send"
    )
    parser.add_argument(
        "--no-stop", action="store_true", help="send the whole schedule (no over-saturation stop)"
    )
    parser.add_argument("--no-pin", action="store_true", help="do not pin server and client")
    parser.add_argument("--append", action="store_true", help="record in bench/RESULTS.md")
    parser.add_argument("--notes", default="", help="a reading recorded with the figures")
    args = parser.parse_args(argv)
    load_before = load_average()
    cpus = sorted(os.sched_getaffinity(0))
    pin = not args.no_pin and len(cpus) >= 2
    server_cpus = {cpus[0]} if pin else None
    if pin:
        os.sched_setaffinity(0, set(cpus[1:]))
    server, base_url = start_server(server_cpus)
    try:
        rates = [
            trio.run(
                one_rate,
                base_url,
                rate,
                args.duration,
                args.pattern,
                args.seed,
                not args.no_stop,
                args.spin_ms / 1000,
            )
            for rate in args.rates
        ]
    finally:
        server.terminate()
        server.wait(timeout=10)
    result = {
        "machine": machine(),
        "server_cpus": sorted(server_cpus) if server_cpus else "unpinned",
        "client_cpus": sorted(os.sched_getaffinity(0)),
        "pattern": args.pattern,
        "seed": args.seed,
        "duration_s": args.duration,
        "stop": not args.no_stop,
        "spin_ms": args.spin_ms,
        "rates": rates,
    }
    command = " ".join([".venv/bin/python", "bench/open_loop_bench.py", *sys.argv[1:]])
    print(render(result, command))
    emit_figures({"open_loop": rates})
    if args.append:
        record(
            "Open-loop send lateness against the calibration server",
            render(result, command),
            notes=args.notes,
            argv=[sys.argv[0], *(argv or sys.argv[1:])],
            load_before=load_before,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
