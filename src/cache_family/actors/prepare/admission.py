"""Preparation admission: every check before the first write (exit 2 creates nothing).

The output must not exist, its parent must, and its canonical path must be disjoint from the
native build, the cache root and every toolkit directory.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from cache_family.actors.audit.trace_file import pin_trace
from cache_family.errors import Refusal, Refused, json_path
from cache_family.schemas.bounded import MIB, read_bounded
from cache_family.schemas.catalog import LoadedCatalog, load_catalog
from cache_family.schemas.catalog import packaged_catalog as _packaged_catalog
from cache_family.schemas.corpus import LoadedCorpus, default_corpus_path, load_corpus
from cache_family.schemas.operator import OperatorInput, PlanInput, validate_operator_object
from cache_family.schemas.prepared import CorpusSource, Mode, loads_strict_json
from cache_family.schemas.text import unsafe_character
from cache_family.schemas.workload import WorkloadsPin, read_workload_file
from cache_family.states.planning import check_selection
from cache_family.system.publish import overlapping_trees

OPERATOR_MAX_BYTES: Final = MIB
CORPUS_ENV: Final = "SKIPPY_CACHE_USECASE_CORPUS"
COMMAND_MODES: Final[Mapping[str, Mode]] = {
    "prepare-full": "full",
    "prepare-use-cases": "use-cases",
}
OVERRIDE_FIELDS: Final[Mapping[str, str]] = {
    "--prefix-tokens": "prefix_tokens",
    "--runtime-lane-count": "runtime_lane_count",
    "--llama-parallel": "llama_parallel",
    "--llama-repeats": "llama_repeats",
    "--cache-hit-repeats": "cache_hit_repeats",
}
CORPUS_FLAG: Final = "--use-case-corpus"
WORKLOADS_FLAG: Final = "--workloads"
#: Not a plan field (the operator input stays the reference's): the native concurrent ladder's
#: output tokens per request, instead of the reference's fixed 128, recorded in the prepared
#: input. Set to ``plan.concurrent_output_tokens``, the native curves compare the same work
#: as the stage arms'.
NATIVE_OUTPUT_FLAG: Final = "--native-output-tokens"
U32_MAX: Final = 2**32 - 1


# --- overrides ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Overrides:
    plan_fields: Mapping[str, int]
    corpus: str | None
    workloads: str | None = None
    native_output_tokens: int | None = None


def parse_overrides(arguments: Sequence[str]) -> Overrides:
    """``--name VALUE`` (or ``--name=VALUE``) pairs; each name once; unknown names refused."""
    refusals: list[Refusal] = []
    values: dict[str, int] = {}
    paths: dict[str, str] = {}
    native: int | None = None
    seen: set[str] = set()
    items = list(arguments)
    if items[:1] == ["--"]:
        items = items[1:]
    position = 0

    def refuse(code: str, message: str, hint: str) -> None:
        refusals.append(Refusal(code, "$.cli", message, hint))

    while position < len(items):
        token = items[position]
        name, has_inline, inline = token.partition("=")
        known = (*OVERRIDE_FIELDS, CORPUS_FLAG, WORKLOADS_FLAG, NATIVE_OUTPUT_FLAG)
        if not token.startswith("--") or name not in known:
            refuse(
                "preparation.override.unknown",
                f"unknown argument {token!r}",
                "overrides are --use-case-corpus ABS, --workloads ABS, --prefix-tokens, "
                "--runtime-lane-count, --llama-parallel, --llama-repeats, --cache-hit-repeats, "
                "--native-output-tokens N",
            )
            position += 1
            # an unknown --flag's value is part of the same mistake, not a second one
            if token.startswith("--") and not has_inline and position < len(items):
                position += 0 if items[position].startswith("--") else 1
            continue
        if has_inline:
            value: str | None = inline
            position += 1
        elif position + 1 < len(items):
            value = items[position + 1]
            position += 2
        else:
            value = None
            position += 1
        if name in seen:
            refuse(
                "preparation.override.duplicate",
                f"{name} is given more than once",
                "give each override at most once",
            )
            continue
        seen.add(name)
        if value is None:
            refuse(
                "preparation.override.missing_value", f"{name} has no value", f"write {name} VALUE"
            )
            continue
        if name in (CORPUS_FLAG, WORKLOADS_FLAG):
            problem = _override_path_problem(name, value)
            if problem is not None:
                refuse(*problem)
            paths[name] = value
            continue
        if not value.isascii() or not value.isdigit() or not 0 < int(value) <= U32_MAX:
            refuse(
                "preparation.override.bad_value",
                f"{name} {value!r} is not a whole number from 1 to {U32_MAX}",
                "give a positive whole number",
            )
            continue
        if name == NATIVE_OUTPUT_FLAG:
            native = int(value)
            continue
        values[OVERRIDE_FIELDS[name]] = int(value)
    if refusals:
        raise Refused(tuple(refusals))
    return Overrides(
        plan_fields=values,
        corpus=paths.get(CORPUS_FLAG),
        workloads=paths.get(WORKLOADS_FLAG),
        native_output_tokens=native,
    )


def _override_path_problem(name: str, value: str) -> tuple[str, str, str] | None:
    """Why a file path override is refused (code, message, hint), if it is: the rules of
    the command line's ``--input`` (no control or invisible characters, no trailing slash)
    and of the operator input's paths (absolute, normal form: no ``.``/``..`` or ``//``).
    Printed escaped: a path is shown in refusals, never its raw terminal sequences."""
    shown = ascii(value)
    if unsafe_character(value) is not None:
        return (
            "preparation.override.bad_path",
            f"{name} {shown} holds a control, invisible or non-UTF-8 character",
            "retype the path without control or invisible characters",
        )
    if not posixpath.isabs(value):
        return (
            "preparation.override.not_absolute",
            f"{name} {shown} is not an absolute path",
            "give an absolute path",
        )
    normal = "/" + posixpath.normpath(value).lstrip("/")
    if value != normal:
        return (
            "preparation.override.not_normalized",
            f"{name} {shown} is not in normal form (a trailing slash, `.`, `..` or `//`)",
            f"write it as {normal!a}",
        )
    return None


# --- admission ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admission:
    """Everything decided before the first write."""

    mode: Mode
    operator: OperatorInput
    catalog: LoadedCatalog
    corpus: LoadedCorpus | None
    corpus_source: CorpusSource | None
    output: str  # canonical parent + the new name
    budget_seconds: float
    # prepare-full's --use-case-corpus: accepted (the reference wrapper passes it to both
    # modes) and recorded as unused in the prepared input.
    unused_corpus: str | None = None
    # --workloads: the workload file, read and pinned here (the run never reads it again).
    workloads: WorkloadsPin | None = None
    # --native-output-tokens: the native ladder's output tokens per request (None: 128).
    native_output_tokens: int | None = None


def strict_json(data: bytes, what: str) -> Any:
    try:
        return loads_strict_json(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Refused.one(
            "operator.json.decode",
            "$",
            f"the {what} is not strict UTF-8 JSON: {exc}",
            "write one UTF-8 JSON object, each member once, without NaN or Infinity",
        ) from None


def _select_corpus(
    mode: Mode, overrides: Overrides, environ: Mapping[str, str], declared: object
) -> tuple[LoadedCorpus | None, CorpusSource | None]:
    """prepare-use-cases: --use-case-corpus, else $SKIPPY_CACHE_USECASE_CORPUS, else the
    plan's own corpus (checked against its pin), else the packaged corpus. prepare-full
    selects none; its --use-case-corpus is recorded as unused (see Admission), not read."""
    if mode == "full":
        return None, None
    if overrides.corpus is not None:
        return load_corpus(overrides.corpus), "override"
    from_env = environ.get(CORPUS_ENV)
    if from_env:
        if not Path(from_env).is_absolute():
            raise Refused.one(
                "preparation.corpus_env_not_absolute",
                f"$env.{CORPUS_ENV}",
                f"{CORPUS_ENV}={from_env!r} is not an absolute path",
                "give an absolute path",
            )
        return load_corpus(from_env), "environment"
    if isinstance(declared, dict) and isinstance(declared.get("path"), str):
        loaded = load_corpus(declared["path"])
        _refuse_unless_declared("corpus", loaded.path, loaded.sha256, declared.get("sha256"))
        return loaded, "operator-plan"
    return load_corpus(default_corpus_path()), "checked-in"


def _refuse_unless_declared(
    what: Literal["catalog", "corpus"], path: str, sha256: str, declared: object
) -> None:
    """The plan's catalog or corpus must be the bytes its ``sha256`` declares."""
    if sha256 != declared:
        raise Refused.one(
            f"preparation.{what}_pin_mismatch",
            f"$.plan.{what}.sha256",
            f"{what} {path} has SHA-256 {sha256}, not the declared one",
            f"restore the {what} or update plan.{what}.sha256",
        )


def load_plan_catalog(plan: PlanInput) -> LoadedCatalog:
    """The catalog a plan names (its bytes must match the pin), else the packaged one."""
    if plan.catalog is None:
        return _packaged_catalog()
    loaded = load_catalog(plan.catalog.path)
    _refuse_unless_declared("catalog", loaded.path, loaded.sha256, plan.catalog.sha256)
    return loaded


def _check_output(output: str, operator: OperatorInput) -> str:
    if not Path(output).is_absolute():
        raise Refused.one(
            "preparation.output_not_absolute",
            "$.output",
            f"output {output!r} is not absolute",
            "give an absolute path for a directory that does not exist yet",
        )
    if os.path.lexists(output):
        raise Refused.one(
            "preparation.output_exists",
            "$.output",
            f"output {output} already exists",
            "choose a fresh output path; preparation never writes into an existing one",
        )
    parent = os.path.dirname(output.rstrip("/")) or "/"
    if not Path(parent).is_dir():
        raise Refused.one(
            "preparation.output_parent_missing",
            "$.output",
            f"the parent directory of {output} does not exist",
            "create the parent directory first",
        )
    canonical = os.path.join(os.path.realpath(parent), os.path.basename(output.rstrip("/")))
    guarded = [
        ("$.native_build", operator.native_build),
        ("$.plan.cache_root", operator.plan.cache_root),
    ]
    guarded += [
        (json_path(["toolkit_directories", name]), toolkit.path)
        for name, toolkit in operator.toolkit_directories.items()
    ]
    if operator.openai_server is not None and operator.openai_server.tree is not None:
        guarded.append(("$.openai_server.tree", operator.openai_server.tree))
    refusals = [
        Refusal(
            "preparation.output_not_disjoint",
            where,
            f"output {canonical} overlaps {tree_canonical}",
            "write the prepared input outside the build, cache and toolkit trees",
        )
        for where, tree_canonical in overlapping_trees(canonical, guarded)
    ]
    if refusals:
        raise Refused(tuple(refusals))
    return canonical


def admit(
    command: str,
    input_path: str,
    output: str,
    overrides: Sequence[str],
    *,
    environ: Mapping[str, str],
) -> Admission:
    """Every check that needs no write; raises :class:`Refused` (exit 2) with all it found."""
    mode = COMMAND_MODES.get(command)
    if mode is None:
        raise Refused.one(
            "preparation.command",
            "$.cli",
            f"unknown command {command!r}",
            "use prepare-full or prepare-use-cases",
        )
    parsed = parse_overrides(overrides)
    raw = read_bounded(input_path, OPERATOR_MAX_BYTES, what="operator input")
    document = strict_json(raw.data, "operator input")
    if not isinstance(document, dict):
        raise Refused.one(
            "operator.type", "$", "the operator input is not an object", "write one JSON object"
        )
    refusals: list[Refusal] = []
    plan = document.get("plan")
    corpus: LoadedCorpus | None = None
    corpus_source: CorpusSource | None = None
    try:
        corpus, corpus_source = _select_corpus(
            mode, parsed, environ, plan.get("corpus") if isinstance(plan, dict) else None
        )
    except Refused as refused:
        refusals.extend(refused.refusals)
    if isinstance(plan, dict):
        plan = dict(plan)
        plan.update(parsed.plan_fields)
        # Without a usable corpus the plan is validated as a full one: its refusal is enough.
        plan["use_cases"] = ["all"] if corpus is not None else []
        plan["corpus"] = (
            {"path": corpus.path, "sha256": corpus.sha256} if corpus is not None else None
        )
        document = {**document, "plan": plan}
    try:
        operator = validate_operator_object(document)
    except Refused as refused:
        raise Refused((*refusals, *refused.refusals)) from None
    try:
        catalog = load_plan_catalog(operator.plan)
        check_selection(operator.plan, catalog.catalog, corpus.corpus if corpus else None)
    except Refused as refused:
        refusals.extend(refused.refusals)
    workloads: WorkloadsPin | None = None
    if parsed.workloads is not None:
        try:
            workloads = read_workload_file(parsed.workloads)
            trace = workloads.workloads.trace
            if trace is not None:
                # The trace is pinned as the workload file is: the run replays these bytes.
                pinned_trace, distinct = pin_trace(trace)
                pinned = workloads.workloads.model_copy(update={"trace": pinned_trace})
                workloads = workloads.model_copy(
                    update={"workloads": pinned, "trace_distinct_ids": distinct}
                )
        except Refused as refused:
            refusals.extend(refused.refusals)
    try:
        canonical_output = _check_output(output, operator)
    except Refused as refused:
        refusals.extend(refused.refusals)
    if refusals:
        raise Refused(tuple(refusals))
    return Admission(
        mode=mode,
        operator=operator,
        catalog=catalog,
        corpus=corpus,
        corpus_source=corpus_source,
        output=canonical_output,
        budget_seconds=float(operator.preparation_seconds),
        unused_corpus=parsed.corpus if mode == "full" else None,
        workloads=workloads,
        native_output_tokens=parsed.native_output_tokens,
    )
