"""The Ray driver's added time per row: the same rows run directly and through ``campaign``.

    .venv/bin/python bench/campaign_driver.py [--prepared PATH] [--cases a,b,c]
        [--hosts 1,2,3] [--work DIR] [--json]

Without ``--prepared`` it prepares the zoo's full-GGUF rows of ``--cases`` (default three
presets) exactly as the demo does (real ``llama-server``, the reference workload oracles).
Then, on this machine:

* direct: each row alone, ``cache-family run --rows KEY``, one after another; the sum of their
  wall times is what the rows themselves cost;
* through the driver: ``cache-family campaign --ray local --hosts H`` for each H; the driver
  records its own times (``local-cluster.json``: cluster start, the rows, the merge).

The driver's added time per row is, with one node (rows one after another, as direct),
``(rows_seconds - direct sum) / rows``: Ray's scheduling, the task's worker and its polling,
everything but the cluster's start-up and the merge, which are per campaign and printed apart.
With more nodes the rows share this machine's cores, so the wall times show contention as much
as scale-out: the core count is printed beside them. Figures from tiny random-weight models
are plumbing timings, never performance claims.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = str(Path(sys.executable).parent / "cache-family")
DEFAULT_CASES = "qwen3_dense,llama,falcon_h1"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, check=False)


def prepare_zoo(work: Path, cases: tuple[str, ...]) -> Path:
    from cache_family.oracles import native_build
    from cache_family.oracles.demo import operator_input
    from cache_family.oracles.native_parts import ensure_parts

    parts = ensure_parts(sys.stderr)
    tools = work / "tools"
    native_build.install(tools, sys.stderr, tools=True)
    operator = work / "operator.json"
    operator.write_text(json.dumps(operator_input(parts, tools, cases), indent=2))
    prepared = work / "prep"
    done = _cli("prepare-full", "--input", str(operator), "--output", str(prepared))
    if done.returncode != 0:
        raise SystemExit(f"prepare-full failed:\n{done.stderr}")
    return prepared / "cache-family-input.json"


def direct(prepared: Path, work: Path) -> dict[str, object]:
    keys = _cli("run", "--input", str(prepared), "--dry-run").stdout.split()
    seconds: dict[str, float] = {}
    for index, key in enumerate(keys):
        started = time.monotonic()
        done = _cli("run", "--input", str(prepared), "--output", str(work / f"direct-{index}"),
                    "--rows", key, "--quiet")  # fmt: skip
        seconds[key] = time.monotonic() - started
        if done.returncode not in (0, 1):
            raise SystemExit(f"run --rows {key} exited {done.returncode}:\n{done.stderr}")
    return {"rows": len(keys), "per_row_seconds": seconds, "sum_seconds": sum(seconds.values())}


def through_driver(prepared: Path, work: Path, hosts: int) -> dict[str, object]:
    out = work / f"campaign-{hosts}"
    started = time.monotonic()
    done = _cli("campaign", "--input", str(prepared), "--output", str(out),
                "--ray", "local", "--hosts", str(hosts))  # fmt: skip
    wall = time.monotonic() - started
    if done.returncode not in (0, 1):
        raise SystemExit(f"campaign --hosts {hosts} exited {done.returncode}:\n{done.stderr}")
    evidence = json.loads((out / "local-cluster.json").read_text())
    return {
        "hosts": hosts,
        "wall_seconds": wall,
        "cluster_start_seconds": evidence["cluster_start_seconds"],
        "rows_seconds": evidence["rows_seconds"],
        "merge_seconds": evidence["merge_seconds"],
        "status": done.stdout.split(":", 1)[0] if done.stdout else "",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--prepared", type=Path)
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--hosts", default="1,2,3")
    parser.add_argument("--work", type=Path)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    # Short: Ray's unix socket paths must fit in 107 bytes.
    work = args.work or Path(tempfile.mkdtemp(prefix="cfb-"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    prepared = args.prepared or prepare_zoo(work, tuple(args.cases.split(",")))
    figures: dict[str, object] = {
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "direct": direct(prepared, work),
        "driver": [through_driver(prepared, work, int(h)) for h in args.hosts.split(",")],
    }
    figures["load_average_after"] = os.getloadavg()[0]
    base = figures["direct"]
    assert isinstance(base, dict)
    rows, direct_sum = int(base["rows"]), float(base["sum_seconds"])
    for run in figures["driver"]:  # type: ignore[attr-defined]
        if run["hosts"] == 1:
            figures["added_seconds_per_row"] = (run["rows_seconds"] - direct_sum) / rows
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"{rows} rows on {figures['cpus']} CPU(s); load average {load_before:.2f} before, "
          f"{figures['load_average_after']:.2f} after")  # fmt: skip
    print(f"direct (one after another): {direct_sum:.1f} s")
    for run in figures["driver"]:  # type: ignore[attr-defined]
        print(
            f"campaign --hosts {run['hosts']}: wall {run['wall_seconds']:.1f} s = cluster start "
            f"{run['cluster_start_seconds']:.1f} s + rows {run['rows_seconds']:.1f} s + merge "
            f"{run['merge_seconds']:.1f} s (+ admission and shutdown) [{run['status']}]"
        )
    if "added_seconds_per_row" in figures:
        print(f"driver's added time per row (1 node): {figures['added_seconds_per_row']:.2f} s")


if __name__ == "__main__":
    main()
