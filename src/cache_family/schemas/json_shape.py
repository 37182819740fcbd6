"""Bounded walks over decoded JSON: nesting and container sizes, before per-entry work.

A decoded document's shape decides how much work validating it takes (one refusal per bad
entry, recursion per level). These walks are iterative and never look past their bounds, so
whatever a document holds, checking its shape is cheap and raises nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

Loc = tuple[str | int, ...]


def containers(
    root: object, base: Loc, *, max_depth: int, max_entries: int
) -> Iterator[tuple[list[Any] | dict[Any, Any], Loc, int]]:
    """Arrays and objects of ``root`` with their location and depth (root = 1).

    Only the first ``max_entries`` entries of a container are looked into, and nothing below
    a container deeper than ``max_depth`` (which is still yielded, so a caller sees it).
    """
    stack: list[tuple[object, Loc, int]] = [(root, base, 1)]
    while stack:
        node, loc, depth = stack.pop()
        if not isinstance(node, list | dict):
            continue
        yield node, loc, depth
        if depth > max_depth:
            continue
        entries: Iterable[tuple[object, object]] = (
            node.items() if isinstance(node, dict) else enumerate(node)
        )
        stack.extend(
            (item, (*loc, key if isinstance(key, str | int) else str(key)), depth + 1)
            for key, item in itertools.islice(entries, max_entries)
            if isinstance(item, list | dict)
        )
