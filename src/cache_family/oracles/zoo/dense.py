"""Tiny builders for the dense-attention catalog families.

Each builder writes the tensors and metadata keys that the vendored llama.cpp's
``src/models/<arch>.cpp`` asks for (names via ``gguf.TENSOR_NAMES``, shapes in ggml ``ne``
order), with the family's distinguishing traits kept: Llama's tied embeddings, Qwen3's
per-head Q/K norms, Gemma2's alternating sliding window with soft-capping, Gemma3's
5-local-to-1-global pattern, OLMo's parameter-free layer norm, GLM4's fused gate/up and
partial rotary embedding, Gemma4's per-layer head sizes, shared KV layers and per-layer
embeddings (E4B) or mixture of experts next to a shared MLP (A4B).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from cache_family.oracles.zoo.base import (
    DEFAULT_SHAPE_ARGS,
    F32,
    BuiltModel,
    TinyShape,
    attention_kv_bytes_per_token,
    model_rng,
    ne_tensor,
    norm_tensor,
    write_gguf,
)
from cache_family.oracles.zoo.vocab import add_byte_bpe_vocab, vocabulary

T = gguf.MODEL_TENSOR
RMS_EPS = 1e-6

DESCRIPTION = (
    "Tiny random-weight model written by cache-family-bench's zoo for tests and demos; "
    "not a trained model, its outputs and speed say nothing about the family it imitates."
)


def tensor_name(kind: gguf.MODEL_TENSOR, bid: int | None = None, suffix: str = "weight") -> str:
    base = gguf.TENSOR_NAMES[kind]
    return f"{base.format(bid=bid) if bid is not None else base}.{suffix}"


@dataclass
class _Model:
    """One GGUF file being assembled: metadata first, then tensors in loader order."""

    path: Path
    arch: str
    key: str
    seed: int
    writer: gguf.GGUFWriter = field(init=False)
    rng: np.random.Generator = field(init=False)
    n_vocab: int = field(init=False)

    def __post_init__(self) -> None:
        self.writer = gguf.GGUFWriter(self.path, self.arch, use_temp_file=False)
        self.rng = model_rng(self.seed, self.key)
        self.writer.add_name(f"cache-family zoo {self.key}")
        self.writer.add_description(DESCRIPTION)
        self.writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        self.n_vocab = add_byte_bpe_vocab(self.writer)

    def common(self, shape: TinyShape) -> None:
        w = self.writer
        w.add_context_length(shape.n_ctx_train)
        w.add_embedding_length(shape.n_embd)
        w.add_block_count(shape.n_layer)
        w.add_feed_forward_length(shape.n_ff)
        w.add_head_count(shape.n_head)
        w.add_head_count_kv(shape.n_head_kv)

    def weight(self, kind: gguf.MODEL_TENSOR, ne: tuple[int, ...], bid: int | None = None) -> None:
        self.writer.add_tensor(tensor_name(kind, bid), ne_tensor(self.rng, ne))

    def bias(self, kind: gguf.MODEL_TENSOR, n: int, bid: int | None = None) -> None:
        values = ne_tensor(self.rng, (n,), dtype=F32)
        self.writer.add_tensor(tensor_name(kind, bid, "bias"), values)

    def norm(self, kind: gguf.MODEL_TENSOR, n: int, bid: int | None = None) -> None:
        self.writer.add_tensor(tensor_name(kind, bid), norm_tensor(self.rng, n))

    def finish(self) -> None:
        write_gguf(self.writer)


def _shape(n_vocab: int, **overrides: int) -> TinyShape:
    args = {**DEFAULT_SHAPE_ARGS, **overrides}
    return TinyShape(n_vocab=n_vocab, **args)


def _n_vocab() -> int:
    return len(vocabulary()[0])


def _llama_like_attention(
    m: _Model, shape: TinyShape, il: int, head_dim: int, *, qk_norm: bool = False
) -> None:
    n_q = shape.n_head * head_dim
    n_kv = shape.n_head_kv * head_dim
    m.weight(T.ATTN_Q, (shape.n_embd, n_q), il)
    m.weight(T.ATTN_K, (shape.n_embd, n_kv), il)
    m.weight(T.ATTN_V, (shape.n_embd, n_kv), il)
    m.weight(T.ATTN_OUT, (n_q, shape.n_embd), il)
    if qk_norm:
        m.norm(T.ATTN_K_NORM, head_dim, il)
        m.norm(T.ATTN_Q_NORM, head_dim, il)


def _gated_ffn(m: _Model, shape: TinyShape, il: int, n_ff: int | None = None) -> None:
    n_ff = shape.n_ff if n_ff is None else n_ff
    m.weight(T.FFN_GATE, (shape.n_embd, n_ff), il)
    m.weight(T.FFN_UP, (shape.n_embd, n_ff), il)
    m.weight(T.FFN_DOWN, (n_ff, shape.n_embd), il)


def build_llama(staging: Path, seed: int) -> BuiltModel:
    """Llama 3.2: GQA, RMS norm, SwiGLU, tied input/output embeddings."""
    path = staging / "llama-3.2-1b-instruct-q4_k_m.gguf"
    shape = _shape(_n_vocab())
    head_dim = shape.n_embd // shape.n_head
    m = _Model(path, "llama", "llama", seed)
    m.common(shape)
    m.writer.add_layer_norm_rms_eps(1e-5)
    m.writer.add_rope_dimension_count(head_dim)
    m.writer.add_rope_freq_base(500000.0)
    m.weight(T.TOKEN_EMBD, (shape.n_embd, m.n_vocab))
    m.norm(T.OUTPUT_NORM, shape.n_embd)
    for il in range(shape.n_layer):
        m.norm(T.ATTN_NORM, shape.n_embd, il)
        _llama_like_attention(m, shape, il, head_dim)
        m.norm(T.FFN_NORM, shape.n_embd, il)
        _gated_ffn(m, shape, il)
    m.finish()
    kv = attention_kv_bytes_per_token(shape.n_layer, shape.n_head_kv, head_dim)
    return BuiltModel((path,), "llama", shape, kv)


def build_qwen3_dense(staging: Path, seed: int) -> BuiltModel:
    """Qwen3 dense: Llama-style blocks plus RMS norms on every query and key head."""
    path = staging / "Qwen3-0.6B-Q8_0.gguf"
    shape = _shape(_n_vocab())
    head_dim = shape.n_embd // shape.n_head
    m = _Model(path, "qwen3", "qwen3_dense", seed)
    m.common(shape)
    m.writer.add_layer_norm_rms_eps(RMS_EPS)
    m.writer.add_rope_freq_base(1000000.0)
    m.writer.add_key_length(head_dim)
    m.writer.add_value_length(head_dim)
    m.weight(T.TOKEN_EMBD, (shape.n_embd, m.n_vocab))
    m.norm(T.OUTPUT_NORM, shape.n_embd)
    for il in range(shape.n_layer):
        m.norm(T.ATTN_NORM, shape.n_embd, il)
        _llama_like_attention(m, shape, il, head_dim, qk_norm=True)
        m.norm(T.FFN_NORM, shape.n_embd, il)
        _gated_ffn(m, shape, il)
    m.finish()
    kv = attention_kv_bytes_per_token(shape.n_layer, shape.n_head_kv, head_dim)
    return BuiltModel((path,), "qwen3", shape, kv)


def build_gemma2(staging: Path, seed: int) -> BuiltModel:
    """Gemma2: local (4096-token window) and global layers alternate; soft-capped logits."""
    path = staging / "gemma-2-2b-it-Q4_K_M.gguf"
    shape = _shape(_n_vocab())
    head_dim = shape.n_embd // shape.n_head
    m = _Model(path, "gemma2", "gemma2", seed)
    m.common(shape)
    m.writer.add_layer_norm_rms_eps(RMS_EPS)
    m.writer.add_key_length(head_dim)
    m.writer.add_value_length(head_dim)
    m.writer.add_sliding_window(4096)
    m.writer.add_attn_logit_softcapping(50.0)
    m.writer.add_final_logit_softcapping(30.0)
    m.weight(T.TOKEN_EMBD, (shape.n_embd, m.n_vocab))
    m.norm(T.OUTPUT_NORM, shape.n_embd)
    for il in range(shape.n_layer):
        m.norm(T.ATTN_NORM, shape.n_embd, il)
        _llama_like_attention(m, shape, il, head_dim)
        m.norm(T.ATTN_POST_NORM, shape.n_embd, il)
        m.norm(T.FFN_NORM, shape.n_embd, il)
        _gated_ffn(m, shape, il)
        m.norm(T.FFN_POST_NORM, shape.n_embd, il)
    m.finish()
    kv = attention_kv_bytes_per_token(shape.n_layer, shape.n_head_kv, head_dim)
    return BuiltModel((path,), "gemma2", shape, kv)


def build_gemma3(staging: Path, seed: int) -> BuiltModel:
    """Gemma3: five 512-token sliding-window layers per global layer, Q/K norms.

    Six layers so the tiny model keeps one global layer after five local ones.
    """
    path = staging / "gemma-3-1b-it-Q4_K_M.gguf"
    shape = _shape(_n_vocab(), n_layer=6)
    head_dim = shape.n_embd // shape.n_head
    m = _Model(path, "gemma3", "gemma3", seed)
    m.common(shape)
    m.writer.add_layer_norm_rms_eps(RMS_EPS)
    m.writer.add_key_length(head_dim)
    m.writer.add_value_length(head_dim)
    m.writer.add_sliding_window(512)
    m.writer.add_rope_freq_base(1000000.0)
    m.writer.add_rope_freq_base_swa(10000.0)
    m.weight(T.TOKEN_EMBD, (shape.n_embd, m.n_vocab))
    m.norm(T.OUTPUT_NORM, shape.n_embd)
    for il in range(shape.n_layer):
        m.norm(T.ATTN_NORM, shape.n_embd, il)
        _llama_like_attention(m, shape, il, head_dim, qk_norm=True)
        m.norm(T.ATTN_POST_NORM, shape.n_embd, il)
        m.norm(T.FFN_NORM, shape.n_embd, il)
        _gated_ffn(m, shape, il)
        m.norm(T.FFN_POST_NORM, shape.n_embd, il)
    m.finish()
    kv = attention_kv_bytes_per_token(shape.n_layer, shape.n_head_kv, head_dim)
    return BuiltModel((path,), "gemma3", shape, kv)


def build_olmo(staging: Path, seed: int) -> BuiltModel:
    """OLMo (first generation): layer norm without weights, untied output, full MHA."""
    path = staging / "olmo-7b-instruct-hf-f16.gguf"
    shape = _shape(_n_vocab(), n_head_kv=DEFAULT_SHAPE_ARGS["n_head"])
    head_dim = shape.n_embd // shape.n_head
    m = _Model(path, "olmo", "olmo", seed)
    m.common(shape)
    m.writer.add_layer_norm_eps(1e-5)
    m.weight(T.TOKEN_EMBD, (shape.n_embd, m.n_vocab))
    m.weight(T.OUTPUT, (shape.n_embd, m.n_vocab))
    for il in range(shape.n_layer):
        _llama_like_attention(m, shape, il, head_dim)
        _gated_ffn(m, shape, il)
    m.finish()
    kv = attention_kv_bytes_per_token(shape.n_layer, shape.n_head_kv, head_dim)
    return BuiltModel((path,), "olmo", shape, kv)


def build_glm4(staging: Path, seed: int) -> BuiltModel:
    """GLM4: Q/K/V biases, rotary embedding on half of each head, fused gate+up FFN."""
    path = staging / "glm-4-9b-0414-q4_k_m.gguf"
    shape = _shape(_n_vocab())
    head_dim = shape.n_embd // shape.n_head
    m = _Model(path, "glm4", "glm4", seed)
    m.common(shape)
    m.writer.add_layer_norm_rms_eps(1e-5)
    m.writer.add_rope_dimension_count(head_dim // 2)
    m.writer.add_rope_freq_base(10000.0)
    m.weight(T.TOKEN_EMBD, (shape.n_embd, m.n_vocab))
    m.norm(T.OUTPUT_NORM, shape.n_embd)
    m.weight(T.OUTPUT, (shape.n_embd, m.n_vocab))
    n_kv = shape.n_head_kv * head_dim
    for il in range(shape.n_layer):
        m.norm(T.ATTN_NORM, shape.n_embd, il)
        _llama_like_attention(m, shape, il, head_dim)
        m.bias(T.ATTN_Q, shape.n_head * head_dim, il)
        m.bias(T.ATTN_K, n_kv, il)
        m.bias(T.ATTN_V, n_kv, il)
        m.norm(T.ATTN_POST_NORM, shape.n_embd, il)
        m.norm(T.FFN_NORM, shape.n_embd, il)
        m.weight(T.FFN_UP, (shape.n_embd, 2 * shape.n_ff), il)
        m.weight(T.FFN_DOWN, (shape.n_ff, shape.n_embd), il)
        m.norm(T.FFN_POST_NORM, shape.n_embd, il)
    m.finish()
    kv = attention_kv_bytes_per_token(shape.n_layer, shape.n_head_kv, head_dim)
    return BuiltModel((path,), "glm4", shape, kv)


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
    shape = _shape(_n_vocab(), n_layer=n_layer, n_head_kv=max(head_kv))
    m = _Model(path, "gemma4", plan.key, seed)
    w = m.writer
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(head_kv)
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

    n_embd = shape.n_embd
    m.weight(T.TOKEN_EMBD, (n_embd, m.n_vocab))
    if plan.n_embd_per_layer:
        per_layer = plan.n_embd_per_layer
        m.weight(T.PER_LAYER_TOKEN_EMBD, (per_layer * n_layer, m.n_vocab))
        m.weight(T.PER_LAYER_MODEL_PROJ, (n_embd, per_layer * n_layer))
        m.norm(T.PER_LAYER_PROJ_NORM, per_layer)
    m.norm(T.OUTPUT_NORM, n_embd)
    # Proportional rotary factors of the global layers; stored once, shared by all of them.
    rope_factors = np.ones((plan.head_dim_full // 2,), dtype=F32)
    w.add_tensor(tensor_name(T.ROPE_FREQS), rope_factors)

    n_kv_layers = n_layer - plan.shared_kv_layers
    kv_bytes = 0
    for il, swa in enumerate(plan.swa_pattern):
        head_dim = plan.head_dim_swa if swa else plan.head_dim_full
        n_q = shape.n_head * head_dim
        n_kv = head_kv[il] * head_dim
        has_kv = il < n_kv_layers
        m.norm(T.ATTN_NORM, n_embd, il)
        m.weight(T.ATTN_Q, (n_embd, n_q), il)
        if has_kv:
            m.weight(T.ATTN_K, (n_embd, n_kv), il)
            m.weight(T.ATTN_V, (n_embd, n_kv), il)
            kv_bytes += attention_kv_bytes_per_token(1, head_kv[il], head_dim)
        m.weight(T.ATTN_OUT, (n_q, n_embd), il)
        m.norm(T.ATTN_Q_NORM, head_dim, il)
        if has_kv:
            m.norm(T.ATTN_K_NORM, head_dim, il)
        m.norm(T.ATTN_POST_NORM, n_embd, il)
        m.norm(T.FFN_NORM, n_embd, il)
        _gated_ffn(m, shape, il)
        m.norm(T.FFN_POST_NORM, n_embd, il)
        if plan.n_expert:
            w.add_tensor(
                tensor_name(T.FFN_GATE_INP, il), ne_tensor(m.rng, (n_embd, plan.n_expert), F32)
            )
            w.add_tensor(tensor_name(T.FFN_GATE_INP, il, "scale"), norm_tensor(m.rng, n_embd))
            m.norm(T.FFN_PRE_NORM_2, n_embd, il)
            m.norm(T.FFN_POST_NORM_1, n_embd, il)
            m.norm(T.FFN_POST_NORM_2, n_embd, il)
            m.weight(T.FFN_GATE_UP_EXP, (n_embd, 2 * plan.n_ff_expert, plan.n_expert), il)
            m.weight(T.FFN_DOWN_EXP, (plan.n_ff_expert, n_embd, plan.n_expert), il)
        if plan.n_embd_per_layer:
            m.weight(T.PER_LAYER_INP_GATE, (n_embd, plan.n_embd_per_layer), il)
            m.weight(T.PER_LAYER_PROJ, (plan.n_embd_per_layer, n_embd), il)
            m.norm(T.PER_LAYER_POST_NORM, n_embd, il)
    m.finish()
    return BuiltModel((path,), "gemma4", shape, kv_bytes)


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
