"""The cross checks (pass 2): rules that relate entries to each other, over the raw document.

Anything of the wrong type is skipped here because pass 1 refuses it. Environment values are
never echoed in a refusal: only the name is shown.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, Final, TypeAlias

from cache_family.errors import Refusal, json_path
from cache_family.schemas.operator.limits import (
    CASES_MAX,
    CONCURRENCY_MAX_RUNGS,
    ENV_ALIAS_PAIRS,
    ENV_MAX_ENTRIES,
    ENV_PLAIN_NAMES,
    ENV_SECRET_MARKERS,
    ENV_SECRET_WORDS,
    ENV_VALUE_MAX_BYTES,
    KEY_PATTERN,
    PREFIX_SWEEP_MAX,
    TOOLKIT_MAX_ENTRIES,
    TOOLKIT_NAMES,
    USE_CASES_ALL,
    USE_CASES_MAX,
    Loc,
)
from cache_family.schemas.operator.values import _show
from cache_family.schemas.refusal_codes import default_hint
from cache_family.schemas.text import unsafe_character

_GGML_NAME = re.compile(r"GGML_[A-Z0-9_]+")


def _catalog_keys() -> tuple[str, ...]:
    """Keys of the packaged catalog, in catalog order.

    Only a plan without a catalog of its own is checked against these here; a plan naming
    ``plan.catalog`` may use that catalog's own keys, which preparation checks once it has read
    (and pinned) those bytes (``planning.unknown_case``).
    """
    from cache_family.schemas.catalog import packaged_catalog

    return packaged_catalog().catalog.keys


def _refusal(code: str, loc: Loc, message: str, hint: str | None = None) -> tuple[Loc, Refusal]:
    return loc, Refusal(code, json_path(loc), message, hint or default_hint(code))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_ALIAS_NAMES: Final = frozenset(name for pair in ENV_ALIAS_PAIRS for name in pair)


_NAME_SEGMENT = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


def secret_name_marker(name: str) -> str | None:
    """What makes an environment name look like a secret or a path, or None.

    The reference's markers count anywhere in the name (`HF_TOKEN`, `MY_API_KEY`,
    `GGML_BACKEND_DL_PATH`); the abbreviations in ENV_SECRET_WORDS count as a whole segment.
    """
    upper = name.upper()
    marker = next((m for m in ENV_SECRET_MARKERS if m in upper), None)
    if marker is not None:
        return marker
    segments = {segment.upper() for segment in _NAME_SEGMENT.findall(name)}
    return next((word for word in ENV_SECRET_WORDS if word in segments), None)


def _env_name_refusal(name: str, loc: Loc) -> tuple[Loc, Refusal] | None:
    # Secret-looking names first: GGML_BACKEND_DL_PATH matches the GGML_ prefix but is a path.
    marker = secret_name_marker(name)
    if marker is not None:
        return _refusal(
            "operator.environment.secret_name",
            loc,
            f"environment name {_show(name, 80)} looks like a secret or a path ({marker}); "
            "its value is not shown",
        )
    if name in ENV_PLAIN_NAMES or name in _ALIAS_NAMES or _GGML_NAME.fullmatch(name):
        return None
    return _refusal(
        "operator.environment.not_allowed",
        loc,
        f"environment name {_show(name, 80)} is not allowed",
    )


def _env_value_refusal(name: str, value: str, loc: Loc) -> tuple[Loc, Refusal] | None:
    size = len(value.encode("utf-8", "surrogatepass"))
    if not 1 <= size <= ENV_VALUE_MAX_BYTES:
        return _refusal(
            "operator.environment.bad_value",
            loc,
            f"value of {name} has {size} bytes, outside 1..={ENV_VALUE_MAX_BYTES}",
        )
    # Values are not enumerated (the reference allowlists names only): device UUIDs
    # (GPU-..., MIG-...), `-1`, CMake lists (`86;89`) and target features (`gfx90a:xnack-`)
    # are all real settings. Only what would corrupt a log line or hide text is refused.
    unsafe = unsafe_character(value)
    if unsafe is None:
        return None
    what = "an invisible format character" if unsafe == "format" else "a control character"
    return _refusal("operator.environment.bad_value", loc, f"value of {name} contains {what}")


def _environment_cross_entry(env: Mapping[Any, object]) -> list[tuple[Loc, Refusal]]:
    out: list[tuple[Loc, Refusal]] = []
    if len(env) > ENV_MAX_ENTRIES:
        out.append(
            _refusal(
                "operator.environment.too_many",
                ("environment",),
                f"environment has {len(env)} entries, more than {ENV_MAX_ENTRIES}",
            )
        )
    accepted: dict[str, str] = {}
    for name, value in env.items():
        if not isinstance(name, str):
            continue
        loc: Loc = ("environment", name)
        refused = _env_name_refusal(name, loc)
        if refused is None and isinstance(value, str):
            refused = _env_value_refusal(name, value, loc)
            if refused is None:
                accepted[name] = value
        if refused is not None:
            out.append(refused)
    for first, second in ENV_ALIAS_PAIRS:
        if first in accepted and second in accepted and accepted[first] != accepted[second]:
            out.append(
                _refusal(
                    "operator.environment.alias_conflict",
                    ("environment", second),
                    f"{first} and {second} name the same setting with different values",
                )
            )
    return out


def environment_refusals(env: Mapping[Any, object]) -> list[Refusal]:
    """The operator's environment rules applied to any environment map (names, values,
    aliases), such as the ones a prepared input hands to each host."""
    return [refusal for _, refusal in _environment_cross_entry(env)]


def _toolkit_cross_entry(toolkits: Mapping[Any, object]) -> list[tuple[Loc, Refusal]]:
    out: list[tuple[Loc, Refusal]] = []
    if len(toolkits) > TOOLKIT_MAX_ENTRIES:
        out.append(
            _refusal(
                "operator.toolkit.too_many",
                ("toolkit_directories",),
                f"{len(toolkits)} toolkit directories, more than {TOOLKIT_MAX_ENTRIES}",
            )
        )
    for name in toolkits:
        if isinstance(name, str) and name not in TOOLKIT_NAMES:
            out.append(
                _refusal(
                    "operator.toolkit.bad_name",
                    ("toolkit_directories", name),
                    f"toolkit directory name {_show(name, 80)} is not allowed",
                )
            )
    return out


def _repeated(items: Iterable[Hashable]) -> list[Hashable]:
    """Items seen more than once, in order of their second sighting.

    Hash-based on purpose: a 1 MiB document can hold a list of 100k entries, and a
    list scan per entry made validation quadratic (minutes for one document).
    """
    seen: set[Hashable] = set()
    repeated: dict[Hashable, None] = {}
    for item in items:
        if item in seen:
            repeated[item] = None
        else:
            seen.add(item)
    return list(repeated)


def _strings(value: object) -> list[tuple[int, str]]:
    return (
        [(i, v) for i, v in enumerate(value) if isinstance(v, str)]
        if isinstance(value, list)
        else []
    )


def _ints(value: object) -> list[int]:
    return [v for v in value if _is_int(v)] if isinstance(value, list) else []


# --- the plan's rules, one check each, run in this order by _plan_cross_entry -----------------


def _cases_within_limit(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    cases = plan.get("cases")
    if not isinstance(cases, list) or len(cases) <= CASES_MAX:
        return []
    return [
        _refusal(
            "plan.case.too_many",
            (*base, "cases"),
            f"cases has {len(cases)} entries, more than {CASES_MAX}",
        )
    ]


def _own_catalog(plan: Mapping[Any, object]) -> bool:
    return plan.get("catalog") is not None


def _cases_in_catalog(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    if _own_catalog(plan):
        return []
    return [
        _refusal(
            "plan.case.unknown",
            (*base, "cases", index),
            f"case {_show(case, 80)} is not in the catalog",
            "use one of " + ", ".join(_catalog_keys()),
        )
        for index, case in _strings(plan.get("cases"))
        if case not in _catalog_keys()
    ]


def _cases_unique(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    repeated = _repeated(case for _, case in _strings(plan.get("cases")))
    if not repeated:
        return []
    return [
        _refusal(
            "plan.case.duplicate",
            (*base, "cases"),
            "cases repeats " + ", ".join(_show(str(c), 80) for c in repeated),
        )
    ]


def _use_cases_within_limit(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    use_cases = plan.get("use_cases")
    if not isinstance(use_cases, list) or len(use_cases) <= USE_CASES_MAX:
        return []
    return [
        _refusal(
            "plan.use_case.too_many",
            (*base, "use_cases"),
            f"use_cases has {len(use_cases)} entries, more than {USE_CASES_MAX}",
        )
    ]


def _use_case_keys_well_formed(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    return [
        _refusal(
            "plan.use_case.bad_key",
            (*base, "use_cases", index),
            f"use case {_show(key, 80)} is not a key `{KEY_PATTERN.pattern}`",
        )
        for index, key in _strings(plan.get("use_cases"))
        if not KEY_PATTERN.fullmatch(key)
    ]


def _use_case_all_alone(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    use_cases = plan.get("use_cases")
    if not isinstance(use_cases, list) or len(use_cases) <= 1:
        return []
    if not any(key == USE_CASES_ALL for _, key in _strings(use_cases)):
        return []
    return [
        _refusal(
            "plan.use_case.all_not_alone",
            (*base, "use_cases"),
            f'"{USE_CASES_ALL}" must be the only use case when given',
        )
    ]


def _use_cases_unique(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    repeated = _repeated(key for _, key in _strings(plan.get("use_cases")))
    if not repeated:
        return []
    return [
        _refusal(
            "plan.use_case.duplicate",
            (*base, "use_cases"),
            "use_cases repeats " + ", ".join(_show(str(k), 80) for k in repeated),
        )
    ]


def _corpus_iff_use_cases(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    use_cases = plan.get("use_cases")
    if not isinstance(use_cases, list) or "corpus" not in plan:
        return []
    corpus = plan["corpus"]
    if use_cases and corpus is None:
        return [
            _refusal(
                "plan.corpus.required",
                (*base, "corpus"),
                "use cases are selected but corpus is null",
            )
        ]
    if not use_cases and corpus is not None:
        return [
            _refusal(
                "plan.corpus.unexpected",
                (*base, "corpus"),
                "corpus is set but use_cases is empty",
            )
        ]
    return []


def _prefix_sweep_within_limit(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    sweep = plan.get("prefix_sweep")
    if not isinstance(sweep, list) or len(sweep) <= PREFIX_SWEEP_MAX:
        return []
    return [
        _refusal(
            "plan.prefix_sweep.too_many",
            (*base, "prefix_sweep"),
            f"prefix_sweep has {len(sweep)} entries, more than {PREFIX_SWEEP_MAX}",
        )
    ]


def _prefix_sweep_unique(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    repeated = _repeated(_ints(plan.get("prefix_sweep")))
    if not repeated:
        return []
    return [
        _refusal(
            "plan.prefix_sweep.duplicate",
            (*base, "prefix_sweep"),
            "prefix_sweep repeats " + ", ".join(str(p) for p in repeated),
        )
    ]


def _ladder_not_empty(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    ladder = plan.get("concurrency")
    if not isinstance(ladder, list) or ladder:
        return []
    loc = (*base, "concurrency")
    return [_refusal("plan.concurrency.empty", loc, "the concurrency ladder is empty")]


def _ladder_within_limit(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    ladder = plan.get("concurrency")
    if not isinstance(ladder, list) or len(ladder) <= CONCURRENCY_MAX_RUNGS:
        return []
    return [
        _refusal(
            "plan.concurrency.too_many",
            (*base, "concurrency"),
            f"{len(ladder)} rungs, more than {CONCURRENCY_MAX_RUNGS}",
        )
    ]


def _ladder_sorted_unique(rungs: list[int]) -> str:
    """The ladder a refusal suggests instead: its rungs, once each, ascending."""
    return "[" + ", ".join(str(r) for r in sorted(set(rungs))) + "]"


def _ladder_unique(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    rungs = _ints(plan.get("concurrency"))
    repeated = _repeated(rungs)
    if not repeated:
        return []
    return [
        _refusal(
            "plan.concurrency.duplicate",
            (*base, "concurrency"),
            "the ladder repeats " + ", ".join(str(r) for r in repeated),
            f"use {_ladder_sorted_unique(rungs)}",
        )
    ]


def _ladder_ascending(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    rungs = _ints(plan.get("concurrency"))
    if not any(a > b for a, b in itertools.pairwise(rungs)):
        return []
    return [
        _refusal(
            "plan.concurrency.not_ascending",
            (*base, "concurrency"),
            "rungs must be strictly ascending",
            f"use {_ladder_sorted_unique(rungs)}",
        )
    ]


def _servers_paired(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    if "old_server" not in plan or "new_server" not in plan:
        return []
    old, new = plan["old_server"], plan["new_server"]
    if (old is None) == (new is None):
        return []
    missing = "old_server" if old is None else "new_server"
    present = "new_server" if old is None else "old_server"
    return [
        _refusal(
            "plan.servers.one_sided",
            (*base, missing),
            f"{present} is set but {missing} is null",
        )
    ]


def _model_pins_in_catalog(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    pins = plan.get("model_sha256")
    if not isinstance(pins, dict) or _own_catalog(plan):
        return []
    return [
        _refusal(
            "plan.case.unknown",
            (*base, "model_sha256", key),
            f"model_sha256 names {_show(key, 80)}, which is not in the catalog",
            "use one of " + ", ".join(_catalog_keys()),
        )
        for key in pins
        if isinstance(key, str) and key not in _catalog_keys()
    ]


_PlanCheck: TypeAlias = Callable[[Mapping[Any, object], Loc], list[tuple[Loc, Refusal]]]

# In this order: a field's refusals keep the order they had when one function made them all.
_PLAN_CHECKS: Final[tuple[_PlanCheck, ...]] = (
    _cases_within_limit,
    _cases_in_catalog,
    _cases_unique,
    _use_cases_within_limit,
    _use_case_keys_well_formed,
    _use_case_all_alone,
    _use_cases_unique,
    _corpus_iff_use_cases,
    _prefix_sweep_within_limit,
    _prefix_sweep_unique,
    _ladder_not_empty,
    _ladder_within_limit,
    _ladder_unique,
    _ladder_ascending,
    _servers_paired,
    _model_pins_in_catalog,
)


def _plan_cross_entry(plan: Mapping[Any, object], base: Loc) -> list[tuple[Loc, Refusal]]:
    return [found for check in _PLAN_CHECKS for found in check(plan, base)]


def _operator_cross_entry(
    doc: Mapping[Any, object], *, include_plan: bool = True
) -> list[tuple[Loc, Refusal]]:
    out: list[tuple[Loc, Refusal]] = []
    env = doc.get("environment")
    if isinstance(env, dict):
        out.extend(_environment_cross_entry(env))
    toolkits = doc.get("toolkit_directories")
    if isinstance(toolkits, dict):
        out.extend(_toolkit_cross_entry(toolkits))
    plan = doc.get("plan")
    if include_plan and isinstance(plan, dict):
        out.extend(_plan_cross_entry(plan, ("plan",)))
    return out
