"""Tiny hybrid attention + recurrent models: Falcon-H1 and Qwen3-Next.

Both keep a recurrent state besides the KV cache, so llama-server reuses their prompts only at
context checkpoints, and the catalog records no per-token KV size for them. The recurrent
tensors are f32, A negative, as converters write them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from cache_family.oracles.zoo.base import (
    F32,
    BuiltModel,
    GqaSpec,
    add_rope_attention_hparams,
    add_trunk_hparams,
    model_rng,
    norm_tensor,
    open_f16_writer,
    tiny_shape,
    write_gguf,
)
from cache_family.oracles.zoo.layers import DOWN_GATE_UP, GATE_DOWN_UP, GATE_UP_DOWN, Tensors
from cache_family.oracles.zoo.vocab import add_byte_bpe_vocab

FALCON_H1_FILE = "Falcon-H1-1.5B-Instruct-Q4_K_M.gguf"
QWEN3NEXT_FILE = "Qwen_Qwen3-Coder-Next-IQ2_XS.gguf"


def _decay(rng: np.random.Generator, n: int) -> npt.NDArray[np.generic]:
    """``A = -exp(A_log)`` per head, A_log spread around 0 as trained models have it."""
    a_log = rng.uniform(-1.0, 1.0, size=(n,)).astype(np.float32)
    return (-np.exp(a_log)).astype(F32)


def _dt_bias(rng: np.random.Generator, n: int) -> npt.NDArray[np.generic]:
    """The inverse softplus of a time step drawn log-uniformly in [0.001, 0.1]."""
    dt = np.exp(rng.uniform(np.log(0.001), np.log(0.1), size=(n,))).astype(np.float32)
    return (dt + np.log(-np.expm1(-dt))).astype(F32)


def _ssm_conv(t: Tensors, il: int, kernel: int, channels: int) -> None:
    """The causal conv1d weights the SSM kernels read in f32, wider spread than projections."""
    t.weight("ssm_conv1d", (kernel, channels), il, dtype=F32, scale=0.2)


@dataclass(frozen=True)
class FalconH1Spec(GqaSpec):
    rms_eps: float = 1e-5
    rope_freq_base: float = 100_000_000_000.0
    n_ff: int = 512
    ssm_inner: int = 256  # mamba_d_ssm
    ssm_heads: int = 8  # mamba_n_heads: the time-step rank llama.cpp reads
    ssm_state: int = 32
    ssm_groups: int = 1
    ssm_conv: int = 4

    @property
    def ssm_conv_dim(self) -> int:
        return self.ssm_inner + 2 * self.ssm_groups * self.ssm_state

    @property
    def ssm_projection(self) -> int:
        return self.ssm_inner + self.ssm_conv_dim + self.ssm_heads


FALCON_H1 = FalconH1Spec()


def build_falcon_h1(staging_dir: Path, seed: int) -> BuiltModel:
    spec = FALCON_H1
    shape = tiny_shape(spec)
    path = staging_dir / FALCON_H1_FILE
    writer = open_f16_writer(path, "falcon-h1", "tiny Falcon-H1-1.5B-Instruct (random weights)")
    add_trunk_hparams(writer, shape)
    add_rope_attention_hparams(writer, spec)
    writer.add_ssm_conv_kernel(spec.ssm_conv)
    writer.add_ssm_inner_size(spec.ssm_inner)
    writer.add_ssm_state_size(spec.ssm_state)
    writer.add_ssm_time_step_rank(spec.ssm_heads)
    writer.add_ssm_group_count(spec.ssm_groups)
    add_byte_bpe_vocab(writer)
    writer.add_vocab_size(shape.n_vocab)

    e, heads = spec.n_embd, spec.ssm_heads
    t = Tensors(model_rng(seed, FALCON_H1_FILE), e)
    t.token_embedding(shape.n_vocab)
    t.output_head()
    for il in range(spec.n_layer):
        t.weight("ssm_in", (e, spec.ssm_projection), il)
        _ssm_conv(t, il, spec.ssm_conv, spec.ssm_conv_dim)
        t.bias("ssm_conv1d", spec.ssm_conv_dim, il)
        t.put("ssm_dt", _dt_bias(t.rng, heads), il, suffix="bias")
        # ggml ne {1, n_heads}: one row of one value per head.
        t.put("ssm_a", _decay(t.rng, heads).reshape(heads, 1), il, suffix=None)
        t.put("ssm_d", norm_tensor(t.rng, heads).reshape(heads, 1), il, suffix=None)
        group_width = spec.ssm_inner // spec.ssm_groups
        ssm_norm = norm_tensor(t.rng, spec.ssm_inner).reshape(spec.ssm_groups, group_width)
        t.put("ssm_norm", ssm_norm, il)
        t.weight("ssm_out", (spec.ssm_inner, e), il)
        t.attention(il, spec.q_width, spec.kv_width)
        t.norm("attn_norm", e, il)
        t.norm("ffn_norm", e, il, suffix=None)
        t.ffn(il, spec.n_ff, GATE_DOWN_UP)
    t.quiet("ssm_out", "attn_output", "ffn_down")
    write_gguf(writer, t)
    return BuiltModel((path,), "falcon-h1", shape, None)


@dataclass(frozen=True)
class Qwen3NextSpec(GqaSpec):
    n_rot: int | None = 16  # partial_rotary_factor 0.25
    rope_freq_base: float = 5_000_000.0
    full_attention_interval: int = 4
    n_ff_exp: int = 128
    n_ff_shexp: int = 128
    n_expert: int = 4
    n_expert_used: int = 2
    linear_key_heads: int = 2  # ssm.group_count
    linear_value_heads: int = 4  # ssm.time_step_rank
    linear_head_dim: int = 32  # ssm.state_size; keys and values share it
    linear_conv: int = 4

    @property
    def key_dim(self) -> int:
        return self.linear_key_heads * self.linear_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_value_heads * self.linear_head_dim

    @property
    def n_ff(self) -> int:
        return self.n_ff_exp  # feed_forward_length: the expert width, as converters write it

    def is_recurrent(self, il: int) -> bool:
        return (il + 1) % self.full_attention_interval != 0


QWEN3NEXT = Qwen3NextSpec()


def build_qwen3next(staging_dir: Path, seed: int) -> BuiltModel:
    spec = QWEN3NEXT
    shape = tiny_shape(spec)
    path = staging_dir / QWEN3NEXT_FILE
    writer = open_f16_writer(path, "qwen3next", "tiny Qwen3-Coder-Next (random weights)")
    add_trunk_hparams(writer, shape)
    add_rope_attention_hparams(writer, spec)
    writer.add_expert_count(spec.n_expert)
    writer.add_expert_used_count(spec.n_expert_used)
    writer.add_expert_feed_forward_length(spec.n_ff_exp)
    writer.add_expert_shared_feed_forward_length(spec.n_ff_shexp)
    writer.add_ssm_conv_kernel(spec.linear_conv)
    writer.add_ssm_state_size(spec.linear_head_dim)
    writer.add_ssm_group_count(spec.linear_key_heads)
    writer.add_ssm_time_step_rank(spec.linear_value_heads)
    writer.add_ssm_inner_size(spec.value_dim)
    writer.add_full_attention_interval(spec.full_attention_interval)
    add_byte_bpe_vocab(writer)
    writer.add_vocab_size(shape.n_vocab)

    e = spec.n_embd
    conv_dim = 2 * spec.key_dim + spec.value_dim
    t = Tensors(model_rng(seed, QWEN3NEXT_FILE), e)
    t.token_embedding(shape.n_vocab)
    t.output_head()
    for il in range(spec.n_layer):
        t.norm("attn_norm", e, il)
        t.norm("post_attention_norm", e, il)
        if spec.is_recurrent(il):
            # The fused projections current converters write (not the legacy ssm_in).
            t.weight("attn_qkv", (e, conv_dim), il)
            t.weight("attn_gate", (e, spec.value_dim), il)
            _ssm_conv(t, il, spec.linear_conv, conv_dim)
            t.put("ssm_dt", _dt_bias(t.rng, spec.linear_value_heads), il, suffix="bias")
            t.put("ssm_a", _decay(t.rng, spec.linear_value_heads), il, suffix=None)
            t.weight("ssm_ba", (e, 2 * spec.linear_value_heads), il)
            t.norm("ssm_norm", spec.linear_head_dim, il)
            t.weight("ssm_out", (spec.value_dim, e), il)
        else:
            t.attention(il, spec.q_width, spec.kv_width, gated_query=True)
            t.norm("attn_q_norm", spec.head_dim, il)
            t.norm("attn_k_norm", spec.head_dim, il)
        t.router(il, spec.n_expert)
        t.experts(il, spec.n_ff_exp, spec.n_expert, DOWN_GATE_UP)
        # The shared expert's sigmoid gate: one f32 weight per input feature.
        t.weight("ffn_gate_inp_shexp", (e,), il, dtype=F32)
        t.shared_expert(il, spec.n_ff_shexp, GATE_UP_DOWN)
    t.quiet("ssm_out", "attn_output", "ffn_down_exps", "ffn_down_shexp")
    write_gguf(writer, t)
    return BuiltModel((path,), "qwen3next", shape, None)
