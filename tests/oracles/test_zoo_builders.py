"""The hard-architecture zoo builders: MLA + MoE, hybrid recurrent, split shards, layer package.

Plain tests read the written bytes back with ``gguf.GGUFReader``: same seed, same bytes; the
catalog's file names; only metadata keys llama.cpp knows; real split metadata; an honest
package manifest. Tests marked ``native`` load every model in the real ``llama-server`` and
check that a prompt extending the previous one reuses the server's prompt cache.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import trio

from cache_family.oracles import package_builder
from cache_family.oracles.native_parts import Parts, free_port
from cache_family.oracles.zoo import BUILDERS as ZOO_BUILDERS
from cache_family.oracles.zoo import hybrid, minimax, moe
from cache_family.oracles.zoo.base import Builder, BuiltModel
from cache_family.oracles.zoo.vocab import vocabulary
from cache_family.schemas.catalog import Preset, packaged_catalog
from cache_family.schemas.corpus import default_corpus_path, load_corpus
from cache_family.schemas.layer_package import MANIFEST_NAME

BUILDERS: dict[str, Builder] = {
    "deepseek2": moe.build_deepseek2,
    "glm47_flash": moe.build_glm47_flash,
    "deepseek3": moe.build_deepseek3_package,
    "falcon_h1": hybrid.build_falcon_h1,
    "qwen3next": hybrid.build_qwen3next,
    "minimax_m27": minimax.build_minimax_m27,
}
SERVABLE = ["deepseek2", "glm47_flash", "falcon_h1", "qwen3next", "minimax_m27"]


def preset(key: str) -> Preset:
    return next(p for p in packaged_catalog().catalog.presets if p.key == key)


def build(key: str, into: Path, seed: int = 7) -> BuiltModel:
    into.mkdir(parents=True, exist_ok=True)
    return BUILDERS[key](into, seed)


def gguf_files(built: BuiltModel) -> list[Path]:
    return [f for f in built.files if f.suffix == ".gguf"]


def field_value(reader: gguf.GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


def known_keys(arch: str) -> set[str]:
    """Every metadata key gguf-py's constants spell, formatted for ``arch``."""
    found: set[str] = set()

    def walk(namespace: type) -> None:
        for name, value in vars(namespace).items():
            if name.startswith("_"):
                continue
            if isinstance(value, type):
                walk(value)
            elif isinstance(value, str) and "{" not in value.replace("{arch}", ""):
                found.add(value.format(arch=arch))

    walk(gguf.Keys)
    return found


# --- bytes, names, keys ---------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(BUILDERS))
def test_same_seed_writes_the_same_bytes_and_another_seed_other_weights(
    key: str, tmp_path: Path
) -> None:
    first = build(key, tmp_path / "a")
    again = build(key, tmp_path / "b")
    other = build(key, tmp_path / "c", seed=8)
    assert [f.name for f in first.files] == [f.name for f in again.files]
    for one, two in zip(first.files, again.files, strict=True):
        assert one.read_bytes() == two.read_bytes(), one.name
    assert first.shape == again.shape == other.shape
    assert gguf_files(first)[0].read_bytes() != gguf_files(other)[0].read_bytes()


@pytest.mark.parametrize("key", sorted(BUILDERS))
def test_builder_writes_the_catalog_file_names_into_the_staging_dir(
    key: str, tmp_path: Path
) -> None:
    built = build(key, tmp_path)
    entry = preset(key)
    names = [f.name for f in built.files]
    assert all(f.is_file() and f.is_relative_to(tmp_path) for f in built.files)
    if entry.artifact_kind == "split-gguf":
        assert names == list(entry.shard_names)
    elif entry.artifact_kind == "single-gguf":
        assert names == [entry.snapshot_relative.rsplit("/", 1)[-1]]
    else:
        assert (tmp_path / MANIFEST_NAME) in built.files
        assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == sorted(built.files)
    if entry.artifact_kind != "layer-package":
        assert all(f.parent == tmp_path for f in built.files)
    assert built.architecture == entry.architecture


@pytest.mark.parametrize("key", sorted(BUILDERS))
def test_every_metadata_key_is_a_known_gguf_key(key: str, tmp_path: Path) -> None:
    built = build(key, tmp_path)
    allowed = known_keys(built.architecture)
    for path in gguf_files(built):
        reader = gguf.GGUFReader(path)
        written = {k for k in reader.fields if not k.startswith("GGUF.")}
        assert written <= allowed, f"{path.name}: unknown keys {sorted(written - allowed)}"


@pytest.mark.parametrize("key", sorted(BUILDERS))
def test_header_states_the_reported_architecture_and_shape(key: str, tmp_path: Path) -> None:
    built = build(key, tmp_path)
    reader = gguf.GGUFReader(gguf_files(built)[0])
    arch = built.architecture
    assert field_value(reader, "general.architecture") == arch
    assert field_value(reader, f"{arch}.block_count") == built.shape.n_layer
    assert field_value(reader, f"{arch}.embedding_length") == built.shape.n_embd
    assert field_value(reader, f"{arch}.context_length") == built.shape.n_ctx_train
    assert field_value(reader, f"{arch}.vocab_size") == built.shape.n_vocab
    assert len(field_value(reader, "tokenizer.ggml.tokens")) == built.shape.n_vocab  # type: ignore[arg-type]
    assert built.shape.n_vocab == len(vocabulary()[0])
    total = sum(path.stat().st_size for path in built.files)
    assert 1_000_000 < total < 16_000_000, "a tiny model stays a few MB"


@pytest.mark.parametrize("key", sorted(BUILDERS))
def test_norms_routers_and_recurrent_parameters_are_f32_matrices_f16(
    key: str, tmp_path: Path
) -> None:
    built = build(key, tmp_path)
    f32_names = re.compile(
        r"(norm|ffn_gate_inp|exp_probs_b|ssm_conv1d|ssm_dt|ssm_a|ssm_d)(\.weight|\.bias)?$"
    )
    for path in gguf_files(built):
        for tensor in gguf.GGUFReader(path).tensors:
            want = (
                gguf.GGMLQuantizationType.F32
                if f32_names.search(tensor.name)
                or tensor.name.endswith("ffn_gate_inp_shexp.weight")
                else gguf.GGMLQuantizationType.F16
            )
            assert tensor.tensor_type == want, tensor.name


def test_falcon_h1_keeps_its_suffixless_tensor_names(tmp_path: Path) -> None:
    built = build("falcon_h1", tmp_path)
    names = {t.name for t in gguf.GGUFReader(built.files[0]).tensors}
    for il in range(built.shape.n_layer):
        assert {f"blk.{il}.ffn_norm", f"blk.{il}.ssm_a", f"blk.{il}.ssm_d"} <= names
        assert f"blk.{il}.ffn_norm.weight" not in names
        assert f"blk.{il}.attn_q.weight" in names and f"blk.{il}.ssm_in.weight" in names


def test_qwen3next_has_full_attention_every_fourth_layer_only(tmp_path: Path) -> None:
    built = build("qwen3next", tmp_path)
    names = {t.name for t in gguf.GGUFReader(built.files[0]).tensors}
    attention = [il for il in range(built.shape.n_layer) if f"blk.{il}.attn_q.weight" in names]
    recurrent = [il for il in range(built.shape.n_layer) if f"blk.{il}.ssm_a" in names]
    assert attention == [3]
    assert recurrent == [0, 1, 2]
    ssm_a = next(t for t in gguf.GGUFReader(built.files[0]).tensors if t.name == "blk.0.ssm_a")
    assert np.all(np.asarray(ssm_a.data) < 0), "A is a decay"


def test_glm47_flash_and_coder_lite_differ_as_their_families_do(tmp_path: Path) -> None:
    lite = gguf.GGUFReader(build("deepseek2", tmp_path / "lite").files[0])
    glm = gguf.GGUFReader(build("glm47_flash", tmp_path / "glm").files[0])
    lite_names = {t.name for t in lite.tensors}
    glm_names = {t.name for t in glm.tensors}
    assert "blk.0.attn_q.weight" in lite_names and "blk.0.attn_q_a.weight" not in lite_names
    assert "blk.0.attn_q_a.weight" in glm_names and "blk.0.attn_q.weight" not in glm_names
    assert "blk.1.exp_probs_b.bias" in glm_names and "blk.1.exp_probs_b.bias" not in lite_names
    assert field_value(lite, "deepseek2.attention.q_lora_rank") == 0
    softmax, sigmoid = gguf.ExpertGatingFuncType.SOFTMAX, gguf.ExpertGatingFuncType.SIGMOID
    assert field_value(lite, "deepseek2.expert_gating_func") == softmax
    assert field_value(glm, "deepseek2.expert_gating_func") == sigmoid
    # MLA: the cached key is the compressed latent plus the rope part, one KV head.
    for reader in (lite, glm):
        rank = field_value(reader, "deepseek2.attention.kv_lora_rank")
        rope = field_value(reader, "deepseek2.rope.dimension_count")
        assert field_value(reader, "deepseek2.attention.key_length") == rank + rope  # type: ignore[operator]
        assert field_value(reader, "deepseek2.attention.head_count_kv") == 1


# --- split shards ---------------------------------------------------------------------------


def test_minimax_is_three_real_split_shards(tmp_path: Path) -> None:
    built = build("minimax_m27", tmp_path)
    readers = [gguf.GGUFReader(path) for path in built.files]
    total = sum(len(r.tensors) for r in readers)
    for index, reader in enumerate(readers):
        assert field_value(reader, "split.no") == index
        assert field_value(reader, "split.count") == 3
        assert field_value(reader, "split.tensors.count") == total
        assert len(reader.tensors) > 0
        # The model's metadata lives in the first shard only, as gguf-split writes it.
        assert ("general.architecture" in reader.fields) == (index == 0)
    names = [t.name for r in readers for t in r.tensors]
    assert len(names) == len(set(names))
    assert names[0] == "token_embd.weight" and names[-1] == "output.weight"
    for il in range(built.shape.n_layer):
        assert f"blk.{il}.ffn_gate_exps.weight" in names
        assert f"blk.{il}.exp_probs_b.bias" in names


# --- layer package --------------------------------------------------------------------------


def test_deepseek3_package_is_a_schema_1_layer_package_the_builder_admits(tmp_path: Path) -> None:
    built = build("deepseek3", tmp_path)
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    entry = preset("deepseek3")
    assert manifest["schema_version"] == 1 and manifest["format"] == "layer-package"
    assert manifest["model_id"] == entry.model_id
    assert manifest["layer_count"] == built.shape.n_layer
    assert manifest["activation_width"] == built.shape.n_embd
    assert manifest["created_at_unix_secs"] == 0
    assert entry.state_layer_end <= manifest["layer_count"], "the state range lies inside"
    listed = [manifest["shared"][r]["path"] for r in ("metadata", "embeddings", "output")]
    listed += [layer["path"] for layer in manifest["layers"]]
    assert sorted([MANIFEST_NAME, *listed]) == sorted(
        p.relative_to(tmp_path).as_posix() for p in built.files
    )
    metadata = gguf.GGUFReader(tmp_path / "shared" / "metadata.gguf")
    assert field_value(metadata, "general.architecture") == entry.architecture == "deepseek2"
    assert field_value(metadata, "deepseek2.block_count") == manifest["layer_count"]
    receipt = package_builder.admit_package(
        str(tmp_path),
        hashlib.sha256((tmp_path / MANIFEST_NAME).read_bytes()).hexdigest(),
        entry.model_id,
        entry.state_layer_start,
        entry.state_layer_end,
        entry.ctx,
    )
    assert receipt["dimensions"]["layer_count"] == built.shape.n_layer


def reassemble_package(package: Path, into: Path) -> Path:
    """One monolithic GGUF from a package's artifacts: the package's own bytes."""
    return package_builder.assemble_package(package, into / "deepseek3-reassembled.gguf")


def test_package_files_carry_the_metadata_a_whole_model_would(tmp_path: Path) -> None:
    build("deepseek3", tmp_path / "package")
    (tmp_path / "whole").mkdir()
    whole = gguf.GGUFReader(reassemble_package(tmp_path / "package", tmp_path / "whole"))
    first = gguf.GGUFReader(tmp_path / "package" / "layers" / "layer-000.gguf")
    for key in whole.fields:
        if key.startswith("GGUF."):
            continue
        assert first.fields[key].contents() == whole.fields[key].contents(), key


# --- real llama-server ----------------------------------------------------------------------


@pytest.fixture
def llama_server(native_parts: Parts) -> Path:
    """The real build from conftest's ``native_parts`` (never compiled here)."""
    return native_parts.llama_server


@dataclass
class Served:
    base_url: str
    log: list[str] = field(default_factory=list)

    def lines(self, pattern: str) -> list[str]:
        return [line for line in self.log if re.search(pattern, line)]


@asynccontextmanager
async def serve(server: Path, model: Path, home: Path) -> AsyncIterator[Served]:
    """Run llama-server on ``model`` until the block ends; its log is collected line by line."""
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    libs = server.parent.parent / "lib"
    if libs.is_dir():
        env["LD_LIBRARY_PATH"] = str(libs)
    argv = [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-c", "2048", "-t", "1", "-lv", "4"]  # -lv 4: the loader's print_info lines
    process = await trio.lowlevel.open_process(
        argv, env=env, cwd=str(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    served = Served(f"http://127.0.0.1:{port}")
    ready = trio.Event()
    ended = trio.Event()
    served_once = False

    async def read_log() -> None:
        assert process.stdout is not None
        pending = b""
        async for chunk in process.stdout:
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for raw in complete:
                line = raw.decode(errors="replace")
                served.log.append(line)
                if "model loaded" in line:
                    ready.set()
        ended.set()
        ready.set()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_log)
            with trio.fail_after(120):
                await ready.wait()
            if not ended.is_set():
                served_once = True
                try:
                    yield served
                finally:
                    nursery.cancel_scope.cancel()
        if not served_once:
            raise AssertionError("llama-server exited:\n" + "\n".join(served.log[-30:]))
    finally:
        with trio.CancelScope(shield=True):
            process.terminate()
            with trio.move_on_after(10):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


# Prose long enough (a few hundred tokens) to leave whole checkpoints inside the common part.
FIRST_PROMPT = " ".join(
    f"the cache family bench measures prompt reuse on tiny model number {i}." for i in range(24)
)
SECOND_PROMPT = FIRST_PROMPT + " and then the second request extends the first prompt a little."


async def complete(client: httpx.AsyncClient, prompt: str) -> dict[str, float]:
    reply = await client.post(
        "/completion",
        json={"prompt": prompt, "n_predict": 4, "cache_prompt": True, "ignore_eos": True},
        timeout=120,
    )
    reply.raise_for_status()
    timings: dict[str, float] = reply.json()["timings"]
    return timings


@dataclass
class Observed:
    built: BuiltModel
    served: Served
    first: dict[str, float]
    second: dict[str, float]


async def serve_and_extend(
    server: Path, model_for: Callable[[Path], tuple[BuiltModel, Path]], tmp_path: Path
) -> Observed:
    built, model = model_for(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    async with (
        serve(server, model, home) as served,
        httpx.AsyncClient(base_url=served.base_url) as client,
    ):
        health = await client.get("/health", timeout=30)
        assert health.status_code == 200, health.text
        first = await complete(client, FIRST_PROMPT)
        second = await complete(client, SECOND_PROMPT)
    return Observed(built, served, first, second)


def kv_cache_bytes(served: Served) -> float | None:
    """The attention cache llama.cpp allocated (K + V, MiB) as its load log states it."""
    for line in served.lines(r"llama_kv_cache: size ="):
        sizes = re.findall(r"[KV] \(f16\):\s+([0-9.]+) MiB", line)
        return sum(float(s) for s in sizes) * 1024 * 1024
    return None


@pytest.mark.native
@pytest.mark.parametrize("key", SERVABLE)
async def test_llama_server_loads_the_model_and_reuses_an_extended_prompt(
    key: str, llama_server: Path, tmp_path: Path
) -> None:
    def model_for(where: Path) -> tuple[BuiltModel, Path]:
        built = build(key, where / "model")
        return built, built.files[0]  # a split model is opened by its first shard

    seen = await serve_and_extend(llama_server, model_for, tmp_path)
    arch_lines = seen.served.lines(r"print_info: arch\s*=")
    assert arch_lines and arch_lines[0].split("=")[-1].strip() == seen.built.architecture
    assert seen.served.lines(rf"print_info: n_layer\s*=\s*{seen.built.shape.n_layer}\b")
    if key == "minimax_m27":
        assert seen.served.lines(r"additional 2 GGUFs metadata loaded"), "siblings found"
    assert seen.first["predicted_n"] == 4 and seen.second["predicted_n"] == 4
    assert seen.first["prompt_n"] > 200
    assert seen.second["cache_n"] > 0, (key, seen.second)
    if seen.built.kv_bytes_per_token is not None:
        allocated = kv_cache_bytes(seen.served)
        assert allocated is not None
        assert allocated == pytest.approx(2048 * seen.built.kv_bytes_per_token, rel=0.01)
        assert not seen.served.lines(r"llama_memory_recurrent: size")
    else:
        # Hybrids: llama.cpp keeps a recurrent state beside the attention cache.
        assert seen.served.lines(r"llama_memory_recurrent: size")
        attention_layers = 1 if key == "qwen3next" else seen.built.shape.n_layer
        assert seen.served.lines(rf"llama_kv_cache: size .*\s{attention_layers} layers")


@pytest.mark.native
async def test_the_deepseek3_package_reassembled_loads_as_deepseek2(
    llama_server: Path, tmp_path: Path
) -> None:
    """The package itself is never served; its layer files, joined, must be a valid model."""

    def model_for(where: Path) -> tuple[BuiltModel, Path]:
        built = build("deepseek3", where / "package")
        (where / "whole").mkdir()
        return built, reassemble_package(where / "package", where / "whole")

    seen = await serve_and_extend(llama_server, model_for, tmp_path)
    assert seen.served.lines(r"print_info: arch\s*=\s*deepseek2")
    assert seen.second["cache_n"] > 0


# --- a prefix-cache hit answers what a cold prompt answers ---------------------------------


# About 200 tokens: inside the smallest sliding window (512), as the demo's prompts are.
CHAT_PROMPT = " ".join(f"the cache family bench reuses the prompt of model {i}." for i in range(12))


@dataclass
class Greedy:
    cached_tokens: int
    tokens: list[str]
    margins: list[float]  # top-1 minus top-2 logprob at each generated token


async def greedy_chat(client: httpx.AsyncClient, prompt: str) -> Greedy:
    """One greedy chat answer of 16 tokens with the top two scores of each."""
    reply = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 2,
        },
        timeout=120,
    )
    reply.raise_for_status()
    answer = reply.json()
    steps = answer["choices"][0]["logprobs"]["content"]
    tokens = [step["token"] for step in steps]
    assert tokens == [step["top_logprobs"][0]["token"] for step in steps]  # greedy
    margins = [
        step["top_logprobs"][0]["logprob"] - step["top_logprobs"][1]["logprob"] for step in steps
    ]
    cached = answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return Greedy(int(cached), tokens, margins)


#: Every family a run serves (the DeepSeek3 package is never served).
SERVED_FAMILIES = [key for key in ZOO_BUILDERS if key != "deepseek3"]

#: Prompt lengths (characters, one token each in the zoo's byte vocabulary) cut from every
#: use case's prompt: inside the smallest sliding window (512), so every family's second
#: request is a cache hit, and well past it, as the larger rows' prefixes are.
HIT_PROMPT_CHARS = (400, 1500)


def use_case_prompts() -> list[tuple[str, str]]:
    corpus = load_corpus(default_corpus_path()).corpus
    return [
        (f"{use_case.key}/{chars}", use_case.prompt[:chars])
        for use_case in corpus.use_cases
        for chars in HIT_PROMPT_CHARS
    ]


@pytest.mark.native
@pytest.mark.parametrize("key", SERVED_FAMILIES)
async def test_a_cache_hit_decodes_what_the_cold_prompt_does(
    key: str, llama_server: Path, tmp_path: Path
) -> None:
    """A prefix-cache hit restores the prefix (or a checkpoint of it) and recomputes the
    tokens after it in a smaller batch: its scores differ from the cold prompt's by float
    rounding (about 1e-3 nats). A random model whose top two tokens are that close flips its
    greedy pick on the hit (the demo's old/new parity failed so on gemma4, then llama), so
    every zoo family wins each step by a clear margin and a hit answers what the cold prompt
    does, for every use case's prompt."""
    (tmp_path / "model").mkdir()
    built = ZOO_BUILDERS[key](tmp_path / "model", 7)
    home = tmp_path / "home"
    home.mkdir()
    async with (
        serve(llama_server, built.files[0], home) as served,
        httpx.AsyncClient(base_url=served.base_url) as client,
    ):
        for label, prompt in use_case_prompts():
            cold = await greedy_chat(client, prompt)
            hit = await greedy_chat(client, prompt)
            assert min(cold.margins) > 1.0, (label, cold.margins)
            assert hit.tokens == cold.tokens, (label, cold, hit)
            if len(prompt) < min(HIT_PROMPT_CHARS) + 1:
                assert hit.cached_tokens > cold.cached_tokens, (label, cold, hit)
