"""`byte_transpose(q)`: the transpose of a 2-D array of one-byte elements (FP8), moved as
4 x 4 blocks of bytes packed in uint32 words.

Hopper's FP8 GEMMs take both operands contiguous along the contracted axis, so the weight
gradient (contracted over tokens) needs every FP8 activation and gradient transposed. XLA's
own transpose of a one-byte array ran at about 0.6 TB/s on the H200 (`wrapped_transpose`,
2026-12-02 profile of the FP8 TransformerLayer); a transpose of 4-byte words is XLA's fast,
tiled case. The bytes of each 4 x 4 block are regrouped within its four words (shifts and
masks) and the words transposed; the result is bit-identical to `q.T` on every platform.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["byte_transpose"]


def byte_transpose(q: jax.Array) -> jax.Array:
    """q [M, K] of a one-byte dtype -> q.T [K, M], bit-identical. Sizes that are not multiples
    of 4, other dtypes and arrays sharded in their type (Explicit mesh axes, where the block
    reshape would need its own output sharding) take the plain transpose."""
    if q.ndim != 2:
        raise ValueError(f"q must be 2-D, got shape {q.shape}")
    M, K = q.shape
    if jnp.dtype(q.dtype).itemsize != 1 or M % 4 or K % 4 or M == 0 or K == 0 or _typed(q):
        return q.T
    u8 = lax.bitcast_convert_type(q, jnp.uint8)
    # w[a, i, b] holds row 4a+i's bytes of columns 4b .. 4b+3 (byte j = column 4b+j).
    w = lax.bitcast_convert_type(u8.reshape(M // 4, 4, K // 4, 4), jnp.uint32)
    rows = [w[:, i, :] for i in range(4)]
    mask = jnp.uint32(0xFF)
    # p[a, j, b] holds column 4b+j's bytes of rows 4a .. 4a+3 (byte i = row 4a+i).
    p = jnp.stack([
        (((rows[0] >> (8 * j)) & mask) | (((rows[1] >> (8 * j)) & mask) << 8)
         | (((rows[2] >> (8 * j)) & mask) << 16) | (((rows[3] >> (8 * j)) & mask) << 24))
        for j in range(4)], axis=1)
    out = lax.bitcast_convert_type(jnp.transpose(p, (2, 1, 0)), jnp.uint8)  # [K/4, 4, M/4, 4]
    return lax.bitcast_convert_type(out.reshape(K, M), q.dtype)


def _typed(q) -> bool:
    """Whether q's type carries a sharding over Explicit mesh axes."""
    sharding = jax.typeof(q).sharding
    types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    return any(t == jax.sharding.AxisType.Explicit for t in types)
