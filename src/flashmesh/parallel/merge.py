"""Combining partial attention results through their log-sum-exps, and the softmax sink.

Shape legend: B batch, T queries, N query heads, H value head dim.

A context-parallel step attends a rank's queries to one subset of the keys and returns
(out, lse): out [B, T, N, H] is softmax-weighted over that subset and lse [B, N, T] is the log of
its softmax denominator. For two disjoint key subsets a and b, the attention over their union is

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)
        = out_a + sigmoid(lse_b - lse_a) * (out_b - out_a)

(the second form is the one TransformerEngine's ring and ring-flash-attention use). A row that
saw no key has lse = EMPTY_ROW_LSE (-1e30, finite on purpose) and out exactly 0. The sigmoid of
+-1e30 is exactly 1 or 0, so merging with an empty partial returns the other one bit for bit, and
two empty partials give exactly 0 with lse still EMPTY_ROW_LSE: no inf - inf, no NaN, and finite
gradients. Inputs at -inf (another library's convention) are lifted to EMPTY_ROW_LSE first.

Softmax variants with an extra denominator term (off_by_one: + exp(0); learnable: + exp(sink[n]))
must count that term once, not once per step. So the steps run with vanilla softmax, the partials
are merged, and `finalize_sink` folds the sink in at the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from flashmesh.attention.spec import EMPTY_ROW_LSE


def _compute_dtype(*xs) -> jnp.dtype:
    """float64 when any input is float64 (x64 mode), else float32: merges never run in 16 bits."""
    return jnp.dtype(jnp.float64) if any(jnp.dtype(x.dtype) == jnp.float64 for x in xs) \
        else jnp.dtype(jnp.float32)


def _check(out, lse, out_name: str, lse_name: str) -> None:
    if out.ndim != 4 or lse.shape != (out.shape[0], out.shape[2], out.shape[1]):
        raise ValueError(f"{out_name} [B, T, N, H] and {lse_name} [B, N, T] disagree: got "
                         f"{out_name}.shape={out.shape}, {lse_name}.shape={lse.shape}")


def _lift(lse: Array, ct) -> Array:
    """lse in the compute dtype with anything below EMPTY_ROW_LSE (e.g. -inf) raised to it. A
    where, not a maximum, so an empty row passes no gradient back (a maximum would pass half)."""
    lse, empty = lse.astype(ct), jnp.asarray(EMPTY_ROW_LSE, ct)
    return jnp.where(lse > empty, lse, empty)


def _logaddexp(a: Array, b: Array) -> Array:
    """logaddexp(a, b) corrected once so that e^(a - r) + e^(b - r) = 1 as this device's exp
    computes it (log(1 + x) ~ x), the sum a backward that recomputes p = e^(s - lse) relies on (a
    TPU's float32 log misses by ~3e-5 relative: `attention.chunked._log_as_exp_sees_it`). An
    empty partial (EMPTY_ROW_LSE) leaves the other exactly as it was; two give EMPTY_ROW_LSE."""
    r = jnp.logaddexp(a, b)
    return r + (jnp.exp(a - r) + jnp.exp(b - r) - 1.0)


def _weight(x: Array) -> Array:
    """A [B, N, T] per-row factor as [B, T, N, 1], to scale an out [B, T, N, H]."""
    return jnp.swapaxes(x, 1, 2)[..., None]


def merge_partials(out_a: Float[Array, "B T N H"], lse_a: Float[Array, "B N T"],
                   out_b: Float[Array, "B T N H"], lse_b: Float[Array, "B N T"]
                   ) -> tuple[Float[Array, "B T N H"], Float[Array, "B N T"]]:
    """Attention over the union of two disjoint key sets, from each set's (out, lse).

    Args:
      out_a, out_b: partial outputs [B, T, N, H] (any float dtype).
      lse_a, lse_b: their log-sum-exps [B, N, T]; EMPTY_ROW_LSE (or -inf) for rows with no key.

    Returns (out [B, T, N, H], lse [B, N, T]), both in float32 (float64 when any input is
    float64). They stay in that precision across a ring's steps; the caller casts out once, at
    the end.

    Example: merging (o1, l1) from keys [0, 64) with (o2, l2) from keys [64, 128) gives exactly
    what one attention call over keys [0, 128) returns, up to rounding.
    """
    _check(out_a, lse_a, "out_a", "lse_a")
    _check(out_b, lse_b, "out_b", "lse_b")
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_a and out_b must have one shape, got {out_a.shape=}, {out_b.shape=}")
    ct = _compute_dtype(out_a, lse_a, out_b, lse_b)
    la, lb = _lift(lse_a, ct), _lift(lse_b, ct)
    oa, ob = out_a.astype(ct), out_b.astype(ct)
    out = oa + _weight(jax.nn.sigmoid(lb - la)) * (ob - oa)
    return out, _logaddexp(la, lb)


def finalize_sink(out: Float[Array, "B T N H"], lse: Float[Array, "B N T"],
                  sink_logit) -> tuple[Float[Array, "B T N H"], Float[Array, "B N T"]]:
    """Adds a softmax sink exp(c_n) to the denominator of merged vanilla results, exactly once.

    With the sink, p_ij = exp(s_ij) / (sum_j exp(s_ij) + exp(c_n)), so

        lse' = logaddexp(lse, c_n)
        out' = out * exp(lse - lse') = out * sigmoid(lse - c_n).

    Args:
      out: merged output [B, T, N, H]; lse: its log-sum-exp [B, N, T].
      sink_logit: c, a scalar or [N]: 0.0 for softmax "off_by_one", the sink parameter sink[n]
        for "learnable" (its gradient flows through here). None means vanilla: returned as is.

    Returns (out', lse') in the merge's precision. An empty row (lse = EMPTY_ROW_LSE, out = 0)
    keeps out' = 0 and gets lse' = c, as the single-device reference reports.
    """
    _check(out, lse, "out", "lse")
    if sink_logit is None:
        return out, lse
    ct = _compute_dtype(out, lse, jnp.asarray(sink_logit))
    c = jnp.asarray(sink_logit).astype(ct)
    if c.ndim not in (0, 1) or (c.ndim == 1 and c.shape[0] not in (1, lse.shape[1])):
        raise ValueError(f"sink_logit must be a scalar or [N={lse.shape[1]}], got shape {c.shape}")
    c = c.reshape(1, -1, 1) if c.ndim == 1 else c.reshape(1, 1, 1)
    lse = _lift(lse, ct)
    return out.astype(ct) * _weight(jax.nn.sigmoid(lse - c)), _logaddexp(lse, c)
