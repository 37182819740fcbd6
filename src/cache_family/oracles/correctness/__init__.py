"""``skippy-correctness state-handoff``: the reference correctness oracle, on llama.cpp.

Honours the reference tool's command line (``cli``), runs the handoff in this process
(``session``) and writes its ``state-handoff.json`` report (``report``). Entry point:
``python -m cache_family.oracles.correctness state-handoff FLAGS...``.
"""

from __future__ import annotations

from cache_family.oracles.correctness.cli import (
    COMMAND,
    MAX_PREFIX_TOKENS,
    MAX_REPEATS,
    build_parser,
    main,
    parse_args,
    state_handoff,
)
from cache_family.oracles.correctness.report import (
    EVIDENCE,
    HIT_LOGITS_TOLERANCE,
    build_report,
    write_report,
)
from cache_family.oracles.correctness.session import (
    DEFAULT_PROMPT,
    DEFAULT_THREADS,
    FAULT_ENV,
    PACKAGE_MANIFEST,
    THREADS_ENV,
    WARMUP_HITS,
    Benchmark,
    Decoded,
    HandoffArgs,
    HandoffFailed,
    Measured,
    Session,
    Threads,
    alter_state_bytes,
    benchmark_prompt,
    oracle_threads,
    run_handoff,
)

__all__ = [
    "COMMAND",
    "DEFAULT_PROMPT",
    "DEFAULT_THREADS",
    "EVIDENCE",
    "FAULT_ENV",
    "HIT_LOGITS_TOLERANCE",
    "MAX_PREFIX_TOKENS",
    "MAX_REPEATS",
    "PACKAGE_MANIFEST",
    "THREADS_ENV",
    "WARMUP_HITS",
    "Benchmark",
    "Decoded",
    "HandoffArgs",
    "HandoffFailed",
    "Measured",
    "Session",
    "Threads",
    "alter_state_bytes",
    "benchmark_prompt",
    "build_parser",
    "build_report",
    "main",
    "oracle_threads",
    "parse_args",
    "run_handoff",
    "state_handoff",
    "write_report",
]
