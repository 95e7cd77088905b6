"""The all_to_all strategy (DeepSpeed-Ulysses): trade the sequence shard for a head shard.

Shape legend: B batch, T local queries (cp * T in all), N query heads, K key/value heads, H head
dim; n = N / cp heads per rank after the exchange.

One `all_to_all` turns q [B, T, N, H] (a sequence shard, every head) into [B, cp*T, n, H] (the
whole sequence, n heads); K and V likewise. Each rank then runs one ordinary attention call over
whole sequences for its heads, and a last `all_to_all` turns the output back into a sequence
shard. Positions, ids and token indices are gathered, so the mask and dropout are the global
ones; the head numbers the dropout hash sees are the global ones too.

K/V heads: rank r's queries need the key/value heads h // G of its query heads h in
[r*n, (r+1)*n) (G = N / K). When K is a multiple of cp they are exactly K / cp consecutive heads,
and K/V split like Q. Otherwise (K < cp, e.g. GQA 128:8 on 16 ranks, or MQA) each rank needs a
head that others need too: K/V are first expanded to the heads each rank needs
(`kv_heads_for`) and then exchanged; replicated heads receive summed gradients through autodiff.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from flashmesh.attention.spec import AttentionSpec, compute_dtype
from flashmesh.parallel import steps
from flashmesh.parallel.steps import Side


def kv_heads_for(num_heads: int, num_kv_heads: int, cp: int) -> np.ndarray | None:
    """The K/V heads to exchange, in rank-major order (rank r gets a block of them), as indices
    into the K original heads; None when the K heads split evenly (no expansion)."""
    if num_kv_heads % cp == 0:
        return None
    n, G = num_heads // cp, num_heads // num_kv_heads
    per_rank = [sorted({h // G for h in range(r * n, (r + 1) * n)}) for r in range(cp)]
    width = max(len(p) for p in per_rank)
    if any(len(p) != width for p in per_rank) or n % width:
        return np.arange(num_heads) // G  # irregular grouping: one K/V head per query head
    return np.asarray([h for p in per_rank for h in p])


def all_to_all(spec: AttentionSpec, implementation: str | None, axis: str, cp: int, q, k, v, bias,
               q_side: Side, kv_side: Side, seed):
    """(out [B, T, N, Dv], lse [B, N, T]) in float32 for the rank's sequence shard; inside
    shard_map over `axis`. `spec` is the step spec of the whole sequence with N / cp heads."""
    N, K = q.shape[2], k.shape[2]
    idx = kv_heads_for(N, K, cp)
    if idx is not None:
        k, v = (jnp.take(x, jnp.asarray(idx), axis=2) for x in (k, v))

    def to_heads(x):  # [B, T, H*, D] sequence shard -> [B, cp*T, H*/cp, D] head shard
        return lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)

    if bias is not None:  # [B|1, N|1, T, S_all]: split heads (or gather rows when shared)
        bias = (lax.all_to_all(bias, axis, split_axis=1, concat_axis=2, tiled=True) if bias.shape[1] > 1
                else lax.all_gather(bias, axis, axis=2, tiled=True))
    n = N // cp
    head_index = lax.axis_index(axis) * n + jnp.arange(n, dtype=jnp.int32)
    out, lse = steps.attend_segments(spec, implementation, to_heads(q), to_heads(k), to_heads(v), bias,
                            q_side.gathered(axis), kv_side.gathered(axis), seed, head_index)
    out = lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)
    lse = lax.all_to_all(lse, axis, split_axis=2, concat_axis=1, tiled=True)
    return out.astype(compute_dtype(q.dtype)), lse
