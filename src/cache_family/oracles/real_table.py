"""The README's real-model table, written by ``./bootstrap demo --real`` from its prefix-sweep
run's receipts: cold against hit prompt time per prefix length, with their spread, and the
native ladder; what the figures are is said beside them."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from cache_family.schemas.bounded import MIB, read_bounded

TABLE_NAME: Final = "real-model-table.md"
_RECEIPT_MAX_BYTES: Final = 16 * MIB
_REQUESTS_MAX_BYTES: Final = 64 * MIB


def _json(path: Path) -> Any:
    return json.loads(read_bounded(str(path), _RECEIPT_MAX_BYTES, what="receipt").data)


def spread(values: Sequence[float]) -> str:
    """``median (min-max, n)`` of a few samples, in ms; "n/a" without any."""
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.1f} (n=1)"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f}, n={len(values)})"


def _serial_prompt_ms(run_dir: Path, cell_dir: str) -> tuple[list[float], list[float], set[int]]:
    """The serial baseline's server prompt times: the excluded cold request's, the warm ones'
    and the cached-token counts of the warm ones."""
    cold: list[float] = []
    warm: list[float] = []
    reused: set[int] = set()
    path = run_dir / cell_dir / "requests.jsonl"
    if not path.is_file():
        return cold, warm, reused
    for line in read_bounded(str(path), _REQUESTS_MAX_BYTES, what="requests").data.splitlines():
        row = json.loads(line).get("row", {})
        timings = row.get("timings") or {}
        if row.get("status") != "completed" or timings.get("prompt_ms") is None:
            continue
        if row.get("excluded_warmup"):
            cold.append(float(timings["prompt_ms"]))
        else:
            warm.append(float(timings["prompt_ms"]))
            reused.add(int(timings.get("cache_n", 0)))
    return cold, warm, reused


def _ladder(row: dict[str, Any]) -> str:
    for observation in row.get("observations", []):
        if observation.get("arm") != "native-concurrent":
            continue
        rates = [
            f"c{summary['concurrency']} {summary['throughput_requests_per_sec']:.2f}"
            for rung in observation.get("rungs", [])
            if (summary := rung.get("rung_summary"))
            and summary.get("throughput_requests_per_sec") is not None
        ]
        return ", ".join(rates) or "n/a"
    return "n/a"


def _stage_times(run_dir: Path, row: dict[str, Any]) -> tuple[list[float], list[float]]:
    """The correctness oracle's full recompute and its cache-hit (import + decode) per repeat,
    from the first topology that passed."""
    correctness = row.get("correctness") or {}
    for topology in correctness.get("topologies", []):
        if topology.get("status") != "pass" or not topology.get("evidence_dir"):
            continue
        report = _json(run_dir / topology["evidence_dir"] / "state-handoff.json")
        recompute = [float(v) for v in report.get("recompute_ms") or [] if v is not None]
        hits = [
            float(a) + float(b)
            for a, b in zip(
                report.get("cache_hit_import_ms") or [],
                report.get("cache_hit_decode_ms") or [],
                strict=False,
            )
            if a is not None and b is not None
        ]
        return recompute, hits
    return [], []


def render_real_table(run_dir: Path) -> str:
    """The table of one run over the trained model's prefix sweep, one line per row."""
    matrix = _json(run_dir / "cache-family-matrix.json")
    lines = [
        "| prefix tokens | row | llama-server cold prompt ms | llama-server hit prompt ms "
        "| reused tokens | stage recompute ms | stage hit ms | native ladder req/s |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    evidence: list[str] = []
    for entry in matrix.get("rows", []):
        result = entry.get("result", {})
        if not result.get("evidence"):
            continue
        row = _json(run_dir / result["evidence"])
        if row.get("evidence_class"):
            evidence.append(str(row["evidence_class"]))
        serial = next(
            (o for o in row.get("observations", []) if o.get("arm") == "native-serial"), None
        )
        cold, warm, reused = (
            _serial_prompt_ms(run_dir, serial["cell_dir"])
            if serial and serial.get("cell_dir")
            else ([], [], set())
        )
        recompute, hits = _stage_times(run_dir, row)
        lines.append(
            f"| {entry.get('prefix_tokens')} | {result.get('status')} | {spread(cold)} "
            f"| {spread(warm)} | {', '.join(map(str, sorted(reused))) or 'n/a'} "
            f"| {spread(recompute)} | {spread(hits)} | {_ladder(row)} |"
        )
    notes = list(dict.fromkeys(evidence))
    lines += ["", *(f"Evidence: {text}." for text in notes)]
    return "\n".join(lines) + "\n"
