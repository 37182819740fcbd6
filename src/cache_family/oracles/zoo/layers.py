"""The tensors zoo builders share: embeddings, attention projections, norms, FFNs, experts.

Every call draws its random values at once from the model's generator, so the order of calls
fixes both the file order and the draws: moving a call changes the bytes a seed gives. Names are
llama.cpp's, shapes in ggml ``ne`` order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from cache_family.oracles.zoo.base import F16, F32, ne_tensor, norm_tensor
from cache_family.oracles.zoo.vocab import eos_token_id

FfnPart = Literal["gate", "up", "down"]
FfnOrder = tuple[FfnPart, FfnPart, FfnPart]

# The order a family's converter writes the three SwiGLU projections in. Only which random
# draws each projection gets depends on it; it is pinned so a seed's bytes never change.
GATE_UP_DOWN: FfnOrder = ("gate", "up", "down")
GATE_DOWN_UP: FfnOrder = ("gate", "down", "up")
DOWN_GATE_UP: FfnOrder = ("down", "gate", "up")

#: How loudly a zoo block writes into the residual stream. With unit-scale random weights the
#: blocks' outputs outweigh the token embedding and the next-token scores are a flat spread
#: whose top two are often a few thousandths of a nat apart. A prefix-cache hit recomputes the
#: tokens after the reused prefix in a smaller batch, which moves the scores by float rounding
#: (about 1e-3 nats): enough to flip such a greedy pick, which no real model's confident
#: answer does (the demo's parity failed so). Quiet blocks keep the context's influence small
#: next to the current token's embedding, and the successor head turns that into a clear win.
BLOCK_GAIN = 0.01


@dataclass
class Tensors:
    """One model's tensors in file order, with ``n_embd`` the width they read and write."""

    rng: np.random.Generator
    n_embd: int
    items: list[tuple[str, npt.NDArray[np.generic]]] = field(default_factory=list)

    def __iter__(self) -> Iterator[tuple[str, npt.NDArray[np.generic]]]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def put(
        self,
        name: str,
        values: npt.NDArray[np.generic],
        il: int | None = None,
        *,
        suffix: str | None = "weight",
    ) -> None:
        full = name if il is None else f"blk.{il}.{name}"
        self.items.append((full if suffix is None else f"{full}.{suffix}", values))

    def weight(
        self,
        name: str,
        ne: tuple[int, ...],
        il: int | None = None,
        *,
        dtype: npt.DTypeLike = F16,
        scale: float = 0.02,
        suffix: str | None = "weight",
    ) -> None:
        self.put(name, ne_tensor(self.rng, ne, dtype, scale), il, suffix=suffix)

    def norm(
        self, name: str, n: int, il: int | None = None, *, suffix: str | None = "weight"
    ) -> None:
        self.put(name, norm_tensor(self.rng, n), il, suffix=suffix)

    def bias(self, name: str, n: int, il: int | None = None) -> None:
        self.weight(name, (n,), il, dtype=F32, suffix="bias")

    def token_embedding(self, n_vocab: int) -> None:
        self.weight("token_embd", (self.n_embd, n_vocab))

    def output_head(self) -> None:
        """The final norm and an untied successor head (``successor_head``)."""
        self.norm("output_norm", self.n_embd)
        self.successor_head()

    def successor_head(self) -> None:
        """An untied LM head whose row for token ``next[c]`` is token ``c``'s embedding.

        With quiet blocks (``quiet``) the last hidden state is close to the current token's
        embedding, whose dot product with itself beats every other row's by several logits:
        greedy decoding follows a fixed random successor of each token by a clear margin, as a
        real model's confident next token does. End-of-sequence is nobody's successor.
        """
        embedding = next(values for name, values in self.items if name == "token_embd.weight")
        n_vocab = embedding.shape[0]
        eos = eos_token_id()
        ordinary = np.array([i for i in range(n_vocab) if i != eos])
        successor = self.rng.permutation(ordinary)
        head = ne_tensor(self.rng, (self.n_embd, n_vocab))
        head[successor] = embedding[ordinary]
        self.put("output", head)

    def quiet(self, *names: str) -> None:
        """Scale every layer's ``names`` tensors by ``BLOCK_GAIN``: the tensors through which a
        block writes into the residual stream (its output projections, or the post norms of a
        family that norms those outputs, since a norm after a projection undoes its scale).
        """
        targets = {f".{name}.weight" for name in names}
        for index, (name, values) in enumerate(self.items):
            if name.startswith("blk.") and name[name.index(".", 4) :] in targets:
                scaled = values.astype(F32) * np.float32(BLOCK_GAIN)
                self.items[index] = (name, scaled.astype(values.dtype))

    def attention(
        self, il: int, n_q: int, n_kv: int, *, gated_query: bool = False, has_kv: bool = True
    ) -> None:
        """Q, K, V and output projections of ``n_q`` query and ``n_kv`` key/value columns.

        ``gated_query``: the query projection also yields an output gate (twice as wide).
        ``has_kv`` False: the layer reuses an earlier layer's KV and has no K or V of its own.
        """
        self.weight("attn_q", (self.n_embd, 2 * n_q if gated_query else n_q), il)
        if has_kv:
            self.weight("attn_k", (self.n_embd, n_kv), il)
            self.weight("attn_v", (self.n_embd, n_kv), il)
        self.weight("attn_output", (n_q, self.n_embd), il)

    def ffn(self, il: int, n_ff: int, order: FfnOrder = GATE_UP_DOWN) -> None:
        """A dense SwiGLU feed-forward block: ``ffn_gate``, ``ffn_up``, ``ffn_down``."""
        self._swiglu(il, n_ff, order, "")

    def shared_expert(self, il: int, n_ff: int, order: FfnOrder) -> None:
        """The always-active expert next to the routed ones: ``ffn_*_shexp``."""
        self._swiglu(il, n_ff, order, "_shexp")

    def router(self, il: int, n_expert: int) -> None:
        """``ffn_gate_inp``; routers stay f32 in converted and quantized files alike."""
        self.weight("ffn_gate_inp", (self.n_embd, n_expert), il, dtype=F32)

    def experts(self, il: int, n_ff: int, n_expert: int, order: FfnOrder) -> None:
        """Routed SwiGLU experts stacked on the outermost axis: ``ffn_*_exps``."""
        self._swiglu(il, n_ff, order, "_exps", n_expert)

    def _swiglu(
        self, il: int, n_ff: int, order: FfnOrder, kind: str, n_expert: int | None = None
    ) -> None:
        for part in order:
            ne = (n_ff, self.n_embd) if part == "down" else (self.n_embd, n_ff)
            self.weight(f"ffn_{part}{kind}", ne if n_expert is None else (*ne, n_expert), il)
