"""A signal that reaches a ``run`` process while it still runs always makes it exit 130,
without a traceback: after its last line (while that line is flushed), and in trio's own
teardown (its signal wakeup socket already closed)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import trio
from trio._core._wakeup_socketpair import WakeupSocketpair

from cache_family.system import interrupts

# A real process, ended by the command line's own exit: its last line is flushed by a FAKE
# stdout that sends SIGTERM to the process as it flushes (the moment the attack run hit, 1.5
# to 3.4 ms after the seal), while a thread that takes signals is alive (as trio's worker
# threads are, and they do not block SIGINT/SIGTERM).
SIGNAL_WHILE_FLUSHING = """
import os, signal, sys, threading
from cache_family import cli
from cache_family.system import interrupts

latch = interrupts.hold_until_exit()
threading.Thread(target=threading.Event().wait, daemon=True).start()

class FakeStdoutSignalledWhileFlushing:
    def __init__(self, real):
        self.real = real
    def write(self, text):
        return self.real.write(text)
    def flush(self):
        os.kill(os.getpid(), signal.SIGTERM)
        self.real.flush()

sys.stdout = FakeStdoutSignalledWhileFlushing(sys.stdout)
print("completed: /runs/r1/cache-family-matrix.json")
cli._exit_holding_signals(latch, 0)
"""


def test_a_signal_while_the_last_line_is_flushed_exits_130() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SIGNAL_WHILE_FLUSHING], capture_output=True, timeout=120
    )
    assert done.stdout == b"completed: /runs/r1/cache-family-matrix.json\n"
    assert done.returncode == 130, done.stderr
    assert b"SIGTERM after the run's last line: the run had finished" in done.stderr
    assert b"Traceback" not in done.stderr


@pytest.fixture
def signal_in_trios_teardown(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """FAKE teardown moment: trio closes its wakeup socket's read end, then SIGTERM comes,
    then trio closes the write end and restores the wakeup fd (trio's own order)."""
    raised: list[int] = []
    original = WakeupSocketpair.close

    def close_with_a_signal_between(self: WakeupSocketpair) -> None:
        if self.old_wakeup_fd is not None:  # the pair that wakes trio on signals
            self.wakeup_sock.close()
            raised.append(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)
        original(self)

    monkeypatch.setattr(WakeupSocketpair, "close", close_with_a_signal_between)
    yield raised


def test_a_signal_in_trios_teardown_reaches_the_latch_without_a_broken_pipe(
    signal_in_trios_teardown: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)

    async def supervised(answer: int) -> int:
        await trio.lowlevel.checkpoint()
        return answer

    with interrupts.Latch().installed() as latch:
        assert interrupts.run_then_release_wakeup_fd(supervised, 7) == 7
        interrupts._handlers_ran()
        assert latch.take() == ["SIGTERM"]
    assert signal_in_trios_teardown == [signal.SIGTERM]
    # The write into trio's half-closed socket was reported here as a BrokenPipeError.
    assert unraisable == []
    assert signal.set_wakeup_fd(-1) == -1
