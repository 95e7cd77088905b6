"""`layernorm` and the `LayerNorm` module (TransformerEngine's fields and parameter names).

    layernorm:  y = (x - mean) / sqrt(var + eps) * gamma + beta
    rmsnorm:    y = x / sqrt(mean(x^2) + eps) * gamma
    zero_centered_gamma: gamma is stored as (gamma - 1), initialised to 0, so weight decay pulls
                         the layer towards the identity

over the last axis, computed in float32 and returned in x's dtype (`layernorm_vjp.normalize`:
LayerNorm's backward is one Pallas kernel on a lone CUDA device, autodiff elsewhere).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from jaxtyping import Array, Float

from flashmesh.nn import partitioning
from flashmesh.nn.layernorm_vjp import along_features, normalize, statistics
from flashmesh.quantization.normalized import Normalization

__all__ = ["layernorm", "LayerNorm", "LAYERNORM_TYPES", "layernorm_params", "expand", "input_layernorm",
           "normalization"]

LAYERNORM_TYPES = ("layernorm", "rmsnorm")


def check_layernorm_type(layernorm_type: str) -> str:
    """The canonical name of a normalisation type, as TE's `canonicalize_norm_type` reads it:
    case, '-' and '_' ignored ("RMSNorm", "rms_norm" -> "rmsnorm"); ValueError otherwise."""
    canonical = (layernorm_type.lower().replace("-", "").replace("_", "")
                 if isinstance(layernorm_type, str) else layernorm_type)
    if canonical not in LAYERNORM_TYPES:
        raise ValueError(f"layernorm_type must be one of {LAYERNORM_TYPES} (case, '-' and '_' "
                         f"ignored), got {layernorm_type!r}")
    return canonical


def layernorm(x: Float[Array, "... H"], scale: Float[Array, "H"], bias: Float[Array, "H"] | None, *,
              layernorm_type: str = "layernorm", epsilon: float = 1e-6,
              zero_centered_gamma: bool = False) -> Float[Array, "... H"]:
    """LayerNorm or RMSNorm of x over its last axis (float32 inside, x's dtype out).

    Args:
      x: [..., H] input.
      scale: [H] gamma (gamma - 1 when zero_centered_gamma).
      bias: [H] beta for "layernorm"; None for "rmsnorm" (which has none).
      layernorm_type: "layernorm" or "rmsnorm".
      epsilon: added to the variance.
      zero_centered_gamma: scale holds gamma - 1.

    Example:
      >>> y = layernorm(x, jnp.ones(64), jnp.zeros(64), epsilon=1e-5)
    """
    layernorm_type = check_layernorm_type(layernorm_type)
    gamma = scale.astype(jnp.float32)
    if zero_centered_gamma:
        gamma = gamma + 1.0
    return normalize(x, gamma, bias, rms=layernorm_type == "rmsnorm", epsilon=epsilon)


def expand(v: jax.Array, ndim: int) -> jax.Array:
    """v with leading unit axes up to `ndim` (explicit, so rank promotion may be an error)."""
    return v.reshape((1,) * (ndim - v.ndim) + v.shape)


def layernorm_params(module: nn.Module, features: int, *, layernorm_type: str,
                     zero_centered_gamma: bool, scale_init: Callable | None, scale_axes,
                     bias_init: Callable, bias_axes, dtype, scale_name: str = "scale",
                     bias_name: str = "ln_bias"):
    """Declare (scale, bias or None) on `module` under TE's names and logical axes."""
    layernorm_type = check_layernorm_type(layernorm_type)
    if scale_init is None:
        scale_init = nn.initializers.zeros if zero_centered_gamma else nn.initializers.ones
    scale = partitioning.param(module, scale_name, scale_init, (features,), dtype, scale_axes)
    bias = None
    if layernorm_type == "layernorm":
        bias = partitioning.param(module, bias_name, bias_init, (features,), dtype, bias_axes)
    return scale, bias


def input_layernorm(module: nn.Module, x: jax.Array) -> tuple[jax.Array, Normalization | None]:
    """The optional LayerNorm in front of LayerNormDenseGeneral and LayerNormMLP, read from
    the module's TE fields (enable_layernorm, layernorm_type, epsilon, zero_centered_gamma,
    scale_init, scale_axes, ln_bias_init, ln_bias_axes, dtype): (y, what y is made of over
    [rows, H], for an FP8 GEMM to quantise y from x: `quantization.normalized`); (x, None)
    when disabled."""
    if not module.enable_layernorm:
        return x, None
    scale, bias = layernorm_params(
        module, x.shape[-1], layernorm_type=module.layernorm_type,
        zero_centered_gamma=module.zero_centered_gamma, scale_init=module.scale_init,
        scale_axes=module.scale_axes, bias_init=module.ln_bias_init, bias_axes=module.ln_bias_axes,
        dtype=module.dtype)
    args = dict(layernorm_type=module.layernorm_type, epsilon=module.epsilon,
                zero_centered_gamma=module.zero_centered_gamma)
    return layernorm(x, scale, bias, **args), normalization(x, scale, bias, **args)


def normalization(x: jax.Array, scale: jax.Array, bias: jax.Array | None, *, layernorm_type: str,
                  epsilon: float, zero_centered_gamma: bool) -> Normalization:
    """What `layernorm(x, scale, bias, ...)` is made of, over x flattened to [rows, H]: its
    input, row statistics and float32 gamma and beta (`quantization.normalized.Normalization`;
    the statistics are the LayerNorm's own operations, which XLA computes once)."""
    rms = check_layernorm_type(layernorm_type) == "rmsnorm"
    gamma = scale.astype(jnp.float32)
    if zero_centered_gamma:  # as `layernorm` (adding 0.0 would turn a -0.0 gamma into +0.0)
        gamma = gamma + 1.0
    gamma, bias = along_features(gamma, x), along_features(bias, x)
    mean, rstd = statistics(x, rms=rms, epsilon=epsilon)
    H = x.shape[-1]
    return Normalization(x.reshape(-1, H), None if rms else mean.reshape(-1, 1), rstd.reshape(-1, 1),
                         gamma, None if bias is None else bias.astype(jnp.float32))


class LayerNorm(nn.Module):
    """LayerNorm / RMSNorm over the last axis (TransformerEngine's `LayerNorm`).

    Attributes:
      epsilon: added to the variance (TE default 1e-6).
      layernorm_type: "layernorm" or "rmsnorm".
      zero_centered_gamma: store gamma - 1 (initialised to 0).
      scale_init: gamma's initialiser (None: ones, or zeros when zero-centred).
      scale_axes, bias_axes: logical axis names of the parameters.
      bias_init: beta's initialiser.
      dtype: the parameters' dtype (computation follows the input's dtype).
      transpose_batch_sequence: accepted (the last axis is normalised either way).

    Parameters: `scale` [H], `ln_bias` [H] (layernorm only).

    Example:
      >>> y = LayerNorm(epsilon=1e-5).apply(variables, x)     # x [B, T, H]
    """

    epsilon: float = 1e-6
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    scale_init: Callable | None = None
    scale_axes: tuple[str, ...] = ("embed",)
    bias_init: Callable = nn.initializers.zeros
    bias_axes: tuple[str, ...] = ("embed",)
    dtype: Any = jnp.float32
    transpose_batch_sequence: bool = False

    @nn.compact
    def __call__(self, x: Float[Array, "... H"]) -> Float[Array, "... H"]:
        scale, bias = layernorm_params(
            self, x.shape[-1], layernorm_type=self.layernorm_type,
            zero_centered_gamma=self.zero_centered_gamma, scale_init=self.scale_init,
            scale_axes=self.scale_axes, bias_init=self.bias_init, bias_axes=self.bias_axes,
            dtype=self.dtype)
        return layernorm(x, scale, bias, layernorm_type=self.layernorm_type, epsilon=self.epsilon,
                         zero_centered_gamma=self.zero_centered_gamma)
