"""`DotProductAttention`: `flashmesh.attention` as a Flax linen module.

The module adds only what a module must own: the learnable-softmax sink as a parameter and
dropout's rng stream. Shapes (heads, head dims, lengths) come from the inputs, so one module
instance serves MHA, GQA, MQA and MLA alike.
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
from flax import linen as nn
from jaxtyping import Array, Float

from flashmesh.attention import api
from flashmesh.attention.sequence import SequenceDescriptor
from flashmesh.nn import partitioning
from flashmesh.quantization.attention import attend_under_autocast


class DotProductAttention(nn.Module):
    """Fused scaled dot-product attention over already-projected heads.

    Shapes (layout "bshd"): q [B, T, N, Dqk], k [B, S, K, Dqk], v [B, S, K, Dv] -> [B, T, N, Dv];
    the other layouts of `flashmesh.attention` work the same way.

    Attributes:
      mask, window, softmax, logits_soft_cap, scale, layout, implementation, reproducible: as
        in `flashmesh.attention` (reproducible: bit-identical results run to run).
      dropout_rate: dropout on the attention probabilities, drawn from the `dropout_rng_name`
        stream (`apply(..., rngs={"dropout": key})`) unless deterministic.
      deterministic: default for the call argument of the same name (as in `flax.linen.Dropout`).
      dtype: if set, q, k, v (and bias) are cast to it first; None keeps the inputs' dtype.
      sink_init: initialiser of the float32 parameter "sink" [N] that softmax="learnable" adds
        to every row's denominator as exp(sink[n]).

    Example:
      >>> attn = DotProductAttention(mask="causal", window=(128, 0))
      >>> variables = attn.init(jax.random.key(0), q, k, v)
      >>> out = attn.apply(variables, q, k, v)
    """

    mask: str | None = "causal"
    window: tuple[int, int] | None = None
    softmax: str = "vanilla"
    logits_soft_cap: float | None = None
    dropout_rate: float = 0.0
    scale: float | None = None
    layout: str = "bshd"
    implementation: str | None = None
    reproducible: bool = False
    deterministic: bool | None = None
    dtype: Any = None
    dropout_rng_name: str = "dropout"
    sink_init: Callable = nn.initializers.zeros

    @nn.compact
    def __call__(self, q: Float[Array, "B T N Dqk"], k: Float[Array, "B S K Dqk"] | None = None,
                 v: Float[Array, "B S K Dv"] | None = None, *,
                 segments: SequenceDescriptor | None = None,
                 bias: Float[Array, "#B #N T S"] | None = None,
                 deterministic: bool | None = None) -> Float[Array, "B T N Dv"]:
        """Attention of q over k, v; `segments` and `bias` as in `flashmesh.attention`."""
        sink = None
        if self.softmax == "learnable":
            # Heads are the second-to-last axis of q in every layout (packed ones included).
            sink = partitioning.param(self, "sink", self.sink_init, (q.shape[-2],), jnp.float32,
                                      (partitioning.HEAD_AXES,))
        dropout_rng = None
        if self.dropout_rate > 0.0:
            deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
            if not deterministic:
                dropout_rng = self.make_rng(self.dropout_rng_name)
        else:
            deterministic = True
        if self.dtype is not None:
            q, k, v, bias = (None if x is None else jnp.asarray(x, self.dtype) for x in (q, k, v, bias))
        options = dict(
            mask=self.mask, window=self.window, segments=segments, bias=bias, scale=self.scale,
            softmax=self.softmax, sink=sink, logits_soft_cap=self.logits_soft_cap,
            dropout_rate=self.dropout_rate, dropout_rng=dropout_rng, deterministic=deterministic,
            layout=self.layout, implementation=self.implementation, reproducible=self.reproducible)
        arrays = tuple(x for x in (q, k, v) if x is not None)
        out = attend_under_autocast(self, arrays, options)  # FP8 when autocast's recipe asks
        return api.attention(*arrays, **options) if out is None else out
