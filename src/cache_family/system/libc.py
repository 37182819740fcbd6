"""This process's C library, loaded once: the Linux calls Python's own modules do not offer
(inotify, timerfd, unshare). Finding it by name (``ctypes.util.find_library``) runs a
subprocess each time, a few milliseconds on every host cell's pin watch; the process's own
symbols already hold it."""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library the interpreter runs on (``OSError`` where it cannot be opened)."""
    return ctypes.CDLL(None, use_errno=True)
