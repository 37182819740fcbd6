"""One definition of what every benchmark records with its figures, and how it records them.

A recorded benchmark appends one Markdown section to ``bench/RESULTS.md``: a title with the
UTC date, the exact command, the machine, the load average before (and after) the
measurement, then its figures. ``section`` builds that text (pure, so it is tested), ``append``
adds it with one ``write`` on an ``O_APPEND`` descriptor (two benchmarks recording at once
cannot interleave their sections), ``record`` does both.

A benchmark that another one drives (``bench/harness.py`` runs them as child processes) may
also print its figures as one machine-readable line, ``bench-figures: {JSON}``
(``emit_figures``), which the driver reads back with ``read_figures`` instead of parsing prose.

    from _results import record, load_average
    before = load_average()
    ...
    record("Journal and replay at scale", body, argv=sys.argv, load_before=before)
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

RESULTS = Path(__file__).resolve().with_name("RESULTS.md")
FIGURES_PREFIX = "bench-figures: "

Load = tuple[float, float, float]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """Kernel, CPU model, the CPUs this process may use (of those online) and Python."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    online = os.cpu_count()
    cpus = f"{online} CPUs" if usable in (None, online) else f"{usable} of {online} CPUs"
    return (
        f"{platform.system()} {platform.release()} {platform.machine()}, {_cpu_model()}, "
        f"{cpus}, Python {platform.python_version()}"
    )


def load_average() -> Load:
    return os.getloadavg()


def format_load(load: Load) -> str:
    return "/".join(f"{x:.2f}" for x in load)


def command_line(argv: Sequence[str], recipe: str | None = None) -> str:
    """The command as one could type it again: ``python bench/x.py ARGS`` (and its recipe)."""
    script, *args = argv
    path = Path(script)
    if path.suffix == ".py" and path.resolve().parent == RESULTS.parent:
        script = f"bench/{path.name}"
    text = shlex.join(["python", script, *args])
    return f"{text} (`just {recipe}`)" if recipe else text


def section(
    title: str,
    body: str,
    *,
    command: str,
    when: dt.datetime,
    machine_text: str,
    load_before: Load,
    load_after: Load | None = None,
    notes: str = "",
) -> str:
    """The Markdown section a recorded run appends: heading, provenance, then ``body``."""
    load = f"load average (1/5/15 min) {format_load(load_before)} before"
    load += f", {format_load(load_after)} after" if load_after is not None else ""
    lines = [
        "",
        f"## {title} ({when.astimezone(dt.UTC):%Y-%m-%d %H:%M} UTC)",
        "",
        "```",
        command,
        "```",
        "",
        f"Machine: {machine_text}; {load}.",
    ]
    if notes:
        lines += ["", notes.strip()]
    lines += ["", body.strip(), ""]
    return "\n".join(lines)


def append(text: str, results: Path = RESULTS) -> None:
    data = text.encode()
    fd = os.open(results, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        while written < len(data):
            written += os.write(fd, data[written:])
    finally:
        os.close(fd)


def record(
    title: str,
    body: str,
    *,
    argv: Sequence[str],
    load_before: Load,
    started: dt.datetime | None = None,
    recipe: str | None = None,
    notes: str = "",
    results: Path = RESULTS,
) -> str:
    """Append ``body`` as a section (load after is read now); the section's text."""
    text = section(
        title,
        body,
        command=command_line(argv, recipe),
        when=started or dt.datetime.now(dt.UTC),
        machine_text=machine(),
        load_before=load_before,
        load_after=load_average(),
        notes=notes,
    )
    append(text, results)
    return text


def emit_figures(figures: Mapping[str, Any], stream: TextIO | None = None) -> None:
    """Print the figures as the one line ``read_figures`` reads back."""
    out = sys.stdout if stream is None else stream
    out.write(FIGURES_PREFIX + json.dumps(dict(figures), sort_keys=True) + "\n")
    out.flush()


def read_figures(stdout: str) -> dict[str, Any] | None:
    """The last ``bench-figures:`` line of a benchmark's output; None when it printed none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(FIGURES_PREFIX):
            value = json.loads(line[len(FIGURES_PREFIX) :])
            return value if isinstance(value, dict) else None
    return None
