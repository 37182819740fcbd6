"""What one Ray task does on its node: run one row as ``cache-family run --rows KEY`` and wait.

The task polls its row rather than blocking in ``wait()``: Ray's cancellation reaches a task
only when Python regains control. On any exit of the task the row's group gets SIGTERM (the run
turns it into its own cancellation), then SIGKILL after the grace. This module imports nothing
of Ray: the driver wraps ``run_row`` as a remote function.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Final

from cache_family.system.process_group import stop_group_blocking

# The end of a row's log that comes back with it when the row ran in the node's own
# work directory.
LOG_TAIL_BYTES: Final = 256 * 1024
# How often the task looks at its row (and so how soon a cancel is seen).
POLL_SECONDS: Final = 0.1
# The run's own cleanup (every host's SIGTERM grace) fits well inside this.
DEFAULT_GRACE_SECONDS: Final = 60.0
# After SIGKILL the row's group is waited for this long at most (a process stuck in the
# kernel does not end even then; the task returns without its exit code).
KILL_WAIT_SECONDS: Final = 10.0


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
            stop_group_blocking(child, grace=grace_seconds, kill_wait=KILL_WAIT_SECONDS)
    return {"returncode": child.returncode, "hostname": socket.gethostname(), **(node or {})}


def log_tail(path: str) -> bytes:
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(log.tell() - LOG_TAIL_BYTES, 0))
            return log.read(LOG_TAIL_BYTES)
    except OSError:
        return b""


def run_row_in_work_dir(
    spec: Mapping[str, str],
    chunk_bytes: int,
    input_data: bytes,
    environ: Mapping[str, str],
    grace_seconds: float,
    node: Mapping[str, object],
) -> dict[str, object]:
    """Run the row in this node's own work directory (no directory is shared with the
    driver), then pack the sealed row for the object store: its manifest and first chunk.
    The row stays on the node only while more chunks are to be fetched."""
    from cache_family.actors.campaign.row_return import node_work_dir, pack_on_node, place_input
    from cache_family.errors import Refused

    key = spec["key"]
    work = os.path.join(node_work_dir(dict(environ)), spec["campaign_id"])
    where = {"hostname": socket.gethostname(), **node}
    try:
        input_path = place_input(work, input_data, spec["input_sha256"])
    except Refused as refused:
        (first, *_) = refused.refusals
        return {**where, "refusal": (first.code, first.message)}
    row_dir = os.path.join(work, f"{spec['name']}-{secrets.token_hex(4)}")
    log = row_dir + ".log"
    keep = False
    try:
        result = run_row(row_argv(input_path, row_dir, key), environ, log, grace_seconds, node)
        result["log_tail"] = log_tail(log)
        result["node_row_dir"] = row_dir
        try:
            packed = pack_on_node(row_dir, key, chunk_bytes)
        except Refused as refused:
            (first, *_) = refused.refusals
            result["refusal"] = (first.code, first.message)
        else:
            result.update(packed)
            keep = packed["chunks"] > 1
        return result
    finally:
        if not keep:
            release_row(row_dir)


def release_row(row_dir: str) -> None:
    """Remove a row's run directory and log from the node's work directory."""
    shutil.rmtree(row_dir, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(row_dir + ".log")
