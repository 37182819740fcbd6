"""A tiny MiniMax-M2 model written as three real split shards.

llama.cpp's ``minimax-m2`` architecture (``src/models/minimax-m2.cpp``): grouped-query
attention with whole-width RMS norms on Q and K (``attn_q_norm`` spans every head), partial
rotary embedding (``rope.dimension_count`` is half the head), and a mixture of experts in every
layer routed by a sigmoid with a per-expert selection bias (``exp_probs_b``).

The catalog's MiniMax M2.7 is a split GGUF: ``split.no``/``split.count``/
``split.tensors.count`` in every shard, the model's metadata only in the first, and the shards
named ``<stem>-0000N-of-00003.gguf`` so that llama.cpp, given the first shard, finds its
siblings by name in the same directory. ``GGUFWriter`` writes exactly that when given a tensor
limit per shard.
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
    attention_kv_bytes_per_token,
    model_rng,
    ne_tensor,
    norm_tensor,
    write_gguf,
)
from cache_family.oracles.zoo.vocab import add_byte_bpe_vocab, vocabulary

ARCH = "minimax-m2"
SHARD_STEM = "MiniMax-M2.7-UD-Q2_K_XL"
SHARD_COUNT = 3
SHARD_NAMES = tuple(f"{SHARD_STEM}-{i:05d}-of-{SHARD_COUNT:05d}.gguf" for i in range(1, 4))


@dataclass(frozen=True)
class MiniMaxSpec:
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_rot: int = 32  # MiniMax-M2 rotates half of each head
    n_ff_exp: int = 128
    n_expert: int = 4
    n_expert_used: int = 2
    n_ctx_train: int = 8192
    rope_freq_base: float = 5_000_000.0
    rms_eps: float = 1e-6


MINIMAX_M2 = MiniMaxSpec()


def _tensors(
    spec: MiniMaxSpec, rng: np.random.Generator, n_vocab: int
) -> list[tuple[str, npt.NDArray[np.generic]]]:
    """Every tensor ``llama_model_minimax_m2::load_arch_tensors`` asks for, in file order."""
    e, x, f = spec.n_embd, spec.n_expert, spec.n_ff_exp
    q_width = spec.n_head * spec.head_dim
    kv_width = spec.n_head_kv * spec.head_dim
    tensors = [("token_embd.weight", ne_tensor(rng, (e, n_vocab)))]
    for il in range(spec.n_layer):
        blk = f"blk.{il}"
        tensors += [
            (f"{blk}.attn_q.weight", ne_tensor(rng, (e, q_width))),
            (f"{blk}.attn_k.weight", ne_tensor(rng, (e, kv_width))),
            (f"{blk}.attn_v.weight", ne_tensor(rng, (e, kv_width))),
            (f"{blk}.attn_output.weight", ne_tensor(rng, (q_width, e))),
            (f"{blk}.attn_norm.weight", norm_tensor(rng, e)),
            (f"{blk}.attn_q_norm.weight", norm_tensor(rng, q_width)),
            (f"{blk}.attn_k_norm.weight", norm_tensor(rng, kv_width)),
            (f"{blk}.ffn_norm.weight", norm_tensor(rng, e)),
            (f"{blk}.ffn_gate_inp.weight", ne_tensor(rng, (e, x), F32)),
            (f"{blk}.ffn_gate_exps.weight", ne_tensor(rng, (e, f, x))),
            (f"{blk}.ffn_down_exps.weight", ne_tensor(rng, (f, e, x))),
            (f"{blk}.ffn_up_exps.weight", ne_tensor(rng, (e, f, x))),
            (f"{blk}.exp_probs_b.bias", ne_tensor(rng, (x,), F32)),
        ]
    tensors += [
        ("output_norm.weight", norm_tensor(rng, e)),
        ("output.weight", ne_tensor(rng, (e, n_vocab))),
    ]
    return tensors


def build_minimax_m27(staging_dir: Path, seed: int) -> BuiltModel:
    spec = MINIMAX_M2
    n_vocab = len(vocabulary()[0])
    tensors = _tensors(spec, model_rng(seed, SHARD_STEM), n_vocab)
    # GGUFWriter opens a new shard whenever the current one holds per_shard tensors.
    per_shard = -(-len(tensors) // SHARD_COUNT)
    if -(-len(tensors) // per_shard) != SHARD_COUNT:
        raise AssertionError(f"{len(tensors)} tensors do not split into {SHARD_COUNT} shards")
    writer = gguf.GGUFWriter(staging_dir / f"{SHARD_STEM}.gguf", ARCH, split_max_tensors=per_shard)
    writer.add_name("tiny MiniMax-M2.7 (random weights)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(spec.n_ctx_train)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    # The expert tensors take their width from feed_forward_length; converters write both.
    writer.add_feed_forward_length(spec.n_ff_exp)
    writer.add_expert_feed_forward_length(spec.n_ff_exp)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.n_rot)
    writer.add_rope_freq_base(spec.rope_freq_base)
    writer.add_layer_norm_rms_eps(spec.rms_eps)
    writer.add_expert_count(spec.n_expert)
    writer.add_expert_used_count(spec.n_expert_used)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    written = add_byte_bpe_vocab(writer)
    assert written == n_vocab
    writer.add_vocab_size(n_vocab)
    for name, data in tensors:
        writer.add_tensor(name, data)
    write_gguf(writer)

    files = tuple(staging_dir / name for name in SHARD_NAMES)
    missing = [path.name for path in files if not path.is_file()]
    if missing:
        raise AssertionError(f"GGUFWriter did not write the expected shards: {missing}")
    return BuiltModel(
        files=files,
        architecture=ARCH,
        shape=TinyShape(
            n_layer=spec.n_layer,
            n_embd=spec.n_embd,
            n_head=spec.n_head,
            n_head_kv=spec.n_head_kv,
            n_ff=spec.n_ff_exp,
            n_ctx_train=spec.n_ctx_train,
            n_vocab=n_vocab,
        ),
        kv_bytes_per_token=attention_kv_bytes_per_token(
            spec.n_layer, spec.n_head_kv, spec.head_dim
        ),
    )
