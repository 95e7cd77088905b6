"""`dense_general` and the `DenseGeneral` / `LayerNormDenseGeneral` modules (TE's fields).

The math is `dense_general(x, kernel, n_contract, recipe, state)`: x's trailing `n_contract`
axes contract with the kernel's leading ones, as one 2-D GEMM [M, K] @ [K, N] (laid out by
`gemm_layout.Layout`, which on Explicit mesh axes orders and shards it to pass JAX's checks). Outside FP8
autocast it is an ordinary dot in x's dtype (the kernel is cast to it); inside, it is
`flashmesh.quantization.dense` (FP8 GEMMs forward and backward, the kernel quantised from its
float32 parameter, as in TransformerEngine).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax import lax
from jaxtyping import Array, Float

from flashmesh.nn import gemm_layout, partitioning
from flashmesh.nn.layernorm import input_layernorm
from flashmesh.quantization import layouts
from flashmesh.quantization import state as qstate
from flashmesh.quantization.dense import dense as fp8_dense
from flashmesh.quantization.dense import dense_parts as fp8_dense_parts

__all__ = ["dense_general", "dense_general_parts", "DenseGeneral", "LayerNormDenseGeneral",
           "default_kernel_init", "constrain", "contracting_axes"]


def default_kernel_init() -> Callable:
    """TE's default: variance_scaling(1, 'fan_in', 'truncated_normal') with flax's default axes
    (in -2, out -1, the rest receptive field), as TE applies it to the kernel's whole shape: a
    kernel [E, 3, F] has fan-in 3E there, not E."""
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def constrain(x: jax.Array, axes) -> jax.Array:
    """A logical-axis sharding constraint on x (TE's *_input_axes); none when axes is empty."""
    if not axes:
        return x
    return nn.with_logical_constraint(x, tuple(axes))


def contracting_axes(axis: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    """Normalise `axis` (int or tuple, negative allowed) to sorted positive input axes."""
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = tuple(sorted(a % ndim for a in axes))
    if len(set(out)) != len(out) or any(not -ndim <= a < ndim for a in axes):
        raise ValueError(f"axis={axis!r} must name distinct axes of the {ndim}-D input")
    return out


def dense_general(x: Float[Array, "... K"], kernel: Float[Array, "K... N..."], n_contract: int,
                  recipe=None, state=None, bias=None, source=None) -> Float[Array, "... N..."]:
    """x's trailing `n_contract` axes contracted with kernel's leading ones, in x's dtype.

    recipe None: a dot in x's dtype; otherwise an FP8 GEMM (`flashmesh.quantization.dense`)
    with the GEMM's state (DelayedScaling) or None (current scaling). bias [N...] (or None) is
    added in x's dtype to the 2-D GEMM result, the form XLA folds into cuBLAS's bias epilogue
    (after the reshape to [..., N...] it stays a separate pass over the output). source: where x
    is a LayerNorm's output, what it is made of (`quantization.normalized.Normalization`); see
    `fp8_source`."""
    layout = _flatten(x, kernel, n_contract, bias)
    x2, k2 = layout.x2(x), layout.k2(kernel)
    if recipe is None:
        y = lax.dot_general(x2, _cast_for_gemm(k2, x.dtype), (((1,), (0,)), ((), ())),
                            out_sharding=layout.y2_sharding())
    else:
        y = fp8_dense(x2, k2, state, recipe, fp8_source(source, x2, n_contract))
    if bias is not None:
        y = y + layout.bias2(bias).astype(y.dtype)
    return layout.y(y)


def dense_general_parts(x, kernel, n_contract: int, recipe=None, state=None, bias=None,
                        source=None) -> tuple[jax.Array, ...]:
    """`dense_general` split over the kernel's first output axis: a tuple of arrays
    [..., N_rest...], y[..., i, ...] for each index i (a fused QKV projection's q, k and v).
    Under FP8 (recipe given, no typed sharding) the GEMM is `quantization.dense_parts`, whose
    backward quantises the parts' gradients where they lie instead of packing them first."""
    layout = _flatten(x, kernel, n_contract, bias)
    lead, out_shape = layout.lead, layout.out
    if len(out_shape) < 2:
        raise ValueError(f"kernel's output shape {tuple(out_shape)} must have two axes or more to split")
    if recipe is None or layout.mesh is not None:
        y = dense_general(x, kernel, n_contract, recipe, state, bias, source)
        return _split(y, len(out_shape))
    x2, k2 = layout.x2(x), layout.k2(kernel)
    flat_bias = None if bias is None else bias.reshape(-1)
    ys = fp8_dense_parts(x2, k2, flat_bias, state, recipe, out_shape[0],
                         fp8_source(source, x2, n_contract))
    return tuple(y.reshape(*lead, *out_shape[1:]) for y in ys)


def _flatten(x, kernel, n_contract, bias) -> gemm_layout.Layout:
    """The contraction's 2-D layout (`gemm_layout.Layout`), its shapes checked."""
    lead, inner = x.shape[:x.ndim - n_contract], x.shape[x.ndim - n_contract:]
    if tuple(kernel.shape[:n_contract]) != tuple(inner):
        raise ValueError(f"kernel's contracted shape {kernel.shape[:n_contract]} must equal the "
                         f"input's {inner}")
    out_shape = kernel.shape[n_contract:]
    if bias is not None and tuple(bias.shape) != tuple(out_shape):
        raise ValueError(f"bias.shape={bias.shape} must equal the kernel's output shape {out_shape}")
    return gemm_layout.Layout.of(x, kernel, n_contract)


def fp8_source(source, x2: jax.Array, n_contract: int):
    """The LayerNorm's `Normalization` an FP8 GEMM quantises x2 [M, K] from (so the LayerNorm's
    output is never written), or None: it is passed only where it describes x2 itself (one
    contracted axis, the normalised one) and the program runs on one device with no mesh (under
    a mesh, quantising from x would bypass the sharding constraints on the GEMM's input,
    `dot_input_axes`; the kernel runs on one device only anyway)."""
    if source is None or n_contract != 1 or source.x.shape != x2.shape or not layouts.one_device_program():
        return None
    return source


def _cast_for_gemm(kernel: jax.Array, dtype) -> jax.Array:
    """The kernel in the GEMM's dtype. Where that is a cast (float32 parameters, bf16 inputs),
    an optimisation barrier sits on the cast kernel, so that the weight gradient's cast back
    to float32 stays out of its GEMM: fused into it, XLA emitted a Triton GEMM with a float32
    output, about 1.3x slower than cuBLAS's bf16 GEMM (the guide's layer on an H200: 1.77 ms for
    the FFN2 weight gradient; benchmarks/results/2026-12-02-nvidia-h200-layer/profile/). The
    gradient is then the bf16 GEMM's, cast (what the jaxpr says; the fused form skipped that
    rounding)."""
    if kernel.dtype == dtype:
        return kernel
    return lax.optimization_barrier(kernel.astype(dtype))


def _split(y: jax.Array, n_features: int) -> tuple[jax.Array, ...]:
    """y [..., F0, F...] -> (y[..., 0, F...], ..., y[..., F0 - 1, F...])."""
    rest = (slice(None),) * (n_features - 1)
    return tuple(y[(..., i) + rest] for i in range(y.shape[y.ndim - n_features]))


def _features(features) -> tuple[int, ...]:
    return (features,) if isinstance(features, int) else tuple(features)


class _Projection(nn.Module):
    """What DenseGeneral and LayerNormDenseGeneral share: kernel, bias, LoRA, the GEMM."""

    def project(self, x, axes: tuple[int, ...], postfix: str = "", source=None):
        """y = x @ kernel (+ bias, + LoRA) over `axes`; with `split_features` the tuple of
        y[..., i, ...] over the first features axis."""
        features = _features(self.features)
        if self.split_features and len(features) < 2:
            raise ValueError(f"split_features needs two features axes or more, "
                             f"got features={self.features!r}")
        if axes != tuple(range(x.ndim - len(axes), x.ndim)):  # contracted axes go last
            x = jnp.moveaxis(x, axes, tuple(range(x.ndim - len(axes), x.ndim)))
            source = None  # it describes x's original layout
        n_in = len(axes)
        in_shape = x.shape[x.ndim - n_in:]
        init = self.kernel_init or default_kernel_init()
        kernel = partitioning.param(self, "kernel", init, (*in_shape, *features), self.dtype,
                                    self.kernel_axes)
        recipe, state = qstate.gemm_state(self, postfix)
        # Parameters in TE's order (kernel, bias, LoRA): the order fixes their init keys.
        bias = None
        if self.use_bias:
            bias = partitioning.param(self, "bias", self.bias_init, features, self.dtype,
                                      self.bias_axes)
        lora = self._lora(x, in_shape, features) if self.enable_low_rank_adaptation else None
        if self.split_features and lora is None:
            return dense_general_parts(x, kernel, n_in, recipe, state, bias, source)
        y = dense_general(x, kernel, n_in, recipe, state, bias, source)
        y = y if lora is None else y + lora
        return _split(y, len(features)) if self.split_features else y

    def _lora(self, x, in_shape, features) -> jax.Array:
        """TE's low-rank adaptation, one adapter per leading output index (a fused QKV
        projection gets one per q, k, v): A [in..., lead..., r], B [lead..., r, last]
        (B starts at zero); x A B * alpha / r, in x's dtype."""
        r, lead = self.low_rank_adaptation_dim, tuple(features[:-1])
        a_shape, b_shape = (*in_shape, *lead, r), (*lead, r, features[-1])
        # unsharded, as TE's (logical axes all None)
        a = partitioning.param(self, "lora_a_kernel", self.kernel_init or default_kernel_init(),
                               a_shape, self.dtype, (None,) * len(a_shape))
        b = partitioning.param(self, "lora_b_kernel", nn.initializers.zeros, b_shape, self.dtype,
                               (None,) * len(b_shape))
        h = dense_general(x, a, len(in_shape))                               # [..., lead..., r]
        n_lead = math.prod(lead)
        h = h.reshape(*h.shape[:h.ndim - len(lead) - 1], n_lead, r)
        y = jnp.einsum("...lr,lrf->...lf", h, b.reshape(n_lead, r, features[-1]).astype(h.dtype))
        y = y.reshape(*y.shape[:-2], *features)
        alpha = self.low_rank_adaptation_alpha
        return y if alpha is None else y * jnp.asarray(alpha / r, y.dtype)


def _no_checkpoint_name(module) -> None:
    if module.quantization_checkpoint_name is not None:
        raise NotImplementedError("quantization_checkpoint_name: flashmesh saves the quantised "
                                  "operands as its FP8 GEMM's residuals; naming them for remat "
                                  "policies is not supported")


class DenseGeneral(_Projection):
    """y = x @ kernel (+ bias) over `axis` (TransformerEngine's `DenseGeneral`).

    Attributes:
      features: output shape (int or tuple); kernel is [x.shape[axis]..., features...].
      kernel_init: None = variance_scaling(1, 'fan_in', 'truncated_normal') over the kernel's
        shape with flax's default axes, as TE (a [E, 3, F] kernel has fan-in 3E); LoRA's A
        kernel takes it too.
      kernel_axes, bias_axes: logical axis names of kernel and bias.
      use_bias: add `bias` [features...] (TE's default True).
      bias_init: the bias initialiser.
      enable_low_rank_adaptation, low_rank_adaptation_dim, low_rank_adaptation_alpha: LoRA.
      axis: the contracted input axes (int or tuple).
      dtype: the parameters' dtype; the GEMM runs in the input's dtype, or FP8 under autocast.
      input_axes: logical sharding constraint on the input.
      transpose_batch_sequence: accepted (the GEMM does not care which leading axis is which).
      quantization_checkpoint_name: None (a name raises NotImplementedError).
      split_features: return y as the tuple of y[..., i, ...] over the first of two or more
        features axes (flashmesh's field: a fused QKV projection's q, k, v). Under FP8 autocast
        the GEMM's gradient is then quantised from the parts as they come back, not packed first
        (`quantization.dense_parts`; its bias gradient is a float32 sum), except with LoRA or
        operands sharded in their types (Explicit mesh axes), where the split follows the GEMM.

    Example:
      >>> y = DenseGeneral(features=3 * 4096, use_bias=True).apply(variables, x)  # x [B, T, 4096]
    """

    features: int | tuple[int, ...]
    kernel_init: Callable | None = None
    kernel_axes: tuple[str, ...] = ()
    use_bias: bool = True
    bias_init: Callable = nn.initializers.zeros
    bias_axes: tuple[str, ...] = ()
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    axis: int | tuple[int, ...] = -1
    dtype: Any = jnp.float32
    input_axes: tuple[str, ...] = ()
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: str | None = None
    split_features: bool = False

    @nn.compact
    def __call__(self, inputs: jax.Array):
        _no_checkpoint_name(self)
        inputs = constrain(inputs, self.input_axes)
        return self.project(inputs, contracting_axes(self.axis, inputs.ndim))


class LayerNormDenseGeneral(_Projection):
    """LayerNorm (optional) then DenseGeneral (TransformerEngine's `LayerNormDenseGeneral`).

    Attributes: those of LayerNorm (layernorm_type, epsilon, zero_centered_gamma, scale_init,
    scale_axes, ln_bias_init, ln_bias_axes) and DenseGeneral (features, kernel_*, use_bias (TE
    default False), bias_*, LoRA, axis, dtype), plus:
      enable_layernorm: apply the LayerNorm first (its params `scale`, `ln_bias`).
      return_layernorm_output: also return the normalised input (else None).
      layernorm_input_axes, dot_input_axes: logical sharding constraints.
      depth_scaling: divide the output by this (None: no scaling).
      split_features: y as a tuple over the first features axis, as DenseGeneral's.

    Returns (y, layernorm output or None).

    Example:
      >>> qkv, _ = LayerNormDenseGeneral(features=3 * 4096, epsilon=1e-5, use_bias=True).apply(v, x)
    """

    features: int | tuple[int, ...]
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Callable | None = None
    scale_axes: tuple[str, ...] = ("embed",)
    ln_bias_init: Callable = nn.initializers.zeros
    ln_bias_axes: tuple[str, ...] = ("embed",)
    kernel_init: Callable | None = None
    kernel_axes: tuple[str, ...] = ()
    use_bias: bool = False
    bias_init: Callable = nn.initializers.zeros
    bias_axes: tuple[str, ...] = ()
    return_layernorm_output: bool = False
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    axis: int | tuple[int, ...] = -1
    dtype: Any = jnp.float32
    layernorm_input_axes: tuple[str, ...] | None = None
    dot_input_axes: tuple[str, ...] | None = None
    depth_scaling: float | None = None
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: str | None = None
    split_features: bool = False

    @nn.compact
    def __call__(self, inputs: jax.Array) -> tuple[jax.Array | tuple[jax.Array, ...], jax.Array | None]:
        _no_checkpoint_name(self)
        x, source = input_layernorm(self, constrain(inputs, self.layernorm_input_axes)
                                    if self.enable_layernorm else inputs)
        ln_out = x if self.return_layernorm_output else None
        x = constrain(x, self.dot_input_axes)
        y = self.project(x, contracting_axes(self.axis, x.ndim), source=source)
        if self.depth_scaling is not None:
            y = jax.tree.map(lambda t: t / jnp.asarray(self.depth_scaling, t.dtype), y)
        return y, ln_out
