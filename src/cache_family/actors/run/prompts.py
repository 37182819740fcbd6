"""Which text a row is measured with.

Every later request of a row sends the prompt its correctness arm accepted; the text never
reaches a receipt, only its SHA-256. A corpus is loaded bounded and checked against its pin
once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cache_family.errors import Refused
from cache_family.schemas.corpus import LoadedCorpus, default_corpus_path, load_corpus
from cache_family.schemas.prepared import CorpusUsed, PreparedInput, PreparedRow, UseCaseRecord
from cache_family.states.plans import SOURCE_FIXED_CORPUS_ENTRY, SOURCE_USE_CASE, PromptChoice


@dataclass(slots=True)
class PromptSelector:
    """Chooses prompts for the rows of one run; corpora are read at most once."""

    prepared: PreparedInput
    # Injected in tests; the packaged corpus otherwise.
    fixed_corpus_path: str | None = None
    _fixed_corpus: LoadedCorpus | None = field(default=None, init=False)

    def check(self) -> None:
        """Find every prompt the rows will need before the run writes anything."""
        rows = self.prepared.rows
        for row in rows:
            if row.use_case is not None:
                self._use_case(row.use_case)
        if any(row.use_case is None for row in rows):
            self._fixed()

    def choose(self, row: PreparedRow) -> PromptChoice:
        if row.use_case is not None:
            entry, pinned = self._use_case(row.use_case)
            return PromptChoice(
                text=entry.prompt,
                source=SOURCE_USE_CASE,
                corpus_path=pinned.path,
                corpus_sha256=pinned.sha256,
                entry_key=entry.key,
            )
        loaded = self._fixed()
        first = loaded.corpus.use_cases[0]
        return PromptChoice(
            text=first.prompt,
            source=SOURCE_FIXED_CORPUS_ENTRY,
            corpus_path=loaded.path,
            corpus_sha256=loaded.sha256,
            entry_key=first.key,
        )

    def _use_case(self, key: str) -> tuple[UseCaseRecord, CorpusUsed]:
        pinned = self.prepared.corpus
        entry = next((u for u in self.prepared.use_cases if u.key == key), None)
        if pinned is None or entry is None:
            raise Refused.one(
                "run.prompt.no_use_case",
                "$.use_cases",
                f"a row names use case {key!r} but the prepared input does not carry it",
                "re-run prepare-use-cases; never edit prepared documents by hand",
            )
        return entry, pinned

    def _fixed(self) -> LoadedCorpus:
        if self._fixed_corpus is None:
            path = self.fixed_corpus_path or default_corpus_path()
            self._fixed_corpus = load_corpus(path)
        return self._fixed_corpus
