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

``--clients ours guidellm aiperf`` measures instead, at each rate and pattern, each client
back to back as its own process against the same server (issue 20's side-by-side table; the
peers come from ``just bench-peers-install``). Every client is measured the same way at the
server: each request's receipt (``time.monotonic_ns``, headers complete) is its arrival;
achieved rate is (arrivals - 1) / (last - first); send lateness is each arrival (in order)
minus its place on the client's schedule anchored at the first arrival (``first + i / rate`` on
a constant schedule; on a Poisson one ours redrawn from the seed, GuideLLM's from its exported
targeted starts, AIPerf's unknown: it exports none), and again with the schedule placed so the
earliest arrival is on time; client CPU is the client's process tree
(``/proc``, sampled every ``--cpu-sample-s``) from the first arrival to the last answer, over
the requests the server finished, and the whole process's (``os.wait4``: start-up included).
Beside them, each client's own lateness figure, named for what it is.

    .venv/bin/python bench/open_loop_bench.py --clients ours guidellm aiperf \\
        --patterns constant poisson [--duration 10] [--append]

``--clients ours ours-base --base-src DIR`` also runs ours from another source tree (``DIR``:
its ``src``, e.g. from ``git archive REV src``), measured the same way: a before / after in
one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import trio
from _results import emit_figures, load_average, machine, read_figures, record
from bench_peers import (
    aiperf_rate_command,
    aiperf_send_rows,
    guidellm_rate_command,
    guidellm_send_rows,
)

from cache_family.actors.run.open_loop import OpenLoopSender, load_exchange
from cache_family.schemas.workload import OverSaturation
from cache_family.states.arrivals import SaturationWatch, achieved_rate, arrival_schedule
from cache_family.states.metrics import percentile

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
    exchange = load_exchange(base_url, "open-loop", output_tokens=TOKENS, request_timeout_ms=30_000)
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


# --- side by side with the peers (issue 20) -----------------------------------------------------

# ``ours-base``: ours from the source tree given with ``--base-src`` (a before / after in one run).
CLIENT_NAMES = ("ours", "ours-base", "guidellm", "aiperf")
TOKENIZER_DIR = HERE / ".peer-tokenizer"
POSTS = ("/completion", "/v1/chat/completions")


def constant_schedule(count: int, rate: float) -> list[float]:
    """Send offsets in seconds from the first: ``i / rate``."""
    return [index / rate for index in range(count)]


def schedule_deviation_ms(arrivals_ns: Sequence[int], schedule_s: Sequence[float]) -> list[float]:
    """Each arrival (in order) minus its place on the schedule (offsets in seconds, in order)
    anchored at the first arrival, in ms; over as many as both have.

    The first is 0 by construction; where the first send was itself late (its connection
    opened then), the others come out early, so ``earliest_anchored`` says the same against
    the schedule placed where the earliest arrival is on time."""
    ordered, offsets = sorted(arrivals_ns), sorted(schedule_s)
    if not ordered or not offsets:
        return []
    first, zero = ordered[0], offsets[0]
    return [
        (at - first) / 1e6 - 1000 * (offset - zero)
        for at, offset in zip(ordered, offsets, strict=False)
    ]


def earliest_anchored(deviation_ms: Sequence[float]) -> list[float]:
    """The deviations against the schedule that puts the earliest send on time (all >= 0):
    no send may be early, so this is the least lateness consistent with the arrivals."""
    if not deviation_ms:
        return []
    earliest = min(deviation_ms)
    return [d - earliest for d in deviation_ms]


def arrival_rate(arrivals_ns: Sequence[int]) -> float | None:
    """Arrivals per second: (count - 1) over the span from the first to the last."""
    return achieved_rate(sorted(at / 1e9 for at in arrivals_ns))


def cpu_at(samples: Sequence[tuple[int, float]], at_ns: int) -> float | None:
    """The cumulative CPU seconds at ``at_ns``, linear between the samples around it
    (``samples``: (monotonic ns, CPU s) in time order); the nearest one outside them."""
    if not samples:
        return None
    if at_ns <= samples[0][0]:
        return samples[0][1]
    for (t0, c0), (t1, c1) in pairwise(samples):
        if t0 <= at_ns <= t1:
            return c0 if t1 == t0 else c0 + (c1 - c0) * (at_ns - t0) / (t1 - t0)
    return samples[-1][1]


def tree_cpu_s(root: int, clock_ticks: int) -> float:
    """User + system CPU of ``root`` and every live descendant (with their reaped
    children's), from ``/proc/PID/stat``."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        pid = int(name)
        parent[pid] = int(fields[1])
        # utime, stime, cutime, cstime: fields 14 to 17 of stat(5).
        ticks[pid] = sum(int(x) for x in fields[11:15])
    tree, frontier = {root}, [root]
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), ()):
            if child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(ticks.get(pid, 0) for pid in tree) / clock_ticks


class TreeCpuSampler:
    """A thread sampling a process tree's CPU every ``every_s`` (a full ``/proc`` scan: about
    2 ms of this process's CPU each, on the client's CPUs, the same for every client)."""

    def __init__(self, pid: int, every_s: float) -> None:
        self.pid = pid
        self.every_s = every_s
        self.samples: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def sample(self) -> None:
        self.samples.append((time.monotonic_ns(), tree_cpu_s(self.pid, self._ticks)))

    def __enter__(self) -> TreeCpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _server_call(base_url: str, method: str, path: str) -> dict[str, Any]:
    request = urllib.request.Request(base_url + path, method=method)
    with urllib.request.urlopen(request, timeout=30) as answer:
        value = json.loads(answer.read())
    assert isinstance(value, dict)
    return value


def _child_env() -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": "/tmp"}
    return env | {"HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "*"}


def _client_argv(
    client: str, base_url: str, rate: float, pattern: str, args: argparse.Namespace, out: Path
) -> tuple[list[str], dict[str, str]]:
    requests = round(rate * args.duration)
    env = _child_env()
    if client in ("ours", "ours-base"):
        argv = [
            sys.executable, str(Path(__file__).resolve()), "--child",
            "--url", base_url, "--rates", f"{rate:g}", "--pattern", pattern,
            "--duration", f"{args.duration:g}", "--seed", str(args.seed),
            "--spin-ms", f"{args.spin_ms:g}", "--no-stop",
        ]  # fmt: skip
        if client == "ours-base":
            if args.base_src is None:
                raise SystemExit("--clients ours-base needs --base-src DIR")
            env |= {"PYTHONPATH": str(Path(args.base_src).resolve())}
        return argv, env
    if client == "guidellm":
        venv = HERE / ".venv-guidellm"
        argv = guidellm_rate_command(
            venv, base_url, rate, pattern, requests, TOKENS, out, TOKENIZER_DIR, args.seed
        )
        return argv, env | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    venv = HERE / ".venv-aiperf"
    # A local tokenizer directory: AIPerf's offline path (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE)
    # would look it up as a repo id; it reads the directory without reaching the network.
    argv = aiperf_rate_command(
        venv, base_url, rate, pattern, requests, TOKENS, out, TOKENIZER_DIR, args.seed
    )
    return argv, env


def _own_lateness(client: str, stdout: str, out: Path) -> dict[str, Any]:
    """The client's own lateness figure, and what it is."""
    late: list[float] = []
    if client in ("ours", "ours-base"):
        figures = read_figures(stdout) or {}
        row = (figures.get("open_loop") or [{}])[0]
        return {
            "own_p50_ms": row.get("lateness_p50_ms"),
            "own_p99_ms": row.get("lateness_p99_ms"),
            "own_what": "send start - schedule, trio clock",
            "own_cpu_ms_per_request": row.get("client_cpu_ms_per_request"),
        }
    if client == "guidellm":
        rows = guidellm_send_rows(out)
        targeted = sorted(r["targeted_s"] for r in rows if r["targeted_s"] is not None)
        late = [
            1000 * (r["start_s"] - r["targeted_s"])
            for r in rows
            if r["start_s"] is not None and r["targeted_s"] is not None
        ]
        what = "request_start - targeted_start, its wall clock"
        schedule = {"targeted_s": targeted}
    else:
        rows = aiperf_send_rows(out)
        late = [
            (r["start_ns"] - r["issued_ns"]) / 1e6
            for r in rows
            if r["start_ns"] is not None and r["issued_ns"] is not None
        ]
        what = "request_start - credit_issued (no schedule exported: pacer lateness left out)"
        schedule = {}
    return {
        "own_p50_ms": percentile(late, 50),
        "own_p99_ms": percentile(late, 99),
        "own_what": what,
        "client_errors": sum(1 for r in rows if r["error"]),
    } | schedule


def client_schedule(
    client: str,
    pattern: str,
    rate: float,
    arrived: int,
    *,
    seed: int,
    duration_s: float,
    targeted_s: Sequence[float] | None,
) -> list[float] | None:
    """The send offsets the client meant to keep: i / rate on a constant schedule; on a
    Poisson one, ours redrawn from the seed and GuideLLM's from its exported targeted starts;
    AIPerf exports no schedule (None)."""
    if pattern == "constant":
        return constant_schedule(arrived, rate)
    if client in ("ours", "ours-base"):
        return list(arrival_schedule("poisson", rate, seed=seed, duration_s=duration_s))
    if client == "guidellm" and targeted_s:
        return sorted(targeted_s)
    return None


def run_client(
    argv: list[str], env: dict[str, str], cwd: Path, *, timeout_s: float, cpu_sample_s: float
) -> tuple[dict[str, Any], TreeCpuSampler, str]:
    """A client as its own process in ``cwd``: its exit, its whole CPU (``os.wait4``) and a
    note when it failed, its process tree's CPU samples, and what it printed. A client that
    hangs is killed after ``timeout_s``."""
    result: dict[str, Any] = {}
    with (cwd / "stdout").open("w+") as stdout, (cwd / "stderr").open("w+") as stderr:
        child = subprocess.Popen(argv, stdout=stdout, stderr=stderr, env=env, cwd=cwd)
        watchdog = threading.Timer(timeout_s, child.kill)
        watchdog.start()
        try:
            with TreeCpuSampler(child.pid, cpu_sample_s) as sampler:
                _, status, usage = os.wait4(child.pid, 0)
        finally:
            watchdog.cancel()
        stdout.seek(0)
        stderr.seek(0)
        printed, errors = stdout.read(), stderr.read()
    code = os.waitstatus_to_exitcode(status)
    result["exit"] = code
    result["whole_cpu_s"] = usage.ru_utime + usage.ru_stime
    if code != 0:
        said = [line for line in (printed + errors).splitlines() if "ERROR" in line]
        tail = said[-1] if said else (errors or printed).strip()[-600:]
        result["note"] = f"exited {code}: {tail.strip()[:600]}"
    return result, sampler, printed


def served_figures(
    base_url: str, schedule: Sequence[float] | None, sampler: TreeCpuSampler, whole_cpu_s: float
) -> dict[str, Any]:
    """What the server saw of the client's run: arrivals, finished requests, the achieved
    rate, lateness against ``schedule`` (first- and earliest-anchored) and the client's CPU
    per finished request, between the first arrival and the last answer and whole."""
    served = [s for s in _server_call(base_url, "GET", "/stamps")["requests"] if s["path"] in POSTS]
    arrivals = [s["received_ns"] for s in served]
    finished = [s for s in served if s["final_ns"] is not None]
    result: dict[str, Any] = {
        "arrivals": len(arrivals),
        "finished": len(finished),
        "achieved_rate_per_s": arrival_rate(arrivals),
    }
    if schedule is not None and arrivals:
        deviation = schedule_deviation_ms(arrivals, schedule)
        result["scheduled"] = len(schedule)
        result["first_p50_ms"] = percentile(deviation, 50)
        result["first_p99_ms"] = percentile(deviation, 99)
        result["earliest_p99_ms"] = percentile(earliest_anchored(deviation), 99)
    if arrivals and finished:
        start, end = min(arrivals), max(s["final_ns"] for s in finished)
        before, after = cpu_at(sampler.samples, start), cpu_at(sampler.samples, end)
        if before is not None and after is not None:
            result["window_cpu_ms_per_request"] = 1000 * (after - before) / len(finished)
        result["whole_cpu_ms_per_request"] = 1000 * whole_cpu_s / len(finished)
    return result


def measure_client(
    client: str, base_url: str, rate: float, pattern: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One client at one rate, as its own process, measured at the server."""
    _server_call(base_url, "DELETE", "/stamps")
    result: dict[str, Any] = {"client": client, "pattern": pattern, "target_rate_per_s": rate}
    with tempfile.TemporaryDirectory(prefix=f"open-loop-{client}-") as tmp:
        out = Path(tmp)
        argv, env = _client_argv(client, base_url, rate, pattern, args, out)
        # Start-up, the run, and its own drain with room.
        ran, sampler, printed = run_client(
            argv, env, out, timeout_s=3 * args.duration + 180, cpu_sample_s=args.cpu_sample_s
        )
        result |= ran
        if ran["exit"] == 0:
            try:
                result |= _own_lateness(client, printed, out)
            except (OSError, ValueError, KeyError) as exc:
                result["note"] = f"its export unread: {exc!r}"
    arrived = len(
        [s for s in _server_call(base_url, "GET", "/stamps")["requests"] if s["path"] in POSTS]
    )
    schedule = client_schedule(
        client,
        pattern,
        rate,
        arrived,
        seed=args.seed,
        duration_s=args.duration,
        targeted_s=result.pop("targeted_s", None),
    )
    return result | served_figures(base_url, schedule, sampler, result["whole_cpu_s"])


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f} %"


def verdicts(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, float], list[str]]:
    """Per (pattern, rate), ours against issue 20's targets: lateness p99 at most 1 ms and at
    most the best peer's measured the same way (at the server, earliest-anchored), and the
    achieved rate within 1 % of the target (constant schedules only: a Poisson draw of a few
    thousand sends differs from its mean rate by itself)."""
    found: dict[tuple[str, float], list[str]] = {}
    for row in rows:
        if row["client"] != "ours":
            continue
        key = (row["pattern"], row["target_rate_per_s"])
        peers = [
            r["earliest_p99_ms"]
            for r in rows
            if r["client"] not in ("ours", "ours-base")
            and (r["pattern"], r["target_rate_per_s"]) == key
            and r.get("earliest_p99_ms") is not None
        ]
        ours, notes = row.get("earliest_p99_ms"), []
        if ours is not None:
            notes.append(f"p99 <= 1 ms: {'met' if ours <= 1.0 else 'NOT met'} ({ours:.3f} ms)")
            if peers:
                best = min(peers)
                met = "met" if ours <= best else "NOT met"
                notes.append(f"p99 <= best peer's {best:.3f} ms: {met}")
            else:
                notes.append("p99 <= best peer's: no peer measured")
        achieved = row.get("achieved_rate_per_s")
        if achieved is not None and key[0] == "constant":
            error = achieved / key[1] - 1
            met = "met" if abs(error) <= 0.01 else "NOT met"
            notes.append(f"rate within 1 %: {met} ({100 * error:+.2f} %)")
        found[key] = notes
    return found


def render_side_by_side(result: dict[str, Any], command: str) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [
        f"command: {command}",
        f"machine: {result['machine']}; server CPUs {result['server_cpus']}, client CPUs "
        f"{result['client_cpus']} (each client and its every process on them)",
        f"calibration server: {TTFT_MS:g} ms to first token, {ITL_MS:g} ms per token, "
        f"{TOKENS} tokens; {result['duration_s']:g} s per rate (rate x duration requests); "
        f"seed {result['seed']}; ours: no over-saturation stop, spin {result['spin_ms']:g} ms; "
        f"CPU sampled every {result['cpu_sample_s']:g} s",
        "",
        "| pattern | client | target /s | arrived (finished) | achieved /s | achieved / target "
        "| server lateness p50 / p99, first-anchored | p99, earliest-anchored "
        "| client's own lateness p50 / p99 | CPU / request, window | CPU / request, whole "
        "process | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in result["rows"]:
        achieved = row.get("achieved_rate_per_s")
        ratio = None if achieved is None else achieved / row["target_rate_per_s"]
        cells = [
            row["pattern"],
            row["client"],
            f"{row['target_rate_per_s']:g}",
            f"{row.get('arrivals', 0)} ({row.get('finished', 0)})",
            "-" if achieved is None else f"{achieved:.2f}",
            _pct(ratio),
            f"{ms(row.get('first_p50_ms'))} / {ms(row.get('first_p99_ms'))} ms",
            f"{ms(row.get('earliest_p99_ms'))} ms",
            f"{ms(row.get('own_p50_ms'))} / {ms(row.get('own_p99_ms'))} ms",
            f"{ms(row.get('window_cpu_ms_per_request'))} ms",
            f"{ms(row.get('whole_cpu_ms_per_request'))} ms",
            row.get("note", "") or "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    owns = {row["client"]: row.get("own_what") for row in result["rows"] if row.get("own_what")}
    lines += ["", "Client's own lateness, per client: "]
    lines[-1] += "; ".join(f"{name}: {what}" for name, what in sorted(owns.items())) + "."
    found = verdicts(result["rows"])
    if found:
        lines += ["", "Issue 20's targets, ours (server-side figures):", ""]
        for (pattern, rate), notes in found.items():
            lines.append(f"* {pattern} {rate:g}/s: " + "; ".join(notes))
    return "\n".join(lines)


def side_by_side(args: argparse.Namespace, base_url: str) -> list[dict[str, Any]]:
    rows = []
    for pattern in args.patterns:
        for rate in args.rates:
            for client in args.clients:
                print(f"open-loop: {client} {pattern} {rate:g}/s ...", file=sys.stderr, flush=True)
                rows.append(measure_client(client, base_url, rate, pattern, args))
    return rows


def child(args: argparse.Namespace) -> int:
    """``--child``: ours at one rate against ``--url``, its figures printed for the parent."""
    rows = [
        trio.run(
            one_rate,
            args.url,
            rate,
            args.duration,
            args.pattern,
            args.seed,
            not args.no_stop,
            args.spin_ms / 1000,
        )
        for rate in args.rates
    ]
    emit_figures({"open_loop": rows})
    return 0


def main_side_by_side(
    args: argparse.Namespace,
    argv: list[str] | None,
    server: subprocess.Popen[str],
    base_url: str,
    server_cpus: set[int] | None,
    load_before: tuple[float, float, float],
) -> int:
    try:
        rows = side_by_side(args, base_url)
    finally:
        server.terminate()
        server.wait(timeout=10)
    result = {
        "machine": machine(),
        "server_cpus": sorted(server_cpus) if server_cpus else "unpinned",
        "client_cpus": sorted(os.sched_getaffinity(0)),
        "seed": args.seed,
        "duration_s": args.duration,
        "spin_ms": args.spin_ms,
        "cpu_sample_s": args.cpu_sample_s,
        "rows": rows,
    }
    command = " ".join([".venv/bin/python", "bench/open_loop_bench.py", *sys.argv[1:]])
    text = render_side_by_side(result, command)
    print(text)
    emit_figures({"open_loop_side_by_side": rows})
    if args.append:
        record(
            "Open-loop send lateness side by side with GuideLLM and AIPerf (issue 20)",
            text,
            notes=args.notes,
            argv=[sys.argv[0], *(argv or sys.argv[1:])],
            load_before=load_before,
        )
    return 0


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
    parser.add_argument(
        "--clients",
        nargs="+",
        choices=CLIENT_NAMES,
        help="side by side: each client as its own process, measured at the server",
    )
    parser.add_argument(
        "--patterns",
        nargs="+",
        choices=("constant", "poisson"),
        default=["constant", "poisson"],
        help="with --clients: the arrival patterns, each at every rate",
    )
    parser.add_argument(
        "--cpu-sample-s", type=float, default=0.5, help="with --clients: CPU sampling period"
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
        return child(args)
    load_before = load_average()
    cpus = sorted(os.sched_getaffinity(0))
    pin = not args.no_pin and len(cpus) >= 2
    server_cpus = {cpus[0]} if pin else None
    if pin:
        os.sched_setaffinity(0, set(cpus[1:]))
    server, base_url = start_server(server_cpus)
    if args.clients:
        return main_side_by_side(args, argv, server, base_url, server_cpus, load_before)
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
