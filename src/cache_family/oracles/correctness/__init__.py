"""``skippy-correctness state-handoff``: the reference correctness oracle, on llama.cpp.

Honours the reference tool's command line (``cli``), runs the handoff in this process
(``session``) and writes its ``state-handoff.json`` report (``report``). Entry point:
``python -m cache_family.oracles.correctness state-handoff FLAGS...``.
"""

from __future__ import annotations

from cache_family.oracles.correctness.cli import (
    main,
    parse_args,
    state_handoff,
)
from cache_family.oracles.correctness.report import (
    HIT_LOGITS_TOLERANCE,
    build_report,
)
from cache_family.oracles.correctness.session import (
    FAULT_ENV,
    PACKAGE_MANIFEST,
    THREADS_ENV,
    HandoffArgs,
    Measured,
    Session,
    Threads,
    alter_state_bytes,
    oracle_threads,
)

__all__ = [
    "FAULT_ENV",
    "HIT_LOGITS_TOLERANCE",
    "PACKAGE_MANIFEST",
    "THREADS_ENV",
    "HandoffArgs",
    "Measured",
    "Session",
    "Threads",
    "alter_state_bytes",
    "build_report",
    "main",
    "oracle_threads",
    "parse_args",
    "state_handoff",
]
