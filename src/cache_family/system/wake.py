"""Waking at a trio deadline to within the kernel's timer slack: a Linux timerfd on
CLOCK_MONOTONIC, waited on as a readable descriptor.

trio sleeps in ``epoll_wait``, whose timeout is whole milliseconds rounded up, so a plain
``trio.sleep_until`` wakes up to a millisecond late. A timerfd expires on the kernel's
high-resolution timer (50 us of slack for an ordinary thread), costs a few syscalls a wait and
no CPU while it waits, and other tasks run meanwhile. Where it cannot work (not Linux, or a
clock other than trio's system clock, such as a test's fake clock) the wait is
``trio.sleep_until``.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
import time
from types import TracebackType
from typing import Final

import trio

from cache_family.system.libc import libc as c_library

CLOCK_MONOTONIC: Final = 1
TFD_TIMER_ABSTIME: Final = 1
# timerfd_create's flags are O_CLOEXEC and O_NONBLOCK's values (timerfd.h says so).
TFD_FLAGS: Final = os.O_CLOEXEC | os.O_NONBLOCK
NS: Final = 1_000_000_000


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


class _Itimerspec(ctypes.Structure):
    _fields_ = (("it_interval", _Timespec), ("it_value", _Timespec))


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = c_library()
        libc.timerfd_create.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.timerfd_settime.argtypes = (
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(_Itimerspec),
            ctypes.c_void_p,
        )
    except (OSError, AttributeError):
        return None
    return libc


_LIBC: Final = _libc()


def _monotonic_offset() -> float | None:
    """trio's time minus CLOCK_MONOTONIC's, where trio runs on its own system clock
    (``offset + perf_counter()``, and ``perf_counter`` is CLOCK_MONOTONIC on Linux); None for
    any other clock (a fake clock's time does not pass with the kernel's)."""
    clock = trio.lowlevel.current_clock()
    offset = getattr(clock, "offset", None)
    if type(clock).__name__ != "SystemClock" or not isinstance(offset, float):
        return None
    if time.get_clock_info("perf_counter").implementation != "clock_gettime(CLOCK_MONOTONIC)":
        return None
    return offset


class PreciseWake:
    """One timerfd, re-armed for every wait (re-arming also clears an expiry not read);
    used by one task at a time and closed with the ``with`` block."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._offset: float | None = None
        self._spec = _Itimerspec()

    def __repr__(self) -> str:
        how = "timerfd" if self._fd is not None else "trio.sleep_until"
        return f"<PreciseWake {how}>"

    def __enter__(self) -> PreciseWake:
        self._offset = _monotonic_offset()
        if self._offset is not None and _LIBC is not None:
            fd = _LIBC.timerfd_create(CLOCK_MONOTONIC, TFD_FLAGS)
            self._fd = fd if fd >= 0 else None
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            trio.lowlevel.notify_closing(fd)
            os.close(fd)

    async def sleep_until(self, deadline: float) -> None:
        """Return at ``deadline`` (trio's time) or just after, never before it; a checkpoint
        like any trio sleep, even for a deadline already past."""
        fd, offset = self._fd, self._offset
        if fd is None or offset is None or _LIBC is None:
            await trio.sleep_until(deadline)
            return
        spec = self._spec
        if trio.current_time() >= deadline:
            await trio.lowlevel.checkpoint()
            return
        # The kernel's nanoseconds rounded up, and trio's clock asked again after the wake:
        # a float's last bit never ends the wait early.
        while trio.current_time() < deadline:
            ns = math.ceil((deadline - offset) * NS)
            spec.it_value.tv_sec, spec.it_value.tv_nsec = divmod(ns, NS)
            if _LIBC.timerfd_settime(fd, TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
                await trio.sleep_until(deadline)  # refused (it never is for a valid time)
                return
            await trio.lowlevel.wait_readable(fd)
            # Readable means expired; reading clears it (a spurious wake finds nothing).
            with contextlib.suppress(BlockingIOError):
                os.read(fd, 8)
