"""The demo's closing lines: one summary line per row and workload cell, from the receipts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

from cache_family.schemas.arms import HOST_ARMS

_ARM_LABELS = {arm.name: arm.label for arm in HOST_ARMS if not arm.serial}


def _arm_figures(row: dict[str, Any]) -> str:
    """Correctness, the serial warm median with its cache hits, each concurrent arm's rungs
    and the old/new parity, from row.json."""
    parts: list[str] = []
    for observation in row.get("observations", []):
        rungs: list[str] = []
        for rung in observation.get("rungs", []):
            serial = rung.get("serial_summary")
            summary = rung.get("rung_summary")
            if serial and serial.get("warm_median_ms") is not None:
                parts.append(
                    f"serial warm median {serial['warm_median_ms']:.1f} ms "
                    f"(cache_n min {serial.get('warm_cache_n_min')})"
                )
            elif summary and summary.get("throughput_requests_per_sec") is not None:
                rungs.append(
                    f"c{summary['concurrency']} {summary['throughput_requests_per_sec']:.1f} req/s"
                )
        if rungs:
            parts.append(f"{_ARM_LABELS.get(observation.get('arm'), '?')} {', '.join(rungs)}")
    parity = row.get("parity") or []
    if parity:
        accepted = sum(1 for p in parity if p.get("matches"))
        parts.append(
            f"parity {'accepted' if accepted == len(parity) else 'refused'} "
            f"({accepted}/{len(parity)} rungs)"
        )
    if not parts:
        reasons = {o.get("reason") for o in row.get("observations", []) if o.get("reason")}
        parts = sorted(str(r) for r in reasons) or [str(row.get("reason") or "")]
    correctness = row.get("correctness") or {}
    topologies = correctness.get("topologies") or []
    passed = sum(1 for t in topologies if t.get("status") == "pass")
    check = f"correctness {correctness.get('status')} ({passed}/{len(topologies)} topologies)"
    return "; ".join([check, *parts])


def summarize_run(run_dir: Path, progress: TextIO) -> None:
    matrix_path = run_dir / "cache-family-matrix.json"
    if not matrix_path.is_file():
        return
    matrix = json.loads(matrix_path.read_text())
    catalog = matrix.get("catalog") or {}
    label = (
        " (synthetic catalog: plumbing evidence, not performance claims)"
        if catalog.get("synthetic")
        else ""
    )
    print(f"\ndemo: {run_dir.name}: matrix status {matrix.get('status')}{label}", file=progress)
    for row in matrix.get("rows", []):
        result = row.get("result", {})
        figures = ""
        evidence = result.get("evidence")
        if evidence and (run_dir / evidence).is_file():
            figures = _arm_figures(json.loads((run_dir / evidence).read_text()))
        use_case = f" {row['use_case']}" if row.get("use_case") else ""
        print(
            f"  {row.get('case', '?'):<14}{use_case} p{row.get('prefix_tokens', '?'):<5} "
            f"{result.get('status', '?'):<11} {figures}",
            file=progress,
        )


def summarize_workloads(run_dir: Path, progress: TextIO) -> None:
    """Each workload cell's verdict, from its ``workload.json``."""
    for path in sorted(run_dir.glob("cell-*/workload-*/workload.json")):
        receipt = json.loads(path.read_text())
        points = [
            f"{p['hit_ratio_pct']}%->{p['achieved_ratio_pct'] or 0:.1f}%"
            + ("" if p["accepted"] else "(refused)")
            for p in receipt.get("overlap", [])
        ]
        rates = [
            f"{s['target_rate_per_s']:.1f}/s->{s['achieved_rate_per_s'] or 0:.1f}/s"
            + (f" stopped ({s['stop_reason']})" if s.get("stop_reason") else "")
            for s in receipt.get("open_loop", [])
            if s.get("stage") == "rate" and s.get("target_rate_per_s") is not None
        ]
        trace = receipt.get("trace") or {}
        if trace:
            efficiency = trace.get("efficiency")
            points.append(
                f"trace {trace.get('measured_requests', 0)} requests: reused "
                f"{trace.get('achieved_tokens', 0)} of {trace.get('designed_infinite_tokens', 0)}"
                " designed tokens" + ("" if efficiency is None else f" ({100 * efficiency:.1f}%)")
            )
        print(
            f"  {receipt['cell_id']:<28} {receipt['status']:<10} {' '.join(points + rates)}",
            file=progress,
        )
