"""Tiny DeepSeek2-architecture models: multi-head latent attention (MLA) plus mixture of experts.

Three catalog families share llama.cpp's ``deepseek2`` architecture (``src/models/deepseek2.cpp``):

* DeepSeek-Coder-V2-Lite: the "lite" layout, a plain ``attn_q`` projection (no query LoRA),
  softmax routing, two shared experts, YaRN rope scaling.
* GLM-4.7-Flash: llama.cpp's converter maps ``Glm4MoeLiteForCausalLM`` onto ``deepseek2``
  (``conversion/glm.py``), with a query LoRA, sigmoid routing plus a per-expert selection bias
  (``exp_probs_b``), normalised and scaled expert weights.
* DeepSeek-V3.2 as a *layer package*: a directory of per-layer-range GGUF files plus
  ``manifest.json``. It is package-only (no monolithic baseline), so it is never served whole.

The MLA layout is the one current converters write: ``key_length_mla``/``value_length_mla`` set,
the KV decompression split into ``attn_k_b``/``attn_v_b``, a single KV head whose key is the
compressed latent plus the rope part. llama.cpp then keeps a K-only cache of
``kv_lora_rank + qk_rope`` elements per layer and token.

Tiny models have 4-6 layers, so the loader's "lite" guess (27 or 26 layers) never fires and
``attention.q_lora_rank`` must be written explicitly: 0 for the lite layout.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from cache_family.oracles.zoo.base import (
    F32,
    KV_ELEMENT_BYTES,
    BuiltModel,
    TinyShape,
    model_rng,
    ne_tensor,
    norm_tensor,
    write_gguf,
)
from cache_family.oracles.zoo.vocab import add_byte_bpe_vocab, vocabulary

DEEPSEEK2_FILE = "DeepSeek-Coder-V2-Lite-Instruct-Q4_K_M.gguf"
GLM47_FLASH_FILE = "GLM-4.7-Flash-Q4_K_M.gguf"
DEEPSEEK3_MODEL_ID = "unsloth/DeepSeek-V3.2-GGUF:UD-Q4_K_XL"
PACKAGE_MANIFEST = "manifest.json"
PACKAGE_SCHEMA_VERSION = 1
ARCH = "deepseek2"


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_context: int
    log_multiplier: float  # as converters write it: 0.1 * mscale_all_dim


@dataclass(frozen=True)
class MlaMoeSpec:
    """Every hyperparameter a deepseek2 GGUF carries, at tiny sizes."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    q_lora_rank: int  # 0: the lite layout with a plain attn_q
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    n_ff: int  # the dense leading layers
    n_ff_exp: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    n_dense_lead: int
    gating: gguf.ExpertGatingFuncType
    weights_norm: bool
    weights_scale: float
    selection_bias: bool  # exp_probs_b, the sigmoid routers' correction bias
    rope_freq_base: float
    yarn: YarnScaling | None
    n_expert_groups: int = 0
    n_expert_groups_used: int = 0
    n_ctx_train: int = 8192
    rms_eps: float = 1e-6

    @property
    def key_length(self) -> int:
        return self.kv_lora_rank + self.qk_rope

    @property
    def kv_bytes_per_token(self) -> int:
        # MLA keeps one K-only row (latent + rope part) per layer; V is a view of it.
        return self.n_layer * self.key_length * KV_ELEMENT_BYTES

    def shape(self, n_vocab: int) -> TinyShape:
        return TinyShape(
            n_layer=self.n_layer,
            n_embd=self.n_embd,
            n_head=self.n_head,
            n_head_kv=1,
            n_ff=self.n_ff,
            n_ctx_train=self.n_ctx_train,
            n_vocab=n_vocab,
        )


DEEPSEEK_CODER_V2_LITE = MlaMoeSpec(
    name="tiny DeepSeek-Coder-V2-Lite (random weights)",
    n_layer=4,
    n_embd=256,
    n_head=4,
    q_lora_rank=0,
    kv_lora_rank=64,
    qk_nope=32,
    qk_rope=16,
    v_head=32,
    n_ff=512,
    n_ff_exp=128,
    n_expert=4,
    n_expert_used=2,
    n_expert_shared=2,
    n_dense_lead=1,
    gating=gguf.ExpertGatingFuncType.SOFTMAX,
    weights_norm=False,
    weights_scale=1.0,
    selection_bias=False,
    rope_freq_base=10000.0,
    yarn=YarnScaling(factor=4.0, original_context=2048, log_multiplier=0.0707),
)

GLM47_FLASH = MlaMoeSpec(
    name="tiny GLM-4.7-Flash (random weights)",
    n_layer=4,
    n_embd=256,
    n_head=4,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope=48,
    qk_rope=16,
    v_head=64,
    n_ff=512,
    n_ff_exp=128,
    n_expert=4,
    n_expert_used=2,
    n_expert_shared=1,
    n_dense_lead=1,
    gating=gguf.ExpertGatingFuncType.SIGMOID,
    weights_norm=True,
    weights_scale=1.8,
    selection_bias=True,
    rope_freq_base=1_000_000.0,
    yarn=None,
)

# Six layers so the catalog's package state range (layers 3..4, stage 1) lies inside the
# model, after three dense leading layers as in DeepSeek-V3.
DEEPSEEK_V32 = MlaMoeSpec(
    name="tiny DeepSeek-V3.2 layer package (random weights)",
    n_layer=6,
    n_embd=256,
    n_head=4,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope=32,
    qk_rope=16,
    v_head=32,
    n_ff=512,
    n_ff_exp=128,
    n_expert=8,
    n_expert_used=2,
    n_expert_shared=1,
    n_dense_lead=3,
    gating=gguf.ExpertGatingFuncType.SIGMOID,
    weights_norm=True,
    weights_scale=2.5,
    selection_bias=True,
    rope_freq_base=10000.0,
    yarn=YarnScaling(factor=4.0, original_context=2048, log_multiplier=0.1),
    n_expert_groups=2,
    n_expert_groups_used=1,
)

PACKAGE_LAYERS_PER_FILE = 2


def add_deepseek2_metadata(writer: gguf.GGUFWriter, spec: MlaMoeSpec) -> int:
    """Write the hyperparameters and the vocabulary; returns the vocabulary size."""
    writer.add_name(spec.name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(spec.n_ctx_train)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_leading_dense_block_count(spec.n_dense_lead)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(1)  # MLA is served as MQA over the latent
    writer.add_layer_norm_rms_eps(spec.rms_eps)
    writer.add_q_lora_rank(spec.q_lora_rank)
    writer.add_kv_lora_rank(spec.kv_lora_rank)
    writer.add_key_length(spec.key_length)
    writer.add_value_length(spec.kv_lora_rank)
    writer.add_key_length_mla(spec.qk_nope + spec.qk_rope)
    writer.add_value_length_mla(spec.v_head)
    writer.add_rope_dimension_count(spec.qk_rope)
    writer.add_rope_freq_base(spec.rope_freq_base)
    if spec.yarn is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(spec.yarn.factor)
        writer.add_rope_scaling_orig_ctx_len(spec.yarn.original_context)
        writer.add_rope_scaling_yarn_log_mul(spec.yarn.log_multiplier)
    writer.add_expert_count(spec.n_expert)
    writer.add_expert_used_count(spec.n_expert_used)
    writer.add_expert_shared_count(spec.n_expert_shared)
    writer.add_expert_feed_forward_length(spec.n_ff_exp)
    writer.add_expert_weights_scale(spec.weights_scale)
    writer.add_expert_weights_norm(spec.weights_norm)
    writer.add_expert_gating_func(spec.gating)
    if spec.n_expert_groups:
        writer.add_expert_group_count(spec.n_expert_groups)
        writer.add_expert_group_used_count(spec.n_expert_groups_used)
    n_vocab = len(vocabulary()[0])
    writer.add_vocab_size(n_vocab)
    written = add_byte_bpe_vocab(writer)
    assert written == n_vocab
    return n_vocab


def add_embedding_tensors(
    writer: gguf.GGUFWriter, rng: np.random.Generator, spec: MlaMoeSpec, n_vocab: int
) -> None:
    writer.add_tensor("token_embd.weight", ne_tensor(rng, (spec.n_embd, n_vocab)))


def add_output_tensors(
    writer: gguf.GGUFWriter, rng: np.random.Generator, spec: MlaMoeSpec, n_vocab: int
) -> None:
    writer.add_tensor("output_norm.weight", norm_tensor(rng, spec.n_embd))
    writer.add_tensor("output.weight", ne_tensor(rng, (spec.n_embd, n_vocab)))


def add_layer_tensors(
    writer: gguf.GGUFWriter, rng: np.random.Generator, spec: MlaMoeSpec, il: int
) -> None:
    """One block's tensors, with the shapes ``llama_model_deepseek2::load_arch_tensors`` asks."""
    blk = f"blk.{il}"
    e, h = spec.n_embd, spec.n_head
    head_k = spec.qk_nope + spec.qk_rope
    writer.add_tensor(f"{blk}.attn_norm.weight", norm_tensor(rng, e))
    if spec.q_lora_rank > 0:
        writer.add_tensor(f"{blk}.attn_q_a_norm.weight", norm_tensor(rng, spec.q_lora_rank))
    writer.add_tensor(f"{blk}.attn_kv_a_norm.weight", norm_tensor(rng, spec.kv_lora_rank))
    if spec.q_lora_rank > 0:
        writer.add_tensor(f"{blk}.attn_q_a.weight", ne_tensor(rng, (e, spec.q_lora_rank)))
        writer.add_tensor(f"{blk}.attn_q_b.weight", ne_tensor(rng, (spec.q_lora_rank, h * head_k)))
    else:
        writer.add_tensor(f"{blk}.attn_q.weight", ne_tensor(rng, (e, h * head_k)))
    writer.add_tensor(f"{blk}.attn_kv_a_mqa.weight", ne_tensor(rng, (e, spec.key_length)))
    writer.add_tensor(
        f"{blk}.attn_k_b.weight", ne_tensor(rng, (spec.qk_nope, spec.kv_lora_rank, h))
    )
    writer.add_tensor(f"{blk}.attn_v_b.weight", ne_tensor(rng, (spec.kv_lora_rank, spec.v_head, h)))
    writer.add_tensor(f"{blk}.attn_output.weight", ne_tensor(rng, (h * spec.v_head, e)))
    writer.add_tensor(f"{blk}.ffn_norm.weight", norm_tensor(rng, e))
    if il < spec.n_dense_lead:
        writer.add_tensor(f"{blk}.ffn_gate.weight", ne_tensor(rng, (e, spec.n_ff)))
        writer.add_tensor(f"{blk}.ffn_down.weight", ne_tensor(rng, (spec.n_ff, e)))
        writer.add_tensor(f"{blk}.ffn_up.weight", ne_tensor(rng, (e, spec.n_ff)))
        return
    x, f = spec.n_expert, spec.n_ff_exp
    # Routers stay f32 in converted and quantized files alike.
    writer.add_tensor(f"{blk}.ffn_gate_inp.weight", ne_tensor(rng, (e, x), F32))
    if spec.selection_bias:
        writer.add_tensor(f"{blk}.exp_probs_b.bias", ne_tensor(rng, (x,), F32))
    writer.add_tensor(f"{blk}.ffn_down_exps.weight", ne_tensor(rng, (f, e, x)))
    writer.add_tensor(f"{blk}.ffn_gate_exps.weight", ne_tensor(rng, (e, f, x)))
    writer.add_tensor(f"{blk}.ffn_up_exps.weight", ne_tensor(rng, (e, f, x)))
    shared = f * spec.n_expert_shared
    writer.add_tensor(f"{blk}.ffn_gate_shexp.weight", ne_tensor(rng, (e, shared)))
    writer.add_tensor(f"{blk}.ffn_down_shexp.weight", ne_tensor(rng, (shared, e)))
    writer.add_tensor(f"{blk}.ffn_up_shexp.weight", ne_tensor(rng, (e, shared)))


def _build_monolithic(staging_dir: Path, seed: int, spec: MlaMoeSpec, file_name: str) -> BuiltModel:
    path = staging_dir / file_name
    rng = model_rng(seed, file_name)
    writer = gguf.GGUFWriter(path, ARCH)
    n_vocab = add_deepseek2_metadata(writer, spec)
    add_embedding_tensors(writer, rng, spec, n_vocab)
    for il in range(spec.n_layer):
        add_layer_tensors(writer, rng, spec, il)
    add_output_tensors(writer, rng, spec, n_vocab)
    write_gguf(writer)
    return BuiltModel(
        files=(path,),
        architecture=ARCH,
        shape=spec.shape(n_vocab),
        kv_bytes_per_token=spec.kv_bytes_per_token,
    )


def build_deepseek2(staging_dir: Path, seed: int) -> BuiltModel:
    """DeepSeek-Coder-V2-Lite: lite MLA (no query LoRA), softmax routing, YaRN."""
    return _build_monolithic(staging_dir, seed, DEEPSEEK_CODER_V2_LITE, DEEPSEEK2_FILE)


def build_glm47_flash(staging_dir: Path, seed: int) -> BuiltModel:
    """GLM-4.7-Flash, which GGUF files declare as ``deepseek2``: MLA with a query LoRA and
    sigmoid routing with a selection bias."""
    return _build_monolithic(staging_dir, seed, GLM47_FLASH, GLM47_FLASH_FILE)


def package_file_name(layer_start: int, layer_end: int) -> str:
    """``layers-SSSSS-EEEEE.gguf``: the half-open block range ``[start, end)`` it holds."""
    return f"layers-{layer_start:05d}-{layer_end:05d}.gguf"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build_deepseek3_package(staging_dir: Path, seed: int) -> BuiltModel:
    """DeepSeek-V3.2 as a layer package: ``staging_dir`` becomes the package directory.

    Every file is a complete GGUF header (all ``deepseek2`` hyperparameters and the
    vocabulary, ``block_count`` of the whole model) followed by the tensors of its half-open
    layer range; the first file also holds ``token_embd``, the last the output head.
    ``manifest.json`` lists the files in layer order with their SHA-256. No single file is a
    whole model, so the package is not servable by ``llama-server``: the catalog marks
    DeepSeek3 package-only.
    """
    spec = DEEPSEEK_V32
    rng = model_rng(seed, "deepseek3-layer-package")
    entries: list[dict[str, object]] = []
    files: list[Path] = []
    n_vocab = len(vocabulary()[0])
    for start in range(0, spec.n_layer, PACKAGE_LAYERS_PER_FILE):
        end = min(start + PACKAGE_LAYERS_PER_FILE, spec.n_layer)
        path = staging_dir / package_file_name(start, end)
        writer = gguf.GGUFWriter(path, ARCH)
        n_vocab = add_deepseek2_metadata(writer, spec)
        holds_embedding = start == 0
        holds_output = end == spec.n_layer
        if holds_embedding:
            add_embedding_tensors(writer, rng, spec, n_vocab)
        for il in range(start, end):
            add_layer_tensors(writer, rng, spec, il)
        if holds_output:
            add_output_tensors(writer, rng, spec, n_vocab)
        write_gguf(writer)
        files.append(path)
        entries.append(
            {
                "path": path.name,
                "layer_start": start,
                "layer_end": end,
                "holds_token_embedding": holds_embedding,
                "holds_output": holds_output,
                "size_bytes": path.stat().st_size,
                "sha256": _sha256_file(path),
            }
        )
    manifest = {
        "schema_version": PACKAGE_SCHEMA_VERSION,
        "model_id": DEEPSEEK3_MODEL_ID,
        "architecture": ARCH,
        "layer_count": spec.n_layer,
        "activation_width": spec.n_embd,
        "layer_range_convention": "half-open [layer_start, layer_end)",
        "producer": "cache-family-bench tiny model zoo: random weights, not the released model",
        "files": entries,
    }
    manifest_path = staging_dir / PACKAGE_MANIFEST
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return BuiltModel(
        files=(manifest_path, *files),
        architecture=ARCH,
        shape=spec.shape(n_vocab),
        kv_bytes_per_token=spec.kv_bytes_per_token,
    )
