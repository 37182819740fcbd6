"""The packaged use-case corpus loads, and malformed corpora are refused with stable codes."""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import json
import os
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

import cache_family
from cache_family.errors import Refused
from cache_family.schemas.catalog import packaged_catalog
from cache_family.schemas.corpus import (
    DEFAULT_CORPUS_RESOURCE,
    DEFAULT_PREFIX_TOKENS,
    Corpus,
    LoadedCorpus,
    UseCase,
    check_corpus,
    default_corpus_path,
    load_corpus,
)

REFERENCE_LABELS = {
    "tool_calling": "Tool calling",
    "text_to_sql": "Text-to-SQL",
    "coding_agent_loop": "Coding agent loop",
    "issue_fixing": "Issue fixing",
    "code_refinement": "Code refinement",
    "few_shot_reasoning": "Few-shot reasoning",
    "open_chat": "Open chat",
    "summarization_rag": "Summarization/RAG",
}
REFERENCE_SOURCES = {
    "tool_calling": ("glaiveai/glaive-function-calling-v2", "default", "train", 1),
    "text_to_sql": ("gretelai/synthetic_text_to_sql", "default", "test", 0),
    "coding_agent_loop": ("SWE-bench/SWE-smith-trajectories", "default", "tool", 0),
    "issue_fixing": ("SWE-bench/SWE-bench", "default", "dev", 0),
    "code_refinement": ("google/code_x_glue_cc_code_refinement", "small", "test", 0),
    "few_shot_reasoning": ("openai/gsm8k", "main", "test", 0),
    "open_chat": ("HuggingFaceH4/mt_bench_prompts", "default", "train", 0),
    "summarization_rag": ("nvidia/ChatRAG-Bench", "doc2dial", "test", 0),
}


def checked_in() -> LoadedCorpus:
    return load_corpus(default_corpus_path())


def checked_in_document() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(Path(default_corpus_path()).read_bytes())
    return doc


def write_json(tmp_path: Path, doc: Any, name: str = "corpus.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc), encoding="utf-8")
    return str(path)


def refused_codes(path: str) -> list[str]:
    with pytest.raises(Refused) as info:
        load_corpus(path)
    return info.value.codes


def entry(key: str, prompt: str = "Summarise the following passage.") -> dict[str, Any]:
    return {"key": key, "label": key.replace("_", " "), "prompt": prompt}


def test_default_path_is_the_packaged_corpus() -> None:
    path = Path(default_corpus_path())
    assert path.is_absolute()
    package = Path(cache_family.__file__).resolve().parent
    assert path == package / "corpus" / "use-cases.json"
    # Found through the package's resources, as a non-editable install finds it.
    resource = resources.files("cache_family").joinpath(DEFAULT_CORPUS_RESOURCE)
    assert resource.read_bytes() == path.read_bytes()


def test_the_packaged_corpus_is_package_data_in_one_copy() -> None:
    repo = Path(__file__).resolve().parents[2]
    pyproject = tomllib.loads((repo / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["package-data"]["cache_family"]
    assert any(fnmatch.fnmatch(DEFAULT_CORPUS_RESOURCE, p) for p in patterns)
    copies = [
        p for p in repo.rglob("use-cases.json")
        if not {".venv", "build", ".git"} & set(p.relative_to(repo).parts)
    ]  # fmt: skip
    assert copies == [repo / "src" / "cache_family" / DEFAULT_CORPUS_RESOURCE]


def test_checked_in_corpus_has_the_eight_use_cases_in_catalog_order() -> None:
    corpus = checked_in().corpus
    assert corpus.version == 1
    assert corpus.keys == packaged_catalog().catalog.use_case_order
    assert {u.key: u.label for u in corpus.use_cases} == REFERENCE_LABELS
    for u in corpus.use_cases:
        assert u.prefix_tokens == 128
        src = u.source
        assert (src.dataset, src.config, src.split, src.row_idx) == REFERENCE_SOURCES[u.key]
        assert src.provenance is not None
        assert src.provenance.startswith("written for cache-family-bench")
        assert src.dataset is not None and src.dataset in src.provenance


def test_every_prompt_is_long_enough_for_a_128_token_prefix() -> None:
    # 1200 characters is several hundred tokens for common tokenizers, so a 128-token
    # prefix plus a distinct tail always fits inside the prompt.
    for u in checked_in().corpus.use_cases:
        assert len(u.prompt) > 1200, u.key
        assert len(u.prompt.split()) > 160, u.key
        assert "\x00" not in u.prompt


def test_prompts_share_no_long_opening() -> None:
    # Distinct openings keep one use case's cached prefix from serving another's.
    openings = [u.prompt[:200] for u in checked_in().corpus.use_cases]
    assert len(set(openings)) == len(openings)


def test_sha256_is_of_exactly_the_bytes_read() -> None:
    loaded = checked_in()
    assert loaded.sha256 == hashlib.sha256(Path(loaded.path).read_bytes()).hexdigest()


def test_reformatting_changes_the_pin_but_not_the_corpus(tmp_path: Path) -> None:
    path = write_json(tmp_path, checked_in_document())
    loaded = load_corpus(path)
    assert loaded.corpus == checked_in().corpus
    assert loaded.sha256 != checked_in().sha256
    assert loaded.sha256 == hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_reference_format_without_provenance_or_defaults_loads(tmp_path: Path) -> None:
    doc = {
        "version": 1,
        "use_cases": [
            {
                "key": "open_chat",
                "label": "Open chat",
                "prompt": "Tell me about tides.",
                "source": {
                    "dataset": "HuggingFaceH4/mt_bench_prompts",
                    "config": "default",
                    "split": "train",
                    "row_idx": 0,
                },
            },
            {"key": "bare", "label": "Bare", "prompt": "No source at all."},
            {"key": "partial", "label": "Partial", "prompt": "x", "source": {"split": "dev"}},
        ],
    }
    corpus: Corpus = load_corpus(write_json(tmp_path, doc)).corpus
    assert corpus.keys == ("open_chat", "bare", "partial")
    assert all(u.prefix_tokens == DEFAULT_PREFIX_TOKENS for u in corpus.use_cases)
    assert corpus.use_case("open_chat").source.provenance is None
    assert corpus.use_case("bare").source.dataset is None
    assert corpus.use_case("partial").source.split == "dev"


def test_unknown_use_case_lookup_is_refused() -> None:
    with pytest.raises(Refused) as info:
        checked_in().corpus.use_case("poetry")
    assert info.value.codes == ["corpus.unknown_use_case"]


def _doc(*entries: dict[str, Any], version: int = 1) -> dict[str, Any]:
    return {"version": version, "use_cases": list(entries)}


BAD_CORPORA: dict[str, tuple[Any, str]] = {
    "unknown top-level field": ({**_doc(entry("a")), "extra": 1}, "corpus.decode"),
    "unknown entry field": (_doc({**entry("a"), "weight": 2}), "corpus.decode"),
    "unknown source field": (_doc({**entry("a"), "source": {"url": "x"}}), "corpus.decode"),
    "string prefix": (_doc({**entry("a"), "prefix_tokens": "128"}), "corpus.decode"),
    "missing prompt": (_doc({"key": "a", "label": "A"}), "corpus.decode"),
    "not an object": ([1, 2, 3], "corpus.decode"),
    "version 2": (_doc(entry("a"), version=2), "corpus.version"),
    "empty": (_doc(), "corpus.empty"),
    "129 entries": (_doc(*(entry(f"k{i}") for i in range(129))), "corpus.too_many"),
    "duplicate key": (_doc(entry("a"), entry("b"), entry("a")), "corpus.duplicate_key"),
    "key with a slash": (_doc(entry("../a")), "corpus.bad_key"),
    "empty key": (_doc(entry("")), "corpus.bad_key"),
    "empty label": (_doc({**entry("a"), "label": ""}), "corpus.label_length"),
    "long label": (_doc({**entry("a"), "label": "é" * 2049}), "corpus.label_length"),
    "empty prompt": (_doc(entry("a", prompt="")), "corpus.prompt_length"),
    "long prompt": (_doc(entry("a", prompt="x" * 65537)), "corpus.prompt_length"),
    "nul in prompt": (_doc(entry("a", prompt="before\x00after")), "corpus.prompt_nul"),
    "zero prefix": (_doc({**entry("a"), "prefix_tokens": 0}), "corpus.prefix_tokens"),
    "negative row": (_doc({**entry("a"), "source": {"row_idx": -1}}), "corpus.bad_source"),
}


@pytest.mark.parametrize("name", sorted(BAD_CORPORA))
def test_a_malformed_corpus_is_refused(tmp_path: Path, name: str) -> None:
    doc, code = BAD_CORPORA[name]
    assert code in refused_codes(write_json(tmp_path, doc))


def test_bounds_are_inclusive(tmp_path: Path) -> None:
    doc = _doc(*(entry(f"k{i}") for i in range(128)))
    doc["use_cases"][0]["label"] = "é" * 2048  # exactly 4096 UTF-8 bytes
    doc["use_cases"][1]["prompt"] = "x" * 65536
    doc["use_cases"][2]["key"] = "k" * 128
    assert len(load_corpus(write_json(tmp_path, doc)).corpus.use_cases) == 128


def test_every_refusal_is_reported_together(tmp_path: Path) -> None:
    doc = _doc(entry("a"), entry("a", prompt="x\x00"), {**entry("b"), "prefix_tokens": -4})
    with pytest.raises(Refused) as info:
        load_corpus(write_json(tmp_path, doc))
    assert info.value.codes == ["corpus.duplicate_key", "corpus.prompt_nul", "corpus.prefix_tokens"]
    assert [r.path for r in info.value.refusals] == [
        "$.use_cases[1].key",
        "$.use_cases[1].prompt",
        "$.use_cases[2].prefix_tokens",
    ]


def test_invalid_utf8_repeated_members_and_lone_surrogates_are_refused(tmp_path: Path) -> None:
    raw = tmp_path / "latin1.json"
    raw.write_bytes(
        b'{"version": 1, "use_cases": [{"key": "a", "label": "caf\xe9", "prompt": "p"}]}'
    )
    assert refused_codes(str(raw)) == ["corpus.decode"]
    repeated = tmp_path / "repeated.json"
    repeated.write_bytes(
        b'{"version": 1, "use_cases": [{"key": "a", "label": "A", "prompt": "p", "prompt": "q"}]}'
    )
    assert refused_codes(str(repeated)) == ["corpus.decode"]
    surrogate = tmp_path / "surrogate.json"
    surrogate.write_bytes(
        b'{"version": 1, "use_cases": [{"key": "a", "label": "A", "prompt": "\\ud800"}]}'
    )
    # msgspec refuses a lone surrogate while decoding; check_corpus would catch it otherwise.
    assert refused_codes(str(surrogate)) == ["corpus.decode"]


def test_check_corpus_refuses_text_that_is_not_valid_unicode() -> None:
    corpus = Corpus(version=1, use_cases=(UseCase(key="a", label="\ud800", prompt="p\udfff"),))
    assert [r.code for r in check_corpus(corpus)] == ["corpus.bad_text", "corpus.bad_text"]


def test_symlink_fifo_relative_and_oversized_files_are_refused(tmp_path: Path) -> None:
    real = Path(write_json(tmp_path, checked_in_document(), "real.json"))
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert refused_codes(str(link)) == ["file.symlink"]
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert refused_codes(str(fifo)) == ["file.not_regular"]
    assert refused_codes("corpus/use-cases.json") == ["file.not_absolute"]
    assert refused_codes(str(tmp_path / "absent.json")) == ["file.missing"]
    big = tmp_path / "big.json"
    big.write_bytes(real.read_bytes() + b" " * (4 * 1024 * 1024))
    assert refused_codes(str(big)) == ["file.too_large"]


def test_a_corpus_inside_the_limit_with_padding_still_loads(tmp_path: Path) -> None:
    real = tmp_path / "padded.json"
    data = json.dumps(checked_in_document()).encode()
    real.write_bytes(data + b" " * (4 * 1024 * 1024 - len(data)))
    assert load_corpus(str(real)).corpus == checked_in().corpus


def test_missing_default_corpus_is_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    import cache_family.schemas.corpus as corpus_module

    # Pretend the install lost its package data.
    monkeypatch.setattr(corpus_module, "DEFAULT_CORPUS_RESOURCE", "corpus/absent.json")
    with pytest.raises(Refused) as info:
        corpus_module.default_corpus_path()
    assert info.value.codes == ["corpus.default_missing"]
    assert "absent.json" in str(info.value)


def test_loaded_corpus_is_immutable() -> None:
    corpus = checked_in().corpus
    with pytest.raises(AttributeError):
        corpus.use_cases[0].prompt = "changed"  # type: ignore[misc]
    assert copy.deepcopy(corpus) == corpus
