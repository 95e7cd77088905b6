"""Float32 dtypes whose autodiff accumulation is max or min instead of a sum.

The FP8 state's new value travels back as its cotangent (TransformerEngine's convention). When
one state is used several times in a differentiated function (a module applied twice, a
`scan` over microbatches with the state broadcast, a loop), autodiff adds the cotangents of
the uses, and a sum of scales or amax histories means nothing. Viewed in these dtypes, the
uses combine as the state one pass over all of them would produce: amax histories by
elementwise max and scales (fp8_max / amax) by min.

The modules view their state this way where they read it, once per `apply` (a module applied
twice in one apply combines by max); uses in separate applies (a loop or `scan` around apply)
still meet at the float32 variable and add, so view the variables once at the top of such a
loss with `combine_by_max(variables)`.
(Flax's `fp8_ops.fp32_max_grad` is the same idea for its own state; a min dtype is needed here
because TE's stored scale is the inverse of Flax's.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import ad_util, core, dtypes, earray
from jax._src.interpreters import pxla

__all__ = ["fmax32", "fmin32", "to_combining", "to_float32", "is_combining"]


class _Rules:
    """How JAX lowers, converts and accumulates the combining dtypes."""

    @staticmethod
    def physical_element_aval(dtype) -> core.ShapedArray:
        return core.ShapedArray((), dtype.float_dtype)

    @staticmethod
    def convert_from(combining, other) -> bool:
        return combining.float_dtype == other

    @staticmethod
    def convert_to(other, combining) -> bool:
        return combining.float_dtype == other

    @staticmethod
    def add(dt, x, y):
        """Autodiff's accumulation: max (or min) instead of +."""
        f = lambda v: lax.convert_element_type(v, dt.float_dtype)
        op = lax.max if dt.op == "max" else lax.min
        return lax.convert_element_type(op(f(x), f(y)), dt)

    @staticmethod
    def zero(dt):
        """The identity of the accumulation: -inf for max, +inf for min."""
        return lax.convert_element_type(np.array(-np.inf if dt.op == "max" else np.inf,
                                                 dt.float_dtype), dt)

    @staticmethod
    def tangent_dtype(dtype):
        return dtype

    @staticmethod
    def full(shape, fill_value, dtype):
        raw = lax.full(shape, lax.convert_element_type(fill_value, dtype.float_dtype), dtype.float_dtype)
        return lax.convert_element_type(raw, dtype)

    @staticmethod
    def global_sharded_result_handler(aval, out_sharding, committed):
        """Eager (un-jitted) results: an extended array over the float32 buffers."""
        physical = pxla.global_result_handlers[core.ShapedArray](core.physical_aval(aval),
                                                                 out_sharding, committed)
        return lambda buffers: earray.EArray(aval, physical(buffers))


class combining_dtype(dtypes.extended):
    """Base type of the combining dtypes (for jnp.issubdtype)."""


@dataclasses.dataclass(frozen=True)
class _Combining(dtypes.ExtendedDType):
    float_dtype: dtypes.DType
    op: str
    _rules: type = _Rules
    type: type = combining_dtype

    @property
    def name(self) -> str:
        return f"f{self.op}32"

    def __repr__(self) -> str:
        return self.name


fmax32 = _Combining(np.dtype(np.float32), "max")
fmin32 = _Combining(np.dtype(np.float32), "min")


def _eager_add(x, y):
    """Autodiff's accumulation of two concrete (un-jitted) combining arrays: eager `jax.grad`
    of a function using one state twice adds the uses' cotangents outside any trace."""
    if not (is_combining(x) and is_combining(y)):
        raise TypeError(f"no autodiff accumulation for {type(x).__name__} of dtype {x.dtype}")
    return _jitted_add(x, y)


_jitted_add = jax.jit(ad_util.add_jaxvals)
ad_util.raw_jaxval_adders.setdefault(earray.EArray, _eager_add)


def is_combining(x) -> bool:
    return isinstance(getattr(x, "dtype", None), _Combining)


def to_combining(x, dtype: _Combining):
    """`x` (float32) viewed in a combining dtype; unchanged if it already is one. A scale's
    view (fmin32) resolves its combined cotangent: a value that is not a scale (the uses'
    +inf / -inf of `scaling.update(combining=True)`, or +inf where no use reached it) becomes
    the old scale, so what leaves the view is always a usable scale."""
    if is_combining(x):
        return x
    x = jnp.asarray(x, jnp.float32)
    return _scale_view(x) if dtype == fmin32 else lax.convert_element_type(x, dtype)


@jax.custom_vjp
def _scale_view(x):
    return lax.convert_element_type(x, fmin32)


def _scale_view_fwd(x):
    return _scale_view(x), x


def _scale_view_bwd(old, g):
    g = lax.convert_element_type(g, jnp.float32)
    return (jnp.where(jnp.isfinite(g) & (g > 0), g, old),)


_scale_view.defvjp(_scale_view_fwd, _scale_view_bwd)


def to_float32(x):
    """The float32 value of `x` (a combining-dtype array or already float32)."""
    if is_combining(x):
        return lax.convert_element_type(x, jnp.float32)
    return x
