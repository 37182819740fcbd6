"""FAULT-INJECTION harness: the real ``cache-family`` command line with one seam that blocks.

Usage: fault_injection_run.py SEAM NOTIFY_FIFO RELEASE_FIFO CACHE_FAMILY_ARGS...

Everything is the product's own code in a real process; only one function of the run (in
``cache_family.console.commands``, ``cache_family.actors.run.matrix`` or
``cache_family.system.interrupts``) is wrapped so that, when the run reaches it, the harness writes
``at SEAM`` to NOTIFY_FIFO and blocks until a line arrives on RELEASE_FIFO. A test sends its
signal in between, at a moment it knows exactly, without sleeping:

  before-output  admission passed, the output directory is not created yet (no side effect)
  run-dir        the output directory exists, trio and the supervisor have not started
  rows-over      every row has ended; the matrix is not folded yet
  published      the matrix is published and the journal sealed; the last lines not printed
  exiting        the last line is printed and the command returned its code; the process
                 has not exited yet (Python's finalization would begin here)

One more SEAM blocks nothing:

  long-grace     every host's cleanup grace is LONG_GRACE_SECONDS, so a test of a second
                 signal cutting the grace short never races the grace running out by itself
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from cache_family import cli
from cache_family.actors.run import matrix
from cache_family.console import commands
from cache_family.system import interrupts

# seam -> (module, its function, block before (True) or after (False) calling it)
SEAMS: dict[str, tuple[Any, str, bool]] = {
    "before-output": (commands, "make_fresh_dir", True),
    "run-dir": (commands, "make_fresh_dir", False),
    "rows-over": (matrix, "check_interrupt_finish", True),
    "published": (commands, "final_line", True),
    "exiting": (interrupts, "signals_at_exit", True),
}


def _block(seam: str, notify: str, release: str) -> None:
    fd = os.open(notify, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, f"at {seam}\n".encode())
    finally:
        os.close(fd)
    with open(release, "rb") as handle:
        handle.readline()


def _wrap(original: Callable[..., Any], seam: str, before: bool, notify: str, release: str) -> Any:
    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before:
            _block(seam, notify, release)
        result = original(*args, **kwargs)
        if not before:
            _block(seam, notify, release)
        return result

    return wrapped


# Under the hosts' cleanup bound (30 s), which must still hold with the kill wait after it.
LONG_GRACE_SECONDS = 20.0


def main() -> int:
    seam, notify, release, *argv = sys.argv[1:]
    # The command line as the program sees it: cli.main() then ends the process as it would.
    sys.argv = [sys.argv[0], *argv]
    if seam == "long-grace":
        matrix.HostSettings = functools.partial(  # type: ignore[misc]
            matrix.HostSettings, grace_seconds=LONG_GRACE_SECONDS
        )
        return cli.main()
    module, name, before = SEAMS[seam]
    setattr(module, name, _wrap(getattr(module, name), seam, before, notify, release))
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
