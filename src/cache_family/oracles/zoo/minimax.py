"""A tiny MiniMax-M2 model written as three real split shards.

The split keeps llama.cpp's layout: ``split.*`` keys in every shard, the metadata only in the
first, and shards named ``<stem>-0000N-of-00003.gguf`` so the first finds its siblings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf

from cache_family.oracles.zoo.base import (
    BuiltModel,
    GqaSpec,
    add_rope_attention_hparams,
    add_trunk_hparams,
    attention_kv_bytes_per_token,
    model_rng,
    open_f16_writer,
    tiny_shape,
    write_gguf,
)
from cache_family.oracles.zoo.layers import GATE_DOWN_UP, Tensors
from cache_family.oracles.zoo.vocab import add_byte_bpe_vocab

ARCH = "minimax-m2"
SHARD_STEM = "MiniMax-M2.7-UD-Q2_K_XL"
SHARD_COUNT = 3
SHARD_NAMES = tuple(f"{SHARD_STEM}-{i:05d}-of-{SHARD_COUNT:05d}.gguf" for i in range(1, 4))


@dataclass(frozen=True)
class MiniMaxSpec(GqaSpec):
    n_rot: int | None = 32  # MiniMax-M2 rotates half of each head
    rope_freq_base: float = 5_000_000.0
    n_ff_exp: int = 128
    n_expert: int = 4
    n_expert_used: int = 2

    @property
    def n_ff(self) -> int:
        # The expert tensors take their width from feed_forward_length; converters write it
        # next to expert_feed_forward_length.
        return self.n_ff_exp


MINIMAX_M2 = MiniMaxSpec()


def _tensors(spec: MiniMaxSpec, t: Tensors, n_vocab: int) -> None:
    """Every tensor ``llama_model_minimax_m2::load_arch_tensors`` asks for, in file order."""
    e = spec.n_embd
    t.token_embedding(n_vocab)
    for il in range(spec.n_layer):
        t.attention(il, spec.q_width, spec.kv_width)
        t.norm("attn_norm", e, il)
        # Whole-width Q/K norms, spanning every head.
        t.norm("attn_q_norm", spec.q_width, il)
        t.norm("attn_k_norm", spec.kv_width, il)
        t.norm("ffn_norm", e, il)
        t.router(il, spec.n_expert)
        t.experts(il, spec.n_ff_exp, spec.n_expert, GATE_DOWN_UP)
        t.bias("exp_probs_b", spec.n_expert, il)
    t.output_head()
    t.quiet("attn_output", "ffn_down_exps")


def build_minimax_m27(staging_dir: Path, seed: int) -> BuiltModel:
    spec = MINIMAX_M2
    shape = tiny_shape(spec)
    t = Tensors(model_rng(seed, SHARD_STEM), spec.n_embd)
    _tensors(spec, t, shape.n_vocab)
    # GGUFWriter opens a new shard whenever the current one holds per_shard tensors.
    per_shard = -(-len(t) // SHARD_COUNT)
    if -(-len(t) // per_shard) != SHARD_COUNT:
        raise AssertionError(f"{len(t)} tensors do not split into {SHARD_COUNT} shards")
    writer = open_f16_writer(
        staging_dir / f"{SHARD_STEM}.gguf",
        ARCH,
        "tiny MiniMax-M2.7 (random weights)",
        split_max_tensors=per_shard,
    )
    add_trunk_hparams(writer, shape)
    writer.add_expert_feed_forward_length(spec.n_ff_exp)
    add_rope_attention_hparams(writer, spec)
    writer.add_expert_count(spec.n_expert)
    writer.add_expert_used_count(spec.n_expert_used)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    add_byte_bpe_vocab(writer)
    writer.add_vocab_size(shape.n_vocab)
    write_gguf(writer, t)

    files = tuple(staging_dir / name for name in SHARD_NAMES)
    missing = [path.name for path in files if not path.is_file()]
    if missing:
        raise AssertionError(f"GGUFWriter did not write the expected shards: {missing}")
    kv_bytes = attention_kv_bytes_per_token(spec.n_layer, spec.n_head_kv, spec.head_dim)
    return BuiltModel(files, ARCH, shape, kv_bytes)
