"""Backward pass of the `chunked` backend (FlashAttention-2's, tile by tile in XLA).

From the residuals q, k, v, (bias, sink), out and lse, each tile's probabilities are recomputed
as p = e^(s - lse) (no [T, S] matrix is ever stored), and with do = dL/dout, for query row i and
key j (Dao, 2023, Algorithm 2):

    dv_j += sum_i p~_ij do_i                      p~ = p after dropout (kept scaled by 1 / keep prob.)
    dp_ij = do_i . v_j, masked and scaled by dropout like p
    ds_ij = p_ij (dp_ij - delta_i),               delta_i = do_i . out_i - g_lse_i
    dq_i += scale ds_ij k_j,   dk_j += scale ds_ij q_i,   dbias_ij = ds_ij

`delta` is the softmax Jacobian's row term; a cotangent g_lse on the log-sum-exp adds
p_ij g_lse_i to ds_ij (d lse_i / d s_ij = p_ij), which is why it is folded into delta. With a soft
cap, ds is multiplied by d(cap tanh(x / cap))/dx = 1 - tanh^2 before it reaches q, k and bias.
The sink is one more softmax term with logit c and no value, so its gradient is
-sum_i e^(c - lse_i) delta_i, computed from lse and delta alone without touching a tile.

Hidden elements have p = 0 (their logits are -inf), so they contribute nothing; a fully masked
row has p = 0 everywhere and gets exactly zero gradient. Padding rows of the last query tile
have do = 0 and delta = 0, so they contribute nothing either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def backward(tiles, out: jax.Array, lse: jax.Array, g_out: jax.Array, g_lse: jax.Array):
    """(dq, dk, dv, dbias, dsink) of one call, each in its input's dtype (None where absent).

    `tiles` is the `chunked.Tiles` of the call (blocked arrays, schedule, tile operations).
    """
    ct = tiles.ct
    delta = jnp.einsum("btnh,btnh->bnt", g_out.astype(ct), out.astype(ct)) - g_lse.astype(ct)
    do = tiles.split_q(g_out.astype(tiles.mm_dtype))
    rows_lse, rows_delta = tiles.split_rows(lse.astype(ct)), tiles.split_rows(delta)

    carry = (jnp.zeros(tiles.q.shape, ct), jnp.zeros(tiles.k.shape, ct), jnp.zeros(tiles.v.shape, ct),
             None if tiles.bias is None else jnp.zeros(tiles.bias.shape, ct))

    def step_fn(step, carry):
        dq, dk, dv, dbias = carry
        kv = tiles.kv_sub(step)
        q_t, do_t = tiles.q_tiles(tiles.q, step), tiles.q_tiles(do, step)
        k_t, v_t = tiles.kv_tiles(tiles.k, step), tiles.kv_tiles(tiles.v, step)
        lse_t, delta_t = tiles.q_tiles(rows_lse, step), tiles.q_tiles(rows_delta, step)

        s, tanh = tiles.logits(step)  # [B, K, A, G, bq, bk]
        p = jnp.exp(s - lse_t[..., None])
        keep = tiles.dropout_keep(step)
        p_dropped = tiles.dropout(keep, p)
        dv = tiles.add_kv_tiles(dv, step, jnp.einsum(
            f"bkagqs,bkagqh->bk{kv}sh", p_dropped.astype(tiles.mm_dtype), do_t, preferred_element_type=ct))
        dp = tiles.dropout(keep, jnp.einsum(f"bkagqh,bk{kv}sh->bkagqs", do_t, v_t, preferred_element_type=ct))
        ds = p * (dp - delta_t[..., None])
        if tanh is not None:
            ds = ds * (1.0 - tanh * tanh)
        if dbias is not None:
            dbias = tiles.add_bias_tiles(dbias, step, ds)
        ds = (ds * tiles.spec.scale).astype(tiles.mm_dtype)
        dq = tiles.put_q_tiles(dq, step, jnp.einsum(f"bkagqs,bk{kv}sd->bkagqd", ds, k_t,
                                                     preferred_element_type=ct), add=True)
        dk = tiles.add_kv_tiles(dk, step, jnp.einsum(f"bkagqs,bkagqd->bk{kv}sd", ds, q_t,
                                                     preferred_element_type=ct))
        return dq, dk, dv, dbias

    dq, dk, dv, dbias = tiles.run(step_fn, carry, g_out, g_lse, out, lse)
    dq = tiles.merge_q(dq).astype(tiles.q_dtype)
    dk = tiles.merge_kv(dk).astype(tiles.q_dtype)
    dv = tiles.merge_kv(dv).astype(tiles.q_dtype)
    if dbias is not None:
        dbias = tiles.merge_bias(dbias).astype(tiles.bias_dtype)
    dsink = None
    if tiles.spec.softmax == "learnable":
        c = tiles.sink.astype(ct)[None, :, None]  # [1, N, 1]
        dsink = -jnp.sum(jnp.exp(c - lse.astype(ct)) * delta, axis=(0, 2)).astype(tiles.sink.dtype)
    return dq, dk, dv, dbias, dsink
