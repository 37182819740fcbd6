"""The contract every zoo builder keeps, and the small helpers they share.

A builder writes one tiny random-weight model (a GGUF file, a split set of shards, or a layer
package directory) into a staging directory, under the file name(s) the catalog names, and
says what it wrote. Weights are deterministic for a seed: the same seed gives the same bytes.
A builder that cannot make its architecture load in the vendored llama.cpp raises
``ZooUnsupported`` with a human reason instead of writing anything that pretends to be it.

Where files go: the staging directory stands for the snapshot's directory. A single GGUF or
split shards may be written flat (``staging/NAME.gguf``) or under the sub-directory the
catalog's ``snapshot_relative`` names (``staging/UD-Q2_K_XL/NAME-00001-of-00003.gguf``); the
hub writer puts flat files into that sub-directory. For a layer-package preset (its
``snapshot_relative`` is the snapshot directory itself) every returned file keeps its path
relative to the staging directory inside the snapshot (``staging/manifest.json`` becomes
``snapshots/REV/manifest.json``). Every file becomes a blob plus a relative symlink.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

#: The f16 element size of llama-server's default KV cache (``--cache-type-k/v f16``).
KV_ELEMENT_BYTES = 2


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


def rng_tensor(
    rng: np.random.Generator,
    shape: tuple[int, ...],
    dtype: npt.DTypeLike = F16,
    scale: float = 0.02,
) -> npt.NDArray[np.generic]:
    """Random normal weights in numpy order: ``(rows, cols)`` is ggml ``ne = [cols, rows]``.

    llama.cpp's ``create_tensor(..., {n_embd, n_vocab})`` lists ``ne`` innermost first, so a
    builder copying shapes from ``src/models/*.cpp`` should call ``ne_tensor`` instead.
    """
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
    return values.astype(dtype)


def ne_tensor(
    rng: np.random.Generator,
    ne: tuple[int, ...],
    dtype: npt.DTypeLike = F16,
    scale: float = 0.02,
) -> npt.NDArray[np.generic]:
    """Random weights with a shape given in ggml ``ne`` order (as llama.cpp's loader lists it)."""
    return rng_tensor(rng, tuple(reversed(ne)), dtype, scale)


def norm_tensor(
    rng: np.random.Generator, n: int, *, around: float = 1.0
) -> npt.NDArray[np.generic]:
    """A norm weight (f32, as converted models store them) close to ``around``."""
    values = np.float32(around) + rng.standard_normal((n,), dtype=np.float32) * np.float32(0.02)
    return values.astype(F32)


def attention_kv_bytes_per_token(
    n_attention_layers: int, n_head_kv: int, head_dim_k: int, head_dim_v: int | None = None
) -> int:
    """Bytes of f16 K plus V one token occupies across all attention layers."""
    head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
    return n_attention_layers * n_head_kv * (head_dim_k + head_dim_v) * KV_ELEMENT_BYTES


def write_gguf(writer: gguf.GGUFWriter) -> None:
    """Header, metadata, tensor infos, tensor data, close: the one order GGUFWriter accepts."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
