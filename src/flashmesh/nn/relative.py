"""T5's bucketed relative position bias, as TransformerEngine's `RelativePositionBiases`.

The bias of query i and key j depends only on the distance d = i - j (the query minus the key
position), put into one of `num_buckets` buckets:

* bidirectional (encoders): half of the buckets for keys after the query (d < 0), half for
  the rest; then n = |d| within each half of B = num_buckets / 2 buckets.
* unidirectional (decoders): n = max(d, 0) over all B = num_buckets buckets (a key after the
  query falls into bucket 0, which a causal mask hides anyway).

Within B buckets the first B/2 are exact (n < B/2 is bucket n); larger distances are spaced
logarithmically up to `max_distance`, and everything beyond shares the last bucket:

    bucket(n) = B/2 + floor(log(n / (B/2) + eps) / log(max_distance / (B/2)) * (B - B/2)),
    clipped to B - 1,  eps = float32 machine epsilon (TE's, so buckets match it exactly).

The buckets are static numpy (they depend only on the lengths); the module holds the table
"rel_embedding" [N, num_buckets] and returns its columns as the bias [1, N, T, S].
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jaxtyping import Array, Float

from flashmesh.nn import partitioning

__all__ = ["RelativePositionBiases", "relative_position_buckets"]



def relative_position_buckets(q_seqlen: int, k_seqlen: int, *, num_buckets: int,
                              max_distance: int, bidirectional: bool = True) -> np.ndarray:
    """int32 [T, S]: the bucket of each (query i, key j) pair, T = q_seqlen, S = k_seqlen."""
    for name, value in (("q_seqlen", q_seqlen), ("k_seqlen", k_seqlen)):
        if not (isinstance(value, (int, np.integer)) and value > 0):
            raise ValueError(f"{name} must be a positive int (a static length), got {value!r}")
    half = num_buckets // 2 if bidirectional else num_buckets
    if half // 2 < 1:
        raise ValueError(f"num_buckets={num_buckets} is too small: needs >= "
                         f"{4 if bidirectional else 2} with bidirectional={bidirectional}")
    if not max_distance > half // 2:
        raise ValueError(f"max_distance={max_distance} must exceed the exact buckets "
                         f"({half // 2}) for num_buckets={num_buckets}")
    d = np.arange(q_seqlen, dtype=np.int64)[:, None] - np.arange(k_seqlen, dtype=np.int64)[None]
    bucket = np.zeros(d.shape, np.int64)
    if bidirectional:
        bucket += (d < 0) * half
        n = np.abs(d)
    else:
        n = np.maximum(d, 0)
    exact = half // 2
    # n = 0 gives log(eps), finite; it takes the exact branch anyway.
    log_ratio = (np.log(n.astype(np.float32) / exact + np.finfo(np.float32).eps)
                 / np.log(max_distance / exact))
    large = exact + (log_ratio * (half - exact)).astype(np.int32)
    bucket += np.where(n < exact, n, np.minimum(large, half - 1))
    return bucket.astype(np.int32)


class RelativePositionBiases(nn.Module):
    """T5-style relative position bias (TransformerEngine's fields and call).

    Attributes:
      num_buckets: buckets the query-key distances are put into.
      max_distance: distances from here on share the last bucket.
      num_attention_heads: N, one bias per head.
      embedding_init: initialiser of the table (flax's default_embed_init, as in TE).
      embedding_axes: logical axes of the table, ('heads', 'relpos_buckets').
      dtype: the table's dtype (float32), and the bias's.

    Call: `module(q_seqlen, k_seqlen, bidirectional=True)` -> [1, N, T, S], where
    bias[0, h, i, j] = rel_embedding[h, bucket(i - j)].

    Example:
      >>> rel = RelativePositionBiases(num_buckets=32, max_distance=128, num_attention_heads=8)
      >>> variables = rel.init(jax.random.key(0), 16, 16)
      >>> rel.apply(variables, 16, 16).shape
      (1, 8, 16, 16)
    """

    num_buckets: int
    max_distance: int
    num_attention_heads: int
    embedding_init: Callable[..., Any] = nn.linear.default_embed_init
    embedding_axes: tuple[str, ...] = ("heads", "relpos_buckets")
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, q_seqlen: int, k_seqlen: int,
                 bidirectional: bool = True) -> Float[Array, "1 N T S"]:
        buckets = relative_position_buckets(q_seqlen, k_seqlen, num_buckets=self.num_buckets,
                                            max_distance=self.max_distance,
                                            bidirectional=bidirectional)
        table = partitioning.param(
            self, "rel_embedding", self.embedding_init, (self.num_attention_heads, self.num_buckets),
            self.dtype, self.embedding_axes)
        # A gather of the table's columns: the same values (and gradient, a scatter-add) as
        # TE's one-hot contraction, without the [num_buckets, T, S] one-hot array.
        bias = jnp.take(jnp.asarray(table, self.dtype), jnp.asarray(buckets), axis=1)
        return bias[None]
