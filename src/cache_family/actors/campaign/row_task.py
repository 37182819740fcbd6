"""What one Ray task does on its node: run one row as ``cache-family run --rows KEY`` and wait."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Final

# How often the task looks at its row (and so how soon a cancel is seen).
POLL_SECONDS: Final = 0.1
# The run's own cleanup (every host's SIGTERM grace) fits well inside this.
DEFAULT_GRACE_SECONDS: Final = 60.0


def row_argv(input_path: str, row_dir: str, key: str) -> list[str]:
    """The command line of one row, through the same interpreter as this process."""
    return [
        sys.executable,
        "-c",
        "import sys; from cache_family.cli import main; sys.exit(main())",
        "run",
        "--input",
        input_path,
        "--output",
        row_dir,
        "--rows",
        key,
        "--quiet",
    ]


def run_row(
    argv: Sequence[str],
    environ: Mapping[str, str],
    log_path: str,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    node: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """Run the row's command in a new session, poll it, end its group if interrupted.

    Returns the exit code and where it ran (``node``: what the caller knows of the node)."""
    with open(log_path, "ab") as log:
        child = subprocess.Popen(
            list(argv),
            env=dict(environ),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        while child.poll() is None:
            time.sleep(POLL_SECONDS)
    finally:
        if child.returncode is None:
            end_group(child, grace_seconds)
    return {"returncode": child.returncode, "hostname": socket.gethostname(), **(node or {})}


def end_group(child: subprocess.Popen[bytes], grace_seconds: float) -> None:
    """SIGTERM the row's process group, wait out the grace, SIGKILL what is left, reap."""
    _signal_group(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
    _signal_group(child.pid, signal.SIGKILL)
    child.wait()


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)
