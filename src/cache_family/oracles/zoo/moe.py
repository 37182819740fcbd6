"""Tiny DeepSeek2-architecture models: multi-head latent attention (MLA) plus mixture of experts.

The MLA layout is the one current converters write (``attn_k_b``/``attn_v_b``, one KV head
holding the latent plus the rope part). Tiny models are below the loader's "lite" guess, so
``attention.q_lora_rank`` is written explicitly (0 for the lite layout). The DeepSeek-V3.2
preset is a layer package only, never served whole.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import gguf

from cache_family.oracles.package_builder import write_package
from cache_family.oracles.zoo.base import (
    KV_ELEMENT_BYTES,
    BuiltModel,
    add_trunk_hparams,
    model_rng,
    open_f16_writer,
    tiny_shape,
    write_gguf,
)
from cache_family.oracles.zoo.layers import DOWN_GATE_UP, GATE_DOWN_UP, Tensors
from cache_family.oracles.zoo.vocab import add_byte_bpe_vocab

DEEPSEEK2_FILE = "DeepSeek-Coder-V2-Lite-Instruct-Q4_K_M.gguf"
GLM47_FLASH_FILE = "GLM-4.7-Flash-Q4_K_M.gguf"
DEEPSEEK3_MODEL_ID = "unsloth/DeepSeek-V3.2-GGUF:UD-Q4_K_XL"
#: The whole tiny model the package is cut from; it is not part of the zoo.
DEEPSEEK3_SOURCE_FILE = "tiny-DeepSeek-V3.2.gguf"
ARCH = "deepseek2"


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_context: int
    log_multiplier: float  # as converters write it: 0.1 * mscale_all_dim


@dataclass(frozen=True)
class MlaMoeSpec:
    """Every hyperparameter a deepseek2 GGUF carries; the defaults are the zoo's tiny sizes."""

    name: str
    q_lora_rank: int  # 0: the lite layout with a plain attn_q
    qk_nope: int
    v_head: int
    n_expert: int
    n_expert_shared: int
    n_dense_lead: int
    gating: gguf.ExpertGatingFuncType
    weights_norm: bool
    weights_scale: float
    selection_bias: bool  # exp_probs_b, the sigmoid routers' correction bias
    rope_freq_base: float
    yarn: YarnScaling | None
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    kv_lora_rank: int = 64
    qk_rope: int = 16
    n_ff: int = 512  # the dense leading layers
    n_ff_exp: int = 128
    n_expert_used: int = 2
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

    @property
    def n_head_kv(self) -> int:
        return 1  # MLA is served as MQA over the latent


DEEPSEEK_CODER_V2_LITE = MlaMoeSpec(
    name="tiny DeepSeek-Coder-V2-Lite (random weights)",
    q_lora_rank=0,
    qk_nope=32,
    v_head=32,
    n_expert=4,
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
    q_lora_rank=96,
    qk_nope=48,
    v_head=64,
    n_expert=4,
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
    q_lora_rank=96,
    qk_nope=32,
    v_head=32,
    n_expert=8,
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


def deepseek2_writer(path: Path, spec: MlaMoeSpec) -> gguf.GGUFWriter:
    """A writer holding every deepseek2 hyperparameter of ``spec`` and the vocabulary."""
    shape = tiny_shape(spec)
    writer = open_f16_writer(path, ARCH, spec.name)
    add_trunk_hparams(writer, shape)
    writer.add_leading_dense_block_count(spec.n_dense_lead)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
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
    writer.add_vocab_size(shape.n_vocab)
    add_byte_bpe_vocab(writer)
    return writer


def add_layer_tensors(t: Tensors, spec: MlaMoeSpec, il: int) -> None:
    """One block's tensors, with the shapes ``llama_model_deepseek2::load_arch_tensors`` asks."""
    e, h = spec.n_embd, spec.n_head
    head_k = spec.qk_nope + spec.qk_rope
    t.norm("attn_norm", e, il)
    if spec.q_lora_rank > 0:
        t.norm("attn_q_a_norm", spec.q_lora_rank, il)
    t.norm("attn_kv_a_norm", spec.kv_lora_rank, il)
    if spec.q_lora_rank > 0:
        t.weight("attn_q_a", (e, spec.q_lora_rank), il)
        t.weight("attn_q_b", (spec.q_lora_rank, h * head_k), il)
    else:
        t.weight("attn_q", (e, h * head_k), il)
    t.weight("attn_kv_a_mqa", (e, spec.key_length), il)
    t.weight("attn_k_b", (spec.qk_nope, spec.kv_lora_rank, h), il)
    t.weight("attn_v_b", (spec.kv_lora_rank, spec.v_head, h), il)
    t.weight("attn_output", (h * spec.v_head, e), il)
    t.norm("ffn_norm", e, il)
    if il < spec.n_dense_lead:
        t.ffn(il, spec.n_ff, GATE_DOWN_UP)
        return
    t.router(il, spec.n_expert)
    if spec.selection_bias:
        t.bias("exp_probs_b", spec.n_expert, il)
    t.experts(il, spec.n_ff_exp, spec.n_expert, DOWN_GATE_UP)
    t.shared_expert(il, spec.n_ff_exp * spec.n_expert_shared, GATE_DOWN_UP)


def _build_monolithic(staging_dir: Path, seed: int, spec: MlaMoeSpec, file_name: str) -> BuiltModel:
    path = staging_dir / file_name
    shape = tiny_shape(spec)
    t = Tensors(model_rng(seed, file_name), spec.n_embd)
    t.token_embedding(shape.n_vocab)
    for il in range(spec.n_layer):
        add_layer_tensors(t, spec, il)
    t.output_head()
    t.quiet("attn_output", "ffn_down", "ffn_down_exps", "ffn_down_shexp")
    write_gguf(deepseek2_writer(path, spec), t)
    return BuiltModel((path,), ARCH, shape, spec.kv_bytes_per_token)


def build_deepseek2(staging_dir: Path, seed: int) -> BuiltModel:
    """DeepSeek-Coder-V2-Lite: lite MLA (no query LoRA), softmax routing, YaRN."""
    return _build_monolithic(staging_dir, seed, DEEPSEEK_CODER_V2_LITE, DEEPSEEK2_FILE)


def build_glm47_flash(staging_dir: Path, seed: int) -> BuiltModel:
    """GLM-4.7-Flash, which GGUF files declare as ``deepseek2``: MLA with a query LoRA and
    sigmoid routing with a selection bias."""
    return _build_monolithic(staging_dir, seed, GLM47_FLASH, GLM47_FLASH_FILE)


def build_deepseek3_package(staging_dir: Path, seed: int) -> BuiltModel:
    """DeepSeek-V3.2 as a layer package: ``staging_dir`` becomes the package directory.

    A whole tiny model is written aside and cut by ``write-package`` (creation time fixed at 0
    so a seed gives the same bytes). Every artifact carries the model's whole metadata, and
    ``model-package.json`` pins each one. No single artifact is a whole model, so the package is
    not servable by ``llama-server``: the catalog marks DeepSeek3 package-only.
    """
    spec = DEEPSEEK_V32
    aside = staging_dir / ".source"
    aside.mkdir()
    try:
        source = _build_monolithic(aside, seed, spec, DEEPSEEK3_SOURCE_FILE).files[0]
        cut = aside / "package"
        write_package(
            source,
            cut,
            DEEPSEEK3_MODEL_ID,
            source_file=DEEPSEEK3_SOURCE_FILE,
            created_at_unix_secs=0,
        )
        for entry in sorted(cut.iterdir()):
            entry.rename(staging_dir / entry.name)
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    files = sorted(p for p in staging_dir.rglob("*") if p.is_file())
    return BuiltModel(tuple(files), ARCH, tiny_shape(spec), spec.kv_bytes_per_token)
