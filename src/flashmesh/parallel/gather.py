"""The all_gather strategy: every rank gathers the whole K/V once, then attends its queries.

Shape legend (per rank): B batch, T local queries, S local keys (cp * S gathered), N query
heads, K key/value heads, H head dim.

K, V and their ids, positions and token indices are gathered once along the mesh axis (in rank
order, the order they are stored in); Q never moves. The step is one attention call over the
gathered keys, whose mask carries every token's global position, so the implementation's block
map skips every tile the rank's queries cannot reach: each rank computes only the key range its
queries see. The backward of `all_gather` is a reduce-scatter (`psum_scatter`), which JAX's
autodiff inserts: dK/dV go back to their owners summed over the ranks that used them.
"""

from __future__ import annotations

import jax
from jax import lax

from flashmesh.attention.spec import AttentionSpec, compute_dtype
from flashmesh.parallel import steps
from flashmesh.parallel.steps import Side


def all_gather(spec: AttentionSpec, implementation: str | None, axis: str, q, k, v, bias,
               q_side: Side, kv_side: Side, seed, head_index):
    """(out [B, T, N, Dv], lse [B, N, T]) in float32; inside shard_map over `axis`. `spec` is a
    step's spec for T local queries and the gathered key length."""
    k_all, v_all = (lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v))
    out, lse = steps.attend_segments(spec, implementation, q, k_all, v_all, bias, q_side,
                            kv_side.gathered(axis), seed, head_index)
    return out.astype(compute_dtype(q.dtype)), lse
