"""The arms of a row, defined once: each arm's name (as journaled and reported), the directory
its cell lives in under ``cell-NNNN/``, the cohort its requests belong to, its measurement kind
and the host kind that serves it (``actors/run/hosts.py`` holds each kind's strategy).

Adding an arm is a new ``Arm`` here, never a new spelling elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Literal

# Which requests a cell sends: llama-server's /completion, or OpenAI chat (a stage server).
COHORT_NATIVE: Final = "native"
COHORT_OPENAI: Final = "openai"
# What the correctness arm measures: the state handoff, through its tool (no host, no cohort).
COHORT_NONE: Final = ""

# The prepared input's name for a host profile (``HostProfile.host``).
HostProfileName = Literal["native-baseline", "skippy-old", "skippy-new", "openai"]
NATIVE_PROFILE: Final[HostProfileName] = "native-baseline"
OLD_PROFILE: Final[HostProfileName] = "skippy-old"
NEW_PROFILE: Final[HostProfileName] = "skippy-new"
# An OpenAI-compatible server the operator declares (``schemas/openai_host.py``).
OPENAI_PROFILE: Final[HostProfileName] = "openai"


class MeasurementKind(StrEnum):
    CORRECTNESS = "correctness"
    # One request at a time, the first excluded as the host's warmup.
    SERIAL = "serial"
    # Ascending concurrency rungs against one retained host.
    CONCURRENT = "concurrent"
    # The workload file's cache traffic (``schemas/workload.py``), one retained host each:
    # designed prefix-overlap points checked against the reuse the server reported,
    PREFIX_OVERLAP = "prefix-overlap"
    # multi-turn sessions (each turn's prompt is the session so far),
    SESSIONS = "sessions"
    # and open-loop arrivals at target rates (a sweep stops at over-saturation),
    OPEN_LOOP = "open-loop"
    # and a recorded trace replayed on its timestamps, each request's reuse checked.
    TRACE = "trace"


# The measurement kinds a workload file chooses (run only when the prepared input has one).
WORKLOAD_KINDS: Final = frozenset(
    (
        MeasurementKind.PREFIX_OVERLAP,
        MeasurementKind.SESSIONS,
        MeasurementKind.OPEN_LOOP,
        MeasurementKind.TRACE,
    )
)


class HostKind(StrEnum):
    # The monolithic llama-server built from the pinned llama.cpp source.
    NATIVE = "native"
    # The operator's (Skippy) stage server, old or new build.
    STAGE = "stage"
    # Any OpenAI-compatible server the operator declares and the product launches.
    OPENAI = "openai"


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    # The cell's directory inside its row directory (the run layout).
    directory: str
    cohort: str
    kind: MeasurementKind
    # None: the arm runs a tool child, not a retained host (the correctness arm).
    host_kind: HostKind | None
    # The prepared host profile the arm's cells run (None: not a host arm).
    profile: HostProfileName | None
    # The progress display's short label.
    label: str

    @property
    def serial(self) -> bool:
        return self.kind == MeasurementKind.SERIAL

    @property
    def workload(self) -> bool:
        """The arm measures a workload of the workload file (``workload.json`` beside it)."""
        return self.kind in WORKLOAD_KINDS


_SERIAL, _CONCURRENT = MeasurementKind.SERIAL, MeasurementKind.CONCURRENT
_NATIVE, _STAGE = HostKind.NATIVE, HostKind.STAGE

# fmt: off
#                        name                 directory                  cohort
#                        kind                            host     profile          label
CORRECTNESS: Final = Arm("correctness",       "correctness",             COHORT_NONE,
                         MeasurementKind.CORRECTNESS,    None,    None,            "check")
NATIVE_SERIAL: Final = Arm("native-serial",   "native-serial",           COHORT_NATIVE,
                           _SERIAL,                      _NATIVE, NATIVE_PROFILE,  "serial")
NATIVE_CONCURRENT: Final = Arm("native-concurrent", "sweep-native-concurrent", COHORT_NATIVE,
                               _CONCURRENT,              _NATIVE, NATIVE_PROFILE,  "native")
SKIPPY_OLD: Final = Arm("skippy-old",         "sweep-skippy-old",        COHORT_OPENAI,
                        _CONCURRENT,                     _STAGE,  OLD_PROFILE,     "old")
SKIPPY_NEW: Final = Arm("skippy-new",         "sweep-skippy-new",        COHORT_OPENAI,
                        _CONCURRENT,                     _STAGE,  NEW_PROFILE,     "new")
NATIVE_OVERLAP: Final = Arm("native-overlap", "workload-native-overlap", COHORT_NATIVE,
                            MeasurementKind.PREFIX_OVERLAP, _NATIVE, NATIVE_PROFILE, "overlap")
NATIVE_SESSIONS: Final = Arm("native-sessions", "workload-native-sessions", COHORT_NATIVE,
                             MeasurementKind.SESSIONS,   _NATIVE, NATIVE_PROFILE,  "sessions")
NATIVE_OPEN_LOOP: Final = Arm("native-open-loop", "workload-native-open-loop", COHORT_NATIVE,
                              MeasurementKind.OPEN_LOOP, _NATIVE, NATIVE_PROFILE,  "open-loop")
# The overlap sweep on the paired stage servers, in their OpenAI chat dialect (text prompts).
OLD_OVERLAP: Final = Arm("old-overlap",       "workload-old-overlap",    COHORT_OPENAI,
                         MeasurementKind.PREFIX_OVERLAP, _STAGE,  OLD_PROFILE,     "old overlap")
NEW_OVERLAP: Final = Arm("new-overlap",       "workload-new-overlap",    COHORT_OPENAI,
                         MeasurementKind.PREFIX_OVERLAP, _STAGE,  NEW_PROFILE,     "new overlap")
# The multi-turn sessions on the paired stage servers (chat messages, the answers as sent).
OLD_SESSIONS: Final = Arm("old-sessions",     "workload-old-sessions",   COHORT_OPENAI,
                          MeasurementKind.SESSIONS,      _STAGE,  OLD_PROFILE,     "old sessions")
NEW_SESSIONS: Final = Arm("new-sessions",     "workload-new-sessions",   COHORT_OPENAI,
                          MeasurementKind.SESSIONS,      _STAGE,  NEW_PROFILE,     "new sessions")
# The open-loop rate sweep on the paired stage servers: the row's prompt as a streamed chat.
OLD_OPEN_LOOP: Final = Arm("old-open-loop",   "workload-old-open-loop",  COHORT_OPENAI,
                           MeasurementKind.OPEN_LOOP,    _STAGE,  OLD_PROFILE,     "old open-loop")
NEW_OPEN_LOOP: Final = Arm("new-open-loop",   "workload-new-open-loop",  COHORT_OPENAI,
                           MeasurementKind.OPEN_LOOP,    _STAGE,  NEW_PROFILE,     "new open-loop")
# The trace replay, native (token ids) and on the paired stage servers (chat text).
NATIVE_TRACE: Final = Arm("native-trace",     "workload-native-trace",   COHORT_NATIVE,
                          MeasurementKind.TRACE,         _NATIVE, NATIVE_PROFILE,  "trace")
OLD_TRACE: Final = Arm("old-trace",           "workload-old-trace",      COHORT_OPENAI,
                       MeasurementKind.TRACE,            _STAGE,  OLD_PROFILE,     "old trace")
NEW_TRACE: Final = Arm("new-trace",           "workload-new-trace",      COHORT_OPENAI,
                       MeasurementKind.TRACE,            _STAGE,  NEW_PROFILE,     "new trace")
# The declared OpenAI-compatible server: the concurrent ladder, and every workload in its
# chat dialect (as the stage servers send them).
_OPENAI = HostKind.OPENAI
OPENAI_CONCURRENT: Final = Arm("openai-concurrent", "sweep-openai-concurrent", COHORT_OPENAI,
                               _CONCURRENT,         _OPENAI, OPENAI_PROFILE, "openai")
OPENAI_OVERLAP: Final = Arm("openai-overlap",   "workload-openai-overlap", COHORT_OPENAI,
                            MeasurementKind.PREFIX_OVERLAP, _OPENAI, OPENAI_PROFILE,
                            "openai overlap")
OPENAI_SESSIONS: Final = Arm("openai-sessions", "workload-openai-sessions", COHORT_OPENAI,
                             MeasurementKind.SESSIONS,   _OPENAI, OPENAI_PROFILE,
                             "openai sessions")
OPENAI_OPEN_LOOP: Final = Arm("openai-open-loop", "workload-openai-open-loop", COHORT_OPENAI,
                              MeasurementKind.OPEN_LOOP, _OPENAI, OPENAI_PROFILE,
                              "openai open-loop")
OPENAI_TRACE: Final = Arm("openai-trace",       "workload-openai-trace",   COHORT_OPENAI,
                          MeasurementKind.TRACE,         _OPENAI, OPENAI_PROFILE, "openai trace")
# fmt: on

# The workload arms in the order a row runs them, after its host arms (each only when the
# prepared input has a workload file choosing it).
WORKLOAD_ARMS: Final = (NATIVE_OVERLAP, NATIVE_SESSIONS, NATIVE_OPEN_LOOP, NATIVE_TRACE)
# The workload arms of the paired stage servers, after the native ones: planned only when both
# old and new servers are bound (paired serving planned) and the workload file chooses it.
STAGE_WORKLOAD_ARMS: Final = (
    OLD_OVERLAP,
    NEW_OVERLAP,
    OLD_SESSIONS,
    NEW_SESSIONS,
    OLD_OPEN_LOOP,
    NEW_OPEN_LOOP,
    OLD_TRACE,
    NEW_TRACE,
)
# Each stage workload arm's old/new pair, by measurement kind (the report compares them).
PAIRED_WORKLOAD_ARMS: Final = {
    MeasurementKind.PREFIX_OVERLAP: (OLD_OVERLAP, NEW_OVERLAP),
    MeasurementKind.SESSIONS: (OLD_SESSIONS, NEW_SESSIONS),
    MeasurementKind.TRACE: (OLD_TRACE, NEW_TRACE),
}

# The host arms in the order a row runs them (and its observations list them).
HOST_ARMS: Final = (NATIVE_SERIAL, NATIVE_CONCURRENT, SKIPPY_OLD, SKIPPY_NEW)
# The paired arms whose rungs are compared with each other (parity).
PAIRED_ARMS: Final = (SKIPPY_OLD, SKIPPY_NEW)
# The declared server's workload arms, in the order the native and stage ones run.
OPENAI_WORKLOAD_ARMS: Final = (OPENAI_OVERLAP, OPENAI_SESSIONS, OPENAI_OPEN_LOOP, OPENAI_TRACE)
# The declared server's arms, after every other arm of a case whose profiles declare one.
OPENAI_ARMS: Final = (OPENAI_CONCURRENT, *OPENAI_WORKLOAD_ARMS)
ARMS: Final = (CORRECTNESS, *HOST_ARMS, *WORKLOAD_ARMS, *STAGE_WORKLOAD_ARMS, *OPENAI_ARMS)
ARM_BY_NAME: Final = {arm.name: arm for arm in ARMS}


def arm_named(name: str) -> Arm:
    """The arm of that name (journals name arms by ``Arm.name``)."""
    return ARM_BY_NAME[name]
