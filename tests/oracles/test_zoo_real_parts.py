"""The real parts together: the built llama-server loads and serves every zoo model.

For each model with a monolithic baseline: the server starts on the model's hub snapshot path,
answers ``/health``, serves ``/completion`` with ``cache_prompt``, and a request that extends
the previous prompt reuses the cached prefix. The proof of reuse is the server's own token
accounting, exact for every pair: the cold request evaluates all of its prompt
(``cache_n == 0``), the warm one takes ``cache_n > 0`` tokens from the cache and evaluates only
the rest. Prompt time is the secondary check, made robust against a loaded machine: three
cold/warm pairs, each cold prompt fresh, and the fastest warm prompt time must be below the
fastest cold one (contention from other processes only ever adds time, so minima are the
stable estimate on a shared 2-core machine). The warm prompt extends the cold one on purpose:
sliding-window, recurrent and hybrid models reuse a prefix only at the server's context
checkpoints, which an extension always reaches (see llama-cpp-facts.md). ``--cache-ram 0``
keeps the server from restoring evicted prompts.

Numbers here come from tiny random-weight models: they prove the mechanism, they are not
performance figures.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import numpy as np
import pytest

from cache_family.oracles.native_parts import Parts, serve
from cache_family.oracles.zoo.base import SYNTHETIC_TAG
from cache_family.oracles.zoo.vocab import CONTROL_TOKENS, vocabulary
from cache_family.schemas.catalog import packaged_catalog

pytestmark = pytest.mark.native

SERVED = [p.key for p in packaged_catalog().catalog.presets if p.baseline_policy == "monolithic"]
PREFIX_TOKENS = 600
# Log level 4 makes the loader print the architecture and the split files it opened.
VERBOSE = ("-lv", "4")
EXTENSION_TOKENS = 24
# Cold/warm pairs per model; the prompt-time check compares minima, not one noisy pair.
PAIRS = 3


def fresh_tokens(label: str, n: int) -> list[int]:
    """Random ordinary token ids, different for every label (so every cold prompt is new)."""
    n_ordinary = len(vocabulary()[0]) - len(CONTROL_TOKENS)
    rng = np.random.default_rng(zlib.crc32(label.encode()))
    return [int(t) for t in rng.integers(0, n_ordinary, size=n)]


def test_every_served_preset_has_a_zoo_model(native_parts: Parts) -> None:
    models = native_parts.report()["models"]
    not_built = {k: models[k]["reason"] for k in SERVED if models[k]["status"] != "built"}
    assert not not_built, f"zoo models missing: {not_built}"


def test_unsupported_models_are_absent_with_a_reason(native_parts: Parts) -> None:
    catalog = {p["key"]: p for p in native_parts.catalog()["presets"]}
    for key, entry in native_parts.report()["models"].items():
        if entry["status"] == "unsupported":
            assert entry["reason"], key
            assert not (native_parts.zoo_root / catalog[key]["snapshot_relative"]).exists()


@pytest.mark.parametrize("key", SERVED)
def test_server_loads_serves_and_reuses_an_extended_prefix(native_parts: Parts, key: str) -> None:
    model = native_parts.model_path(key)
    preset = next(p for p in native_parts.catalog()["presets"] if p["key"] == key)
    with serve(
        native_parts.llama_server, model, ctx_size=4096, threads=2, extra_args=VERBOSE
    ) as server:
        status, health = server.request("GET", "/health")
        assert (status, health) == (200, {"status": "ok"})
        arch = re.search(r"print_info: arch\s+=\s+(\S+)", server.log_text())
        assert arch is not None and arch.group(1) == preset["architecture"]
        # The loader read the synthetic marker (its log cuts long values short).
        tags = re.search(r"general\.tags\s+arr\[str,1\]\s+= \[\"([^\".]+)", server.log_text())
        assert tags is not None, server.log_text()[-3000:]
        assert len(tags.group(1)) > 20 and SYNTHETIC_TAG.startswith(tags.group(1)), tags.group(0)
        status, models = server.request("GET", "/v1/models")
        meta = models["data"][0]["meta"]
        assert meta["n_embd"] == preset["activation_width"]
        assert meta["n_vocab"] == len(vocabulary()[0])

        pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
        for pair in range(PAIRS):
            prefix = fresh_tokens(f"{key}:{native_parts.seed}:prefix:{pair}", PREFIX_TOKENS)
            cold = server.completion(prefix, n_predict=1)["timings"]
            extended = prefix + fresh_tokens(f"{key}:extension:{pair}", EXTENSION_TOKENS)
            warm = server.completion(extended, n_predict=1)["timings"]
            pairs.append((cold, warm))

    for cold, warm in pairs:
        assert cold["cache_n"] == 0, cold
        assert cold["prompt_n"] == PREFIX_TOKENS, cold
        assert warm["cache_n"] > 0, warm
        assert warm["cache_n"] + warm["prompt_n"] == PREFIX_TOKENS + EXTENSION_TOKENS, warm
        assert warm["prompt_n"] < cold["prompt_n"], (cold, warm)
    cold_ms = min(cold["prompt_ms"] for cold, _ in pairs)
    warm_ms = min(warm["prompt_ms"] for _, warm in pairs)
    assert warm_ms < cold_ms, pairs


def test_split_model_loads_from_its_first_shard_snapshot_path(native_parts: Parts) -> None:
    preset = next(p for p in native_parts.catalog()["presets"] if p["key"] == "minimax_m27")
    first = native_parts.model_path("minimax_m27")
    assert first.is_symlink() and first.name == preset["shard_names"][0]
    siblings = sorted(p.name for p in first.parent.iterdir())
    assert siblings == preset["shard_names"]
    with serve(
        native_parts.llama_server, first, ctx_size=1024, threads=2, extra_args=VERBOSE
    ) as server:
        reply = server.completion(fresh_tokens("split", 32), n_predict=2)
        log = server.log_text()
    loaded = re.search(r"additional (\d+) GGUFs metadata loaded", log)
    assert loaded is not None, log[-2000:]
    assert int(loaded.group(1)) == len(siblings) - 1
    assert reply["timings"]["predicted_n"] == 2
