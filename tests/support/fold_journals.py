"""Helpers several test modules share (they were in test_fold.py)."""

from __future__ import annotations

from cell_journal_builder import run_started

from cache_family.schemas.journal import (
    JournalLine,
    Record,
    encode_journal,
    read_journal,
)


def journal(*records: Record, synthetic_catalog: bool = False) -> tuple[JournalLine, ...]:
    read = read_journal(encode_journal([run_started(synthetic=synthetic_catalog), *records]))
    assert read.chain_break is None
    return read.lines
