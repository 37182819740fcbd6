"""PreciseWake (system/wake.py): a wait on the kernel's timer never ends before its deadline,
not even after an earlier wait was cut short and its timer expired unread; on a fake clock it
is trio's own sleep. The timer waits need trio's system clock, so those tests wait a few real
milliseconds; they assert what the wait guarantees (never early), not how late it was."""

from __future__ import annotations

import sys

import pytest
import trio
import trio.testing

from cache_family.system.wake import PreciseWake

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux's")


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


@linux_only
def test_waits_on_the_system_clock_never_end_early() -> None:
    async def main() -> list[tuple[float, float]]:
        seen = []
        with PreciseWake() as wake:
            assert "timerfd" in repr(wake)
            start = trio.current_time()
            for step in range(1, 21):
                deadline = start + step * 0.0005
                await wake.sleep_until(deadline)
                seen.append((deadline, trio.current_time()))
        return seen

    for deadline, woke in trio.run(main):
        assert woke >= deadline


@linux_only
def test_a_wait_cut_short_leaves_no_expiry_that_ends_the_next_one_early() -> None:
    async def main() -> tuple[float, float]:
        with PreciseWake() as wake:
            start = trio.current_time()
            with trio.CancelScope() as scope:
                scope.cancel()
                await wake.sleep_until(start + 0.001)  # armed, then cancelled at once
            # The cut wait's timer expires unread while the task waits elsewhere.
            await trio.sleep_until(start + 0.003)
            later = start + 0.006
            await wake.sleep_until(later)
            return later, trio.current_time()

    deadline, woke = trio.run(main)
    assert woke >= deadline


@linux_only
def test_a_deadline_already_past_is_a_checkpoint() -> None:
    async def main() -> None:
        with PreciseWake() as wake:
            with trio.CancelScope() as scope:
                scope.cancel()
                await wake.sleep_until(trio.current_time() - 1.0)
            assert scope.cancelled_caught

    trio.run(main)


async def test_on_a_fake_clock_it_is_trios_sleep(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with PreciseWake() as wake:
        assert "trio.sleep_until" in repr(wake)
        deadline = trio.current_time() + 12.5
        await wake.sleep_until(deadline)
        assert trio.current_time() == deadline
