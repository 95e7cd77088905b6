"""Per-tensor FP8 scaling as pure functions: amax, quantise, and the delayed-scaling update.

Conventions are TransformerEngine's: `scale` multiplies a tensor into FP8 range
(q = clip(x * scale, ±fp8_max)), and `1 / scale` multiplies the GEMM's result back.

The delayed-scaling update of one tensor's (scale, amax_history) given its amax this step,
in TE's order (`transformer_engine/jax/quantize`):

    history[0] = amax
    amax_ref   = max(history)            ("max")   or history[0] ("most_recent")
    scale      = fp8_max / amax_ref / 2**margin,  the old scale if amax_ref is 0 or not finite
    history    = roll(history, -1); history[0] = 0

The tensor was quantised with the *stored* scale before the update, so a step always uses the
scale computed from the history up to the previous step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from flashmesh.attention.varying import varying_axes
from flashmesh.quantization import combine
from flashmesh.quantization.recipe import DelayedScaling, Float8CurrentScaling

__all__ = ["amax", "local_amax", "reduce_amax", "quantize", "update", "update_state", "current_scale"]


def amax(x: jax.Array) -> jax.Array:
    """max |x| as float32 [1], reduced over every device the tensor is split across.

    Under jit on sharded arrays the reduction is global by construction; inside `shard_map`
    it is also taken over the manual mesh axes along which `x` differs between devices, so
    every device quantises with the same scale (TE's reduce_amax over data/tensor axes)."""
    return reduce_amax(local_amax(x), x)


def local_amax(x: jax.Array) -> jax.Array:
    """max |x| on this device, a float32 scalar."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def reduce_amax(local: jax.Array, like: jax.Array) -> jax.Array:
    """A tensor's amax on this device (float32 scalar or [1]) -> float32 [1] over every device
    `like` (an array, or a tuple of the arrays the amax covers) is split across (see `amax`)."""
    local = local.astype(jnp.float32).reshape(())
    axes = varying_axes(like)
    if axes:
        local = lax.pmax(local, axes)
    return local.reshape(1)


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """x * scale clipped to the FP8 dtype's range, in that dtype (computed in float32)."""
    top = float(jnp.finfo(dtype).max)
    scaled = x.astype(jnp.float32) * scale.astype(jnp.float32).reshape(())
    return jnp.clip(scaled, -top, top).astype(dtype)


def current_scale(amax_now: jax.Array, fp8_max: float, recipe: Float8CurrentScaling) -> jax.Array:
    """fp8_max / amax of the tensor itself; 1 where amax is 0 or not finite."""
    ok = (amax_now > 0) & jnp.isfinite(amax_now)
    scale = jnp.where(ok, fp8_max / jnp.where(ok, amax_now, 1.0), 1.0)
    if recipe.use_power_2_scales:
        scale = jnp.exp2(jnp.floor(jnp.log2(scale)))
    return scale.astype(jnp.float32)


def update(scale: jax.Array, history: jax.Array, amax_now: jax.Array, fp8_max: float,
           recipe: DelayedScaling, *, combining: bool = False) -> tuple[jax.Array, jax.Array]:
    """The delayed-scaling update of one tensor: (scale [1], history [L]) -> the next ones.

    Where the reference amax is 0 or not finite the old scale is kept. With `combining` (the
    state is one use of several, combined by min: flashmesh.quantization.combine) the kept scale
    is left to the combination instead: +inf (min's identity) for a zero amax, so another use's
    scale wins as one pass over both would give it, and -inf (absorbing) for a non-finite one,
    so the combination keeps the old scale; the view resolves both to the old scale."""
    history = history.astype(jnp.float32).at[0].set(amax_now.astype(jnp.float32).reshape(()))
    ref = jnp.max(history) if recipe.amax_compute_algo == "max" else history[0]
    ok = (ref > 0) & jnp.isfinite(ref)
    fresh = fp8_max / jnp.where(ok, ref, 1.0) / (2.0 ** recipe.margin)
    kept = (jnp.where(ref == 0, jnp.inf, -jnp.inf) if combining
            else scale.astype(jnp.float32).reshape(()))
    new_scale = jnp.where(ok, fresh, kept).reshape(1)
    new_history = jnp.roll(history, -1).at[0].set(0.0)
    return new_scale, new_history


def update_state(scale: jax.Array, history: jax.Array, amax_now: jax.Array, fp8_max: float,
                 recipe: DelayedScaling) -> tuple[jax.Array, jax.Array]:
    """`update` of one quantiser's state as a module holds it (float32, or viewed in the
    combining dtypes): the next (scale, history) in the same dtypes, the cotangent a GEMM's or
    attention's backward returns; a viewed scale leaves a kept scale to the combination."""
    new_scale, new_history = update(combine.to_float32(scale), combine.to_float32(history), amax_now,
                                    fp8_max, recipe, combining=combine.is_combining(scale))
    return (lax.convert_element_type(new_scale, scale.dtype),
            lax.convert_element_type(new_history, history.dtype))
