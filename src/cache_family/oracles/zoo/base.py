"""The contract every zoo builder keeps, and the small helpers they share.

Weights are deterministic for a seed. A builder that cannot make its architecture load in the
vendored llama.cpp raises ``ZooUnsupported`` with a reason instead of writing anything that
pretends to be it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import gguf
import numpy as np
import numpy.typing as npt

from cache_family.oracles.zoo.vocab import vocabulary

#: The f16 element size of llama-server's default KV cache (``--cache-type-k/v f16``).
KV_ELEMENT_BYTES = 2

#: In ``general.tags`` of every zoo GGUF (the first shard of a split model, which holds the
#: model's metadata): later tooling recognises a synthetic model by its bytes, not its path.
SYNTHETIC_TAG = "cache-family-bench-zoo:synthetic-random-weights"
#: ``general.description`` of a zoo GGUF whose builder states none of its own.
SYNTHETIC_DESCRIPTION = (
    "Synthetic random-weight model written by the cache-family-bench tiny model zoo; "
    "not a trained model."
)


@dataclass(frozen=True)
class TinyShape:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int
    n_vocab: int


@dataclass(frozen=True)
class BuiltModel:
    files: tuple[Path, ...]  # written inside the staging dir; for split models in shard order
    architecture: str  # general.architecture written
    shape: TinyShape
    kv_bytes_per_token: int | None


class ZooUnsupported(Exception):
    """Raised with a human reason when an architecture cannot be made to load."""

    reason: str

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


Builder = Callable[[Path, int], BuiltModel]  # (staging_dir, seed) -> files written

#: The default tiny shape: about 2-5 M parameters, a few MB in f16, fast to prefill yet slow
#: enough at 2048 tokens that a prefix-cache hit is clearly visible.
DEFAULT_SHAPE_ARGS = {
    "n_layer": 4,
    "n_embd": 256,
    "n_head": 4,
    "n_head_kv": 2,
    "n_ff": 512,
    "n_ctx_train": 8192,
}

F16 = np.float16
F32 = np.float32


def model_rng(seed: int, name: str) -> np.random.Generator:
    """A generator private to one model: models differ from each other, not between runs."""
    digest = hashlib.sha256(f"cache-family-zoo:{seed}:{name}".encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))


def ne_tensor(
    rng: np.random.Generator,
    ne: tuple[int, ...],
    dtype: npt.DTypeLike = F16,
    scale: float = 0.02,
) -> npt.NDArray[np.generic]:
    """Random normal weights with a shape given in ggml ``ne`` order, innermost first.

    llama.cpp's loader lists shapes that way (``create_tensor(..., {n_embd, n_vocab})``), so
    shapes copy straight from ``src/models/*.cpp``; numpy's order is the reverse.
    """
    values = rng.standard_normal(tuple(reversed(ne)), dtype=np.float32) * np.float32(scale)
    return values.astype(dtype)


def norm_tensor(rng: np.random.Generator, n: int) -> npt.NDArray[np.generic]:
    """A norm weight (f32, as converted models store them) close to 1."""
    values = np.float32(1.0) + rng.standard_normal((n,), dtype=np.float32) * np.float32(0.02)
    return values.astype(F32)


def attention_kv_bytes_per_token(
    n_attention_layers: int, n_head_kv: int, head_dim_k: int, head_dim_v: int | None = None
) -> int:
    """Bytes of f16 K plus V one token occupies across all attention layers."""
    head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
    return n_attention_layers * n_head_kv * (head_dim_k + head_dim_v) * KV_ELEMENT_BYTES


class ShapeSpec(Protocol):
    """The sizes every architecture spec states; ``tiny_shape`` reports them."""

    @property
    def n_layer(self) -> int: ...
    @property
    def n_embd(self) -> int: ...
    @property
    def n_head(self) -> int: ...
    @property
    def n_head_kv(self) -> int: ...
    @property
    def n_ff(self) -> int: ...
    @property
    def n_ctx_train(self) -> int: ...


@dataclass(frozen=True)
class GqaSpec:
    """Grouped-query attention with one head size for K and V and rotary positions.

    The defaults are the zoo's tiny sizes; a family's spec extends this one and overrides
    what its family does differently (every family sets its own ``rope_freq_base``).
    """

    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_rot: int | None = None  # None: rope.dimension_count unwritten, the whole head rotates
    n_ctx_train: int = 8192
    rope_freq_base: float = 10_000.0
    rms_eps: float = 1e-6

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_head_kv * self.head_dim


def zoo_vocab_size() -> int:
    """Every zoo model carries the same byte-level BPE vocabulary, so one size for all."""
    return len(vocabulary()[0])


def tiny_shape(spec: ShapeSpec) -> TinyShape:
    return TinyShape(
        n_layer=spec.n_layer,
        n_embd=spec.n_embd,
        n_head=spec.n_head,
        n_head_kv=spec.n_head_kv,
        n_ff=spec.n_ff,
        n_ctx_train=spec.n_ctx_train,
        n_vocab=zoo_vocab_size(),
    )


def open_f16_writer(
    path: Path,
    arch: str,
    name: str,
    *,
    description: str | None = None,
    split_max_tensors: int = 0,
) -> gguf.GGUFWriter:
    """A writer for ``arch`` that names the model, marks it synthetic and declares f16 weights.

    ``split_max_tensors`` > 0 makes the writer open a new shard after that many tensors.
    """
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    writer.add_name(name)
    writer.add_description(SYNTHETIC_DESCRIPTION if description is None else description)
    writer.add_tags([SYNTHETIC_TAG])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    return writer


def add_trunk_hparams(writer: gguf.GGUFWriter, shape: TinyShape) -> None:
    """Context length, width, block count and FFN width: the keys every architecture reads."""
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)


def add_rope_attention_hparams(writer: gguf.GGUFWriter, spec: GqaSpec) -> None:
    """Head counts, head size, rotary embedding and RMS norm epsilon, in converter order."""
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    if spec.n_rot is not None:
        writer.add_rope_dimension_count(spec.n_rot)
    writer.add_rope_freq_base(spec.rope_freq_base)
    writer.add_layer_norm_rms_eps(spec.rms_eps)


def write_gguf(
    writer: gguf.GGUFWriter, tensors: Iterable[tuple[str, npt.NDArray[np.generic]]]
) -> None:
    """Add ``tensors`` in order, then header, metadata, tensor infos, data, close.

    That is the one order GGUFWriter accepts; the tensors' order is their order in the file.
    """
    for name, data in tensors:
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
