"""The arms of a row, defined once: each arm's name (as journaled and reported), the directory
its cell lives in under ``cell-NNNN/``, the cohort its requests belong to, its measurement kind
and the host kind that serves it (``actors/run/hosts.py`` holds each kind's strategy).

The run, the folds, the report and the oracles all read arms from here: adding an arm is a new
``Arm`` in ``HOST_ARMS`` (or a new host kind beside it), never a new spelling elsewhere.
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
HostProfileName = Literal["native-baseline", "skippy-old", "skippy-new"]
NATIVE_PROFILE: Final[HostProfileName] = "native-baseline"
OLD_PROFILE: Final[HostProfileName] = "skippy-old"
NEW_PROFILE: Final[HostProfileName] = "skippy-new"


class MeasurementKind(StrEnum):
    CORRECTNESS = "correctness"
    # One request at a time, the first excluded as the host's warmup.
    SERIAL = "serial"
    # Ascending concurrency rungs against one retained host.
    CONCURRENT = "concurrent"


class HostKind(StrEnum):
    # The monolithic llama-server built from the pinned llama.cpp source.
    NATIVE = "native"
    # The operator's (Skippy) stage server, old or new build.
    STAGE = "stage"


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
# fmt: on

# The host arms in the order a row runs them (and its observations list them).
HOST_ARMS: Final = (NATIVE_SERIAL, NATIVE_CONCURRENT, SKIPPY_OLD, SKIPPY_NEW)
# The paired arms whose rungs are compared with each other (parity).
PAIRED_ARMS: Final = (SKIPPY_OLD, SKIPPY_NEW)
ARMS: Final = (CORRECTNESS, *HOST_ARMS)
ARM_BY_NAME: Final = {arm.name: arm for arm in ARMS}


def arm_named(name: str) -> Arm:
    """The arm of that name (journals name arms by ``Arm.name``)."""
    return ARM_BY_NAME[name]
