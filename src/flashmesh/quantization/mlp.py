"""`fp8_mlp`: act(x @ wi + wi_bias) @ wo with FP8 GEMMs, the activation fused with the
quantisation of its output and its backward with the quantisation of the pre-activation's
gradient (`quantization.activation`), as TransformerEngine's fused LayerNormMLP does.

The four GEMMs (and the two weight gradients) are `dense`'s, in the same fast cuBLASLt form and
with the same two states as two `dense` calls (state_0 the first GEMM's "x", "kernel" and "grad"
for dh, state_1 the second's, whose "x" is the activation's output); the one difference is where
the arithmetic between the GEMMs runs and that it stays in float32 (see `activation`). The first
GEMM's output h (without its bias, as cuBLAS writes it) is the one activation-sized residual.
DelayedScaling only: current scaling needs the activation's amax before quantising it, which the
unfused composition already does in one XLA fusion.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from flashmesh.quantization import activation, combine
from flashmesh.quantization.dense import gemm, quantized_pair, updated_state
from flashmesh.quantization.normalized import Normalization
from flashmesh.quantization.recipe import DelayedScaling

__all__ = ["fp8_mlp"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def fp8_mlp(x: jax.Array, wi: jax.Array, wi_bias: jax.Array | None, wo: jax.Array, state_0: dict,
            state_1: dict, recipe: DelayedScaling, acts: tuple[Callable, ...],
            source: Normalization | None = None) -> jax.Array:
    """x [M, H], wi [H, n*F] (n = len(acts) blocks), wi_bias [n*F] or None, wo [F, N] -> [M, N]
    in x's dtype: act(x @ wi + wi_bias) @ wo, act = acts[0] (times acts[1] of the second block
    for a gated pair). The states are two `dense` calls' (see the module docstring). source:
    what x is made of where it is a LayerNorm's output (as `dense`'s)."""
    if not isinstance(recipe, DelayedScaling):
        raise NotImplementedError(f"fp8_mlp takes DelayedScaling, got {type(recipe).__name__} "
                                  "(current scaling runs the unfused composition)")
    return _forward(x, wi, wi_bias, wo, state_0, state_1, recipe, acts, source)[0]


def _forward(x, wi, wi_bias, wo, state_0, state_1, recipe, acts, source=None):
    fmt = recipe.fp8_format
    fwd = (fmt.max_fwd, fmt.forward_dtype, recipe)
    xq, xqT, sx, ax = quantized_pair(x, state_0, "x", *fwd, source)
    k1, k1T, sk1, ak1 = quantized_pair(wi, state_0, "kernel", *fwd)
    k2, k2T, sk2, ak2 = quantized_pair(wo, state_1, "kernel", *fwd)
    # both layouts of a weight from one quantisation (see dense._forward)
    k1, k1T = jax.lax.optimization_barrier((k1, k1T))
    k2, k2T = jax.lax.optimization_barrier((k2, k2T))
    h = gemm(xq, k1T, (1.0 / sx) * (1.0 / sk1), x.dtype)
    sa = combine.to_float32(state_1["x"][0])
    aq, aqT, aa = activation.act_quantize_both(h, wi_bias, acts, sa, fmt.forward_dtype)
    y = gemm(aq, k2T, (1.0 / sa) * (1.0 / sk2), x.dtype)
    # zero-size arrays carry the weights' dtypes (their gradients are returned in them)
    likes = (jnp.zeros((0,), wi.dtype), jnp.zeros((0,), wo.dtype))
    return y, (xqT, k1, h, wi_bias, aqT, k2, (sx, sk1, sa, sk2), (ax, ak1, aa, ak2),
               state_0, state_1, likes)


def _backward(recipe, acts, residuals, g):
    xqT, k1, h, wi_bias, aqT, k2, scales, amaxes, state_0, state_1, (wi_like, wo_like) = residuals
    sx, sk1, sa, sk2 = scales
    ax, ak1, aa, ak2 = amaxes
    fmt = recipe.fp8_format
    gq, gqT, sg, ag = quantized_pair(g, state_1, "grad", fmt.max_bwd, fmt.backward_dtype, recipe)
    da = gemm(gq, k2, (1.0 / sg) * (1.0 / sk2), g.dtype)
    dwo = gemm(aqT, gqT, (1.0 / sa) * (1.0 / sg), wo_like.dtype)  # in the weight's dtype, as dense
    sd = combine.to_float32(state_0["grad"][0])
    dq, dqT, ad, dbias = activation.dact_quantize_both(da, h, wi_bias, acts, sd, fmt.backward_dtype)
    dx = gemm(dq, k1, (1.0 / sd) * (1.0 / sk1), g.dtype)
    dwi = gemm(xqT, dqT, (1.0 / sx) * (1.0 / sd), wi_like.dtype)
    maxes = {"x": fmt.max_fwd, "kernel": fmt.max_fwd, "grad": fmt.max_bwd}
    new_0 = updated_state(state_0, {"x": ax, "kernel": ak1, "grad": ad}, maxes, recipe)
    new_1 = updated_state(state_1, {"x": aa, "kernel": ak2, "grad": ag}, maxes, recipe)
    dbias = None if wi_bias is None else dbias.astype(wi_bias.dtype)
    return dx, dwi, dbias, dwo, new_0, new_1, None  # the source's gradient comes through x's


fp8_mlp.defvjp(_forward, _backward)
