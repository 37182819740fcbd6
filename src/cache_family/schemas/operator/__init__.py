"""Operator input (schema_version 1) and its plan: strict models, every refusal at once.

``limits`` holds the bounds and vocabularies, ``values`` the per-value rules, ``models`` the
pydantic models, ``cross_checks`` the rules across entries and ``validation`` the two passes
over a document. This package re-exports what code outside it uses.
"""

from __future__ import annotations

from cache_family.schemas.operator.cross_checks import _repeated as _repeated  # a test times it
from cache_family.schemas.operator.cross_checks import (
    environment_refusals,
    secret_name_marker,
)
from cache_family.schemas.operator.limits import (
    DOCUMENT_MAX_BYTES,
    ENV_ALIAS_PAIRS,
    ENV_GGML_PREFIX,
    ENV_PLAIN_NAMES,
    ENV_SECRET_MARKERS,
    ENV_SECRET_WORDS,
    ENV_VALUE_MAX_BYTES,
    JSON_MAX_ENTRIES,
    KEY_PATTERN,
    TOOLKIT_NAMES,
)
from cache_family.schemas.operator.models import (
    OpenAIServer,
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
    IntRange,
    LowerHex,
    Rule,
    SchemaVersion,
)

__all__ = [
    "DOCUMENT_MAX_BYTES",
    "ENV_ALIAS_PAIRS",
    "ENV_GGML_PREFIX",
    "ENV_PLAIN_NAMES",
    "ENV_SECRET_MARKERS",
    "ENV_SECRET_WORDS",
    "ENV_VALUE_MAX_BYTES",
    "JSON_MAX_ENTRIES",
    "KEY_PATTERN",
    "TOOLKIT_NAMES",
    "AbsolutePath",
    "IntRange",
    "LowerHex",
    "OpenAIServer",
    "OperatorInput",
    "PinnedFile",
    "PlanInput",
    "Rule",
    "SchemaVersion",
    "ServerBinary",
    "ToolkitDirectory",
    "environment_refusals",
    "secret_name_marker",
    "validate_operator_document",
    "validate_operator_object",
    "validate_plan_object",
]
