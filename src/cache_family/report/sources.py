"""The use-case corpus as the report's source table reads it.

Leniently, as the reference does: only ``key``, ``label`` and ``source`` of each entry are
read and other members are ignored, so a corpus from another producer renders too. The
strict loader for preparation is ``schemas/corpus.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from cache_family.report.decode import Reader, Refusals, Where
from cache_family.schemas.bounded import MIB

MAX_CORPUS_BYTES: Final = 16 * MIB
MAX_CORPUS_ENTRIES: Final = 10_000


@dataclass(frozen=True, slots=True)
class SourceEntry:
    key: str
    label: str | None
    dataset: str
    config: str
    split: str
    row_idx: int | None


def read_sources(path: str, refusals: Refusals) -> tuple[SourceEntry, ...]:
    """The entries of the corpus at ``path`` (absolute); problems go to ``refusals``."""
    reader = Reader(path, what="use-case corpus", sink=refusals)
    ok, document = reader.load(MAX_CORPUS_BYTES)
    if not ok:
        return ()
    if not isinstance(document, dict):
        reader.wrong([], "an object (the corpus)", document)
        return ()
    present, entries = reader.member(document, "use_cases", [])
    if not present:
        # Unlike a row's members, this one has no default: `{}` is not a corpus (an empty
        # corpus lists no use cases: `"use_cases": []`).
        reader.refuse("report.missing_field", ["use_cases"], "the corpus has no use_cases")
        return ()
    if not isinstance(entries, list):
        reader.wrong(["use_cases"], "an array", entries)
        return ()
    if len(entries) > MAX_CORPUS_ENTRIES:
        reader.refuse(
            "report.corpus_too_large",
            ["use_cases"],
            f"{len(entries)} use cases, more than {MAX_CORPUS_ENTRIES}",
        )
        return ()
    out: list[SourceEntry] = []
    for i, entry in enumerate(entries):
        where: Where = ["use_cases", i]
        if not isinstance(entry, dict):
            reader.wrong(where, "an object (a use case)", entry)
            continue
        source = reader.obj(entry, "source", where)
        at_source: Where = [*where, "source"]
        out.append(
            SourceEntry(
                key=reader.text(entry, "key", where),
                label=reader.opt_text(entry, "label", where),
                dataset=reader.text(source, "dataset", at_source),
                config=reader.text(source, "config", at_source),
                split=reader.text(source, "split", at_source),
                row_idx=reader.opt_count(source, "row_idx", at_source),
            )
        )
    return tuple(out)
