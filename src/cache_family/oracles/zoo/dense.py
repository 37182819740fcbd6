"""Tiny builders for the dense-attention catalog families.

Each builder writes the tensors and keys the vendored llama.cpp's ``src/models/<arch>.cpp`` asks
for (shapes in ggml ``ne`` order) and keeps its family's distinguishing traits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from cache_family.oracles.zoo.base import (
    DEFAULT_SHAPE_ARGS,
    F32,
    BuiltModel,
    TinyShape,
    add_trunk_hparams,
    attention_kv_bytes_per_token,
    model_rng,
    open_f16_writer,
    write_gguf,
    zoo_vocab_size,
)
from cache_family.oracles.zoo.layers import Tensors
from cache_family.oracles.zoo.vocab import add_byte_bpe_vocab

RMS_EPS = 1e-6

DESCRIPTION = (
    "Tiny random-weight model written by cache-family-bench's zoo for tests and demos; "
    "not a trained model, its outputs and speed say nothing about the family it imitates."
)


def _shape(**overrides: int) -> TinyShape:
    return TinyShape(n_vocab=zoo_vocab_size(), **{**DEFAULT_SHAPE_ARGS, **overrides})


@dataclass
class _Model:
    """One dense GGUF being assembled: the shared metadata is written, the family's follows."""

    path: Path
    arch: str
    shape: TinyShape
    writer: gguf.GGUFWriter
    tensors: Tensors

    @classmethod
    def start(
        cls,
        path: Path,
        arch: str,
        key: str,
        seed: int,
        shape: TinyShape,
        *,
        head_count_kv: Sequence[int] | None = None,  # per layer, where layers differ
    ) -> _Model:
        writer = open_f16_writer(path, arch, f"cache-family zoo {key}", description=DESCRIPTION)
        add_byte_bpe_vocab(writer)
        add_trunk_hparams(writer, shape)
        writer.add_head_count(shape.n_head)
        writer.add_head_count_kv(shape.n_head_kv if head_count_kv is None else head_count_kv)
        return cls(path, arch, shape, writer, Tensors(model_rng(seed, key), shape.n_embd))

    @property
    def head_dim(self) -> int:
        return self.shape.n_embd // self.shape.n_head

    def finish(self, kv_bytes_per_token: int | None = None) -> BuiltModel:
        """Write the file; by default every layer holds f16 K and V of ``head_dim``."""
        write_gguf(self.writer, self.tensors)
        if kv_bytes_per_token is None:
            shape = self.shape
            kv_bytes_per_token = attention_kv_bytes_per_token(
                shape.n_layer, shape.n_head_kv, self.head_dim
            )
        return BuiltModel((self.path,), self.arch, self.shape, kv_bytes_per_token)


def _attention(m: _Model, il: int, *, qk_norm: bool = False) -> None:
    shape, head_dim = m.shape, m.head_dim
    m.tensors.attention(il, shape.n_head * head_dim, shape.n_head_kv * head_dim)
    if qk_norm:
        m.tensors.norm("attn_k_norm", head_dim, il)
        m.tensors.norm("attn_q_norm", head_dim, il)


def _pre_norm_decoder(
    m: _Model, *, qk_norm: bool = False, post_norms: bool = False, tied_head: bool = False
) -> None:
    """Llama-style blocks: RMS norm before attention and before the FFN; quiet blocks and a
    successor head (``Tensors.quiet``, ``Tensors.successor_head``).

    ``qk_norm``: RMS norms on every query and key head. ``post_norms``: Gemma's extra norms
    after attention and after the FFN (the ones made quiet). ``tied_head``: the family's
    loader always reads the output head from the input embedding (Gemma2), so greedy decoding
    repeats the current token, still by a clear margin.
    """
    t, e = m.tensors, m.shape.n_embd
    t.token_embedding(m.shape.n_vocab)
    if not tied_head:
        t.successor_head()
    t.norm("output_norm", e)
    for il in range(m.shape.n_layer):
        t.norm("attn_norm", e, il)
        _attention(m, il, qk_norm=qk_norm)
        if post_norms:
            t.norm("post_attention_norm", e, il)
        t.norm("ffn_norm", e, il)
        t.ffn(il, m.shape.n_ff)
        if post_norms:
            t.norm("post_ffw_norm", e, il)
    if post_norms:
        t.quiet("post_attention_norm", "post_ffw_norm")
    else:
        t.quiet("attn_output", "ffn_down")


def build_llama(staging: Path, seed: int) -> BuiltModel:
    """Llama 3.2: GQA, RMS norm, SwiGLU (the real model ties its output head to the input
    embedding; llama.cpp also reads an untied one, which the zoo writes)."""
    path = staging / "llama-3.2-1b-instruct-q4_k_m.gguf"
    m = _Model.start(path, "llama", "llama", seed, _shape())
    m.writer.add_layer_norm_rms_eps(1e-5)
    m.writer.add_rope_dimension_count(m.head_dim)
    m.writer.add_rope_freq_base(500000.0)
    _pre_norm_decoder(m)
    return m.finish()


def build_qwen3_dense(staging: Path, seed: int) -> BuiltModel:
    """Qwen3 dense: Llama-style blocks plus RMS norms on every query and key head."""
    path = staging / "Qwen3-0.6B-Q8_0.gguf"
    m = _Model.start(path, "qwen3", "qwen3_dense", seed, _shape())
    m.writer.add_layer_norm_rms_eps(RMS_EPS)
    m.writer.add_rope_freq_base(1000000.0)
    m.writer.add_key_length(m.head_dim)
    m.writer.add_value_length(m.head_dim)
    _pre_norm_decoder(m, qk_norm=True)
    return m.finish()


def build_gemma2(staging: Path, seed: int) -> BuiltModel:
    """Gemma2: local (4096-token window) and global layers alternate; soft-capped logits."""
    path = staging / "gemma-2-2b-it-Q4_K_M.gguf"
    m = _Model.start(path, "gemma2", "gemma2", seed, _shape())
    m.writer.add_layer_norm_rms_eps(RMS_EPS)
    m.writer.add_key_length(m.head_dim)
    m.writer.add_value_length(m.head_dim)
    m.writer.add_sliding_window(4096)
    m.writer.add_attn_logit_softcapping(50.0)
    m.writer.add_final_logit_softcapping(30.0)
    _pre_norm_decoder(m, post_norms=True, tied_head=True)
    return m.finish()


def build_gemma3(staging: Path, seed: int) -> BuiltModel:
    """Gemma3: five 512-token sliding-window layers per global layer, Q/K norms.

    Six layers so the tiny model keeps one global layer after five local ones.
    """
    path = staging / "gemma-3-1b-it-Q4_K_M.gguf"
    m = _Model.start(path, "gemma3", "gemma3", seed, _shape(n_layer=6))
    m.writer.add_layer_norm_rms_eps(RMS_EPS)
    m.writer.add_key_length(m.head_dim)
    m.writer.add_value_length(m.head_dim)
    m.writer.add_sliding_window(512)
    m.writer.add_rope_freq_base(1000000.0)
    m.writer.add_rope_freq_base_swa(10000.0)
    _pre_norm_decoder(m, qk_norm=True, post_norms=True)
    return m.finish()


def build_olmo(staging: Path, seed: int) -> BuiltModel:
    """OLMo (first generation): layer norm without weights, untied output, full MHA."""
    path = staging / "olmo-7b-instruct-hf-f16.gguf"
    m = _Model.start(path, "olmo", "olmo", seed, _shape(n_head_kv=DEFAULT_SHAPE_ARGS["n_head"]))
    m.writer.add_layer_norm_eps(1e-5)
    t = m.tensors
    t.token_embedding(m.shape.n_vocab)
    t.successor_head()
    for il in range(m.shape.n_layer):
        _attention(m, il)
        t.ffn(il, m.shape.n_ff)
    t.quiet("attn_output", "ffn_down")
    return m.finish()


def build_glm4(staging: Path, seed: int) -> BuiltModel:
    """GLM4: Q/K/V biases, rotary embedding on half of each head, fused gate+up FFN."""
    path = staging / "glm-4-9b-0414-q4_k_m.gguf"
    m = _Model.start(path, "glm4", "glm4", seed, _shape())
    m.writer.add_layer_norm_rms_eps(1e-5)
    m.writer.add_rope_dimension_count(m.head_dim // 2)
    m.writer.add_rope_freq_base(10000.0)
    t, shape, e = m.tensors, m.shape, m.shape.n_embd
    t.token_embedding(shape.n_vocab)
    t.output_head()
    for il in range(shape.n_layer):
        t.norm("attn_norm", e, il)
        _attention(m, il)
        t.bias("attn_q", shape.n_head * m.head_dim, il)
        t.bias("attn_k", shape.n_head_kv * m.head_dim, il)
        t.bias("attn_v", shape.n_head_kv * m.head_dim, il)
        t.norm("post_attention_norm", e, il)
        t.norm("ffn_norm", e, il)
        t.weight("ffn_up", (e, 2 * shape.n_ff), il)
        t.weight("ffn_down", (shape.n_ff, e), il)
        t.norm("post_ffw_norm", e, il)
    t.quiet("post_attention_norm", "post_ffw_norm")
    return m.finish()


@dataclass(frozen=True)
class _Gemma4Plan:
    key: str
    file_name: str
    swa_pattern: tuple[bool, ...]  # True: sliding-window layer
    sliding_window: int
    head_dim_swa: int
    head_dim_full: int
    n_head_kv_swa: int
    n_head_kv_full: int
    shared_kv_layers: int
    n_embd_per_layer: int
    n_expert: int
    n_expert_used: int
    n_ff_expert: int


def _build_gemma4(staging: Path, seed: int, plan: _Gemma4Plan) -> BuiltModel:
    n_layer = len(plan.swa_pattern)
    path = staging / plan.file_name
    head_kv = [plan.n_head_kv_swa if swa else plan.n_head_kv_full for swa in plan.swa_pattern]
    shape = _shape(n_layer=n_layer, n_head_kv=max(head_kv))
    m = _Model.start(path, "gemma4", plan.key, seed, shape, head_count_kv=head_kv)
    w = m.writer
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_key_length(plan.head_dim_full)
    w.add_value_length(plan.head_dim_full)
    w.add_key_length_swa(plan.head_dim_swa)
    w.add_value_length_swa(plan.head_dim_swa)
    w.add_rope_dimension_count(plan.head_dim_full)
    w.add_rope_dimension_count_swa(plan.head_dim_swa)
    w.add_rope_freq_base(1000000.0)
    w.add_rope_freq_base_swa(10000.0)
    w.add_sliding_window(plan.sliding_window)
    w.add_sliding_window_pattern(list(plan.swa_pattern))
    w.add_shared_kv_layers(plan.shared_kv_layers)
    w.add_embedding_length_per_layer_input(plan.n_embd_per_layer)
    w.add_final_logit_softcapping(30.0)
    if plan.n_expert:
        w.add_expert_count(plan.n_expert)
        w.add_expert_used_count(plan.n_expert_used)
        w.add_expert_feed_forward_length(plan.n_ff_expert)

    t, n_embd = m.tensors, shape.n_embd
    t.token_embedding(shape.n_vocab)
    t.successor_head()
    if plan.n_embd_per_layer:
        per_layer = plan.n_embd_per_layer
        t.weight("per_layer_token_embd", (per_layer * n_layer, shape.n_vocab))
        t.weight("per_layer_model_proj", (n_embd, per_layer * n_layer))
        t.norm("per_layer_proj_norm", per_layer)
    t.norm("output_norm", n_embd)
    # Proportional rotary factors of the global layers; stored once, shared by all of them.
    t.put("rope_freqs", np.ones((plan.head_dim_full // 2,), dtype=F32))

    n_kv_layers = n_layer - plan.shared_kv_layers
    kv_bytes = 0
    for il, swa in enumerate(plan.swa_pattern):
        head_dim = plan.head_dim_swa if swa else plan.head_dim_full
        has_kv = il < n_kv_layers
        if has_kv:
            kv_bytes += attention_kv_bytes_per_token(1, head_kv[il], head_dim)
        t.norm("attn_norm", n_embd, il)
        t.attention(il, shape.n_head * head_dim, head_kv[il] * head_dim, has_kv=has_kv)
        t.norm("attn_q_norm", head_dim, il)
        if has_kv:
            t.norm("attn_k_norm", head_dim, il)
        t.norm("post_attention_norm", n_embd, il)
        t.norm("ffn_norm", n_embd, il)
        t.ffn(il, shape.n_ff)
        t.norm("post_ffw_norm", n_embd, il)
        if plan.n_expert:
            t.router(il, plan.n_expert)
            t.norm("ffn_gate_inp", n_embd, il, suffix="scale")
            t.norm("pre_ffw_norm_2", n_embd, il)
            t.norm("post_ffw_norm_1", n_embd, il)
            t.norm("post_ffw_norm_2", n_embd, il)
            t.weight("ffn_gate_up_exps", (n_embd, 2 * plan.n_ff_expert, plan.n_expert), il)
            t.weight("ffn_down_exps", (plan.n_ff_expert, n_embd, plan.n_expert), il)
        if plan.n_embd_per_layer:
            t.weight("inp_gate", (n_embd, plan.n_embd_per_layer), il)
            t.weight("proj", (plan.n_embd_per_layer, n_embd), il)
            t.norm("post_norm", n_embd, il)
    t.quiet("post_attention_norm", "post_ffw_norm", "post_norm")
    return m.finish(kv_bytes)


# E4B: per-layer token embeddings, and the last layers reuse the KV of the last local and
# global layers before them (llama.cpp requires the last KV layer global, the one before
# it local). Three local layers per global one keeps that shape in eight layers.
_GEMMA4_E4B = _Gemma4Plan(
    key="gemma4_e4b",
    file_name="gemma-4-E4B-it-Q4_K_M.gguf",
    swa_pattern=(True, True, True, False, True, True, True, False),
    sliding_window=512,
    head_dim_swa=64,
    head_dim_full=128,
    n_head_kv_swa=2,
    n_head_kv_full=2,
    shared_kv_layers=4,
    n_embd_per_layer=32,
    n_expert=0,
    n_expert_used=0,
    n_ff_expert=0,
)

# A4B: every layer routes to experts next to a shared MLP; local layers carry more KV heads
# than global ones, as in the 26B model.
_GEMMA4_A4B = _Gemma4Plan(
    key="gemma4_a4b",
    file_name="google-gemma-4-26B-A4B-it-Q6_K.gguf",
    swa_pattern=(True, True, True, False),
    sliding_window=1024,
    head_dim_swa=64,
    head_dim_full=128,
    n_head_kv_swa=2,
    n_head_kv_full=1,
    shared_kv_layers=0,
    n_embd_per_layer=0,
    n_expert=4,
    n_expert_used=2,
    n_ff_expert=128,
)


def build_gemma4_e4b(staging: Path, seed: int) -> BuiltModel:
    return _build_gemma4(staging, seed, _GEMMA4_E4B)


def build_gemma4_a4b(staging: Path, seed: int) -> BuiltModel:
    return _build_gemma4(staging, seed, _GEMMA4_A4B)
