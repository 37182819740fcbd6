"""Client fidelity and cost, side by side: ours, the bare floor and each installed peer.

Every client runs against the calibration server (``bench/calibration_server.py``), which
stamps on CLOCK_MONOTONIC when it received each request and wrote each event. The server runs
on one CPU, each client as its own process on another. For each client and concurrency
(closed loop) the harness reports, against the server's truth of that very request:

* TTFT error and TPOT error (client figure minus server truth): median, p99, max;
* client time above server truth (end-to-end latency minus the server's receipt-to-final-event
  time) at concurrency 1: p50, p90, p99;
* client CPU per streamed request: for ours and the floor, ``getrusage`` around the load only;
  for peers, the whole process tree (``wait4``), start-up included, so not comparable;
* achieved requests/s.

The first ``c`` requests of each run (the closed loop's ramp) are left out. Samples of all
repeats are pooled. It prints the figures and their ratios to the floor and appends them with
the command, date, machine and load average to ``bench/RESULTS.md`` (``--no-record`` skips).

    just bench-harness [--clients ours bare bare-aiohttp aiperf guidellm] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "RESULTS.md"
CONCURRENCIES = (1, 8, 32, 64)
PROMPT = "calibration prompt " * 16
TOKENIZER_DIR = BENCH / ".peer-tokenizer"


@dataclass
class Sample:
    """One request: the client's figures and the server's truth, in ms."""

    ttft: float
    latency: float
    tpot: float | None
    truth_ttft: float
    truth_latency: float
    truth_tpot: float


@dataclass
class RunResult:
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0
    cpu_s: float = 0.0
    cpu_requests: int = 0
    cpu_scope: str = "load"
    wall_s: float = 0.0
    requests: int = 0
    note: str = ""


# --- clients as child processes -----------------------------------------------------------------


def _child_env(*, hf_offline: bool = True) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": "/tmp"}
    env |= {"HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "*"}
    if hf_offline:
        env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return env


def _run_child(
    argv: Sequence[str], cpu: int | None, cwd: Path | None = None, *, hf_offline: bool = True
) -> tuple[str, float]:
    """Run a client process on ``cpu``; its stdout and the CPU its whole tree used."""
    started = time.monotonic()
    env = _child_env(hf_offline=hf_offline)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=cwd)
        if cpu is not None:
            os.sched_setaffinity(child.pid, {cpu})
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if child.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(argv[:3])} ... exited {child.returncode} after "
            f"{time.monotonic() - started:.1f}s: {stderr[-2000:]}"
        )
    return stdout, usage.ru_utime + usage.ru_stime


def _own_rows(stdout: str, result: RunResult, ramp: int) -> None:
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    summary = lines.pop()
    result.cpu_s, result.cpu_requests = summary["cpu_s"], summary["requests"]
    result.wall_s = summary.get("wall_s", 0.0)
    result.requests = len(lines)
    for index, row in enumerate(lines):
        if "error" in row:
            result.errors += 1
            continue
        if index < ramp:
            continue
        prompt_ms, predicted_ms = row["server_prompt_ms"], row["server_predicted_ms"]
        result.samples.append(
            Sample(
                ttft=row["ttft_ms"],
                latency=row["latency_ms"],
                tpot=row["tpot_ms"],
                truth_ttft=prompt_ms,
                truth_latency=prompt_ms + predicted_ms,
                truth_tpot=predicted_ms / max(row["tokens"] - 1, 1),
            )
        )


def run_ours(url: str, c: int, n: int, tokens: int, cpu: int | None, _: Any) -> RunResult:
    argv = [sys.executable, str(Path(__file__)), "ours-client", url, str(c), str(n), str(tokens)]
    stdout, _tree_cpu = _run_child(argv, cpu)
    result = RunResult()
    _own_rows(stdout, result, ramp=c)
    return result


def run_bare(url: str, c: int, n: int, tokens: int, cpu: int | None, _: Any) -> RunResult:
    argv = [sys.executable, str(BENCH / "bare_client.py"), "--url", url]
    argv += ["--concurrency", str(c), "--requests", str(n), "--tokens", str(tokens)]
    argv += ["--prompt", PROMPT]
    stdout, _tree_cpu = _run_child(argv, cpu)
    result = RunResult()
    _own_rows(stdout, result, ramp=c)
    return result


def run_bare_aiohttp(url: str, c: int, n: int, tokens: int, cpu: int | None, _: Any) -> RunResult:
    python = BENCH / ".venv-aiperf" / "bin" / "python"
    if not python.exists():
        raise RuntimeError("bench/.venv-aiperf is missing (its aiohttp runs this floor)")
    argv = [str(python), str(BENCH / "bare_aiohttp.py"), "--url", url]
    argv += ["--concurrency", str(c), "--requests", str(n), "--tokens", str(tokens)]
    argv += ["--prompt", PROMPT]
    stdout, _tree_cpu = _run_child(argv, cpu)
    result = RunResult()
    _own_rows(stdout, result, ramp=c)
    return result


def ours_client(url: str, c: int, n: int, tokens: int) -> None:
    """Child side of ``run_ours``: the product's load client through its public API."""
    import resource

    import trio

    from cache_family.actors.load import LoadRun
    from cache_family.schemas.measurement import LoadRequest

    request = LoadRequest(
        base_url=url,
        prompt=PROMPT,
        requests=n,
        concurrency=c,
        output_tokens=tokens,
        stream=True,
        request_timeout_ms=120_000,
    )
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    outcome = trio.run(LoadRun(request, stop_on_failure=False).run)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    for row in outcome.rows:
        if row.status != "completed" or row.timings is None:
            print(json.dumps({"error": f"{row.status}: {row.error}"}))
            continue
        print(
            json.dumps(
                {
                    "ttft_ms": row.ttft_ms,
                    "latency_ms": row.elapsed_ms,
                    "tpot_ms": row.tpot_ms,
                    "tokens": row.tokens_predicted,
                    "server_prompt_ms": row.timings.prompt_ms,
                    "server_predicted_ms": row.timings.predicted_ms,
                }
            )
        )
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(json.dumps({"cpu_s": cpu, "requests": len(outcome.rows), "wall_s": wall}))


# --- peers: their exports joined with the server's stamps ----------------------------------------


def _pair_with_stamps(
    client: list[dict[str, float]], stamps: list[dict[str, Any]], ramp: int, result: RunResult
) -> None:
    """Pair each peer request with the server's record of it.

    By the request number when the peer exports the text or id that carries it; otherwise
    the i-th request the peer started with the i-th the server received (wall clock): with a
    closed loop, start order and receipt order agree except for near-ties, whose server
    truths differ by microseconds.
    """
    served = sorted(
        (s for s in stamps if s["ttft_ms"] is not None), key=lambda s: s["received_wall_ns"]
    )
    mine = sorted(client, key=lambda r: r["start_wall_ns"])
    by_seq = {s["seq"]: s for s in served}
    if mine and all(row.get("seq") in by_seq for row in mine):
        pairs = [(row, by_seq[row["seq"]]) for row in mine]
        result.note += "paired by request number; "
    else:
        pairs = list(zip(mine, served, strict=False))
        result.note += "paired by order; "
        if len(served) != len(mine):
            result.note += f"paired {len(pairs)} of {len(mine)} client / "
            result.note += f"{len(served)} server requests; "
    for index, (row, truth) in enumerate(pairs):
        if index < ramp:
            continue
        result.samples.append(
            Sample(
                ttft=row["ttft_ms"],
                latency=row["latency_ms"],
                tpot=row.get("tpot_ms"),
                truth_ttft=truth["ttft_ms"],
                truth_latency=truth["latency_ms"],
                truth_tpot=truth["tpot_ms"],
            )
        )


def _peer_result(
    result: RunResult, rows: list[dict[str, Any]], n: int, stamps: list[dict[str, Any]], c: int
) -> None:
    result.requests = len(rows)
    result.errors = n - len(rows)
    if rows:
        # The peer's own span of requests, not its process's life (start-up takes seconds).
        first = min(r["start_wall_ns"] for r in rows) / 1e9
        last = max(r["start_wall_ns"] / 1e9 + r["latency_ms"] / 1000 for r in rows)
        result.wall_s = last - first
    _pair_with_stamps(rows, stamps, c, result)


def run_aiperf(url: str, c: int, n: int, tokens: int, cpu: int | None, stamps: Any) -> RunResult:
    from bench_peers import aiperf_command, aiperf_rows

    with tempfile.TemporaryDirectory(prefix="aiperf-") as tmp:
        argv = aiperf_command(BENCH / ".venv-aiperf", url, c, n, tokens, Path(tmp), TOKENIZER_DIR)
        started = time.monotonic()
        _, tree_cpu = _run_child(argv, cpu, cwd=Path(tmp), hf_offline=False)
        wall = time.monotonic() - started
        rows = aiperf_rows(Path(tmp))
    result = RunResult(cpu_s=tree_cpu, cpu_requests=n, cpu_scope="process tree", wall_s=wall)
    _peer_result(result, rows, n, stamps(), c)
    return result


def run_guidellm(url: str, c: int, n: int, tokens: int, cpu: int | None, stamps: Any) -> RunResult:
    from bench_peers import guidellm_command, guidellm_rows

    with tempfile.TemporaryDirectory(prefix="guidellm-") as tmp:
        argv = guidellm_command(
            BENCH / ".venv-guidellm", url, c, n, tokens, Path(tmp), TOKENIZER_DIR
        )
        started = time.monotonic()
        _, tree_cpu = _run_child(argv, cpu, cwd=Path(tmp))
        wall = time.monotonic() - started
        rows = guidellm_rows(Path(tmp))
    result = RunResult(cpu_s=tree_cpu, cpu_requests=n, cpu_scope="process tree", wall_s=wall)
    _peer_result(result, rows, n, stamps(), c)
    return result


CLIENTS: dict[str, Callable[..., RunResult]] = {
    "ours": run_ours,
    "bare": run_bare,
    "bare-aiohttp": run_bare_aiohttp,
    "aiperf": run_aiperf,
    "guidellm": run_guidellm,
}


# --- the server -----------------------------------------------------------------------------------


class Server:
    def __init__(self, ttft_ms: float, itl_ms: float, tokens: int, cpu: int | None) -> None:
        argv = [sys.executable, str(BENCH / "calibration_server.py"), "--port", "0"]
        argv += ["--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms), "--tokens", str(tokens)]
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=_child_env()
        )
        if cpu is not None:
            os.sched_setaffinity(self.process.pid, {cpu})
        assert self.process.stdout is not None
        line = self.process.stdout.readline().decode().strip()
        if not line.startswith("listening "):
            self.stop()
            raise RuntimeError(f"calibration server did not start: {line!r}")
        self.url = line.removeprefix("listening ").rstrip("/")

    def _call(self, method: str, path: str) -> Any:
        request = urllib.request.Request(self.url + path, method=method)
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read(256 * 1024 * 1024))

    def take_stamps(self) -> list[dict[str, Any]]:
        requests: list[dict[str, Any]] = self._call("GET", "/stamps")["requests"]
        self._call("DELETE", "/stamps")
        return requests

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# --- figures --------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation, so every figure is a measured sample)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def figures(result: RunResult) -> dict[str, float]:
    s = result.samples
    ttft_err = [x.ttft - x.truth_ttft for x in s]
    tpot_err = [x.tpot - x.truth_tpot for x in s if x.tpot is not None]
    above = [x.latency - x.truth_latency for x in s]
    out = {
        "n": float(len(s)),
        "errors": float(result.errors),
        "ttft_err_p50": percentile(ttft_err, 50),
        "ttft_err_p99": percentile(ttft_err, 99),
        "ttft_err_max": max(ttft_err, default=math.nan),
        "tpot_err_p50": percentile(tpot_err, 50),
        "tpot_err_p99": percentile(tpot_err, 99),
        "tpot_err_max": max(tpot_err, default=math.nan),
        "above_p50": percentile(above, 50),
        "above_p90": percentile(above, 90),
        "above_p99": percentile(above, 99),
        "cpu_ms_per_request": (
            1000 * result.cpu_s / result.cpu_requests if result.cpu_requests else math.nan
        ),
        "requests_per_s": result.requests / result.wall_s if result.wall_s else math.nan,
    }
    return out


def merge(results: list[RunResult]) -> RunResult:
    merged = RunResult(cpu_scope=results[0].cpu_scope)
    for r in results:
        merged.samples += r.samples
        merged.errors += r.errors
        merged.cpu_s += r.cpu_s
        merged.cpu_requests += r.cpu_requests
        merged.wall_s += r.wall_s
        merged.requests += r.requests
        merged.note += r.note
    return merged


def _fmt(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def report(
    table: dict[str, dict[int, dict[str, float]]], scopes: dict[str, str], failures: dict[str, str]
) -> str:
    lines = []
    lines.append(
        "| client | c | n | TTFT err p50 / p99 / max | TPOT err p50 / p99 / max | "
        "above truth p50 / p90 / p99 | CPU ms/req | req/s |"
    )
    lines.append("|---|---:|---:|---|---|---|---:|---:|")
    for client, by_c in table.items():
        for c, f in sorted(by_c.items()):
            lines.append(
                f"| {client} | {c} | {int(f['n'])}"
                + (f" ({int(f['errors'])} failed)" if f["errors"] else "")
                + f" | {_fmt(f['ttft_err_p50'])} / {_fmt(f['ttft_err_p99'])} / "
                f"{_fmt(f['ttft_err_max'])} | {_fmt(f['tpot_err_p50'])} / "
                f"{_fmt(f['tpot_err_p99'])} / {_fmt(f['tpot_err_max'])} | "
                f"{_fmt(f['above_p50'])} / {_fmt(f['above_p90'])} / {_fmt(f['above_p99'])} | "
                f"{_fmt(f['cpu_ms_per_request'])} | {_fmt(f['requests_per_s'])} |"
            )
    lines.append("")
    lines.append(
        "All figures in ms except req/s. CPU scope: "
        + ", ".join(f"{k}: {v}" for k, v in scopes.items())
        + "."
    )
    for client, why in failures.items():
        lines.append(f"\n**{client} did not run:** {why}")
    return "\n".join(lines)


def ratios(table: dict[str, dict[int, dict[str, float]]]) -> str:
    if "bare" not in table:
        return ""
    lines = [
        "| client / floor | c=1 above p50 | c=1 above p90 | c=1 above p99 | "
        "c=64 TTFT err p99 | CPU/req (c=1) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    floor = table["bare"]

    def ratio(client: str, c: int, key: str) -> str:
        mine, base = table[client].get(c, {}).get(key), floor.get(c, {}).get(key)
        if mine is None or base is None or not base or math.isnan(mine) or math.isnan(base):
            return "-"
        return f"{mine / base:.2f}x"

    for client in table:
        if client == "bare":
            continue  # the ratios' denominator
        lines.append(
            f"| {client} | {ratio(client, 1, 'above_p50')} | {ratio(client, 1, 'above_p90')} | "
            f"{ratio(client, 1, 'above_p99')} | {ratio(client, 64, 'ttft_err_p99')} | "
            f"{ratio(client, 1, 'cpu_ms_per_request')} |"
        )
    return "\n".join(lines)


FLOORS = ("bare", "bare-aiohttp")


def targets(table: dict[str, dict[int, dict[str, float]]]) -> str:
    """Issue 13 item 3, judged on this run's figures only."""
    ours = table.get("ours", {})
    peers = {k: v for k, v in table.items() if k != "ours" and k not in FLOORS}
    out = []

    def judge(name: str, value: float, limit: float, unit: str = " ms") -> None:
        if math.isnan(value) or math.isnan(limit):
            out.append(f"- {name}: not measured")
        elif value <= limit:
            out.append(f"- {name}: met in this run ({value:.2f} <= {limit:.2f}{unit})")
        else:
            out.append(
                f"- {name}: missed by {value - limit:.2f}{unit} ({value:.2f} > {limit:.2f}{unit})"
            )

    nan = math.nan
    if ours.get(1):
        for floor_name in FLOORS:
            floor = table.get(floor_name, {}).get(1)
            if floor is None:
                continue
            judge(
                f"c=1 above truth p50 within 0.2 ms of the floor ({floor_name})",
                ours[1]["above_p50"],
                floor["above_p50"] + 0.2,
            )
            judge(
                f"client CPU per streamed request at most 1.2x the floor ({floor_name}, c=1)",
                ours[1]["cpu_ms_per_request"],
                1.2 * floor["cpu_ms_per_request"],
            )
        for q in ("p90", "p99"):
            best = min((p[1][f"above_{q}"] for p in peers.values() if 1 in p), default=nan)
            judge(f"c=1 above truth {q} at most the best peer's", ours[1][f"above_{q}"], best)
    if ours.get(64):
        judge("TTFT p99 error at most 1 ms at c=64", ours[64]["ttft_err_p99"], 1.0)
    out.append(
        "- sustained capacity at least the best peer's: not measured (the calibration server "
        "paces every request, so req/s above shows the pace, not a client's limit)"
    )
    return "\n".join(out)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{platform.platform()}, {cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ours-client"]:
        url, c, n, tokens = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
        ours_client(url, c, n, tokens)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=list(CONCURRENCIES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ttft-ms", type=float, default=50.0)
    parser.add_argument("--itl-ms", type=float, default=10.0)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=0, help="per run; 0: max(40, 5 c)")
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--label", default="", help="a line to record with the run")
    args = parser.parse_args(argv)

    cpus = sorted(os.sched_getaffinity(0))
    pinned = not args.no_pin and len(cpus) >= 2
    server_cpu, client_cpu = (cpus[0], cpus[1]) if pinned else (None, None)
    sys.path.insert(0, str(BENCH))
    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.UTC)
    server = Server(args.ttft_ms, args.itl_ms, args.tokens, server_cpu)
    runs: dict[str, dict[int, list[RunResult]]] = {}
    failures: dict[str, str] = {}
    try:
        for repeat in range(args.repeats):
            for client in args.clients:
                if client in failures:
                    continue
                for c in args.concurrency:
                    n = args.requests or max(40, 5 * c)
                    server.take_stamps()
                    try:
                        result = CLIENTS[client](
                            server.url, c, n, args.tokens, client_cpu, server.take_stamps
                        )
                    except (RuntimeError, OSError, ImportError, KeyError, ValueError) as exc:
                        failures[client] = f"{type(exc).__name__}: {exc}"[:3000]
                        print(f"{client} c={c}: FAILED {failures[client][:500]}", file=sys.stderr)
                        break
                    runs.setdefault(client, {}).setdefault(c, []).append(result)
                    f = figures(result)
                    print(
                        f"repeat {repeat + 1} {client} c={c}: n={int(f['n'])} "
                        f"ttft err p50 {_fmt(f['ttft_err_p50'])} p99 {_fmt(f['ttft_err_p99'])} "
                        f"above p50 {_fmt(f['above_p50'])} cpu/req "
                        f"{_fmt(f['cpu_ms_per_request'])} {result.note}",
                        file=sys.stderr,
                    )
    finally:
        server.stop()
    load_after = os.getloadavg()
    table = {
        client: {c: figures(merge(results)) for c, results in by_c.items()}
        for client, by_c in runs.items()
    }
    scopes = {client: next(iter(by_c.values()))[0].cpu_scope for client, by_c in runs.items()}
    verdicts = targets(table)
    busiest = max(load_before[0], load_after[0])
    if busiest > 0.5 * len(cpus):
        verdicts = (
            f"Load average reached {busiest:.1f} on {len(cpus)} CPUs: the lines below say what "
            "this run measured; they are not claims that a target is met or missed.\n\n" + verdicts
        )
    parts = (report(table, scopes, failures), ratios(table), verdicts)
    text = "\n\n".join(part for part in parts if part)
    print(text)
    if args.no_record:
        return
    command = "python bench/harness.py " + shlex.join(argv)
    pin_text = (
        f"server on CPU {server_cpu}, each client on CPU {client_cpu}" if pinned else "not pinned"
    )
    section = f"""
## Client fidelity against the calibration server (issue 13)

Taken {started:%Y-%m-%d %H:%M} UTC on {machine()}. {args.label}
Load average (1/5/15 min) {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f} before,
{load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f} after; {pin_text}.
Calibration server: TTFT {args.ttft_ms} ms, inter-token {args.itl_ms} ms, {args.tokens} tokens;
{args.repeats} repeats pooled, the first c requests of each run left out.

```
{command}
```

{text}
"""
    with RESULTS.open("a") as results:
        results.write(section)


if __name__ == "__main__":
    main()
