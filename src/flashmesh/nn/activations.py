"""The MLP activations by name, with TransformerEngine's names and parameters, and TE's
`activation` function.

A name is one of `ACTIVATIONS` ('gelu' is the tanh form, as TE's), GPT-OSS's clamped SwiGLU
pair ('clamped_silu', 'clamped_linear'), whose limit and alpha come from `ActivationParams`,
or else flax.linen's function of that name (TE's rule). Functions are values (frozen
dataclasses where they carry parameters), so equal activations compare and hash equal under
jit.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from flashmesh.quantization.activation import gelu_tanh

__all__ = ["ACTIVATIONS", "ActivationParams", "ClampedSwigluParams", "activation",
           "activation_functions", "activation_names"]

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": gelu_tanh,   # TE's gelu is the tanh form
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "squared_relu": lambda x: jnp.square(jax.nn.relu(x)),
    "linear": lambda x: x,
}
CLAMPED = ("clamped_silu", "clamped_linear")


@dataclasses.dataclass(frozen=True)
class ClampedSwigluParams:
    """GPT-OSS's clamped SwiGLU (TE's names and defaults): clamped_silu(x) = m sigmoid(alpha m)
    with m = min(x, limit); clamped_linear(x) = clip(x, -limit, limit) + 1."""

    limit: float = 7.0
    alpha: float = 1.702


@dataclasses.dataclass(frozen=True)
class ActivationParams:
    """The activations' parameters (TE's `ActivationParams`; only the clamped SwiGLU has any)."""

    clamped_swiglu: ClampedSwigluParams = ClampedSwigluParams()

    @staticmethod
    def create(activation_type, **kwargs) -> "ActivationParams":
        """TE's factory: kwargs (limit, alpha) are the clamped SwiGLU's; ValueError for
        parameters given to activations that take none."""
        names = (activation_type,) if isinstance(activation_type, str) else tuple(activation_type)
        if not kwargs:
            return ActivationParams()
        if not any(isinstance(n, str) and n.lower() in CLAMPED for n in names):
            raise ValueError(f"activation_params={kwargs!r}: activations {names!r} take no "
                             f"parameters (only {CLAMPED!r} do)")
        unknown = set(kwargs) - {f.name for f in dataclasses.fields(ClampedSwigluParams)}
        if unknown:
            raise ValueError(f"activation_params: unknown {sorted(unknown)}; expected 'limit', 'alpha'")
        return ActivationParams(ClampedSwigluParams(**kwargs))


@dataclasses.dataclass(frozen=True)
class _ClampedSilu:
    limit: float
    alpha: float

    def __call__(self, x):  # Python floats (weakly typed): x's dtype, and Triton lowers them
        m = jnp.minimum(x, float(self.limit))
        return m * jax.nn.sigmoid(float(self.alpha) * m)


@dataclasses.dataclass(frozen=True)
class _ClampedLinear:
    limit: float

    def __call__(self, x):
        return jnp.clip(x, -float(self.limit), float(self.limit)) + 1.0


def _act_fn(name: str, params: ActivationParams):
    """The activation of a name: flashmesh's table, the clamped pair with `params`, else
    flax.linen's function of that name, else None."""
    if name in ACTIVATIONS:
        return ACTIVATIONS[name]
    if name == "clamped_silu":
        return _ClampedSilu(params.clamped_swiglu.limit, params.clamped_swiglu.alpha)
    if name == "clamped_linear":
        return _ClampedLinear(params.clamped_swiglu.limit)
    fn = getattr(nn, name, None)
    return fn if callable(fn) and not isinstance(fn, type) else None


def activation_names(activation_type) -> tuple[str, ...]:
    """activation_type as lower-case names, checked: one activation or a gated pair."""
    names = tuple(a.lower() if isinstance(a, str) else a for a in activation_type)
    if not 1 <= len(names) <= 2:
        raise ValueError(f"activation_type must hold one activation or a gated pair, got {activation_type!r}")
    unknown = [a for a in names if not isinstance(a, str) or _act_fn(a, ActivationParams()) is None]
    if unknown:
        raise ValueError(f"activation_type: unknown {unknown}; expected names from "
                         f"{sorted(ACTIVATIONS) + list(CLAMPED)} or a flax.linen activation")
    return names


def activation_functions(names: Sequence[str], params: ActivationParams | None = None) -> tuple[Callable, ...]:
    """The functions of checked names (`activation_names`), with `params` (None: defaults)."""
    params = ActivationParams() if params is None else params
    return tuple(_act_fn(name, params) for name in names)


def activation(x: jax.Array, activation_type: Sequence[str] = ("gelu",), quantizer=None,
               act_params: ActivationParams | None = None) -> jax.Array:
    """TE's `activation`: x [..., n, F] with n = len(activation_type) -> [..., F].

    One activation applies to x[..., 0, :]; a pair multiplies the first applied to x[..., 0, :]
    by the second applied to x[..., 1, :] (gated: ('gelu', 'linear') is GeGLU, ('clamped_silu',
    'clamped_linear') GPT-OSS's SwiGLU with act_params' limit and alpha). Computed in float32,
    returned in x's dtype.

    Example:
      >>> y = activation(h.reshape(*h.shape[:-1], 1, h.shape[-1]), ("gelu",))
    """
    if quantizer is not None:
        raise NotImplementedError("activation(quantizer=...): flashmesh quantises a GEMM's input "
                                  "inside the GEMM; pass quantizer=None")
    if act_params is not None and not isinstance(act_params, ActivationParams):
        raise ValueError(f"act_params must be an ActivationParams or None, got {type(act_params).__name__}")
    names = activation_names(activation_type)
    if x.ndim < 2 or x.shape[-2] != len(names):
        raise ValueError(f"activation: x.shape[-2] must equal len(activation_type)={len(names)}, "
                         f"got x.shape={x.shape}")
    return _activation_rematerialised(x, activation_functions(names, act_params))


@functools.partial(jax.checkpoint, static_argnums=(1,), policy=jax.checkpoint_policies.nothing_saveable)
def _activation_rematerialised(x: jax.Array, fns: tuple[Callable, ...]) -> jax.Array:
    """The activation in float32, in x's dtype. Under autodiff only x is kept for the
    backward, which recomputes the float32 intermediates inside its own fusion (as TE's
    kernels do): otherwise XLA keeps them (e.g. GELU's tanh) as float32 arrays, twice the
    bytes of the input (at the guide's size 0.8 GB of traffic per step: the GELU fusion of
    benchmarks/results/2026-12-02-nvidia-h200-layer/profile/ba2dd47-*.hlo)."""
    xf = x.astype(jnp.float32)
    y = fns[0](xf[..., 0, :])
    if len(fns) == 2:
        y = y * fns[1](xf[..., 1, :])
    return y.astype(x.dtype)
