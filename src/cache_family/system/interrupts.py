"""SIGINT/SIGTERM for the whole life of a ``run`` process: never Python's defaults.

``cache-family run`` installs the process's latch before its first side effect and never takes
it down, so no signal can end the process by SIGTERM's default action (143 / -15) or as a
``KeyboardInterrupt`` (-2) at any moment:

  * before the supervisor's receiver opens (admission, creating the run directory, starting
    trio), the latch remembers the signal; the supervisor takes it as the run's cancellation
    once its receiver is open and ``run_started`` is journaled;
  * while the receiver is open, trio's handler displaces the latch and the supervisor's
    watcher sees every signal; when it closes, trio puts the latch back and re-delivers any
    signal it had not handed out, which the latch then records;
  * after the matrix is published, the latch only counts: the exit code becomes 130.

(Preparation's ``InterruptLatch`` is its own: it cancels the preparation budget and is put
back once preparation ends.)
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType
from typing import Final

SIGNALS: Final = (signal.SIGINT, signal.SIGTERM)


class RunInterrupts:
    """Every SIGINT/SIGTERM that reached the latch, by name, in arrival order."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self._taken = 0

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self.received.append(signal.Signals(signum).name)

    def take(self) -> list[str]:
        """The signals received since the last ``take``."""
        new = self.received[self._taken :]
        self._taken = len(self.received)
        return new


# The latch in place now: the process's (never removed), or one ``held`` put up for a block.
_CURRENT: RunInterrupts | None = None


def hold_until_exit() -> RunInterrupts:
    """Install the process's latch (once; it is never removed) and return it. Only the
    command line calls this: the process is then the run's alone."""
    global _CURRENT
    if _CURRENT is None:
        latch = RunInterrupts()
        for signum in SIGNALS:
            signal.signal(signum, latch._handler)
        _CURRENT = latch
    return _CURRENT


@contextlib.contextmanager
def held() -> Iterator[RunInterrupts]:
    """The latch in place (the process's, when the command line installed it); otherwise (a
    run inside someone else's process, such as a test) one installed for the block only."""
    global _CURRENT
    if _CURRENT is not None:
        yield _CURRENT
        return
    latch = RunInterrupts()
    previous = {signum: signal.signal(signum, latch._handler) for signum in SIGNALS}
    _CURRENT = latch
    try:
        yield latch
    finally:
        _CURRENT = None
        for signum, handler in previous.items():
            signal.signal(signum, handler)
