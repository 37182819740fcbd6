"""Markdown and other renderings computed from receipts only.

``build_report`` is `cache-family report`: rows of 1 to 32 ``production-cache-bench.json``
files and a use-case corpus in, the combined README tables out, every refusal raised
before the caller writes anything.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from cache_family.report.decode import Refusals
from cache_family.report.render import render_report
from cache_family.report.rows import read_rows
from cache_family.report.sources import read_sources
from cache_family.schemas.corpus import default_corpus_path

__all__ = ["build_report", "corpus_shown"]


def corpus_shown(path: str, cwd: str) -> str:
    """How the report names the default corpus: relative to ``cwd`` when inside it, so the
    text does not depend on where the checkout lives."""
    relative = os.path.relpath(path, cwd)
    return path if relative.startswith(os.pardir) else relative


def build_report(inputs: Sequence[str], corpus: str | None = None) -> str:
    """The report text for ``inputs`` (paths as given) and ``corpus`` (None: the checked-in
    corpus preparation uses). Raises ``Refused`` with every problem found."""
    cwd = os.getcwd()
    if corpus is None:
        corpus_path = default_corpus_path()
        shown = corpus_shown(corpus_path, cwd)
    else:
        corpus_path, shown = str(Path(corpus).absolute()), corpus
    refusals = Refusals()
    rows = read_rows([str(Path(p).absolute()) for p in inputs], refusals)
    sources = read_sources(corpus_path, refusals)
    refusals.raise_any()
    text = render_report(rows, sources, shown, refusals)
    refusals.raise_any()
    return text
