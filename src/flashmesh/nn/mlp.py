"""The `LayerNormMLP` module (TransformerEngine's fields and parameter names). Its activations
and TE's `activation` function live in `flashmesh.nn.activations`.

    LayerNormMLP(x) = dropout(act(layernorm(x) @ wi + wi_bias)) @ wo + wo_bias

with `wi_kernel` [H, n, F] for n = len(activations): one activation, e.g. ('gelu',), or a
gated pair, e.g. ('gelu', 'linear') (GeGLU), ('silu', 'linear') (SwiGLU) or GPT-OSS's
('clamped_silu', 'clamped_linear') with `activation_params`, where
act(h) = f(h[..., 0, :]) * g(h[..., 1, :]). Under FP8 autocast both GEMMs run in FP8 with
their own state (postfixes "_0" and "_1").
"""

from __future__ import annotations

from collections.abc import Mapping

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from flashmesh.nn.activations import (ACTIVATIONS, CLAMPED, ActivationParams, activation,
                                      activation_functions, activation_names)
from flashmesh.nn.dense import constrain, default_kernel_init, dense_general, fp8_source
from flashmesh.nn import partitioning
from flashmesh.nn.dropout import Dropout
from flashmesh.nn.layernorm import input_layernorm
from flashmesh.quantization import layouts
from flashmesh.quantization import state as qstate
from flashmesh.quantization.mlp import fp8_mlp
from flashmesh.quantization.recipe import DelayedScaling

__all__ = ["ACTIVATIONS", "activation", "LayerNormMLP"]  # the first two from nn.activations

def _per_block(init: Callable, n: int) -> Callable:
    """TE's `kernel_1_init`: wi_kernel [H, n, F] as n independent draws of `init` over [H, F]
    (each block its own fan-in H), keys split in turn, stacked on axis -2."""
    def draw(key, shape, dtype):
        H, _, F = shape
        blocks = []
        for _ in range(n):
            key, block_key = jax.random.split(key)
            blocks.append(init(block_key, (H, F), dtype))
        return jnp.stack(blocks, axis=-2)
    return draw


def _mlp_activation_names(activations) -> tuple[str, ...]:
    """LayerNormMLP's order, TE's: a pair given linear first, ('linear', 'gelu') or
    ('clamped_linear', 'clamped_silu'), is the gated pair ('gelu', 'linear'), gelu(h0) * h1
    (TE reverses it before use)."""
    names = activation_names(activations)
    return names[::-1] if names[0] in ("linear", "clamped_linear") else names


@jax.custom_vjp
def _stored_forward(x: jax.Array) -> jax.Array:
    """x, stored in its own dtype (an optimization barrier) in the forward; the cotangent
    passes through untouched."""
    return jax.lax.optimization_barrier(x)


_stored_forward.defvjp(lambda x: (jax.lax.optimization_barrier(x), None), lambda _, g: (g,))


@jax.custom_vjp
def _stored_backward(x: jax.Array) -> jax.Array:
    """x; its cotangent stored in its own dtype (an optimization barrier) in the backward."""
    return x


_stored_backward.defvjp(lambda x: (x, None), lambda _, g: (jax.lax.optimization_barrier(g),))


class LayerNormMLP(nn.Module):
    """LayerNorm, then a two-GEMM MLP with (gated) activation (TransformerEngine's `LayerNormMLP`).

    Attributes:
      intermediate_dim: F, the hidden width.
      enable_layernorm, layernorm_type, epsilon, zero_centered_gamma, scale_init, scale_axes,
        ln_bias_init, ln_bias_axes: the LayerNorm (params `scale`, `ln_bias`).
      kernel_init: None = variance_scaling(1, 'fan_in', 'truncated_normal'); wi_kernel's blocks
        [H, F] are drawn one by one (TE's kernel_1_init).
      kernel_axes_1, kernel_axes_2: logical axes of wi_kernel [H, n, F] and wo_kernel [F, H].
      use_bias, bias_init, bias_axes_1, bias_axes_2: wi_bias [n, F], wo_bias [H].
      return_layernorm_output: also return the normalised input (else None).
      activations: one name or a gated pair (see `activation`); a pair given linear first,
        ('linear', 'gelu'), is reversed as TE reverses it (gelu(h0) * h1); a name outside
        flashmesh's table is flax.linen's function of that name (TE's rule).
      activation_params: the activations' parameters as TE's dict, None for the defaults: for
        GPT-OSS's clamped SwiGLU ('clamped_silu', 'clamped_linear'), {'limit': 7.0, 'alpha': 1.702}
        (`flashmesh.nn.activations.ActivationParams.create`).
      intermediate_dropout_rng_name, intermediate_dropout_rate, intermediate_hidden_dropout_dims:
        dropout on the activation's output (broadcast along the given dims).
      enable_low_rank_adaptation, low_rank_adaptation_dim (32), low_rank_adaptation_alpha (None):
        TE's LoRA on both GEMMs (wi_lora_a_kernel [H, n, r], wi_lora_b_kernel [n, r, F],
        wo_lora_a_kernel [F, r], wo_lora_b_kernel [r, H]; B starts at zero), added in the
        input's dtype beside the (FP8 under autocast) GEMMs, scaled by alpha / r.
      axis: -1 only (as in TE).
      dtype: the parameters' dtype; GEMMs run in the input's dtype, or FP8 under autocast.
      layernorm_input_axes, dot_1_input_axes, dot_2_input_axes: logical sharding constraints.
      ffn1_ckpt_name, ffn2_ckpt_name: remat names of the two GEMMs' outputs.
      transpose_batch_sequence: accepted (the MLP does not care).

    Call: (x, deterministic=False) -> (y, layernorm output or None).

    Example:
      >>> y, _ = LayerNormMLP(intermediate_dim=16384, epsilon=1e-5, use_bias=True)(x, deterministic=True)
    """

    intermediate_dim: int = 2048
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Callable | None = None
    scale_axes: tuple[str, ...] = ("embed",)
    ln_bias_init: Callable = nn.initializers.zeros
    ln_bias_axes: tuple[str, ...] = ("embed",)
    kernel_init: Callable | None = None
    kernel_axes_1: tuple[str, ...] = ("embed", "act", "mlp")
    kernel_axes_2: tuple[str, ...] = ("mlp", "embed")
    use_bias: bool = False
    bias_init: Callable = nn.initializers.zeros
    bias_axes_1: tuple[str, ...] = ("act", "mlp")
    bias_axes_2: tuple[str, ...] = ("embed",)
    return_layernorm_output: bool = False
    activations: Sequence[str | Callable] = ("gelu",)
    activation_params: dict | None = None
    intermediate_dropout_rng_name: str = "dropout"
    intermediate_dropout_rate: float = 0.0
    intermediate_hidden_dropout_dims: Sequence[int] = ()
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    axis: int = -1
    dtype: Any = jnp.float32
    layernorm_input_axes: tuple[str, ...] | None = None
    dot_1_input_axes: tuple[str, ...] | None = None
    dot_2_input_axes: tuple[str, ...] | None = None
    ffn1_ckpt_name: str = "ffn1"
    ffn2_ckpt_name: str = "ffn2"
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: str | None = None

    def _param(self, name, init, shape, axes):
        return partitioning.param(self, name, init, shape, self.dtype, axes)

    def _lora(self, x, prefix, a_lead, b_out, blocks):
        """TE's LayerNormMLP low-rank adaptation: `{prefix}_lora_a_kernel` [in, lead..., r] (the
        kernel_init, block by block for wi as its kernel) and `{prefix}_lora_b_kernel`
        [lead..., r, out] (zeros); x A B * alpha / r (1 without alpha), in x's dtype, not FP8."""
        r = self.low_rank_adaptation_dim
        init = self.kernel_init or default_kernel_init()
        a_init = _per_block(init, blocks) if blocks else init
        # unsharded, as TE's (logical axes all None)
        a = self._param(f"{prefix}_lora_a_kernel", a_init, (*a_lead, r), (None,) * (len(a_lead) + 1))
        b = self._param(f"{prefix}_lora_b_kernel", nn.initializers.zeros, (*b_out[:-1], r, b_out[-1]),
                        (None,) * (len(b_out) + 1))
        a, b = a.astype(x.dtype), b.astype(x.dtype)
        y = (jnp.einsum("...h,hnr,nrf->...nf", x, a, b) if blocks else
             jnp.einsum("...f,fr,rh->...h", x, a, b))
        alpha = self.low_rank_adaptation_alpha
        return y if alpha is None else y * jnp.asarray(alpha / r, y.dtype)

    def _fused(self, x, recipe, names, deterministic) -> bool:
        """Whether the FP8 MLP runs as one `quantization.mlp.fp8_mlp` (activation fused with
        the quantisations): DelayedScaling, activations from flashmesh's table, no LoRA, no
        active intermediate dropout, and no Explicit mesh axes or `shard_map` around the call
        (whose shardings and sums `dense` handles)."""
        if not isinstance(recipe, DelayedScaling) or self.enable_low_rank_adaptation:
            return False
        if self.intermediate_dropout_rate > 0 and not deterministic:
            return False
        if any(name not in ACTIVATIONS and name not in CLAMPED for name in names):
            return False
        mesh = jax.sharding.get_abstract_mesh()
        return not layouts.typed_sharding(x) and (mesh.empty or not mesh.manual_axes)

    def _fused_call(self, x, wi, wi_bias, wo, wo_bias, recipe, state_0, fns, source):
        """The FP8 MLP as one fused function. States are created in the unfused path's order;
        `ffn1_ckpt_name` names nothing here (h is the function's own residual).
        source: the LayerNorm's `Normalization` (x quantised from its input; `dense.fp8_source`)."""
        hidden, n, F = wi.shape
        _, state_1 = qstate.gemm_state(self, "_1")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, hidden)
        y = fp8_mlp(x2, wi.reshape(hidden, n * F),
                    None if wi_bias is None else wi_bias.reshape(n * F), wo, state_0, state_1, recipe,
                    fns, fp8_source(source, x2, 1))
        if wo_bias is not None:
            y = y + wo_bias.reshape(1, hidden).astype(y.dtype)
        return checkpoint_name(y.reshape(*lead, hidden), self.ffn2_ckpt_name)

    @nn.compact
    def __call__(self, inputs: jax.Array, deterministic: bool = False):
        if self.axis not in (-1, inputs.ndim - 1):
            raise ValueError(f"axis must be -1 (the last axis), got {self.axis}")
        if any(callable(a) for a in self.activations):
            raise NotImplementedError("callable activations: pass names (see flashmesh.nn.activations)")
        if self.quantization_checkpoint_name is not None:
            raise NotImplementedError("quantization_checkpoint_name is not supported (see DenseGeneral)")
        names = _mlp_activation_names(self.activations)
        if self.activation_params is not None and not isinstance(self.activation_params, Mapping):
            raise ValueError(f"activation_params must be a dict or None, got "
                             f"{type(self.activation_params).__name__}")
        params = ActivationParams.create(names, **(self.activation_params or {}))
        x, source = input_layernorm(self, constrain(inputs, self.layernorm_input_axes)
                                    if self.enable_layernorm else inputs)
        ln_out = x if self.return_layernorm_output else None
        hidden, n, F = x.shape[-1], len(names), self.intermediate_dim

        x = constrain(x, self.dot_1_input_axes)
        wi_init = _per_block(self.kernel_init or default_kernel_init(), n)
        # the parameters in TE's order (it fixes their init keys): kernels, biases, then LoRA
        wi = self._param("wi_kernel", wi_init, (hidden, n, F), self.kernel_axes_1)
        wo = self._param("wo_kernel", self.kernel_init or default_kernel_init(), (F, hidden),
                         self.kernel_axes_2)
        wi_bias = wo_bias = None
        if self.use_bias:
            wi_bias = self._param("wi_bias", self.bias_init, (n, F), self.bias_axes_1)
            wo_bias = self._param("wo_bias", self.bias_init, (hidden,), self.bias_axes_2)
        recipe, state = qstate.gemm_state(self, "_0")
        if self._fused(x, recipe, names, deterministic):
            return self._fused_call(x, wi, wi_bias, wo, wo_bias, recipe, state,
                                    activation_functions(names, params), source), ln_out
        h = dense_general(x, wi, 1, recipe, state, wi_bias, source)    # [..., n, F]
        if self.enable_low_rank_adaptation:  # TE's: x A B * alpha / r beside the GEMM, one per block
            h = h + self._lora(x, "wi", (hidden, n), (n, F), n)
        h = checkpoint_name(h, self.ffn1_ckpt_name)
        fp8 = recipe is not None
        # Under FP8 the activation's float32 arithmetic met the FP8 GEMMs' amax-and-quantise
        # fusions, which XLA did not merge with it (GELU's tanh): it stored the activation's
        # output, and in the backward its input's cotangent, as float32 [..., F] arrays
        # (loop_multiply_fusion / loop_add_fusion in
        # benchmarks/results/2026-12-02-nvidia-h200-bwd-columns/train_step_fp8.hlo.txt.gz).
        # Both are stored in the activations' dtype instead: half the bytes written and read.
        h = _stored_backward(h) if fp8 else h
        a = activation(h, names, act_params=params)   # [..., F]
        a = _stored_forward(a) if fp8 else a
        a = Dropout(rate=self.intermediate_dropout_rate,
                    broadcast_dims=tuple(self.intermediate_hidden_dropout_dims),
                    rng_collection=self.intermediate_dropout_rng_name)(a, deterministic=deterministic)

        a = constrain(a, self.dot_2_input_axes)
        recipe, state = qstate.gemm_state(self, "_1")
        y = dense_general(a, wo, 1, recipe, state, wo_bias)
        if self.enable_low_rank_adaptation:
            y = y + self._lora(a, "wo", (F,), (hidden,), None)
        y = checkpoint_name(y, self.ffn2_ckpt_name)
        return y, ln_out
