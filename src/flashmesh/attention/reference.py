"""The reference implementation: readable einsum code with every feature.

It materialises the [B, N, T, S] logits, so it is for learning the semantics, for tests (the
ground truth in float32/float64) and for short sequences on CPU. Gradients come from autodiff.

The computation, per batch b, query head n (key/value head n // (N / K)), query i, key j:

    s_ij = scale * q_i . k_j + bias_ij           (post-scale bias)
    s_ij = cap * tanh(s_ij / cap)                (optional logit soft cap)
    s_ij = -inf where (i, j) is masked            (causal / window / segments / padding)
    p_ij = exp(s_ij) / (sum_j exp(s_ij) + z)      z = 0, 1 (off_by_one) or exp(sink_n) (learnable)
    o_i  = sum_j dropout(p_ij) v_j                keeps with prob kp = masks.keep_probability(rate),
                                                  scales the kept by 1 / kp
    lse_i = log(sum_j exp(s_ij) + z)              EMPTY_ROW_LSE if that sum is 0
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flashmesh.attention import masks
from flashmesh.attention.spec import EMPTY_ROW_LSE, AttentionInputs, AttentionSpec, compute_dtype

# Materialising logits past this many bytes is refused when the reference is picked
# automatically (named explicitly, it runs whatever the size).
AUTO_LOGITS_BYTES = 256 * 2**20


def unsupported_reason(spec: AttentionSpec, platform: str, *, automatic: bool = False) -> str | None:
    if automatic:
        nbytes = 4 * spec.batch * spec.num_heads * spec.q_len * spec.kv_len
        if nbytes > AUTO_LOGITS_BYTES:
            return (f"would materialise {nbytes / 2**30:.2f} GiB of logits "
                    f"(automatic choice limit {AUTO_LOGITS_BYTES / 2**30:.2f} GiB)")
    return None


def sink_logit(spec: AttentionSpec, sink: jax.Array | None, dtype) -> jax.Array | None:
    """The extra softmax term's logit per head, [N], or None for vanilla softmax."""
    if spec.softmax == "off_by_one":
        return jnp.zeros((spec.num_heads,), dtype)
    if spec.softmax == "learnable":
        return sink.astype(dtype)
    return None


def attention(inputs: AttentionInputs, spec: AttentionSpec) -> tuple[jax.Array, jax.Array]:
    """Returns (out [B, T, N, Dv] in q's dtype, lse [B, N, T] float32, float64 for float64 q)."""
    ct = compute_dtype(inputs.q.dtype)
    inputs = masks.without_padding(inputs)
    B, T, N, _ = inputs.q.shape
    S, K = inputs.k.shape[1], inputs.k.shape[2]
    q = inputs.q.astype(ct).reshape(B, T, K, N // K, -1)
    k, v = inputs.k.astype(ct), inputs.v.astype(ct)

    s = jnp.einsum("btkgh,bskh->bkgts", q, k).reshape(B, N, T, S) * jnp.asarray(spec.scale, ct)
    visible = masks.element_mask(spec, inputs, np.arange(T), np.arange(S))
    if inputs.bias is not None:
        bias = inputs.bias.astype(ct)
        if spec.segments is not None:  # a padded row or column of the bias may hold anything
            bias = jnp.where(visible[:, None], bias, 0.0)
        s = s + bias
    if spec.logits_soft_cap is not None:
        cap = jnp.asarray(spec.logits_soft_cap, ct)
        s = cap * jnp.tanh(s / cap)
    if visible is not None:
        # -inf (not a finite fill) so exp gives exact zeros whose gradient is zero too.
        s = jnp.where(visible[:, None], s, -jnp.inf)

    extra = sink_logit(spec, inputs.sink, ct)
    row_max = jnp.max(s, axis=-1)
    if extra is not None:
        row_max = jnp.maximum(row_max, extra[None, :, None])
    # Softmax is shift invariant, so the shift needs no gradient; 0 for rows with no key.
    shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    e = jnp.exp(s - shift[..., None])
    denom = jnp.sum(e, axis=-1)
    if extra is not None:
        denom = denom + jnp.exp(extra[None, :, None] - shift)
    empty = denom == 0
    p = e / jnp.where(empty, 1.0, denom)[..., None]
    lse = jnp.where(empty, EMPTY_ROW_LSE, shift + jnp.log(jnp.where(empty, 1.0, denom)))

    if spec.has_dropout:
        n, i, j = masks.dropout_numbers(inputs, jnp.arange(N), jnp.arange(T), jnp.arange(S))
        keep = masks.dropout_keep(inputs.dropout_seed, spec.dropout_rate, jnp.arange(B)[:, None, None, None],
                                  n[None, :, None, None], i[None, None, :, None], j[None, None, None, :])
        p = jnp.where(keep, p / masks.keep_probability(spec.dropout_rate), 0.0)

    o = jnp.einsum("bkgts,bskh->btkgh", p.reshape(B, K, N // K, T, S), v).reshape(B, T, N, -1)
    return o.astype(inputs.q.dtype), lse
