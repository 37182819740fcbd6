"""One writer per run directory: an exclusive ``flock`` on ``RUN_DIR/run.lock``.

``run``, ``run --resume`` and ``replay --reap`` hold it while they may write into the directory
or end its processes. The kernel releases a ``flock`` with its holder's descriptor (close-on-
exec), so a killed holder leaves no stale lock; the holder's pid is in the file so a refused
taker can name it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from typing import Final

from cache_family.errors import Refused

LOCK_NAME: Final = "run.lock"
_PID_READ_MAX: Final = 64


def lock_path(run_dir: str) -> str:
    return os.path.join(run_dir, LOCK_NAME)


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, _PID_READ_MAX, 0).decode("ascii", errors="replace").strip()
    except OSError:
        return "an unknown pid"
    return f"pid {text}" if text.isdigit() else "a pid not yet written"


@contextlib.contextmanager
def run_lock(run_dir: str, *, what: str, named: str | None = None) -> Iterator[None]:
    """Hold the run directory's lock for the block; ``Refused`` (``run.locked``) naming the
    holder's pid when another process holds it, ``run.lock_unavailable`` when the lock file
    cannot be opened. ``what`` names the taker in the refusal, ``named`` the directory (when
    ``run_dir`` is its handle's path)."""
    path = lock_path(run_dir)
    shown = named or run_dir
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise Refused.one(
            "run.lock_unavailable",
            "$.run_dir",
            f"cannot open {lock_path(shown)}: {exc.strerror or exc}",
            "check that the run directory exists and is writable (a symlinked lock file is "
            "refused)",
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise Refused.one(
                "run.locked",
                "$.run_dir",
                f"{shown} is in use by {_holder(fd)} (it holds {LOCK_NAME}); {what} waits "
                "for no one",
                "a run directory has one writer at a time: let that process finish (or stop "
                "it with Ctrl-C / SIGTERM), then try again",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def lock_held(run_dir: str) -> bool:
    """Whether some open file description holds ``run_dir``'s lock now (a live run, resume
    or reap; this process's own ``run_lock`` counts too). A missing or unreadable lock file,
    or a symlink in its place, holds nothing."""
    try:
        fd = os.open(lock_path(run_dir), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)
    return False
