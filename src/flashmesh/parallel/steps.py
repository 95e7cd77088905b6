"""One step of context-parallel attention: a rank's queries against one block of keys.

Shape legend: B batch, T (local) query length, S key length of the block, N query heads,
K key/value heads, H head dim.

Every strategy cuts the global call into steps, and each step is an ordinary single-device
attention call through the registry (`registry.select`), always returning its lse. What makes a
step equal to its part of the global call is that it carries each token's *global* identity:

* positions: the token's position in the original sequence (or inside its packed segment), so
  causal and window masks are those of the global call whatever the order (contiguous,
  dual_chunk, striped) placed the token on this rank;
* segment ids: unchanged (0 = padding);
* index: the token's original index, which the dropout hash sees (and the head numbers, when
  heads are split), so dropout drops exactly what one device drops.

Steps run with vanilla softmax: a sink is one extra denominator term and must be counted once,
after the merge (`merge.finalize_sink`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from flashmesh.attention import registry, varying
from flashmesh.attention.spec import EMPTY_ROW_LSE, AttentionInputs, AttentionSpec, compute_dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Side:
    """The mask data of one side's tokens (queries or keys) on a rank.

    ids: [B, L] int32 segment ids (0 = padding), or None without segments.
    positions: [B, L] int32 global positions, or None when no mask reads them.
    index: [L] int32 original token indices (for the dropout hash).
    """

    ids: jax.Array | None
    positions: jax.Array | None
    index: jax.Array

    def gathered(self, axis) -> "Side":
        """The sides of every rank along `axis`, concatenated in rank order (all_gather)."""
        def gather(x, dim):
            return None if x is None else jax.lax.all_gather(x, axis, axis=dim, tiled=True)
        return Side(gather(self.ids, 1), gather(self.positions, 1), gather(self.index, 0))


def step_spec(spec: AttentionSpec, q_len: int, kv_len: int, bias_shape) -> AttentionSpec:
    """The global spec narrowed to one step: its lengths, explicit positions, vanilla softmax."""
    return dataclasses.replace(
        spec, q_len=q_len, kv_len=kv_len, softmax="vanilla", bottom_right=False,
        segments=None if spec.segments is None else "packed", max_segments=None,
        positions_canonical=False, return_lse=True, bias_shape=bias_shape,
        context_step=True)  # every step numbers its keys by Side.index


def attend(spec: AttentionSpec, implementation: str | None, q, k, v, bias, q_side: Side,
           kv_side: Side, seed, head_index) -> tuple[jax.Array, jax.Array]:
    """(out [B, T, N, Dv] in q's dtype, lse [B, N, T]) of one step, through the registry."""
    inputs = _inputs(q, k, v, bias, q_side, kv_side, seed, head_index)
    return registry.select(spec, implementation).module.attention(inputs, spec)


def attend_segments(spec: AttentionSpec, implementation: str | None, q, k, v, bias, q_side: Side,
                    kv_side: Side, seed, head_index) -> tuple[jax.Array, jax.Array]:
    """`attend`, and with packed segments whose positions turn out canonical at run time (the
    documents start inside the block), the spec that says so: cuDNN can then run the step."""
    canonical = canonical_spec(spec)
    if canonical is None:
        return attend(spec, implementation, q, k, v, bias, q_side, kv_side, seed, head_index)
    axes = varying.varying_axes(q, k, v, bias, q_side, kv_side, seed)

    def run(s):
        return lambda: varying.like(attend(s, implementation, q, k, v, bias, q_side, kv_side, seed, head_index), axes)

    return lax.cond(positions_canonical(q_side) & positions_canonical(kv_side), run(canonical), run(spec))


def attend_backward(spec: AttentionSpec, implementation: str | None, q, k, v, bias, q_side: Side,
                    kv_side: Side, seed, head_index, out, lse, g_out, g_lse):
    """(dq, dk, dv, dbias) of one step inside a merged softmax whose (out, lse) and cotangents
    (g_out, g_lse) are the merged ones. An implementation with `backward_with_stats` computes
    them directly (FlashAttention's backward needs only the final statistics); any other re-runs
    the step's forward under `jax.vjp` and feeds it the cotangents the merge gives it:
    w = e^(lse_d - lse), g_out_d = w g_out, g_lse_d = w (g_lse + g_out . (out_d - out))."""
    inputs = _inputs(q, k, v, bias, q_side, kv_side, seed, head_index)
    module = registry.select(spec, implementation).module
    if hasattr(module, "backward_with_stats"):
        return module.backward_with_stats(inputs, spec, out, lse, g_out, g_lse)
    ct = compute_dtype(q.dtype)

    def step(q, k, v, b):
        return module.attention(dataclasses.replace(inputs, q=q, k=k, v=v, bias=b), spec)

    (o_d, l_d), vjp = jax.vjp(step, q, k, v, bias)
    w = jnp.exp(l_d.astype(ct) - lse)  # [B, N, T]: this step's share of each row
    g_lse_d = w * (g_lse + jnp.einsum("btnh,btnh->bnt", g_out, o_d.astype(ct) - out))
    return vjp(((jnp.swapaxes(w, 1, 2)[..., None] * g_out).astype(o_d.dtype), g_lse_d.astype(l_d.dtype)))


def _inputs(q, k, v, bias, q_side: Side, kv_side: Side, seed, head_index) -> AttentionInputs:
    return AttentionInputs(q=q, k=k, v=v, bias=bias, sink=None, q_segment_ids=q_side.ids,
                           kv_segment_ids=kv_side.ids, q_positions=q_side.positions,
                           kv_positions=kv_side.positions, dropout_seed=seed,
                           q_index=q_side.index, kv_index=kv_side.index, head_index=head_index)


def empty_result(q, v, axes) -> tuple[jax.Array, jax.Array]:
    """What a step with no visible pair returns: out exactly 0, lse EMPTY_ROW_LSE."""
    B, T, N, _ = q.shape
    ct = compute_dtype(q.dtype)
    out = jnp.zeros((B, T, N, v.shape[-1]), q.dtype)
    lse = jnp.full((B, N, T), EMPTY_ROW_LSE, ct)
    return varying.like((out, lse), axes)


def canonical_spec(spec: AttentionSpec) -> AttentionSpec | None:
    """The step spec for blocks whose positions are each token's offset from the start of its
    run of ids inside the block (`positions_canonical`), or None when no implementation could use
    it: the mask reads no positions, or the call's segment count is unknown (cuDNN needs it
    statically). A block holds at most one more run than a row has documents (a document cut by
    the block's left edge)."""
    if spec.segments is None or not spec.causal or spec.max_segments is None:
        return None
    return dataclasses.replace(spec, positions_canonical=True, max_segments=spec.max_segments + 1)


def positions_canonical(side: Side) -> jax.Array:
    """Whether every non-padding token's position is its offset from the start of its run of
    equal ids in this block (a scalar bool): what an implementation that derives positions from
    segment ids (cuDNN) would use."""
    ids, pos = side.ids, side.positions
    L = ids.shape[1]
    idx = jnp.arange(L, dtype=jnp.int32)[None]
    start = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    run_start = lax.cummax(jnp.where(start, idx, 0), axis=1)
    return jnp.all((pos == idx - run_start) | (ids == 0))


def may_meet(spec: AttentionSpec, q_side: Side, kv_side: Side) -> jax.Array:
    """Whether any query of q_side may see any key of kv_side (a scalar bool, conservative:
    False means certainly no visible pair). From the ranges of segment ids and positions:
    O(B * (T + S)), never a [T, S] matrix."""
    meet = jnp.ones((), bool)
    if q_side.ids is not None:
        big = jnp.iinfo(jnp.int32).max
        def span(ids):  # nonzero id range per batch row; an all-padding row gets an empty range
            real = ids != 0
            return (jnp.min(jnp.where(real, ids, big), axis=1), jnp.max(jnp.where(real, ids, 0), axis=1))
        (q_lo, q_hi), (k_lo, k_hi) = span(q_side.ids), span(kv_side.ids)
        meet = jnp.any((q_lo <= k_hi) & (k_lo <= q_hi))
    left, right = spec.window
    if left >= 0 or right >= 0:  # holds for any pair, so also across packed segments
        qp, kp = q_side.positions, kv_side.positions
        if left >= 0:  # visible needs q_pos - k_pos <= left for some pair
            meet = meet & (jnp.min(qp) - jnp.max(kp) <= left)
        if right >= 0:
            meet = meet & (jnp.min(kp) - jnp.max(qp) <= right)
    return meet
