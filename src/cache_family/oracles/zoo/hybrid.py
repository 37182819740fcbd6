"""Tiny hybrid attention + recurrent models: Falcon-H1 and Qwen3-Next.

* ``falcon-h1`` (``src/models/falcon-h1.cpp``): every block runs grouped-query attention and a
  Mamba-2 mixer side by side on the same normed input, adds both, then a SwiGLU FFN. Its
  ``ssm_a``, ``ssm_d`` and ``ffn_norm`` tensors carry no ``.weight`` suffix.
* ``qwen3next`` (``src/models/qwen3next.cpp``): gated delta net (linear attention) blocks with
  a gated full-attention block every ``full_attention_interval`` (4) layers, a post-attention
  norm, and a mixture of experts with a sigmoid-gated shared expert in every block.

Both keep a per-sequence recurrent state besides the attention KV cache, so llama-server
reuses their prompts only at context checkpoints; the catalog records no per-token KV size
for them (``kv_bytes_per_token`` is None), as it does for the real presets.

The recurrent tensors llama.cpp feeds to its SSM kernels (conv weights and biases, A, D, dt
bias, group norms) are f32, as converters write them; A is negative (a decay).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

from cache_family.oracles.zoo.base import (
    F32,
    BuiltModel,
    TinyShape,
    model_rng,
    ne_tensor,
    norm_tensor,
    write_gguf,
)
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


@dataclass(frozen=True)
class FalconH1Spec:
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_ff: int = 512
    ssm_inner: int = 256  # mamba_d_ssm
    ssm_heads: int = 8  # mamba_n_heads: the time-step rank llama.cpp reads
    ssm_state: int = 32
    ssm_groups: int = 1
    ssm_conv: int = 4
    n_ctx_train: int = 8192
    rope_freq_base: float = 100_000_000_000.0
    rms_eps: float = 1e-5

    @property
    def ssm_conv_dim(self) -> int:
        return self.ssm_inner + 2 * self.ssm_groups * self.ssm_state

    @property
    def ssm_projection(self) -> int:
        return self.ssm_inner + self.ssm_conv_dim + self.ssm_heads


FALCON_H1 = FalconH1Spec()


def build_falcon_h1(staging_dir: Path, seed: int) -> BuiltModel:
    spec = FALCON_H1
    path = staging_dir / FALCON_H1_FILE
    rng = model_rng(seed, FALCON_H1_FILE)
    writer = gguf.GGUFWriter(path, "falcon-h1")
    writer.add_name("tiny Falcon-H1-1.5B-Instruct (random weights)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(spec.n_ctx_train)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_freq_base)
    writer.add_layer_norm_rms_eps(spec.rms_eps)
    writer.add_ssm_conv_kernel(spec.ssm_conv)
    writer.add_ssm_inner_size(spec.ssm_inner)
    writer.add_ssm_state_size(spec.ssm_state)
    writer.add_ssm_time_step_rank(spec.ssm_heads)
    writer.add_ssm_group_count(spec.ssm_groups)
    n_vocab = add_byte_bpe_vocab(writer)
    writer.add_vocab_size(n_vocab)

    e = spec.n_embd
    q_width = spec.n_head * spec.head_dim
    kv_width = spec.n_head_kv * spec.head_dim
    writer.add_tensor("token_embd.weight", ne_tensor(rng, (e, n_vocab)))
    writer.add_tensor("output_norm.weight", norm_tensor(rng, e))
    writer.add_tensor("output.weight", ne_tensor(rng, (e, n_vocab)))
    for il in range(spec.n_layer):
        blk = f"blk.{il}"
        writer.add_tensor(f"{blk}.ssm_in.weight", ne_tensor(rng, (e, spec.ssm_projection)))
        writer.add_tensor(
            f"{blk}.ssm_conv1d.weight", ne_tensor(rng, (spec.ssm_conv, spec.ssm_conv_dim), F32, 0.2)
        )
        writer.add_tensor(f"{blk}.ssm_conv1d.bias", ne_tensor(rng, (spec.ssm_conv_dim,), F32))
        writer.add_tensor(f"{blk}.ssm_dt.bias", _dt_bias(rng, spec.ssm_heads))
        # ggml ne {1, n_heads}: one row of one value per head.
        writer.add_tensor(f"{blk}.ssm_a", _decay(rng, spec.ssm_heads).reshape(spec.ssm_heads, 1))
        writer.add_tensor(
            f"{blk}.ssm_d", norm_tensor(rng, spec.ssm_heads).reshape(spec.ssm_heads, 1)
        )
        group_width = spec.ssm_inner // spec.ssm_groups
        writer.add_tensor(
            f"{blk}.ssm_norm.weight",
            norm_tensor(rng, spec.ssm_inner).reshape(spec.ssm_groups, group_width),
        )
        writer.add_tensor(f"{blk}.ssm_out.weight", ne_tensor(rng, (spec.ssm_inner, e)))
        writer.add_tensor(f"{blk}.attn_q.weight", ne_tensor(rng, (e, q_width)))
        writer.add_tensor(f"{blk}.attn_k.weight", ne_tensor(rng, (e, kv_width)))
        writer.add_tensor(f"{blk}.attn_v.weight", ne_tensor(rng, (e, kv_width)))
        writer.add_tensor(f"{blk}.attn_output.weight", ne_tensor(rng, (q_width, e)))
        writer.add_tensor(f"{blk}.attn_norm.weight", norm_tensor(rng, e))
        writer.add_tensor(f"{blk}.ffn_norm", norm_tensor(rng, e))
        writer.add_tensor(f"{blk}.ffn_gate.weight", ne_tensor(rng, (e, spec.n_ff)))
        writer.add_tensor(f"{blk}.ffn_down.weight", ne_tensor(rng, (spec.n_ff, e)))
        writer.add_tensor(f"{blk}.ffn_up.weight", ne_tensor(rng, (e, spec.n_ff)))
    write_gguf(writer)
    return BuiltModel(
        files=(path,),
        architecture="falcon-h1",
        shape=TinyShape(
            n_layer=spec.n_layer,
            n_embd=spec.n_embd,
            n_head=spec.n_head,
            n_head_kv=spec.n_head_kv,
            n_ff=spec.n_ff,
            n_ctx_train=spec.n_ctx_train,
            n_vocab=n_vocab,
        ),
        kv_bytes_per_token=None,
    )


@dataclass(frozen=True)
class Qwen3NextSpec:
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_rot: int = 16  # partial_rotary_factor 0.25
    full_attention_interval: int = 4
    n_ff_exp: int = 128
    n_ff_shexp: int = 128
    n_expert: int = 4
    n_expert_used: int = 2
    linear_key_heads: int = 2  # ssm.group_count
    linear_value_heads: int = 4  # ssm.time_step_rank
    linear_head_dim: int = 32  # ssm.state_size; keys and values share it
    linear_conv: int = 4
    n_ctx_train: int = 8192
    rope_freq_base: float = 5_000_000.0
    rms_eps: float = 1e-6

    @property
    def key_dim(self) -> int:
        return self.linear_key_heads * self.linear_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_value_heads * self.linear_head_dim

    def is_recurrent(self, il: int) -> bool:
        return (il + 1) % self.full_attention_interval != 0


QWEN3NEXT = Qwen3NextSpec()


def build_qwen3next(staging_dir: Path, seed: int) -> BuiltModel:
    spec = QWEN3NEXT
    path = staging_dir / QWEN3NEXT_FILE
    rng = model_rng(seed, QWEN3NEXT_FILE)
    writer = gguf.GGUFWriter(path, "qwen3next")
    writer.add_name("tiny Qwen3-Coder-Next (random weights)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(spec.n_ctx_train)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff_exp)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.n_rot)
    writer.add_rope_freq_base(spec.rope_freq_base)
    writer.add_layer_norm_rms_eps(spec.rms_eps)
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
    n_vocab = add_byte_bpe_vocab(writer)
    writer.add_vocab_size(n_vocab)

    e, x = spec.n_embd, spec.n_expert
    conv_dim = 2 * spec.key_dim + spec.value_dim
    writer.add_tensor("token_embd.weight", ne_tensor(rng, (e, n_vocab)))
    writer.add_tensor("output_norm.weight", norm_tensor(rng, e))
    writer.add_tensor("output.weight", ne_tensor(rng, (e, n_vocab)))
    for il in range(spec.n_layer):
        blk = f"blk.{il}"
        writer.add_tensor(f"{blk}.attn_norm.weight", norm_tensor(rng, e))
        writer.add_tensor(f"{blk}.post_attention_norm.weight", norm_tensor(rng, e))
        if spec.is_recurrent(il):
            # The fused projections current converters write (not the legacy ssm_in).
            writer.add_tensor(f"{blk}.attn_qkv.weight", ne_tensor(rng, (e, conv_dim)))
            writer.add_tensor(f"{blk}.attn_gate.weight", ne_tensor(rng, (e, spec.value_dim)))
            writer.add_tensor(
                f"{blk}.ssm_conv1d.weight", ne_tensor(rng, (spec.linear_conv, conv_dim), F32, 0.2)
            )
            writer.add_tensor(f"{blk}.ssm_dt.bias", _dt_bias(rng, spec.linear_value_heads))
            writer.add_tensor(f"{blk}.ssm_a", _decay(rng, spec.linear_value_heads))
            writer.add_tensor(
                f"{blk}.ssm_ba.weight", ne_tensor(rng, (e, 2 * spec.linear_value_heads))
            )
            writer.add_tensor(f"{blk}.ssm_norm.weight", norm_tensor(rng, spec.linear_head_dim))
            writer.add_tensor(f"{blk}.ssm_out.weight", ne_tensor(rng, (spec.value_dim, e)))
        else:
            q_width = spec.n_head * spec.head_dim
            kv_width = spec.n_head_kv * spec.head_dim
            # The query projection also yields the output gate: twice the query width.
            writer.add_tensor(f"{blk}.attn_q.weight", ne_tensor(rng, (e, 2 * q_width)))
            writer.add_tensor(f"{blk}.attn_k.weight", ne_tensor(rng, (e, kv_width)))
            writer.add_tensor(f"{blk}.attn_v.weight", ne_tensor(rng, (e, kv_width)))
            writer.add_tensor(f"{blk}.attn_output.weight", ne_tensor(rng, (q_width, e)))
            writer.add_tensor(f"{blk}.attn_q_norm.weight", norm_tensor(rng, spec.head_dim))
            writer.add_tensor(f"{blk}.attn_k_norm.weight", norm_tensor(rng, spec.head_dim))
        writer.add_tensor(f"{blk}.ffn_gate_inp.weight", ne_tensor(rng, (e, x), F32))
        writer.add_tensor(f"{blk}.ffn_down_exps.weight", ne_tensor(rng, (spec.n_ff_exp, e, x)))
        writer.add_tensor(f"{blk}.ffn_gate_exps.weight", ne_tensor(rng, (e, spec.n_ff_exp, x)))
        writer.add_tensor(f"{blk}.ffn_up_exps.weight", ne_tensor(rng, (e, spec.n_ff_exp, x)))
        writer.add_tensor(f"{blk}.ffn_gate_inp_shexp.weight", ne_tensor(rng, (e,), F32))
        writer.add_tensor(f"{blk}.ffn_gate_shexp.weight", ne_tensor(rng, (e, spec.n_ff_shexp)))
        writer.add_tensor(f"{blk}.ffn_up_shexp.weight", ne_tensor(rng, (e, spec.n_ff_shexp)))
        writer.add_tensor(f"{blk}.ffn_down_shexp.weight", ne_tensor(rng, (spec.n_ff_shexp, e)))
    write_gguf(writer)
    return BuiltModel(
        files=(path,),
        architecture="qwen3next",
        shape=TinyShape(
            n_layer=spec.n_layer,
            n_embd=spec.n_embd,
            n_head=spec.n_head,
            n_head_kv=spec.n_head_kv,
            n_ff=spec.n_ff_exp,
            n_ctx_train=spec.n_ctx_train,
            n_vocab=n_vocab,
        ),
        kv_bytes_per_token=None,
    )
