"""The exit codes of every ``cache-family`` command and of the package's own programs (the
oracles), defined once (README, "Exit codes")."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """What a ``cache-family`` process (or an oracle program) tells its caller; equal values
    are one code under the name each command's help uses for it."""

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
    # The oracles' own names. The stage server: its llama-server child died or never got
    # ready (a refusal is REFUSED).
    FAILED = 1
    # skippy-package-builder, as the program it stands in for: 1 for every refusal.
    PACKAGE_REFUSED = 1
    # The oracle launcher: the installed package source is not the one it was built for.
    SOURCE_CHANGED = 126
