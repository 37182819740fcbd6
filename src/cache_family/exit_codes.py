"""The exit codes of every ``cache-family`` command, defined once (README, "Exit codes")."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """What a ``cache-family`` process tells its caller; equal values are one code under
    the name each command's help uses for it."""

    OK = 0
    COMPLETED = 0
    IDENTICAL = 0
    NOT_COMPLETED = 1
    NEGATIVE = 1
    DIFFERS = 1
    PRECONDITION = 1
    REFUSED = 2
    UNREADABLE = 2
    REFUSED_DURING_WORK = 3
    MISSING_OUTPUT = 3
    WORKER_DEADLINE = 124
    INTERRUPTED = 130
