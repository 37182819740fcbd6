"""Which rows of a prepared input one run runs: ``--rows KEY,…`` or ``--shard I/N``. Pure.

A row's key is ``CASE/USE_CASE/PREFIX`` (``qwen3_dense/none/512``): it names what the row
measures, so it survives changes to the plan. A shard takes the rows the rendezvous hash
(largest SHA-256 of ``i``, ``N``, key) gives it: adding rows never moves another, and the shards
together hold every row exactly once.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from cache_family.errors import Refusal, Refused

NO_USE_CASE: Final = "none"
# The most shards one campaign is split into (a Slurm or Kubernetes array larger than this
# would hold rows of a plan far bigger than any catalog gives).
MAX_SHARDS: Final = 4096
# Environment variables a batch scheduler sets to an array task's index, in the order read.
SLURM_INDEX: Final = "SLURM_ARRAY_TASK_ID"
SLURM_MIN: Final = "SLURM_ARRAY_TASK_MIN"
KUBERNETES_INDEX: Final = "JOB_COMPLETION_INDEX"

_SHARD = re.compile(r"^(?P<index>auto|0|[1-9][0-9]{0,8})/(?P<count>[1-9][0-9]{0,8})$")
_INDEX = re.compile(r"^(0|[1-9][0-9]{0,8})$")


def row_key(case: str, use_case: str | None, prefix_tokens: int | None) -> str:
    """The stable key of one row: ``CASE/USE_CASE/PREFIX``."""
    prefix = "none" if prefix_tokens is None else str(prefix_tokens)
    return f"{case}/{use_case or NO_USE_CASE}/{prefix}"


@dataclass(frozen=True, slots=True)
class Shard:
    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass(frozen=True, slots=True)
class Selection:
    """The rows one run runs, in plan order, and how they were chosen."""

    how: str  # "rows" | "shard"
    row_keys: tuple[str, ...]
    shard: Shard | None = None


def plan_keys(rows: Sequence[tuple[int, str]]) -> dict[str, int]:
    """Row key -> plan index for a plan's ``(index, key)`` pairs; two rows with one key are
    refused (a key must name one row)."""
    keys: dict[str, int] = {}
    for index, key in rows:
        if key in keys:
            raise Refused.one(
                "run.rows.ambiguous_key",
                "$.rows",
                f"rows {keys[key]} and {index} of the prepared input share the key {key!r}",
                "prepare a plan that names each (case, use case, prefix) once",
            )
        keys[key] = index
    return keys


def shard_of(key: str, count: int) -> int:
    """The shard of ``count`` that the rendezvous hash gives the row ``key``."""
    best, best_weight = 0, b""
    for shard in range(count):
        weight = hashlib.sha256(f"{shard}/{count}\0{key}".encode()).digest()
        if weight > best_weight:
            best, best_weight = shard, weight
    return best


def parse_shard(text: str, environ: Mapping[str, str]) -> Shard:
    """``I/N`` or ``auto/N`` (the index from the batch scheduler's environment)."""
    match = _SHARD.fullmatch(text)
    if match is None:
        raise Refused.one(
            "run.shard.malformed",
            "$.shard",
            f"--shard {text!r} is not I/N or auto/N",
            "give the shard as I/N (0 <= I < N), e.g. 0/3, or auto/N in an array job",
        )
    count = int(match["count"])
    if count > MAX_SHARDS:
        raise Refused.one(
            "run.shard.out_of_range",
            "$.shard",
            f"--shard {text}: {count} shards, more than {MAX_SHARDS}",
            f"split the campaign into at most {MAX_SHARDS} shards",
        )
    index = _auto_index(environ) if match["index"] == "auto" else int(match["index"])
    if index >= count:
        raise Refused.one(
            "run.shard.out_of_range",
            "$.shard",
            f"shard index {index} is not below the shard count {count}",
            "an array of N tasks has indices 0..N-1 (Slurm: --array=0-(N-1); Kubernetes: "
            "completions N, completionMode Indexed)",
        )
    return Shard(index=index, count=count)


def _auto_index(environ: Mapping[str, str]) -> int:
    found: list[tuple[str, int]] = []
    for name in (SLURM_INDEX, KUBERNETES_INDEX):
        value = environ.get(name)
        if value is None:
            continue
        if not _INDEX.fullmatch(value):
            raise Refused.one(
                "run.shard.no_index",
                "$.shard",
                f"{name}={value!r} is not a whole number",
                "run --shard auto/N inside a Slurm array or a Kubernetes Indexed Job",
            )
        index = int(value)
        if name == SLURM_INDEX:
            # An array may be numbered from 1 (--array=1-3): its first task is shard 0.
            low = environ.get(SLURM_MIN, "0")
            index -= int(low) if _INDEX.fullmatch(low) else 0
        found.append((name, index))
    if not found:
        raise Refused.one(
            "run.shard.no_index",
            "$.shard",
            f"--shard auto/N needs {SLURM_INDEX} or {KUBERNETES_INDEX}; neither is set",
            "run it as a Slurm array task or a Kubernetes Indexed Job, or give the index (I/N)",
        )
    if len({index for _, index in found}) > 1:
        names = ", ".join(f"{name} gives {index}" for name, index in found)
        raise Refused.one(
            "run.shard.no_index",
            "$.shard",
            f"the scheduler's indices disagree ({names})",
            "unset the one that does not belong to this job, or give the index (I/N)",
        )
    return found[0][1]


def select_rows(
    keys: Mapping[str, int], *, rows: Sequence[str] | None = None, shard: Shard | None = None
) -> Selection:
    """The selection of the plan ``keys`` (key -> index) named by ``--rows`` or ``--shard``."""
    in_plan_order = sorted(keys, key=keys.__getitem__)
    if shard is not None:
        chosen = tuple(key for key in in_plan_order if shard_of(key, shard.count) == shard.index)
        return Selection(how="shard", row_keys=chosen, shard=shard)
    asked = list(rows or ())
    problems = [
        Refusal(
            "run.rows.unknown",
            f"$.rows[{position}]",
            f"no row of the prepared input has the key {key!r}",
            "list the keys with `cache-family run --input PREPARED --dry-run` "
            "(a key is CASE/USE_CASE/PREFIX)",
        )
        for position, key in enumerate(asked)
        if key not in keys
    ]
    problems.extend(
        Refusal(
            "run.rows.repeated",
            f"$.rows[{position}]",
            f"the row {key!r} is named more than once",
            "name each row once",
        )
        for position, key in enumerate(asked)
        if key in asked[:position]
    )
    if not asked:
        problems.append(
            Refusal("run.rows.empty", "$.rows", "--rows names no row", "give KEY[,KEY…]")
        )
    if problems:
        raise Refused(tuple(problems))
    wanted = set(asked)
    return Selection(how="rows", row_keys=tuple(k for k in in_plan_order if k in wanted))


def split_row_list(text: str) -> list[str]:
    """``--rows KEY[,KEY…]``: the keys in the order given (blank entries dropped)."""
    return [part.strip() for part in text.split(",") if part.strip()]
