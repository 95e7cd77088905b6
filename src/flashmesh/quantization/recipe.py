"""FP8 recipes: TransformerEngine's `transformer_engine.common.recipe` names, as frozen data.

A recipe says how tensors are scaled into FP8; `flashmesh.quantization.autocast` makes one
current for a block of code. Field names and defaults are TransformerEngine's, with its
environment-variable defaults replaced by plain arguments (flashmesh reads no environment).

    Format.HYBRID    e4m3 (max 448) for activations and weights, e5m2 (max 57344) for gradients
    Format.E4M3      e4m3 everywhere
    DelayedScaling   per-tensor scales from a history of amaxes (state in `fp8_metas`)
    Float8CurrentScaling  per-tensor scales from the tensor itself (no state)
    MXFP8BlockScaling, NVFP4BlockScaling  block-scaled formats of Blackwell GPUs (refused on
                     Hopper and older, with the generation they need)
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple

import jax.numpy as jnp

__all__ = ["Format", "MMParams", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
           "NVFP4BlockScaling", "Recipe"]


class _FormatHelper(NamedTuple):
    """A format's largest magnitudes forward and backward (TE's `Format.X.value`)."""

    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """FP8 formats as (forward dtype, backward dtype); `.value` is TE's (max_fwd, max_bwd)."""

    E4M3 = _FormatHelper(448.0, 448.0)
    E5M2 = _FormatHelper(57344.0, 57344.0)
    HYBRID = _FormatHelper(448.0, 57344.0)
    E2M1 = _FormatHelper(6.0, 6.0)

    @property
    def forward_dtype(self):
        """The dtype of activations and weights (the forward GEMM's operands)."""
        return {Format.E4M3: jnp.float8_e4m3fn, Format.HYBRID: jnp.float8_e4m3fn,
                Format.E5M2: jnp.float8_e5m2}.get(self) or _no_fp4()

    @property
    def backward_dtype(self):
        """The dtype of gradients (the backward GEMMs' cotangent operand)."""
        return {Format.E4M3: jnp.float8_e4m3fn, Format.HYBRID: jnp.float8_e5m2,
                Format.E5M2: jnp.float8_e5m2}.get(self) or _no_fp4()

    @property
    def max_fwd(self) -> float:
        return self.value[0]

    @property
    def max_bwd(self) -> float:
        return self.value[1]


def _no_fp4():
    raise NotImplementedError("Format.E2M1 is NVFP4's element format: its GEMMs need a Blackwell "
                              "GPU (sm100) and are not available in flashmesh")


class Recipe:
    """The base of the recipes, with TransformerEngine's predicates (`recipe.delayed()`, ...)."""

    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def float8_per_tensor_scaling(self) -> bool:
        return self.delayed() or self.float8_current_scaling()

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def nvfp4(self) -> bool:
        return isinstance(self, NVFP4BlockScaling)

    def float8_block_scaling(self) -> bool:
        return False  # TE's Float8BlockScaling is not supported in its JAX stack either

    def custom(self) -> bool:
        return False


@dataclasses.dataclass(frozen=True)
class MMParams:
    """TE's GEMM options. flashmesh, like TE's JAX stack, runs every FP8 GEMM with fast
    accumulation (XLA's DEFAULT precision), so this is accepted and recorded only."""

    use_split_accumulator: bool = True


def _format(value: Any, name: str) -> Format:
    if isinstance(value, Format):
        return value
    if isinstance(value, str) and value.upper() in Format.__members__:
        return Format[value.upper()]
    raise ValueError(f"{name} must be a Format (E4M3, HYBRID, ...), got {value!r}")


def _no_backward_override(recipe) -> None:
    if recipe.backward_override is not None:
        raise NotImplementedError(f"backward_override={recipe.backward_override!r} is not supported: "
                                  f"flashmesh's FP8 backward follows the recipe (None)")


def _per_tensor_format(recipe) -> None:
    """Normalise a per-tensor recipe's fp8_format (a Format or its name); HYBRID or E4M3 only."""
    object.__setattr__(recipe, "fp8_format", _format(recipe.fp8_format, "fp8_format"))
    if recipe.fp8_format not in (Format.HYBRID, Format.E4M3):
        raise ValueError(f"fp8_format must be Format.HYBRID or Format.E4M3, got {recipe.fp8_format}")


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor scaling from the amax history (TE's default recipe).

    Each quantised tensor keeps `scale` [1] and `amax_history` [amax_history_len] in the
    `fp8_metas` collection. A step quantises with the stored scale, then records the tensor's
    amax in history[0], sets scale = fp8_max / amax_ref / 2**margin, where amax_ref is the
    history's max ("max") or history[0] ("most_recent") and the old scale is kept when amax_ref
    is 0 or not finite, and finally rolls the history by one (history[0] = 0).

    Attributes:
      margin: extra headroom, as a power of two.
      fp8_format: Format.HYBRID (default) or Format.E4M3.
      amax_history_len: length of the history (TE default 1024; the guide uses 16).
      amax_compute_algo: "max" or "most_recent" (TE's JAX stack refuses a callable, as here).
      reduce_amax: amaxes are reduced over the devices the tensor is split across; False is
        refused, as in TE's JAX stack.
      fp8_dpa: attention (DotProductAttention) also runs in FP8 (cuDNN's FP8 attention) where
        it supports the call; TE's name. Default False: attention stays in the input dtype.
      fp8_mha: accepted for compatibility (TE's JAX stack ignores it too).
      backward_override: TE's field (None: the backward as the recipe says); any other value is
        refused.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    scaling_factor_compute_algo: Any = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Any = None

    def __post_init__(self):
        _per_tensor_format(self)
        _no_backward_override(self)
        if not isinstance(self.margin, int) or isinstance(self.margin, bool) or self.margin < 0:
            raise ValueError(f"margin must be an int >= 0, got {self.margin!r}")
        if (not isinstance(self.amax_history_len, int) or isinstance(self.amax_history_len, bool)
                or self.amax_history_len < 1):
            raise ValueError(f"amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got "
                             f"{self.amax_compute_algo!r} (a callable is not supported, as in TE's JAX stack)")
        if self.scaling_factor_compute_algo is not None:
            raise NotImplementedError("scaling_factor_compute_algo (a custom scale function) is not "
                                      "supported, as in TE's JAX stack")
        if self.reduce_amax is not True:
            raise NotImplementedError("reduce_amax=False is not supported, as in TE's JAX stack: "
                                      "amaxes are always reduced over the devices a tensor spans")


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor scaling from the tensor itself (scale = fp8_max / amax(x)); no state.

    Attributes:
      use_power_2_scales: round each scale down to a power of two.
      fp8_format: Format.HYBRID (default) or Format.E4M3.
      fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: TE's MMParams, accepted and recorded.
      fp8_dpa, fp8_mha, backward_override: as in DelayedScaling.
    """

    use_power_2_scales: bool = False
    fp8_format: Format = Format.HYBRID
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Any = None

    def __post_init__(self):
        _per_tensor_format(self)
        _no_backward_override(self)
        if not isinstance(self.use_power_2_scales, bool):
            raise ValueError(f"use_power_2_scales must be a bool, got {self.use_power_2_scales!r}")


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: e4m3 elements with one e8m0 scale per 32 (TE's name). Its GEMMs need Blackwell."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    enable_2d_quantization: bool = False
    fp8_dpa: bool = False
    fp8_mha: bool = False
    needs = "a Blackwell GPU (compute capability 10.0, sm100; TE asks for sm >= 9.9)"


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: e2m1 elements with e4m3 block scales (TE's name). Its GEMMs need Blackwell."""

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    needs = "a Blackwell GPU (compute capability 10.0, sm100)"
