"""The use-case corpus: one benchmark prompt per use case, in the reference corpus format.

A corpus in the reference format loads unchanged (``prefix_tokens`` defaults to 128, every
``source`` member optional; ``provenance`` is our one addition). Loading is bounded, hashes
exactly the bytes read and refuses with every problem found.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Final

import msgspec

from cache_family.errors import Refusal, Refused, json_path
from cache_family.schemas.bounded import MIB, read_bounded
from cache_family.schemas.catalog import KEY_PATTERN, decode_strict

CORPUS_VERSION = 1
CORPUS_MAX_BYTES = 4 * MIB
CORPUS_MAX_ENTRIES = 128
LABEL_MAX_BYTES = 4096
PROMPT_MAX_BYTES = 65536
DEFAULT_PREFIX_TOKENS = 128


class UseCaseSource(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The public task a prompt stands for (shown in the report's source table)."""

    dataset: str | None = None
    config: str | None = None
    split: str | None = None
    row_idx: int | None = None
    provenance: str | None = None


class UseCase(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    key: str
    label: str
    prompt: str
    prefix_tokens: int = DEFAULT_PREFIX_TOKENS
    source: UseCaseSource = msgspec.field(default_factory=UseCaseSource)


class Corpus(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    version: int
    use_cases: tuple[UseCase, ...]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(u.key for u in self.use_cases)

    def use_case(self, key: str) -> UseCase:
        for u in self.use_cases:
            if u.key == key:
                return u
        raise Refused.one(
            "corpus.unknown_use_case",
            "$",
            f"corpus has no use case {key!r}",
            "use one of: " + ", ".join(self.keys),
        )


@dataclass(frozen=True, slots=True)
class LoadedCorpus:
    """A corpus with the SHA-256 of exactly the bytes it was decoded from."""

    corpus: Corpus
    sha256: str
    path: str


def load_corpus(path: str) -> LoadedCorpus:
    """Read and check a corpus file (absolute, regular, no symlink, at most 4 MiB)."""
    raw = read_bounded(path, CORPUS_MAX_BYTES, what="use-case corpus")
    corpus = decode_strict(raw.data, Corpus, code_prefix="corpus", what="use-case corpus")
    refusals = check_corpus(corpus)
    if refusals:
        raise Refused(tuple(refusals))
    return LoadedCorpus(corpus=corpus, sha256=raw.sha256, path=raw.path)


DEFAULT_CORPUS_RESOURCE: Final = "corpus/use-cases.json"


def default_corpus_path() -> str:
    """Absolute path of the packaged use-case corpus (``cache_family/corpus/use-cases.json``).

    It ships as package data, so any install (editable or from a wheel) has it; its bytes
    are read by path, like an operator's corpus, so its pin is of exactly those bytes.
    """
    resource = resources.files("cache_family").joinpath(DEFAULT_CORPUS_RESOURCE)
    candidate = Path(str(resource))
    if not candidate.is_absolute() or not candidate.is_file():
        raise Refused.one(
            "corpus.default_missing",
            "$",
            f"the packaged use-case corpus {candidate} does not exist",
            "reinstall cache-family-bench, or pass --use-case-corpus ABS",
        )
    return str(candidate)


def _utf8_len(text: str) -> int | None:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate escape such as "\ud800"
        return None


def check_corpus(corpus: Corpus) -> list[Refusal]:
    """Every bound the corpus breaks, in document order."""
    out: list[Refusal] = []

    def refuse(code: str, where: list[str | int], message: str, hint: str) -> None:
        out.append(Refusal(code, json_path(where), message, hint))

    if corpus.version != CORPUS_VERSION:
        refuse(
            "corpus.version", ["version"], f"version is {corpus.version}, not 1", "write version 1"
        )
    count = len(corpus.use_cases)
    if count == 0:
        refuse(
            "corpus.empty",
            ["use_cases"],
            "the corpus has no use cases",
            "list at least one use case",
        )
    if count > CORPUS_MAX_ENTRIES:
        refuse(
            "corpus.too_many",
            ["use_cases"],
            f"{count} use cases, more than {CORPUS_MAX_ENTRIES}",
            f"keep at most {CORPUS_MAX_ENTRIES} use cases in one corpus",
        )
    seen: set[str] = set()
    for i, case in enumerate(corpus.use_cases):
        where: list[str | int] = ["use_cases", i]
        if not KEY_PATTERN.fullmatch(case.key):
            refuse(
                "corpus.bad_key",
                [*where, "key"],
                f"key {case.key!r} is not [A-Za-z0-9_-]{{1,128}}",
                "keys name output directories: use letters, digits, '_' and '-'",
            )
        elif case.key in seen:
            refuse(
                "corpus.duplicate_key",
                [*where, "key"],
                f"key {case.key!r} appears twice",
                "give every use case its own key",
            )
        seen.add(case.key)

        label_len = _utf8_len(case.label)
        if label_len is None:
            refuse(
                "corpus.bad_text",
                [*where, "label"],
                "label holds an unpaired surrogate",
                "write the label as valid Unicode",
            )
        elif not 1 <= label_len <= LABEL_MAX_BYTES:
            refuse(
                "corpus.label_length",
                [*where, "label"],
                f"label is {label_len} bytes, not 1..{LABEL_MAX_BYTES}",
                "give a short non-empty label",
            )

        prompt_len = _utf8_len(case.prompt)
        if prompt_len is None:
            refuse(
                "corpus.bad_text",
                [*where, "prompt"],
                "prompt holds an unpaired surrogate",
                "write the prompt as valid Unicode",
            )
        elif not 1 <= prompt_len <= PROMPT_MAX_BYTES:
            refuse(
                "corpus.prompt_length",
                [*where, "prompt"],
                f"prompt is {prompt_len} bytes, not 1..{PROMPT_MAX_BYTES}",
                f"keep the prompt non-empty and under {PROMPT_MAX_BYTES} bytes",
            )
        if "\x00" in case.prompt:
            refuse(
                "corpus.prompt_nul",
                [*where, "prompt"],
                f"prompt has a NUL character at offset {case.prompt.index(chr(0))}",
                "remove the NUL; servers truncate prompts there",
            )

        if case.prefix_tokens <= 0:
            refuse(
                "corpus.prefix_tokens",
                [*where, "prefix_tokens"],
                f"prefix_tokens is {case.prefix_tokens}, not > 0",
                "give a positive prefix length or leave it out (128)",
            )
        if case.source.row_idx is not None and case.source.row_idx < 0:
            refuse(
                "corpus.bad_source",
                [*where, "source", "row_idx"],
                f"row_idx is {case.source.row_idx}",
                "use a row index >= 0 or null",
            )
    return out
