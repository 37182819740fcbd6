"""Operator input (schema_version 1) and its plan: strict models, every refusal at once.

``limits`` holds the bounds and vocabularies, ``values`` the per-value rules, ``models`` the
pydantic models, ``cross_checks`` the rules across entries and ``validation`` the two passes
over a document. Importers name this package.
"""

from __future__ import annotations

from cache_family.schemas.operator.cross_checks import _repeated as _repeated  # a test times it
from cache_family.schemas.operator.cross_checks import (
    environment_refusals,
    secret_name_marker,
)
from cache_family.schemas.operator.limits import (
    CASES_MAX,
    CONCURRENCY_MAX_RUNGS,
    DOCUMENT_MAX_BYTES,
    ENV_ALIAS_PAIRS,
    ENV_DEVICE_NAMES,
    ENV_GGML_PREFIX,
    ENV_MAX_ENTRIES,
    ENV_PLAIN_NAMES,
    ENV_SECRET_MARKERS,
    ENV_SECRET_WORDS,
    ENV_VALUE_MAX_BYTES,
    I32_MAX,
    JSON_MAX_DEPTH,
    JSON_MAX_ENTRIES,
    KEY_PATTERN,
    MAX_RUNG,
    PATH_MAX_BYTES,
    PREFIX_SWEEP_MAX,
    SCHEMA_VERSION,
    TOOLKIT_MAX_ENTRIES,
    TOOLKIT_NAMES,
    U32_MAX,
    USE_CASES_ALL,
    USE_CASES_MAX,
    Loc,
)
from cache_family.schemas.operator.models import (
    OperatorInput,
    PinnedFile,
    PlanInput,
    ServerBinary,
    ToolkitDirectory,
)
from cache_family.schemas.operator.validation import (
    validate_operator_document,
    validate_operator_object,
    validate_plan_object,
)
from cache_family.schemas.operator.values import (
    AbsolutePath,
    AbsPath,
    CommitHex,
    Count1024,
    Count65536,
    GpuLayers,
    IntRange,
    LowerHex,
    PositiveU32,
    Rule,
    Rung,
    SchemaVersion,
    Sha256Hex,
)

__all__ = [
    "CASES_MAX",
    "CONCURRENCY_MAX_RUNGS",
    "DOCUMENT_MAX_BYTES",
    "ENV_ALIAS_PAIRS",
    "ENV_DEVICE_NAMES",
    "ENV_GGML_PREFIX",
    "ENV_MAX_ENTRIES",
    "ENV_PLAIN_NAMES",
    "ENV_SECRET_MARKERS",
    "ENV_SECRET_WORDS",
    "ENV_VALUE_MAX_BYTES",
    "I32_MAX",
    "JSON_MAX_DEPTH",
    "JSON_MAX_ENTRIES",
    "KEY_PATTERN",
    "MAX_RUNG",
    "PATH_MAX_BYTES",
    "PREFIX_SWEEP_MAX",
    "SCHEMA_VERSION",
    "TOOLKIT_MAX_ENTRIES",
    "TOOLKIT_NAMES",
    "U32_MAX",
    "USE_CASES_ALL",
    "USE_CASES_MAX",
    "AbsPath",
    "AbsolutePath",
    "CommitHex",
    "Count1024",
    "Count65536",
    "GpuLayers",
    "IntRange",
    "Loc",
    "LowerHex",
    "OperatorInput",
    "PinnedFile",
    "PlanInput",
    "PositiveU32",
    "Rule",
    "Rung",
    "SchemaVersion",
    "ServerBinary",
    "Sha256Hex",
    "ToolkitDirectory",
    "environment_refusals",
    "secret_name_marker",
    "validate_operator_document",
    "validate_operator_object",
    "validate_plan_object",
]
