"""Per-cell overhead and marker-to-ready, read from a run's journal.

For every cell (host session) of a run, from the journal's own ``mono_ns`` stamps:

* span: the cell's first journal line to its last (``cell_opened`` to the receipt);
* host start-up: the host's ``child_spawned`` to its ``ready``;
* marker-to-ready: ``listening_marker_seen`` to ``ready`` (the readiness client's share);
* load: the measured requests, the sum of the rungs' makespans plus a serial cell's excluded
  first request (its ``elapsed_ms``);
* overhead: span minus host start-up minus load, i.e. everything the harness itself spends on
  the cell (pin checks, the prompt cut, journaling, host cleanup, the receipt);
* the time spent in each cell state, from the ``transition`` records, so the overhead can be
  attributed (pin-verify and post-verify hash the pins; cleanup ends the host).

    .venv/bin/python bench/cell_overhead.py RUN_DIR [RUN_DIR ...] [--json]

RUN_DIR is a run directory (holding ``journal.jsonl``) or the journal itself. Only cells that
spawned a host are counted; the correctness arm's tool children are not cells. The medians
are also printed per cohort (``native``: llama-server; ``openai``: a stage server).

``--input PREPARED --rounds N`` runs instead ``cache-family run`` on the prepared input N times
into fresh directories under ``--work`` and reads those runs; with ``--base-src DIR`` (a
``src`` tree, e.g. ``git archive REV src``, put first on ``PYTHONPATH``) each round runs that
runner first and this checkout's second, and both are printed side by side (a before / after
in one run; the tools the runs start are the prepared input's either way):

    .venv/bin/python bench/cell_overhead.py --input DIR/cache-family-input.json --rounds 3 \
        --base-src /tmp/base/src --work /tmp/overhead [--append]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _results import format_load, load_average, record

from cache_family.schemas import request_rows
from cache_family.schemas.journal import (
    CellOpened,
    ChildSpawned,
    ListeningMarkerSeen,
    Ready,
    RungCompleted,
    RungRows,
    Transition,
    read_journal,
)


@dataclass
class Cell:
    cell_id: str
    cohort: str = ""  # native (llama-server) or openai (a stage server)
    first_ns: int = 0
    last_ns: int = 0
    spawned_ns: int | None = None
    marker_ns: int | None = None
    ready_ns: int | None = None
    load_s: float = 0.0
    states: dict[str, float] = field(default_factory=dict)
    _state: str | None = None
    _state_ns: int = 0

    def figures(self) -> dict[str, float | None]:
        span = (self.last_ns - self.first_ns) / 1e6
        startup = (
            (self.ready_ns - self.spawned_ns) / 1e6
            if self.ready_ns is not None and self.spawned_ns is not None
            else None
        )
        marker = (
            (self.ready_ns - self.marker_ns) / 1e6
            if self.ready_ns is not None and self.marker_ns is not None
            else None
        )
        load = self.load_s * 1000
        overhead = span - (startup or 0.0) - load
        return {
            "span_ms": span,
            "startup_ms": startup,
            "marker_to_ready_ms": marker,
            "load_ms": load,
            "overhead_ms": overhead,
        }


def cells_of(journal: Path) -> list[Cell]:
    read = read_journal(journal.read_bytes())
    cells: dict[str, Cell] = {}
    cell_dirs: dict[str, str] = {}
    for line in read.lines:
        record = line.record
        cell_id = getattr(record, "cell_id", None)
        if isinstance(record, CellOpened):
            cell_dirs[record.cell_id] = record.cell_dir
            # A cell opens in pin-verify; its first transition leaves it.
            cells[record.cell_id] = Cell(
                record.cell_id,
                record.cohort,
                line.mono_ns,
                line.mono_ns,
                _state="pin-verify",
                _state_ns=line.mono_ns,
            )
            continue
        if not isinstance(cell_id, str) or cell_id not in cells:
            continue
        cell = cells[cell_id]
        cell.last_ns = line.mono_ns
        if isinstance(record, ChildSpawned) and record.role == "host":
            cell.spawned_ns = line.mono_ns
        elif isinstance(record, ListeningMarkerSeen):
            cell.marker_ns = line.mono_ns
        elif isinstance(record, Ready):
            cell.ready_ns = line.mono_ns
        elif isinstance(record, RungCompleted):
            cell.load_s += record.makespan_seconds or 0.0
        elif isinstance(record, RungRows) and record.first_line == 0:
            # A serial cell's warmup request is the first line of its rows file.
            rows = journal.parent / cell_dirs[cell_id] / record.path
            with rows.open("rb") as stream:
                row = request_rows.DECODER.decode(stream.readline()).row
            if row.excluded_warmup and row.elapsed_ms is not None:
                cell.load_s += row.elapsed_ms / 1000
        elif isinstance(record, Transition) and record.machine == "cell":
            if cell._state is not None:
                spent = (line.mono_ns - cell._state_ns) / 1e6
                cell.states[cell._state] = cell.states.get(cell._state, 0.0) + spent
            cell._state, cell._state_ns = record.to_state, line.mono_ns
    return [cell for cell in cells.values() if cell.spawned_ns is not None]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summary(cells: list[Cell]) -> dict[str, object]:
    figures = [cell.figures() for cell in cells]
    out: dict[str, object] = {"cells": len(cells)}
    for key in ("span_ms", "startup_ms", "marker_to_ready_ms", "load_ms", "overhead_ms"):
        values = [f[key] for f in figures if f[key] is not None]
        out[key] = {
            "median": _median(values),  # type: ignore[arg-type]
            "min": min(values) if values else None,  # type: ignore[type-var]
            "max": max(values) if values else None,  # type: ignore[type-var]
        }
    states: dict[str, list[float]] = defaultdict(list)
    for cell in cells:
        for state, spent in cell.states.items():
            states[state].append(spent)
    out["state_median_ms"] = {state: _median(values) for state, values in states.items()}
    return out


def _fmt(value: object) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def _run_once(prepared: Path, out: Path, base_src: Path | None) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(out.parent), "LANG": "C.UTF-8"}
    if base_src is not None:
        env["PYTHONPATH"] = str(base_src.resolve())
    argv = [sys.executable, "-m", "cache_family.cli", "run", "--input", str(prepared)]
    with (out.parent / f"{out.name}.log").open("wb") as log:
        code = subprocess.call([*argv, "--output", str(out)], env=env, stdout=log, stderr=log)
    if code != 0:
        print(f"cell_overhead: {out.name} exited {code} (its cells are read all the same)")


def _cells_of_runs(runs: Sequence[Path]) -> list[Cell]:
    return [cell for run in runs for cell in cells_of(run / "journal.jsonl")]


def _cohorts(cells: Sequence[Cell]) -> list[str]:
    """ "all", then each cohort, unless there is only one."""
    found = sorted({cell.cohort for cell in cells})
    return found if len(found) == 1 else ["all", *found]


def side_by_side(args: argparse.Namespace) -> tuple[str, tuple[float, float, float]]:
    """Rounds of real runs (base, then this checkout), their cells pooled per variant."""
    args.work.mkdir(parents=True, exist_ok=True)
    variants = {"this checkout": None} if args.base_src is None else {}
    if args.base_src is not None:
        variants = {f"base ({args.base_src})": args.base_src, "this checkout": None}
    runs: dict[str, list[Path]] = {name: [] for name in variants}
    before = load_average()
    for round_index in range(args.rounds):
        for number, (name, src) in enumerate(variants.items()):
            out = args.work / f"run-{round_index}-{number}"
            _run_once(args.input, out, src)
            runs[name].append(out)
    after = load_average()
    lines = [
        f"{args.rounds} round(s) of `cache-family run --input {args.input}`"
        + (", base first in each round" if args.base_src else ""),
        f"load average {format_load(before)} before, {format_load(after)} after",
        "",
        "| runner | host cells | overhead median ms | host start-up median ms | overhead / "
        "start-up | overhead min / max ms | time in cell states, median ms |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    rows = [
        (f"{name}, {cohort} cells", [c for c in cells if cohort in ("all", c.cohort)])
        for name, paths in runs.items()
        for cells in [_cells_of_runs(paths)]
        for cohort in _cohorts(cells)
    ]
    for name, cells in rows:
        result = summary(cells)
        overhead, startup = result["overhead_ms"], result["startup_ms"]
        states = result["state_median_ms"]
        assert isinstance(overhead, dict) and isinstance(startup, dict)
        assert isinstance(states, dict)
        ratio = (
            overhead["median"] / startup["median"]
            if overhead["median"] is not None and startup["median"]
            else None
        )
        lines.append(
            f"| {name} | {result['cells']} | {_fmt(overhead['median'])} | "
            f"{_fmt(startup['median'])} | {'-' if ratio is None else f'{ratio:.2f}x'} | "
            f"{_fmt(overhead['min'])} / {_fmt(overhead['max'])} | "
            + ", ".join(f"{state} {_fmt(spent)}" for state, spent in states.items())
            + " |"
        )
    return "\n".join(lines), before


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path)
    parser.add_argument("--json", action="store_true", help="one JSON object per run")
    parser.add_argument("--input", type=Path, help="a prepared input: run it, then read")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--base-src", type=Path, help="with --input: the runner to compare")
    parser.add_argument("--work", type=Path, default=Path("/tmp/cell-overhead"))
    parser.add_argument("--append", action="store_true", help="record in bench/RESULTS.md")
    parser.add_argument("--notes", default="", help="a reading recorded with the figures")
    args = parser.parse_args(argv)
    if args.input is not None:
        text, before = side_by_side(args)
        print(text)
        if args.append:
            record(
                "Per-cell overhead and host start-up, side by side (issue 28)",
                text,
                notes=args.notes,
                argv=[sys.argv[0], *(argv or sys.argv[1:])],
                load_before=before,
            )
        return
    for run in args.runs:
        journal = run if run.is_file() else run / "journal.jsonl"
        cells = cells_of(journal)
        result = summary(cells)
        if args.json:
            result["journal"] = str(journal)
            result["per_cell"] = [{"cell_id": c.cell_id, **c.figures()} for c in cells]
            result["per_cell_states"] = [asdict(c)["states"] for c in cells]
            print(json.dumps(result))
            continue
        print(f"{journal}: {result['cells']} host cells")
        print("| figure | median ms | min ms | max ms |")
        print("|---|---:|---:|---:|")
        for key in ("overhead_ms", "marker_to_ready_ms", "startup_ms", "load_ms", "span_ms"):
            entry = result[key]
            assert isinstance(entry, dict)
            print(
                f"| {key.removesuffix('_ms')} | {_fmt(entry['median'])} | "
                f"{_fmt(entry['min'])} | {_fmt(entry['max'])} |"
            )
        states = result["state_median_ms"]
        assert isinstance(states, dict)
        print(
            "time in cell states, median ms: "
            + ", ".join(f"{state} {_fmt(spent)}" for state, spent in states.items())
        )
        for cohort in sorted({cell.cohort for cell in cells}):
            part = summary([cell for cell in cells if cell.cohort == cohort])
            overhead, marker = part["overhead_ms"], part["marker_to_ready_ms"]
            part_states = part["state_median_ms"]
            assert isinstance(overhead, dict) and isinstance(marker, dict)
            assert isinstance(part_states, dict)
            print(
                f"{cohort} cells ({part['cells']}): overhead {_fmt(overhead['median'])}, "
                f"marker-to-ready {_fmt(marker['median'])}; states: "
                + ", ".join(f"{state} {_fmt(spent)}" for state, spent in part_states.items())
            )
        for cell in cells:
            f = cell.figures()
            print(
                f"  {cell.cell_id}: overhead {_fmt(f['overhead_ms'])}, marker-to-ready "
                f"{_fmt(f['marker_to_ready_ms'])}, start-up {_fmt(f['startup_ms'])}, "
                f"load {_fmt(f['load_ms'])}, span {_fmt(f['span_ms'])}"
            )


if __name__ == "__main__":
    main()
