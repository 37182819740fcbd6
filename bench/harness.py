"""Issue 13's benchmarks in one invocation: every part measured in one run, one record.

``just bench-harness`` runs these sections, each as child processes, and prints their figures,
then ONE table of every target of the issue with ours, the floor or best peer, the ratio and
met / missed (by how much); it appends all of it with the command, date, machine and load
average to ``bench/RESULTS.md`` (``--no-record`` skips; ``--quick`` never records):

* ``fidelity`` (items 1-3): ours, the bare floors (h11 on trio; aiohttp) and each installed
  peer (AIPerf, GuideLLM) against the calibration server (``bench/calibration_server.py``),
  which stamps on CLOCK_MONOTONIC when it received each request and wrote each event. The
  server runs on one CPU, each client as its own process on another. Per client and
  concurrency (closed loop): TTFT and TPOT error against the server's truth of that very
  request (median, p99, max), client time above truth, client CPU per streamed request
  (``getrusage`` around the load for ours and the floors; the whole process tree, start-up
  included, for peers), achieved requests/s; the server's own lateness against its schedule,
  and for the floors the TTFT error split into send-to-receipt and write-to-read (client and
  server share CLOCK_MONOTONIC). Then sustained capacity: each client against an unpaced
  server. The first ``c`` requests of each run (the closed loop's ramp) are left out; samples
  of all repeats are pooled.
* ``overhead`` (item 4) and ``calibration`` (item 7): one real run, the demo's quick plan
  (``python -m cache_family.oracles.demo --quick``), read back: per-cell overhead and
  marker-to-ready from its journals (``bench/cell_overhead.py --json``); the matrix's
  ``client_calibration`` and the rungs flagged near it or with first content only in the
  final event, from its receipts.
* ``pins`` (item 5): ``bench/pins_bench.py``, a 100 GiB sparse multi-shard model.
* ``journal`` (item 6): ``bench/journal_bench.py``, appends, durable transitions, replay.
* ``million`` (item 6): ``bench/million_cell.py``, a 1,000,000-request cell.

    just bench-harness                       # everything, recorded (22 min on 2 busy CPUs)
    just bench-harness --quick --no-record   # a smoke of every section (7 min on 2 busy CPUs)
    just bench-harness --only fidelity --clients ours bare --concurrency 1 64
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _results import RESULTS, format_load, load_average, machine, read_figures
from _results import append as append_results
from _results import section as results_section

BENCH = Path(__file__).resolve().parent
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
    # Where a client exports its own CLOCK_MONOTONIC stamps (the floors): the TTFT error split
    # into client start to server receipt and server write to client read, in ms.
    send_to_receipt: float | None = None
    write_to_read: float | None = None
    # Of send_to_receipt, the part after the client's send returned (the h11 floor stamps it):
    # the request waits in the server's accept queue and socket until the server reads it.
    sent_to_receipt: float | None = None


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
    # The server's first content after its schedule (receipt + TTFT), ms, ramp left out.
    server_late: list[float] = field(default_factory=list)


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


def _own_rows(
    stdout: str, result: RunResult, ramp: int, stamps: list[dict[str, Any]] | None = None
) -> None:
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    summary = lines.pop()
    result.cpu_s, result.cpu_requests = summary["cpu_s"], summary["requests"]
    result.wall_s = summary.get("wall_s", 0.0)
    result.requests = len(lines)
    by_seq = {s["seq"]: s for s in stamps or ()}
    for index, row in enumerate(lines):
        if "error" in row:
            result.errors += 1
            continue
        if index < ramp:
            continue
        prompt_ms, predicted_ms = row["server_prompt_ms"], row["server_predicted_ms"]
        sample = Sample(
            ttft=row["ttft_ms"],
            latency=row["latency_ms"],
            tpot=row["tpot_ms"],
            truth_ttft=prompt_ms,
            truth_latency=prompt_ms + predicted_ms,
            truth_tpot=predicted_ms / max(row["tokens"] - 1, 1),
        )
        truth = by_seq.get(row.get("seq"))
        if truth is not None and row.get("first_ns") is not None:
            sample.send_to_receipt = (truth["received_ns"] - row["start_ns"]) / 1e6
            sample.write_to_read = (row["first_ns"] - truth["first_content_ns"]) / 1e6
            if row.get("sent_ns") is not None:
                sample.sent_to_receipt = (truth["received_ns"] - row["sent_ns"]) / 1e6
        result.samples.append(sample)


def run_ours(url: str, c: int, n: int, tokens: int, cpu: int | None, stamps: Any) -> RunResult:
    argv = [sys.executable, str(Path(__file__)), "ours-client", url, str(c), str(n), str(tokens)]
    stdout, _tree_cpu = _run_child(argv, cpu)
    result = RunResult()
    _own_rows(stdout, result, c, stamps())
    return result


def run_bare(url: str, c: int, n: int, tokens: int, cpu: int | None, stamps: Any) -> RunResult:
    argv = [sys.executable, str(BENCH / "bare_client.py"), "--url", url]
    argv += ["--concurrency", str(c), "--requests", str(n), "--tokens", str(tokens)]
    argv += ["--prompt", PROMPT]
    stdout, _tree_cpu = _run_child(argv, cpu)
    result = RunResult()
    _own_rows(stdout, result, c, stamps())
    return result


def run_bare_aiohttp(
    url: str, c: int, n: int, tokens: int, cpu: int | None, stamps: Any
) -> RunResult:
    python = BENCH / ".venv-aiperf" / "bin" / "python"
    if not python.exists():
        raise RuntimeError("bench/.venv-aiperf is missing (its aiohttp runs this floor)")
    argv = [str(python), str(BENCH / "bare_aiohttp.py"), "--url", url]
    argv += ["--concurrency", str(c), "--requests", str(n), "--tokens", str(tokens)]
    argv += ["--prompt", PROMPT]
    stdout, _tree_cpu = _run_child(argv, cpu)
    result = RunResult()
    _own_rows(stdout, result, c, stamps())
    return result


def ours_client(url: str, c: int, n: int, tokens: int) -> None:
    """Child side of ``run_ours``: the product's load client through its public API."""
    import resource

    import trio

    from cache_family.actors.run.load import LoadRun
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
    def __init__(
        self, ttft_ms: float, itl_ms: float, tokens: int, cpu: int | None, accept: str = "drain"
    ) -> None:
        self.ttft_ms = ttft_ms
        argv = [sys.executable, str(BENCH / "calibration_server.py"), "--port", "0"]
        argv += ["--accept", accept]
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

    def lateness(self, stamps: list[dict[str, Any]], ramp: int) -> list[float]:
        """Each request's first content after its schedule, ms; the ramp's requests left out."""
        served = sorted(
            (s for s in stamps if s.get("first_content_ns") is not None),
            key=lambda s: s["received_ns"],
        )
        late = [(s["first_content_ns"] - s["received_ns"]) / 1e6 - self.ttft_ms for s in served]
        return late[ramp:]

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
    send = [x.send_to_receipt for x in s if x.send_to_receipt is not None]
    read = [x.write_to_read for x in s if x.write_to_read is not None]
    queued = [x.sent_to_receipt for x in s if x.sent_to_receipt is not None]
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
        "server_late_p50": percentile(result.server_late, 50),
        "server_late_p99": percentile(result.server_late, 99),
        "send_receipt_p50": percentile(send, 50),
        "send_receipt_p99": percentile(send, 99),
        "sent_receipt_p50": percentile(queued, 50),
        "sent_receipt_p99": percentile(queued, 99),
        "write_read_p50": percentile(read, 50),
        "write_read_p99": percentile(read, 99),
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
        merged.server_late += r.server_late
    return merged


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:,.{digits}f}"


Table = dict[str, dict[int, dict[str, float]]]


def report(table: Table, scopes: dict[str, str], failures: dict[str, str]) -> str:
    lines = [
        "| client | c | n | TTFT err p50 / p99 / max | TPOT err p50 / p99 / max | "
        "above truth p50 / p90 / p99 | CPU ms/req | req/s | server late p50 / p99 |",
        "|---|---:|---:|---|---|---|---:|---:|---|",
    ]
    for client, by_c in table.items():
        for c, f in sorted(by_c.items()):
            lines.append(
                f"| {client} | {c} | {int(f['n'])}"
                + (f" ({int(f['errors'])} failed)" if f["errors"] else "")
                + f" | {_fmt(f['ttft_err_p50'])} / {_fmt(f['ttft_err_p99'])} / "
                f"{_fmt(f['ttft_err_max'])} | {_fmt(f['tpot_err_p50'])} / "
                f"{_fmt(f['tpot_err_p99'])} / {_fmt(f['tpot_err_max'])} | "
                f"{_fmt(f['above_p50'])} / {_fmt(f['above_p90'])} / {_fmt(f['above_p99'])} | "
                f"{_fmt(f['cpu_ms_per_request'])} | {_fmt(f['requests_per_s'])} | "
                f"{_fmt(f['server_late_p50'])} / {_fmt(f['server_late_p99'])} |"
            )
    lines.append("")
    lines.append(
        "All figures in ms except req/s. Server late: the calibration server's first content "
        "after its own schedule (receipt + TTFT); when it is large the server's core, not the "
        "client, set the pace. CPU scope: "
        + ", ".join(f"{k}: {v}" for k, v in scopes.items())
        + "."
    )
    split = [
        (client, c, f)
        for client, by_c in table.items()
        for c, f in sorted(by_c.items())
        if not math.isnan(f["send_receipt_p50"])
    ]
    if split:
        lines += [
            "",
            "TTFT error of the floors split on the shared CLOCK_MONOTONIC: client start to the "
            "server's receipt of the headers (connect, send, and the server's accept and read "
            "of a request), and the server's write of the first content to the client's read "
            "of it. Of the first, the h11 floor also stamps when its send returned: from there "
            "the request waits in the server's accept queue and socket (server side).",
            "",
            "| client | c | TTFT err p50 / p99 | start to receipt p50 / p99 | "
            "of it, sent to receipt p50 / p99 | write to read p50 / p99 |",
            "|---|---:|---|---|---|---|",
        ]
        for client, c, f in split:
            lines.append(
                f"| {client} | {c} | {_fmt(f['ttft_err_p50'])} / {_fmt(f['ttft_err_p99'])} | "
                f"{_fmt(f['send_receipt_p50'])} / {_fmt(f['send_receipt_p99'])} | "
                f"{_fmt(f['sent_receipt_p50'])} / {_fmt(f['sent_receipt_p99'])} | "
                f"{_fmt(f['write_read_p50'])} / {_fmt(f['write_read_p99'])} |"
            )
    if any(64 in by_c for by_c in table.values()):
        lines += ["", C64_NEEDS]
    for client, why in failures.items():
        lines.append(f"\n**{client} did not run:** {why}")
    return "\n".join(lines)


C64_NEEDS = (
    "At c=64 the TTFT error measures the client only if the server reads each request as it "
    "arrives: its receipt stamp starts the truth, so every millisecond a request waits in the "
    "server's accept queue counts as client error (the floors' split above shows how much). "
    "With TTFT 50 ms and 15 intervals of 10 ms, 64 streams offer 320 new connections and "
    "5,440 events a second to a Python server on one core. A run that can judge the 1 ms "
    "target needs that core to itself (no other load on the machine), the client on another "
    "idle core, and a server that keeps its receipt lag under 0.1 ms at that rate (its "
    "sent-to-receipt p99 above says whether it did); on 2 shared CPUs it does not, and the "
    "floor misses the target too."
)


def capacity_report(capacity: dict[str, float], c: int, n: int) -> str:
    if not capacity:
        return ""
    lines = [
        f"Sustained capacity: each client alone against an unpaced calibration server (TTFT 0, "
        f"inter-token 0), closed loop c={c}, one run of {n} requests, requests/s over the "
        "client's own span of requests (peers' start-up left out); the server's core bounds "
        "the fastest clients alike:",
        "",
        "| client | req/s |",
        "|---|---:|",
    ]
    lines += [f"| {client} | {_fmt(rate, 1)} |" for client, rate in capacity.items()]
    return "\n".join(lines)


def ratios(table: Table) -> str:
    if "bare" not in table:
        return ""
    lines = [
        "Ratios to the h11 floor (`bare`):",
        "",
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


# --- sections -------------------------------------------------------------------------------------


@dataclass
class Part:
    """One section's outcome: its Markdown, the figures the targets read, and its failure."""

    name: str
    title: str
    text: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Sizes:
    """How big each section runs; ``FULL`` is the recorded run, ``QUICK`` a smoke of each."""

    repeats: int
    concurrency: tuple[int, ...]
    requests: int  # per fidelity run; 0: max(40, 5 c)
    capacity_c: int
    capacity_requests: int
    pins: tuple[str, ...]
    journal: tuple[str, ...]
    million: int


FULL = Sizes(
    repeats=3,
    concurrency=CONCURRENCIES,
    requests=0,
    capacity_c=32,
    capacity_requests=400,
    pins=("--model-gib", "100", "--shards", "8", "--hash-gib", "4", "--cells", "4"),
    journal=("--appends", "200000", "--durable", "200", "--rounds", "9"),
    million=1_000_000,
)
QUICK = Sizes(
    repeats=1,
    concurrency=(1, 64),
    requests=0,
    capacity_c=16,
    capacity_requests=100,
    pins=("--model-gib", "100", "--shards", "8", "--hash-gib", "0.25", "--cells", "4"),
    journal=("--appends", "20000", "--durable", "50", "--rounds", "3"),
    million=50_000,
)
# journal_bench's own cell is the million section's job; it still runs one, kept small.
JOURNAL_CELL = ("--cell-requests", "20000")
SECTIONS = ("fidelity", "overhead", "pins", "journal", "million", "calibration")


def _script_env() -> dict[str, str]:
    """What a benchmark script needs: the real HOME holds the cached native parts."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    for name in ("HOME", "TMPDIR"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def run_script(argv: Sequence[str], timeout: float, cwd: Path | None = None) -> str:
    """A benchmark script's stdout; RuntimeError with its stderr's tail when it fails."""
    try:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            env=_script_env(),
            cwd=cwd,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{shlex.join(argv[:3])} ... ran past {timeout:.0f} s") from exc
    if done.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(argv[:3])} ... exited {done.returncode}: "
            f"{(done.stderr or done.stdout)[-1500:]}"
        )
    return done.stdout


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _search(pattern: str, text: str) -> re.Match[str] | None:
    return re.search(pattern, text, re.MULTILINE)


def _numeric_figures(stdout: str) -> dict[str, float] | None:
    """The numbers of a script's ``bench-figures`` line; None when it printed none."""
    figures = read_figures(stdout)
    if figures is None:
        return None
    return {k: float(v) for k, v in figures.items() if isinstance(v, int | float)}


def parse_journal(stdout: str) -> dict[str, float]:
    """journal_bench's figures: its ``bench-figures`` line, else its prose lines."""
    if (figures := _numeric_figures(stdout)) is not None:
        return figures
    out: dict[str, float] = {}
    if m := _search(r"non-durable appends: ours ([\d,.]+)/s, plain write ([\d,.]+)/s", stdout):
        out["appends_per_s"], out["plain_appends_per_s"] = _number(m[1]), _number(m[2])
    if m := _search(r"^replay.*?([\d,.]+) lines/s", stdout):
        out["replay_lines_per_s"] = _number(m[1])
    if m := _search(r"durable transitions: ours ([\d,.]+)/s, write\+fsync ([\d,.]+)/s", stdout):
        out["durable_per_s"], out["plain_durable_per_s"] = _number(m[1]), _number(m[2])
    return out


def parse_pins(stdout: str) -> dict[str, float]:
    """pins_bench's figures: its ``bench-figures`` line, else its prose lines."""
    if (figures := _numeric_figures(stdout)) is not None:
        return figures
    out: dict[str, float] = {}
    if m := _search(r"full hash: ([\d.]+) GiB/s", stdout):
        out["hash_gib_per_s"] = _number(m[1])
    if m := _search(r"the ([\d.]+) GiB model", stdout):
        out["model_gib"] = _number(m[1])
    if m := _search(r"per cell.*?full re-hash ([\d,.]+) s, identity checks ([\d,.]+) ms", stdout):
        out["rehash_per_cell_s"], out["identity_per_cell_ms"] = _number(m[1]), _number(m[2])
    return out


def parse_million(stdout: str) -> dict[str, float]:
    """million_cell's ``bench-figures`` line (it always prints one; its prose changes with
    what it drives)."""
    return _numeric_figures(stdout) or {}


def _bullets(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.strip()]
    return "\n".join(f"- {line}" for line in lines if not line.startswith("bench-figures: "))


def pins_part(sizes: Sizes) -> Part:
    part = Part("pins", "Pin cost per cell, 100 GiB sparse multi-shard model (item 5)")
    stdout = run_script([sys.executable, str(BENCH / "pins_bench.py"), *sizes.pins], 3600)
    part.text = f"`pins_bench.py {shlex.join(sizes.pins)}`:\n\n{_bullets(stdout)}"
    part.figures = parse_pins(stdout)
    return part


def journal_part(sizes: Sizes) -> Part:
    part = Part("journal", "Journal and replay at scale (item 6)")
    args = (*sizes.journal, *JOURNAL_CELL)
    # journal_bench puts its scratch files in its working directory.
    with tempfile.TemporaryDirectory(prefix="harness-journal-") as tmp:
        stdout = run_script(
            [sys.executable, str(BENCH / "journal_bench.py"), *args], 3600, cwd=Path(tmp)
        )
    part.text = f"`journal_bench.py {shlex.join(args)}`:\n\n{_bullets(stdout)}"
    part.figures = parse_journal(stdout)
    return part


def million_part(sizes: Sizes) -> Part:
    part = Part("million", f"A {sizes.million:,}-request cell (item 6)")
    with tempfile.TemporaryDirectory(prefix="harness-million-") as tmp:
        args = ("--requests", str(sizes.million), "--dir", tmp)
        stdout = run_script([sys.executable, str(BENCH / "million_cell.py"), *args], 3600)
    part.text = f"`million_cell.py --requests {sizes.million}`:\n\n{_bullets(stdout)}"
    part.figures = parse_million(stdout)
    return part


def run_dirs(out: Path) -> list[Path]:
    return [out / name for name in ("full-gguf", "use-cases") if (out / name).is_dir()]


def run_demo(out: Path) -> tuple[list[Path], str]:
    """The demo's quick plan, a real run on the real parts: its run directories, and why it
    failed when it did (a failed step still leaves journals and receipts worth reading)."""
    argv = [sys.executable, "-m", "cache_family.oracles.demo", "--quick", "--quiet", str(out)]
    failed = ""
    try:
        run_script(argv, 1800)
    except RuntimeError as exc:
        failed = str(exc)
    runs = run_dirs(out)
    if not runs:
        raise RuntimeError(failed or f"the demo wrote no run directory under {out}")
    return runs, failed


def overhead_summary(per_run: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Cells of every run pooled: median and max overhead and marker-to-ready, ms."""
    cells = [cell for run in per_run for cell in run.get("per_cell", [])]
    out: dict[str, float] = {"cells": float(len(cells))}
    for key in ("overhead_ms", "marker_to_ready_ms", "startup_ms", "load_ms", "span_ms"):
        values = [float(c[key]) for c in cells if c.get(key) is not None]
        if values:
            out[f"{key}_median"] = statistics.median(values)
            out[f"{key}_max"] = max(values)
    return out


def overhead_part(runs: list[Path]) -> Part:
    part = Part("overhead", "Per-cell overhead and marker-to-ready of a real run (item 4)")
    argv = [sys.executable, str(BENCH / "cell_overhead.py"), *map(str, runs), "--json"]
    stdout = run_script(argv, 600)
    per_run = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    part.figures = overhead_summary(per_run)
    f = part.figures
    lines = [
        f"The demo's quick plan ({', '.join(r.name for r in runs)}), "
        f"{int(f['cells'])} host cells pooled, from `cell_overhead.py --json`:",
        "",
        "| figure | median ms | max ms |",
        "|---|---:|---:|",
    ]
    for key in ("overhead_ms", "marker_to_ready_ms", "startup_ms", "load_ms", "span_ms"):
        lines.append(
            f"| {key.removesuffix('_ms')} | {_fmt(f.get(f'{key}_median', math.nan), 1)} | "
            f"{_fmt(f.get(f'{key}_max', math.nan), 1)} |"
        )
    states: dict[str, list[float]] = {}
    for run in per_run:
        for cell_states in run.get("per_cell_states", []):
            for state, spent in cell_states.items():
                states.setdefault(state, []).append(float(spent))
    if states:
        lines += [
            "",
            "Time in cell states, median ms: "
            + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in states.items()),
        ]
    part.text = "\n".join(lines)
    return part


def calibration_figures(runs: list[Path]) -> dict[str, Any]:
    """Item 7 read from the receipts: each matrix's ``client_calibration``, and the rungs of
    every cell flagged near it or holding requests whose first content came with the final
    event."""
    out: dict[str, Any] = {"runs": len(runs), "calibrated_runs": 0, "calibrations": []}
    rungs = flagged = unknown = final_only = 0
    for run in runs:
        matrix = json.loads((run / "cache-family-matrix.json").read_text())
        calibration = matrix.get("client_calibration")
        if calibration:
            out["calibrated_runs"] += 1
            out["calibrations"].append(calibration)
        for cell in sorted(run.glob("cell-*/*/cell.json")):
            measurement = json.loads(cell.read_text()).get("measurement") or {}
            for rung in measurement.get("rungs", []):
                rungs += 1
                near = rung.get("near_client_overhead")
                flagged += near is True
                unknown += near is None
                final_only += len(rung.get("first_content_with_final_ids") or ())
    out |= {"rungs": rungs, "flagged_rungs": flagged, "unflagged_unknown": unknown}
    out["final_event_requests"] = final_only
    return out


def calibration_part(runs: list[Path]) -> Part:
    part = Part("calibration", "Self-calibration receipt of a real run (item 7)")
    f = calibration_figures(runs)
    part.figures = f
    lines = [f"The demo's quick plan ({', '.join(r.name for r in runs)}):", ""]
    for run, calibration in zip(runs, f["calibrations"], strict=False):
        keys = ("overhead_p50_ms", "overhead_p90_ms", "overhead_max_ms", "ttft_error_p50_ms")
        lines.append(
            f"- {run.name}: `client_calibration` "
            + ", ".join(f"{k} {_fmt(calibration.get(k))}" for k in keys)
            + f" ({calibration.get('requests')} requests, near factor "
            f"{calibration.get('near_factor')})"
        )
    lines.append(
        f"- {f['calibrated_runs']} of {f['runs']} matrices record `client_calibration`; "
        f"{f['flagged_rungs']} of {f['rungs']} rungs flagged `near_client_overhead` "
        f"({f['unflagged_unknown']} without the figure: serial rungs or none measured); "
        f"{f['final_event_requests']} requests whose first content came only with the final "
        "event (`first_content_with_final_ids`)"
    )
    part.text = "\n".join(lines)
    return part


def fidelity_part(args: argparse.Namespace, sizes: Sizes) -> Part:
    part = Part("fidelity", "Client fidelity and cost against the calibration server (items 1-3)")
    cpus = sorted(os.sched_getaffinity(0))
    pinned = not args.no_pin and len(cpus) >= 2
    server_cpu, client_cpu = (cpus[0], cpus[1]) if pinned else (None, None)
    concurrency = tuple(args.concurrency or sizes.concurrency)
    repeats = args.repeats or sizes.repeats
    runs: dict[str, dict[int, list[RunResult]]] = {}
    capacity_runs: dict[str, list[RunResult]] = {}
    failures: dict[str, str] = {}

    def measure(server: Server, client: str, c: int, n: int) -> RunResult | None:
        got: list[dict[str, Any]] = []

        def stamps() -> list[dict[str, Any]]:
            if not got:
                got.extend(server.take_stamps())
            return got

        server.take_stamps()
        try:
            result = CLIENTS[client](server.url, c, n, args.tokens, client_cpu, stamps)
        except (RuntimeError, OSError, ImportError, KeyError, ValueError) as exc:
            failures[client] = f"{type(exc).__name__}: {exc}"[:3000]
            print(f"{client} c={c}: FAILED {failures[client][:500]}", file=sys.stderr)
            return None
        result.server_late = server.lateness(stamps(), c)
        return result

    server = Server(args.ttft_ms, args.itl_ms, args.tokens, server_cpu, args.server_accept)
    try:
        for repeat in range(repeats):
            for client in args.clients:
                for c in concurrency:
                    if client in failures:
                        break
                    n = args.requests or sizes.requests or max(40, 5 * c)
                    began = time.monotonic()
                    result = measure(server, client, c, n)
                    if result is None:
                        break
                    runs.setdefault(client, {}).setdefault(c, []).append(result)
                    f = figures(result)
                    print(
                        f"repeat {repeat + 1} {client} c={c}: n={int(f['n'])} "
                        f"ttft err p50 {_fmt(f['ttft_err_p50'])} p99 {_fmt(f['ttft_err_p99'])} "
                        f"above p50 {_fmt(f['above_p50'])} cpu/req "
                        f"{_fmt(f['cpu_ms_per_request'])} server late p99 "
                        f"{_fmt(f['server_late_p99'])} ({time.monotonic() - began:.0f} s) "
                        f"{result.note}",
                        file=sys.stderr,
                    )
    finally:
        server.stop()
    if sizes.capacity_requests:
        unpaced = Server(0.0, 0.0, args.tokens, server_cpu, args.server_accept)
        try:
            # One run a client: a peer's start-up costs more than its run, and a capacity
            # figure is a rate over hundreds of requests, not a tail.
            for client in args.clients:
                if client in failures:
                    continue
                began = time.monotonic()
                result = measure(unpaced, client, sizes.capacity_c, sizes.capacity_requests)
                if result is not None:
                    capacity_runs.setdefault(client, []).append(result)
                    print(
                        f"capacity {client} c={sizes.capacity_c}: "
                        f"{_fmt(figures(result)['requests_per_s'], 1)} req/s "
                        f"({time.monotonic() - began:.0f} s)",
                        file=sys.stderr,
                    )
        finally:
            unpaced.stop()
    table = {
        client: {c: figures(merge(results)) for c, results in by_c.items()}
        for client, by_c in runs.items()
    }
    capacity = {
        client: figures(merge(results))["requests_per_s"]
        for client, results in capacity_runs.items()
    }
    scopes = {client: next(iter(by_c.values()))[0].cpu_scope for client, by_c in runs.items()}
    pin_text = (
        f"server on CPU {server_cpu}, each client on CPU {client_cpu}" if pinned else "not pinned"
    )
    head = (
        f"Calibration server: TTFT {args.ttft_ms} ms, inter-token {args.itl_ms} ms, "
        f"{args.tokens} tokens, listener `--accept {args.server_accept}`; {pin_text}; "
        f"concurrency {', '.join(map(str, concurrency))}; "
        f"{repeats} repeat(s) pooled, the first c requests of each run left out."
    )
    pieces = (
        head,
        report(table, scopes, failures),
        ratios(table),
        capacity_report(capacity, sizes.capacity_c, sizes.capacity_requests),
    )
    part.text = "\n\n".join(p for p in pieces if p)
    pace = {"ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms, "tokens": args.tokens}
    part.figures = {"table": table, "capacity": capacity, "failures": failures, "pace": pace}
    if failures:
        part.error = "; ".join(f"{k}: {v[:200]}" for k, v in failures.items())
    return part


# --- targets --------------------------------------------------------------------------------------


def _per_cpu_note(per_cpu: float | None) -> str:
    """On a shared machine the wall rate says what the process got, the CPU rate what the
    code costs; both are printed, the verdict stays on the wall rate."""
    return "" if per_cpu is None else f"{per_cpu:,.0f} per CPU second of the process"


@dataclass(frozen=True)
class Target:
    """One target of the issue judged on this run's figures.

    ``limit`` is what ``ours`` must not exceed (or, with ``higher_is_better``, must reach);
    ``reference`` is the floor or best peer it is compared with (the ratio's denominator).
    """

    item: str
    target: str
    unit: str
    ours: float | None
    limit: float | None
    reference: float | None = None
    reference_name: str = ""
    higher_is_better: bool = False
    note: str = ""

    def measured(self) -> bool:
        return self.ours is not None and not math.isnan(self.ours)

    def met(self) -> bool | None:
        if not self.measured() or self.limit is None or math.isnan(self.limit):
            return None
        assert self.ours is not None
        return self.ours >= self.limit if self.higher_is_better else self.ours <= self.limit

    def verdict(self) -> str:
        met = self.met()
        if not self.measured():
            return "not measured"
        if met is None:
            return "recorded (no limit measured)"
        if met:
            return "met"
        assert self.ours is not None and self.limit is not None
        gap = self.limit - self.ours if self.higher_is_better else self.ours - self.limit
        return f"**missed** by {_amount(gap, self.unit)}"

    def ratio(self) -> str:
        if not self.measured() or self.reference is None or math.isnan(self.reference):
            return "-"
        if not self.reference:
            return "-"
        assert self.ours is not None
        ratio = self.ours / self.reference
        return f"{ratio:.2f}x" if ratio >= 0.01 else f"{ratio:.1e}x"


def _amount(value: float | None, unit: str) -> str:
    if value is None or math.isnan(value):
        return "-"
    counted = unit in ("", "runs", "rungs") and float(value).is_integer()
    digits = 0 if abs(value) >= 100 or counted else 2
    return f"{value:,.{digits}f}{' ' + unit if unit else ''}"


def _get(mapping: Mapping[str, Any] | None, *keys: Any) -> float | None:
    value: Any = mapping
    for key in keys:
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return float(value) if isinstance(value, int | float) else None


def _best(values: Mapping[str, float | None]) -> tuple[float | None, str]:
    present = {k: v for k, v in values.items() if v is not None and not math.isnan(v)}
    if not present:
        return None, ""
    name = min(present, key=lambda k: present[k])
    return present[name], name


def build_targets(parts: Mapping[str, Part]) -> list[Target]:
    """Every target of issue 13 from the figures of the parts that ran."""
    out: list[Target] = []
    fid = parts.get("fidelity")
    table: Table = fid.figures.get("table", {}) if fid else {}
    capacity: dict[str, float] = fid.figures.get("capacity", {}) if fid else {}
    ours = table.get("ours", {})
    floors = {k: v for k, v in table.items() if k in FLOORS}
    peers = {k: v for k, v in table.items() if k != "ours" and k not in FLOORS}
    if fid:
        floor, floor_name = _best({k: _get(v, 1, "above_p50") for k, v in floors.items()})
        out.append(
            Target(
                "3",
                "c=1 client time above server truth, p50: within 0.2 ms of the floor",
                "ms",
                _get(ours, 1, "above_p50"),
                None if floor is None else floor + 0.2,
                floor,
                floor_name,
            )
        )
        for q in ("p90", "p99"):
            best, best_name = _best({k: _get(v, 1, f"above_{q}") for k, v in peers.items()})
            out.append(
                Target(
                    "3",
                    f"c=1 client time above server truth, {q}: at most the best peer's",
                    "ms",
                    _get(ours, 1, f"above_{q}"),
                    best,
                    best,
                    best_name,
                )
            )
        floor64 = _get(floors.get("bare"), 64, "ttft_err_p99")
        out.append(
            Target(
                "3",
                "c=64 TTFT error p99: at most 1 ms",
                "ms",
                _get(ours, 64, "ttft_err_p99"),
                1.0,
                floor64,
                "bare" if floor64 is not None else "",
                note=c64_note(fid.figures),
            )
        )
        cpu_floor, cpu_floor_name = _best(
            {k: _get(v, 1, "cpu_ms_per_request") for k, v in floors.items()}
        )
        out.append(
            Target(
                "3",
                "client CPU per streamed request (c=1): at most 1.2x the floor",
                "ms",
                _get(ours, 1, "cpu_ms_per_request"),
                None if cpu_floor is None else 1.2 * cpu_floor,
                cpu_floor,
                cpu_floor_name,
            )
        )
        peer_caps = {k: v for k, v in capacity.items() if k != "ours" and k not in FLOORS}
        best_cap_name = max(peer_caps, key=lambda k: peer_caps[k]) if peer_caps else ""
        best_cap = peer_caps.get(best_cap_name)
        out.append(
            Target(
                "3",
                "sustained capacity (unpaced server): at least the best peer's",
                "req/s",
                capacity.get("ours"),
                best_cap,
                best_cap,
                best_cap_name,
                higher_is_better=True,
            )
        )
    if over := parts.get("overhead"):
        f = over.figures
        out.append(
            Target("4", "per-cell overhead, median: at most 30 ms", "ms",
                   f.get("overhead_ms_median"), 30.0)
        )  # fmt: skip
        out.append(
            Target("4", "marker-to-ready, median: at most 5 ms", "ms",
                   f.get("marker_to_ready_ms_median"), 5.0)
        )  # fmt: skip
    if pins := parts.get("pins"):
        f = pins.figures
        rehash_ms = f.get("rehash_per_cell_s")
        rehash_ms = None if rehash_ms is None else rehash_ms * 1000
        out.append(
            Target(
                "5",
                f"pin cost per cell, {_amount(f.get('model_gib'), 'GiB')} model: identity "
                "checks, at most 1% of re-hashing it (does not scale with model size)",
                "ms",
                f.get("identity_per_cell_ms"),
                None if rehash_ms is None else rehash_ms / 100,
                rehash_ms,
                "full re-hash per cell",
            )
        )
    if journal := parts.get("journal"):
        f = journal.figures
        out.append(
            Target("6", "non-durable appends: at least 200,000/s", "/s",
                   f.get("appends_per_s"), 200_000.0, f.get("plain_appends_per_s"),
                   "plain write loop", higher_is_better=True,
                   note=_per_cpu_note(f.get("appends_per_cpu_s")))
        )  # fmt: skip
        plain = f.get("plain_durable_per_s")
        out.append(
            Target("6", "durable transitions: at least 0.8x a write+fsync loop", "/s",
                   f.get("durable_per_s"), None if plain is None else 0.8 * plain, plain,
                   "write+fsync loop", higher_is_better=True)
        )  # fmt: skip
        out.append(
            Target("6", "replay: at least 200,000 lines/s", "lines/s",
                   f.get("replay_lines_per_s"), 200_000.0, higher_is_better=True,
                   note=_per_cpu_note(f.get("replay_lines_per_cpu_s")))
        )  # fmt: skip
    if million := parts.get("million"):
        f = million.figures
        peak = max(
            (v for v in (f.get("run_rss_mib"), f.get("replay_rss_mib")) if v is not None),
            default=None,
        )
        out.append(
            Target(
                "6",
                f"a {_amount(f.get('requests'), '')}-request cell runs, folds and replays in "
                f"bounded memory: peak RSS at most {MILLION_RSS_BOUND_MIB} MiB",
                "MiB",
                peak,
                float(MILLION_RSS_BOUND_MIB),
                note=(
                    f"run {_amount(f.get('run_s'), 's')}, replay {_amount(f.get('replay_s'), 's')}"
                    if f
                    else ""
                ),
            )
        )
    if cal := parts.get("calibration"):
        f = cal.figures
        runs = f.get("runs") or 0
        out.append(
            Target(
                "7",
                "client overhead measured and recorded in every matrix receipt",
                "runs",
                float(f.get("calibrated_runs", 0)),
                float(runs),
                higher_is_better=True,
                note=f"{f.get('calibrated_runs')} of {runs} matrices",
            )
        )
        rungs = f.get("rungs") or 0
        out.append(
            Target(
                "7",
                "every concurrent rung judged against it (near_client_overhead set)",
                "rungs",
                float(rungs - f.get("unflagged_unknown", 0)),
                None,
                note=(
                    f"{f.get('flagged_rungs')} of {rungs} rungs flagged near the overhead; "
                    f"{f.get('final_event_requests')} requests with first content only in the "
                    "final event flagged"
                ),
            )
        )
    return out


def c64_note(figures: Mapping[str, Any]) -> str:
    """Why the floor's c=64 TTFT error is what it is: how much of it waited on the server's
    side (after the floor's send returned, before the server read the request), and the load
    c=64 offers against what the floor sustained against an unpaced server."""
    floor = figures.get("table", {}).get("bare", {}).get(64)
    if not floor or math.isnan(floor["ttft_err_p99"]) or floor["ttft_err_p99"] <= 1.0:
        return ""
    note = f"the floor misses too, by {_amount(floor['ttft_err_p99'] - 1.0, 'ms')}"
    if not math.isnan(floor["sent_receipt_p99"]):
        note += (
            f", {_amount(floor['sent_receipt_p99'], 'ms')} of its p99 after its send returned "
            "and before the server read the request (server side)"
        )
    pace = figures.get("pace") or {}
    offered = pace and 64 / ((pace["ttft_ms"] + (pace["tokens"] - 1) * pace["itl_ms"]) / 1000)
    sustained = figures.get("capacity", {}).get("bare")
    if offered and sustained:
        note += (
            f"; c=64 at this pace offers {_amount(offered, 'req/s')}, the floor sustained "
            f"{_amount(sustained, 'req/s')} against an unpaced server: queueing, not timing"
        )
    return note


# The issue asks for bounded memory without a figure; this is the bound the harness judges
# (a million rows held inline would need several times it).
MILLION_RSS_BOUND_MIB = 512


def targets_table(targets: Sequence[Target]) -> str:
    lines = [
        "| item | target | ours | floor / best peer | ours / it | verdict |",
        "|---|---|---:|---|---:|---|",
    ]
    for t in targets:
        reference = "-"
        if t.reference is not None and not math.isnan(t.reference):
            reference = _amount(t.reference, t.unit) + (
                f" ({t.reference_name})" if t.reference_name else ""
            )
        verdict = t.verdict() + (f"; {t.note}" if t.note else "")
        ours = _amount(t.ours, t.unit) if t.measured() else "-"
        lines.append(f"| {t.item} | {t.target} | {ours} | {reference} | {t.ratio()} | {verdict} |")
    return "\n".join(lines)


# --- the run --------------------------------------------------------------------------------------


def combined(
    parts: Sequence[Part], targets: Sequence[Target], load_warning: str, quick: bool
) -> str:
    """Every part's figures, then the one table of targets (what is printed and recorded)."""
    lines = []
    if quick:
        lines += ["**Smoke sizes (`--quick`): not a measurement of any target.**", ""]
    for part in parts:
        lines += [f"### {part.title}", "", f"({part.seconds:.0f} s)", ""]
        if part.text:
            lines += [part.text, ""]
        if part.error:
            lines += [f"**Failed:** {part.error}", ""]
    lines += ["### Targets of issue 13", ""]
    if load_warning:
        lines += [load_warning, ""]
    lines += [targets_table(targets), ""]
    return "\n".join(lines)


def load_warning(before: Sequence[float], after: Sequence[float], cpus: int) -> str:
    busiest = max(before[0], after[0])
    if busiest <= 0.5 * cpus:
        return ""
    return (
        f"Load average reached {busiest:.1f} on {cpus} CPUs: other work shared the machine, so "
        "the verdicts below say what this run measured, not what a quiet machine would."
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ours-client"]:
        url, c, n, tokens = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
        ours_client(url, c, n, tokens)
        return 0
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated sections (default all: {','.join(SECTIONS)})",
    )
    parser.add_argument("--quick", action="store_true", help="smoke sizes; never recorded")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--label", default="", help="a line to record with the run")
    parser.add_argument("--demo-dir", type=Path, help="read this demo output instead of a run")
    parser.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS))
    parser.add_argument("--concurrency", nargs="+", type=int)
    parser.add_argument("--repeats", type=int, help="fidelity repeats (default 3; quick 1)")
    parser.add_argument("--ttft-ms", type=float, default=50.0)
    parser.add_argument("--itl-ms", type=float, default=10.0)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=0, help="per run; 0: max(40, 5 c)")
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument(
        "--server-accept",
        choices=("drain", "one"),
        default="drain",
        help="the calibration server's listener: every pending connection at each wake-up "
        "(drain) or trio's one a pass (one)",
    )
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    sizes = QUICK if args.quick else FULL
    sys.path.insert(0, str(BENCH))
    load_before = load_average()
    started = datetime.datetime.now(datetime.UTC)
    clock = time.monotonic()
    parts: dict[str, Part] = {}

    def run_part(name: str, build: Callable[[], Part]) -> None:
        print(f"harness: {name} ...", file=sys.stderr, flush=True)
        began = time.monotonic()
        try:
            part = build()
        except (RuntimeError, OSError, ValueError, KeyError) as exc:
            part = Part(name, name, error=f"{type(exc).__name__}: {exc}"[:2000])
        part.seconds = time.monotonic() - began
        parts[name] = part
        print(f"harness: {name} done in {part.seconds:.0f} s", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="harness-demo-") as scratch:
        demo_runs: list[Path] = []
        if {"overhead", "calibration"} & set(chosen):
            demo = args.demo_dir or Path(scratch) / "demo"

            def demo_part() -> Part:
                part = Part("demo", "The real run read by items 4 and 7")
                runs, part.error = (run_dirs(demo), "") if args.demo_dir else run_demo(demo)
                demo_runs.extend(runs)
                part.text = (
                    "`python -m cache_family.oracles.demo --quick` "
                    + ("(read from " + str(args.demo_dir) + ")" if args.demo_dir else "")
                    + f": runs {', '.join(r.name for r in runs)}"
                )
                return part

            run_part("demo", demo_part)
        for name in SECTIONS:
            if name not in chosen:
                continue
            if name == "fidelity":
                run_part(name, lambda: fidelity_part(args, sizes))
            elif name == "pins":
                run_part(name, lambda: pins_part(sizes))
            elif name == "journal":
                run_part(name, lambda: journal_part(sizes))
            elif name == "million":
                run_part(name, lambda: million_part(sizes))
            elif not demo_runs:
                parts[name] = Part(name, name, error="no real run to read (the demo failed)")
            elif name == "overhead":
                run_part(name, lambda: overhead_part(demo_runs))
            else:
                run_part(name, lambda: calibration_part(demo_runs))
    load_after = load_average()
    wall = time.monotonic() - clock
    targets = build_targets(parts)
    ordered = [parts[n] for n in ("demo", *SECTIONS) if n in parts]
    warning = load_warning(load_before, load_after, len(os.sched_getaffinity(0)))
    text = combined(ordered, targets, warning, args.quick)
    print(text)
    print(f"harness: all sections in {wall / 60:.1f} min", file=sys.stderr)
    if args.no_record or args.quick:
        return 1 if any(p.error for p in ordered) else 0
    notes = f"All sections in {wall / 60:.1f} min."
    if args.label:
        notes = f"{args.label}\n\n{notes}"
    append_results(
        results_section(
            "Issue 13 benchmarks, one run (`just bench-harness`)",
            text,
            command="python bench/harness.py " + shlex.join(argv) + " (`just bench-harness`)",
            when=started,
            machine_text=machine(),
            load_before=load_before,
            load_after=load_after,
            notes=notes,
        )
    )
    print(f"harness: recorded in {RESULTS} (load average {format_load(load_after)} after)")
    return 1 if any(p.error for p in ordered) else 0


if __name__ == "__main__":
    raise SystemExit(main())
