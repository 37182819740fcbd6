"""The one SIGINT/SIGTERM latch: never Python's defaults where a command owns the signals.

A ``Latch`` remembers every signal by name in arrival order, put up for a block
(``Latch.installed``) or, for ``run``, for the process's life (``hold_until_exit``): before the
run's receiver opens it remembers, while a trio receiver is open trio's handler displaces it
(and re-delivers on close), after the matrix it only counts (exit 130), and at exit the signals
are blocked and the process ends with ``os._exit`` so finalization never restores the defaults.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Awaitable, Callable, Iterator
from types import FrameType
from typing import Final, TypeVar, TypeVarTuple, Unpack

import trio

T = TypeVar("T")
Args = TypeVarTuple("Args")

SIGNALS: Final = (signal.SIGINT, signal.SIGTERM)


class Latch:
    """Every SIGINT/SIGTERM that reached the latch, by name, in arrival order; ``on_signal``
    is called with each signal's number as it arrives (from the handler: keep it short)."""

    def __init__(self, on_signal: Callable[[int], None] | None = None) -> None:
        self.received: list[str] = []
        self.on_signal = on_signal
        self._taken = 0

    def fire(self, signum: int) -> None:
        """Record ``signum`` as received (also how a trio watcher hands one over)."""
        self.received.append(signal.Signals(signum).name)
        if self.on_signal is not None:
            self.on_signal(signum)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self.fire(signum)

    @property
    def first_signum(self) -> int | None:
        return signal.Signals[self.received[0]].value if self.received else None

    @property
    def last_signum(self) -> int | None:
        return signal.Signals[self.received[-1]].value if self.received else None

    def take(self) -> list[str]:
        """The signals received since the last ``take``."""
        new = self.received[self._taken :]
        self._taken = len(self.received)
        return new

    @contextlib.contextmanager
    def installed(self) -> Iterator[Latch]:
        """The latch handles SIGINT/SIGTERM for the block; the previous handlers come back."""
        previous = {signum: signal.signal(signum, self._handler) for signum in SIGNALS}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


# The latch in place now: the process's (never removed), or one ``held`` put up for a block.
_CURRENT: Latch | None = None
# The process's latch, once the command line installed it for the life of the process.
_PROCESS: Latch | None = None


def hold_until_exit() -> Latch:
    """Install the process's latch (once; it is never removed) and return it. Only the
    command line calls this: the process is then the run's alone."""
    global _CURRENT, _PROCESS
    if _PROCESS is None:
        latch = Latch()
        for signum in SIGNALS:
            signal.signal(signum, latch._handler)
        _CURRENT = _PROCESS = latch
    return _PROCESS


def process_latch() -> Latch | None:
    """The latch :func:`hold_until_exit` installed, or None when no command holds one."""
    return _PROCESS


@contextlib.contextmanager
def held() -> Iterator[Latch]:
    """The latch in place (the process's, when the command line installed it); otherwise (a
    run inside someone else's process, such as a test) one installed for the block only."""
    global _CURRENT
    if _CURRENT is not None:
        yield _CURRENT
        return
    latch = Latch()
    with latch.installed():
        _CURRENT = latch
        try:
            yield latch
        finally:
            _CURRENT = None


def run_then_release_wakeup_fd(async_fn: Callable[[Unpack[Args]], Awaitable[T]], *args: *Args) -> T:
    """``trio.run(async_fn, *args)``, with the signal wakeup fd set back to none as soon as
    ``async_fn`` returns. Trio closes its wakeup socket before it restores the fd: a signal
    in between was written into the closed socket and printed as "Exception ignored when
    trying to write to the signal wakeup fd: BrokenPipeError". The latch still records it;
    nothing needs waking once the main function has returned."""

    async def main() -> T:
        try:
            return await async_fn(*args)
        finally:
            signal.set_wakeup_fd(-1)

    return trio.run(main)


def _handlers_ran() -> None:
    """A Python call: a handler whose C part already ran is run here at the latest."""


def signals_at_exit(latch: Latch) -> list[str]:
    """Block SIGINT/SIGTERM for the rest of the process and return the signals the latch has
    not handed out yet, with any that arrived since and waits blocked. Called as the last
    thing before the process ends with ``os._exit`` (after its output is flushed): one that
    arrives later is never delivered (the process is already exiting). Once this thread
    blocks them, the kernel hands a signal to any other thread that does not (trio's worker
    threads): its handler's Python part then runs here, at the next call, so nothing may
    come between this and the exit that a signal should still change."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    _handlers_ran()
    late = latch.take()
    for signum in sorted(signal.sigpending() & set(SIGNALS)):
        late.append(signal.Signals(signum).name)
    _handlers_ran()  # one handed to another thread meanwhile
    return late + latch.take()
