"""Dropout whose mask is a hash of each element's index: `dropout(x, rate, rng)` and `Dropout`.

`flax.linen.Dropout` draws its mask with `jax.random.bernoulli`, whose default generator
(threefry2x32, twenty rounds for two words) costs tens of integer operations per element and
whose mask the backward reads back from memory. Here the mask is a pure function of the key
and the element's position: two rounds of a 32-bit finaliser over (row, column) of the mask,
a few operations per element, computed inside the fusion that applies it, forward and
backward alike (the backward recomputes it from the key; nothing is stored). On the guide's
layer (two hidden dropouts of [8192, 4096] per step) this is memory-bound work fused into the
residual adds instead of a compute-bound pass of its own.

The mask depends only on (key, index), so it is the same however `jit` shards the array, and
a different key gives an independent mask. Inside `shard_map` the indices are the shard's own:
every shard given the same key draws the same mask, as with Flax (fold the shard's
`lax.axis_index` into the key for independent ones). It is not Flax's mask for the same key.
Reverse mode keeps only the key for the backward; forward mode (`jax.jvp`) works too.

    >>> y = dropout(x, 0.1, jax.random.key(0))            # x [..., H]; kept x / 0.9, else 0
    >>> y = Dropout(0.1, broadcast_dims=(1,))(x, deterministic=False)   # as flax.linen.Dropout
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax import lax
from jaxtyping import Array

from flashmesh.attention.masks import mix32

__all__ = ["Dropout", "dropout", "dropout_keep"]


def _seed_words(rng) -> jax.Array:
    """Two uint32 words from a key (typed or raw, any PRNG implementation)."""
    return jax.random.bits(rng, (2,), jnp.uint32)


def dropout_keep(seed: jax.Array, rate: float, shape: tuple[int, ...]) -> jax.Array:
    """bool[shape]: which elements survive, from `seed` (uint32[2]) and each element's index.

    The mask is read as [rows, columns] (its last axis the columns); each element hashes its
    row and column with the seed, so masks of more than 2**32 elements stay distinct (each
    count must be below 2**32)."""
    u = jnp.uint32
    cols = shape[-1] if shape else 1
    rows = math.prod(shape[:-1]) if shape else 1
    if max(rows, cols) >= 2**32:  # uint32 indices would repeat the mask
        raise ValueError(f"dropout mask of shape {shape}: rows ({rows}) and the last axis ({cols}) "
                         f"must each be below 2**32")
    row = lax.broadcasted_iota(u, (rows, cols), 0)
    col = lax.broadcasted_iota(u, (rows, cols), 1)
    h = mix32(row * u(0x9E3779B1) + seed[0])
    h = mix32(h ^ (col * u(0x85EBCA77) + seed[1]))
    threshold = min(int(round(rate * 2.0**32)), 2**32 - 1)
    return (h >= u(threshold)).reshape(shape)


def _mask_shape(shape, broadcast_dims):
    return tuple(1 if d in broadcast_dims else n for d, n in enumerate(shape))


def _masked(x, seed, rate, broadcast_dims):
    keep = dropout_keep(seed, rate, _mask_shape(x.shape, broadcast_dims))
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


# The tangent's mask, recomputed from the seed wherever it is needed: under reverse mode the
# only residual is the seed (the transpose recomputes the mask), and forward mode works.
# prevent_cse=False: no optimization barrier on the cotangent, which would keep XLA from
# fusing the backward's mask into the cotangent's producer (the backward is then the same
# program as a hand-written recomputation).
_recomputed = jax.checkpoint(_masked, policy=jax.checkpoint_policies.nothing_saveable,
                             static_argnums=(2, 3), prevent_cse=False)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 3))
def _apply(x, rate, seed, broadcast_dims):
    return _masked(x, seed, rate, broadcast_dims)


@_apply.defjvp
def _apply_jvp(rate, broadcast_dims, primals, tangents):
    x, seed = primals
    return _apply(x, rate, seed, broadcast_dims), _recomputed(tangents[0], seed, rate, broadcast_dims)


def dropout(x: Array, rate: float, rng, broadcast_dims: Sequence[int] = ()) -> Array:
    """Inverted dropout of x: each element kept with probability 1 - rate (scaled by
    1 / (1 - rate)) or set to 0; the decision is shared along `broadcast_dims`.

    Args:
      x: any shape, floating dtype; the output has its shape and dtype.
      rate: the probability of dropping, in [0, 1]; 0 returns x, 1 returns zeros.
      rng: a PRNG key (typed or raw; unused for rate 0 or 1); the mask is a function of it and
        each element's index.
      broadcast_dims: axes along which one decision is shared (negative counts from the end).
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate={rate} must be in [0, 1]")
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise ValueError(f"x must be floating point, got dtype {x.dtype}")
    dims = tuple(sorted(d % x.ndim if -x.ndim <= d < x.ndim else _bad_dim(d, x.ndim)
                        for d in broadcast_dims))
    if rate == 0.0:
        return x
    if rate == 1.0:
        return jnp.zeros_like(x)
    return _apply(x, float(rate), _seed_words(rng), dims)


def _bad_dim(d, ndim):
    raise ValueError(f"broadcast_dims entry {d} must be in [-{ndim}, {ndim}) for an input of rank {ndim}")


class Dropout(nn.Module):
    """`flax.linen.Dropout`'s fields and call, with `dropout`'s hashed mask.

    Attributes:
      rate: the probability of dropping an element.
      broadcast_dims: axes that share one decision.
      deterministic: default for the call's argument (True: identity).
      rng_collection: the rng stream the key comes from (`apply(..., rngs={"dropout": key})`).
    """

    rate: float
    broadcast_dims: Sequence[int] = ()
    deterministic: bool | None = None
    rng_collection: str = "dropout"

    @nn.compact
    def __call__(self, inputs, deterministic: bool | None = None, rng=None):
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if deterministic or self.rate == 0.0:
            return inputs
        if rng is None and self.rate < 1.0:  # rate 1 drops everything and draws no key (flax)
            rng = self.make_rng(self.rng_collection)
        return dropout(inputs, self.rate, rng, tuple(self.broadcast_dims))
