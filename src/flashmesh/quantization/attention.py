"""FP8 attention: cuDNN's FP8 fused attention (through JAX's primitives) with delayed scaling.

    out = fp8_attention(q, k, v, state, recipe, causal=True, scale=1 / sqrt(128))

q [B, T, N, H], k and v [B, S, N, H] (bfloat16, float16 or float32) are quantised to e4m3
with their stored scales, cuDNN runs attention in FP8 and the e4m3 output is dequantised to
q's dtype. The backward quantises dO the same way, runs cuDNN's FP8 backward and returns
dq, dk, dv in the inputs' dtype and, as TransformerEngine does, the *updated state* as the
cotangent of `state` (`flashmesh.quantization.state.update_fp8_metas` writes it back).

What cuDNN FP8 attention runs in jax 0.11.2 (jax/_src/cudnn/fused_attention_stablehlo.py):
  * q, k, v, o, dO, dq, dk, dv all in ONE fp8 dtype. JAX's forward and backward primitives
    give o and dq/dk/dv q's dtype (fp8 abstract evals, l. 1360-1397), and XLA's cuDNN graphs
    require it (stream_executor/cuda/cuda_dnn.cc: GetCudnnFlashAttentionF8OperationGraph wants
    q == k == v == o, the backward q == k and v == dO == dq == dk == dv, and declares every
    tensor in q's type). So Format.HYBRID (e5m2 dO) cannot be expressed: only Format.E4M3.
  * masks NO_MASK or CAUSAL only (l. 1958-1959), top-left (cuDNN: row >= column); bias,
    mask, q_seqlen, kv_seqlen must be None (l. 1960-1964); dropout_rate, sliding_window_length
    and q/kv_offsets are accepted by `dot_product_attention` but never reach the FP8 kernel
    (l. 1968-1971), so flashmesh refuses them rather than ignore them.
  * training: head dim exactly 128 and T, S multiples of 128; inference: head dim <= 256 and
    a multiple of 16 (check_is_flash_attention, l. 369-375). Dv = Dqk (the backward sizes dv
    from q's head dim, l. 1482-1484). K = N only: jax's FP8 tests never run GQA.
  * layouts BTNH / BNTH (flashmesh uses BTNH); scales are float32 [1, 1, 1, 1]; vmap over a
    scale is refused (l. 1544-1552); the amax outputs are float32 [1, 1, 1, 1] over the whole
    batch (l. 1563-1565).
  * hardware (jax's DotProductAttentionF8Test skips and cudnn-frontend's SDPA FP8 checks):
    compute capability >= 9.0, not 12.x; cuDNN >= 9.1.0 and not 9.10.0; 10.3 needs 9.11;
    the Blackwell backward needs 9.19. jax also skips these tests on CUDA 13 ("cuDNN creates
    no execution plans"), a note from 2025 that our H200 runs (CUDA 13) must confirm.

Kernel semantics (cudnn-frontend node/sdpa_fp8.h, sdpa_fp8_bwd.h), TE's scale convention
(x8 = clip(x * scale), descale = 1 / scale):
  s: the forward is a flash kernel: it quantises with scale_s the UNNORMALISED tile
       probabilities exp(scale * q k^T - running row max), in (0, 1] with max 1 in every row,
       and divides by the row sum after P v (cudnn-frontend test/python/sdpa/fp8_ref.py
       compute_ref, l. 117-131; its fp8.py l. 363 fixes s_amax = 1.0). amax_s is (by the H200 run:
       s's history matched the emulation) max of the normalised softmax P, so scale_s must
       NOT be fp8_max / amax_s (that saturates every p > amax_s): flashmesh passes
       scale_s = fp8_max, descale_s = 1 / fp8_max.
       The backward recomputes the normalised P (<= 1) from the stats and uses the same scale.
  o  = P v: amax_o = max |o| before scale_o, returned in e4m3 as o * scale_o.
  dp = dS = P * (dO v^T - rowsum(dO * o)) * scale, the logits' gradient: amax_dP before
       scale_dP, quantised for dS k and dS^T q.
  dq, dk, dv: amaxes before scale_dQ/dK/dV, returned in e4m3 as dq * scale_dQ, ...

Operand order: JAX binds the backward's scales in fp8_params_keys_bwd's order, but XLA's cuDNN
graph numbers them (cuda_dnn.cc, GetCudnnFlashAttentionBackwardF8OperationGraph, the set_uid
calls) as descale_q, k, v, s, o, dO, dP, scale_s, dP, dQ, dK, dV and binds buffers to uids by
position (CudnnGraph::PackOperands), so `_cudnn_backward` passes them in XLA's order
(`XLA_BWD_KEYS`). The forward's order and all result orders agree.

State: {name: (scale [1], amax_history [L])} for the ten tensors of `TENSORS`, float32 or
viewed in the combining dtypes of `flashmesh.quantization.combine`; a module keeps them in
the `fp8_metas` collection as `{name}_scale` and `{name}_amax_history` (`declare_state`).
q, k, v and dO amaxes come from the tensors, s, o, dp, dq, dk, dv from cuDNN. state["s"] keeps
cuDNN's amax_s history (and its scale) for the record only: the kernels get scale_s = fp8_max.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from flashmesh.attention import api, cudnn
from flashmesh.attention.spec import AttentionSpec, reproducible_reason
from flashmesh.attention.varying import varying_axes
from flashmesh.quantization import combine, scaling
from flashmesh.quantization.state import declare as declare_variables
from flashmesh.quantization.recipe import DelayedScaling, Float8CurrentScaling, Format

__all__ = ["TENSORS", "init_state", "declare_state", "fp8_attention", "fp8_attention_support",
           "spec_reason", "device_reason", "recipe_reason", "Fp8Kernels", "CUDNN_KERNELS"]

# q, k, v, softmax output, output | output grad, logits grad, input grads (jax's key suffixes).
TENSORS = ("q", "k", "v", "s", "o", "do", "dp", "dq", "dk", "dv")
TRAIN_HEAD_DIM = 128
SEQ_MULTIPLE = 128
CUDNN_FP8 = 90100           # SDPA FP8 forward and backward
CUDNN_FP8_BROKEN = 91000    # 9.10.0: known FP8 backward bug (cudnn-frontend refuses it)
CUDNN_SM103 = 91100
CUDNN_BLACKWELL_BWD = 91900  # the FP8 backward on sm10x routes to a deterministic kernel


# --------------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------------
def init_state(amax_history_len: int) -> dict[str, tuple[jax.Array, jax.Array]]:
    """{name: (scale ones [1], amax_history zeros [L])} for every name in TENSORS."""
    n = amax_history_len
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"amax_history_len must be an int >= 1, got {amax_history_len!r}")
    return {t: (jnp.ones((1,), jnp.float32), jnp.zeros((n,), jnp.float32)) for t in TENSORS}


def declare_state(module, recipe: DelayedScaling) -> dict[str, tuple[jax.Array, jax.Array]]:
    """The state of one attention from (in `init`, created in) `module`'s `fp8_metas`:
    variables `{name}_scale` [1] (ones) and `{name}_amax_history` [L] (zeros), viewed in the
    combining dtypes (scales min, histories max) as `state.gemm_state` does for GEMMs."""
    return declare_variables(module, TENSORS, "", recipe.amax_history_len)


def _checked_state(state, length: int) -> dict:
    if not isinstance(state, dict) or set(state) != set(TENSORS):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state must be a dict with keys {list(TENSORS)} (init_state), got {got}")
    for t in TENSORS:
        pair = state[t]
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise ValueError(f"state[{t!r}] must be a (scale, amax_history) pair, got "
                             f"{type(pair).__name__}")
        if pair[0].shape != (1,) or pair[1].shape != (length,):
            raise ValueError(f"state[{t!r}] shapes {pair[0].shape}, {pair[1].shape} must be (1,) and "
                             f"(amax_history_len,) = ({length},)")
    return {t: state[t] for t in TENSORS}


# --------------------------------------------------------------------------------------------
# The kernels (a seam: CPU tests pass an emulation with the same contract)
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Fp8Kernels:
    """forward(q8, k8, v8, meta, *, scale, causal, is_training) -> (o8, amax_s, amax_o, stats
    float32 [B, N, T] or None when not training); backward(q8, k8, v8, o8, do8, stats, meta, *,
    scale, causal) -> (dq8, dk8, dv8, amax_dq, amax_dk, amax_dv, amax_dp). `meta` maps jax's
    fp8_params names (descale_q, scale_s, ...) to float32 [1, 1, 1, 1]; amaxes any size-1 shape."""

    forward: Callable
    backward: Callable


def _cudnn_forward(q8, k8, v8, meta, *, scale, causal, is_training):
    from jax._src.cudnn import fused_attention_stablehlo as fa
    _check_jax_operand_order(fa)
    layout = fa.AttentionLayout.BTNH.value
    fa.check_is_flash_attention_fp8(q8, k8, v8, layout, fa.check_cudnn_version(),
                                    is_training=is_training)
    out = fa._dot_product_attention_fp8_fwd_p_wrapper.bind(
        q8, k8, v8, *(meta[n] for n in fa.fp8_params_keys_fwd), scale=scale,
        use_causal_mask=causal, layout=layout, is_training=is_training)
    return out[0], out[1], out[2], (out[3] if is_training else None)


# The backward's 12 scale operands. JAX's primitive and its lowering take them in JAX_BWD_KEYS'
# order (jax 0.11.2 fused_attention_stablehlo.py l. 1256-1259, 1463-1513: operands q, k, v, o,
# dO, stats, then these). XLA builds the cuDNN graph with uids in XLA_BWD_KEYS' order
# (xla/stream_executor/cuda/cuda_dnn.cc GetCudnnFlashAttentionBackwardF8OperationGraph: the
# set_uid calls after the tensor_like ones, zml/xla 1e203b5 l. 4513-4524: descale_s before
# descale_o and descale_dO, scale_dP before scale_dQ) and binds the custom call's buffers to
# uids 1, 2, ... by position (CudnnGraph::PackOperands, l. 6888-6903). Binding in JAX's order
# hands cuDNN descale_o as Descale_S, descale_dO as Descale_O, descale_s as Descale_dO and
# scale_dQ/dK/dV/dP as Scale_dP/dQ/dK/dV; jax's own FP8 tests pass all-ones scales, which hides
# it. So flashmesh binds in XLA's order. (Forward: JAX's and XLA's orders agree, l. 1253-1254
# and cuda_dnn.cc l. 4326-4343; results agree too.)
JAX_BWD_KEYS = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s",
                "descale_dP", "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
XLA_BWD_KEYS = ("descale_q", "descale_k", "descale_v", "descale_s", "descale_o", "descale_dO",
                "descale_dP", "scale_s", "scale_dP", "scale_dQ", "scale_dK", "scale_dV")
JAX_FWD_KEYS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")


def _check_jax_operand_order(fa) -> None:
    got = (tuple(fa.fp8_params_keys_fwd), tuple(fa.fp8_params_keys_bwd))
    if got != (JAX_FWD_KEYS, JAX_BWD_KEYS):
        raise NotImplementedError(
            f"fp8_attention: this jax orders the FP8 attention scales as {got}, not as the jax "
            "0.11.2 that flashmesh's operand reordering (XLA_BWD_KEYS) was derived for; re-check "
            "it against XLA's cuDNN graph before use")


def cudnn_backward_operands(meta) -> list:
    """The backward's scale operands in the positional order XLA's cuDNN graph reads them."""
    return [meta[n] for n in XLA_BWD_KEYS]


def _cudnn_backward(q8, k8, v8, o8, do8, stats, meta, *, scale, causal):
    from jax._src.cudnn import fused_attention_stablehlo as fa
    _check_jax_operand_order(fa)
    return tuple(fa._dot_product_attention_fp8_bwd_p_wrapper.bind(
        q8, k8, v8, o8, do8, stats, *cudnn_backward_operands(meta), scale=scale,
        use_causal_mask=causal, layout=fa.AttentionLayout.BTNH.value))


CUDNN_KERNELS = Fp8Kernels(_cudnn_forward, _cudnn_backward)


# --------------------------------------------------------------------------------------------
# What can run
# --------------------------------------------------------------------------------------------
def recipe_reason(recipe) -> str | None:
    """Why FP8 attention cannot run under `recipe`, or None."""
    if isinstance(recipe, Float8CurrentScaling):
        return ("Float8CurrentScaling: cuDNN's FP8 attention needs the scales of s, o, dP, dq, dk, "
                "dv before it computes those tensors, so only DelayedScaling's stored scales work")
    if not isinstance(recipe, DelayedScaling):
        return f"recipe {type(recipe).__name__}: FP8 attention runs under DelayedScaling only"
    if recipe.fp8_format is not Format.E4M3:
        return (f"fp8_format={recipe.fp8_format.name}: cuDNN's FP8 attention in XLA takes q, k, v, "
                "o, dO, dq, dk, dv in one FP8 dtype (cuda_dnn.cc, the F8 backward graph), so "
                "HYBRID's e5m2 dO cannot be passed; use Format.E4M3")
    return None


def spec_reason(spec: AttentionSpec, *, is_training: bool = True) -> str | None:
    """Why cuDNN's FP8 attention cannot run this call whatever the GPU, or None."""
    T, S, H = spec.q_len, spec.kv_len, spec.qk_dim
    if spec.dtype not in ("bfloat16", "float16", "float32"):
        return f"dtype {spec.dtype}: fp8_attention quantises bfloat16, float16 or float32 inputs"
    if spec.has_bias:
        return "bias: cuDNN's FP8 attention takes no bias (JAX requires bias=None with use_fp8)"
    if spec.segments is not None:
        return (f"segments ({spec.segments}): JAX's FP8 attention takes no sequence lengths and "
                "drops segment offsets")
    if spec.has_dropout:
        return "dropout: JAX's FP8 attention never passes dropout_rate to cuDNN"
    if reason := reproducible_reason(spec, "cuDNN's FP8 attention"):
        return reason
    if spec.window not in ((-1, -1), (-1, 0)):
        return f"window={spec.window}: JAX's FP8 attention never passes a sliding window to cuDNN"
    if spec.softmax != "vanilla":
        return f"softmax={spec.softmax!r}: cuDNN's FP8 attention has only the vanilla softmax"
    if spec.logits_soft_cap is not None:
        return "logits_soft_cap: cuDNN's FP8 attention has no logit soft cap"
    if spec.causal and spec.bottom_right and T != S:
        return f"bottom-right causal mask with T={T} != S={S}: cuDNN's FP8 causal mask is top-left"
    if spec.num_kv_heads != spec.num_heads:
        return (f"num_kv_heads={spec.num_kv_heads} != num_heads={spec.num_heads} (GQA/MQA): jax's "
                "FP8 attention is tested with as many key/value heads as query heads only")
    if spec.v_dim != H:
        return f"Dv={spec.v_dim} != Dqk={H}: JAX's FP8 backward gives dv the query head dim"
    if spec.return_lse:
        return "return_lse: fp8_attention does not return the log-sum-exp"
    if is_training:
        if H != TRAIN_HEAD_DIM:
            return f"head dim {H}: cuDNN's FP8 attention trains with head dim {TRAIN_HEAD_DIM} only"
        if T % SEQ_MULTIPLE or S % SEQ_MULTIPLE:
            return (f"T={T}, S={S}: cuDNN's FP8 attention trains with T and S multiples of "
                    f"{SEQ_MULTIPLE}")
    elif H > 256 or H % 16:
        return f"head dim {H}: cuDNN's FP8 inference needs a multiple of 16 up to 256"
    return None


# Measured on the H200 (2026-12-01, jax 0.11.2, CUDA 13 wheels; tests/quantization/
# test_fp8_attention.py's GPU tests): this wrapper's cuDNN FP8 attention output was wrong
# (relative error 0.55 without a mask, 0.05 causal, against 0.002-0.004 for the emulation of
# the same quantisation) and its softmax / dP amaxes disagreed with the emulation. Until the
# cause is found (the scale conventions of the kernels' descale/scale arguments are the
# suspects) every GPU is refused, so fp8_dpa never gives silently wrong attention.
#
# Likely cause found by reading the sources (no GPU to confirm; reproduced on CPU by emulation):
#   1. Forward, P scaling: cuDNN's flash kernel quantises the UNNORMALISED probabilities
#      exp(logit - running max) <= 1 with scale_s (cudnn-frontend test/python/sdpa/fp8_ref.py
#      l. 117-131; its fp8.py l. 363 uses s_amax = 1.0), while amax_s reports (it seems: s's
#      history passed on the H200, o's failed) the normalised max. scale_s = 448 / amax_s
#      (0.21-0.35 unmasked) saturated every p > amax_s: a
#      flash-style emulation of that gives rel. error 0.555 (seed 1) and amax_o 0.41 vs 0.92
#      (seed 2), the H200's numbers; causal has amax_s = 1, hence only 0.05.
#      Fix: `_meta` passes scale_s = fp8_max, descale_s = 1 / fp8_max always.
#   2. Backward, operand order: JAX binds the 12 scales in fp8_params_keys_bwd order, XLA's
#      graph reads them in uid order (XLA_BWD_KEYS), so Descale_dO got descale_s etc. The
#      emulated effect, amax_dP 0.166 vs 0.741 (causal, seed 2), matches the H200's 0.16 vs 0.74.
#      Fix: `_cudnn_backward` binds in XLA_BWD_KEYS order (cudnn_backward_operands).
# H200 run of 2026-12-01 with both fixes: the amaxes of s, o, dp, dq, dk, dv match the
# emulation (test_gpu_scales_update_over_steps). The first accuracy check failed only because its
# references were wrong: XLA:GPU's SimplifyFPConversions folds convert(convert(x, f8e4m3fn), f32)
# into x, so the emulation lost its FP8 rounding (/work/notes/fp8_attention_diagnosis.md). With
# an optimization barrier on each e4m3 value the references keep their rounding on the GPU
# (test_gpu_references_keep_their_fp8_rounding) and cuDNN's errors from float32 are within 1.5x
# of the full emulation's (test_gpu_cudnn_fp8_against_float32), on the H200 on 2026-12-01.


def device_reason(device: cudnn.Device, *, is_training: bool = True) -> str | None:
    """Why this GPU's cuDNN cannot run FP8 attention, or None."""
    cc, ver = device.compute_capability, device.cudnn_version
    name = f"compute capability {cc[0]}.{cc[1]}"
    version = cudnn._version
    if cc < (9, 0):
        return f"cuDNN's FP8 attention needs compute capability >= 9.0 (Hopper), this GPU has {name}"
    if cc[0] == 12:
        return f"{name}: cuDNN has no FP8 attention for it (jax's FP8 attention tests skip 12.0)"
    if ver < CUDNN_FP8:
        return f"cuDNN's FP8 attention needs cuDNN >= {version(CUDNN_FP8)}, found {version(ver)}"
    if ver == CUDNN_FP8_BROKEN:
        return "cuDNN 9.10.0 has a known FP8 attention backward bug; use 9.10.2 or newer"
    if cc == (10, 3) and ver < CUDNN_SM103:
        return f"{name} needs cuDNN >= {version(CUDNN_SM103)}, found {version(ver)}"
    if cc[0] == 10 and is_training and ver < CUDNN_BLACKWELL_BWD:
        return (f"the FP8 attention backward on {name} needs cuDNN >= "
                f"{version(CUDNN_BLACKWELL_BWD)}, found {version(ver)}")
    return None


def _where_reason(reason: str | None, device, is_training: bool) -> str | None:
    """`reason` combined with this machine's (or the given device's)."""
    if device is None:
        platform = jax.default_backend()
        if platform != "gpu":
            here = f"needs an NVIDIA GPU with CUDA (platform is {platform!r})"
            return here if reason is None else f"{here}; and on one: {reason}"
        device = cudnn.local_device()
    if reason is not None:
        return reason
    return device if isinstance(device, str) else device_reason(device, is_training=is_training)


def fp8_attention_support(q, k=None, v=None, *, recipe=None, is_training: bool = True,
                          device: cudnn.Device | None = None, **options) -> str | None:
    """None when `fp8_attention` can run this call, else a one-line reason.

    Takes `flashmesh.attention`'s arguments (arrays or jax.ShapeDtypeStruct; mask, window,
    segments, bias, softmax, logits_soft_cap, dropout_rate, layout, ...), the recipe (None:
    not checked), whether the call is differentiated, and the device (None: this machine's).
    fp8_attention itself takes the separate [B, T, N, H] arrays of `layouts.split`.

    Example:
      >>> fp8_attention_support(q, k, v, mask="causal", bias=b)
      "bias: cuDNN's FP8 attention takes no bias (JAX requires bias=None with use_fp8)"
    """
    options.setdefault("return_lse", False)
    specs = []

    def trace(q, k, v):  # shapes suffice: nothing is computed
        specs.append(api.normalize(q, k, v, **options)[1])
        return 0

    jax.eval_shape(trace, q, k, v)
    reason = ((recipe_reason(recipe) if recipe is not None else None) or cudnn.jax_reason()
              or spec_reason(specs[0], is_training=is_training))
    return _where_reason(reason, device, is_training)


# --------------------------------------------------------------------------------------------
# fp8_attention
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Config:
    recipe: DelayedScaling
    scale: float
    causal: bool
    kernels: Fp8Kernels


def fp8_attention(q: jax.Array, k: jax.Array, v: jax.Array, state: dict, recipe: DelayedScaling,
                  *, causal: bool, scale: float, kernels: Fp8Kernels | None = None) -> jax.Array:
    """Attention of q over k, v in FP8 (cuDNN), delayed-scaling state in and (as the
    cotangent of `state`) out.

    Shapes: q [B, T, N, H], k and v [B, S, N, H], one float dtype; output [B, T, N, H] in it.
    B batch, T query length, S key length, N heads, H head dim (128 for training).

    Args:
      q, k, v: the attention inputs.
      state: {name: (scale [1], amax_history [L])} for every name in TENSORS (init_state,
        declare_state); its cotangent under jax.grad is the updated state.
      recipe: a DelayedScaling with fp8_format=Format.E4M3 (margin, amax_history_len and
        amax_compute_algo are used as for GEMMs).
      causal: query i sees keys j <= i (top-left), else every key.
      scale: the logit scale (e.g. 1 / sqrt(H)).
      kernels: None for cuDNN (the call is checked first and refused with NotImplementedError
        and the reason); tests pass an emulation.

    Example:
      >>> recipe = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=16)
      >>> state = init_state(16)
      >>> loss = lambda q, k, v, s: jnp.sum(fp8_attention(q, k, v, s, recipe, causal=True,
      ...                                                 scale=128 ** -0.5).astype(jnp.float32))
      >>> dq, dk, dv, state = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, state)
    """
    reason = recipe_reason(recipe)
    if reason is not None:
        raise NotImplementedError(f"fp8_attention: {reason}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not abs(scale) < float("inf"):
        raise ValueError(f"scale must be a finite real number, got {scale!r}")
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    if not (q.ndim == k.ndim == v.ndim == 4):
        raise ValueError(f"q, k, v must be [B, T, N, H], [B, S, N, H], got {q.shape}, {k.shape}, "
                         f"{v.shape}")
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k, v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, T, N, H = q.shape
    if k.shape[0] != B or k.shape[3] != H or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k {k.shape} and v {v.shape} must be [B, S, K, H] for q {q.shape}")
    if kernels is None:
        spec = AttentionSpec(batch=B, q_len=T, kv_len=k.shape[1], num_heads=N,
                             num_kv_heads=k.shape[2], qk_dim=H, v_dim=v.shape[3],
                             dtype=q.dtype.name, scale=float(scale),
                             window=(-1, 0) if causal else (-1, -1), return_lse=False)
        reason = _where_reason(cudnn.jax_reason() or spec_reason(spec), None, True)
        if reason is not None:
            raise NotImplementedError(f"fp8_attention: {reason}")
        kernels = CUDNN_KERNELS
    state = _checked_state(state, recipe.amax_history_len)
    return _fp8_attention(q, k, v, state, _Config(recipe, float(scale), causal, kernels))


def _scales(state) -> dict:
    return {t: combine.to_float32(state[t][0]).astype(jnp.float32) for t in TENSORS}


def _meta(scales, fmt: Format) -> dict:
    """jax's fp8_params by name (descale = 1 / scale), float32 [1, 1, 1, 1].

    scale_s is fmt.max_fwd whatever the state holds: cuDNN's forward quantises the
    unnormalised probabilities exp(logit - running max) <= 1 (max 1 in every row) with it, so a
    larger scale (fp8_max / amax_s of the normalised softmax) saturates them."""
    f = lambda t: scales[t].reshape(1, 1, 1, 1)  # noqa: E731
    inv = lambda t: (1.0 / scales[t]).reshape(1, 1, 1, 1)  # noqa: E731
    s_scale = jnp.full((1, 1, 1, 1), fmt.max_fwd, jnp.float32)
    return {"descale_q": inv("q"), "descale_k": inv("k"), "descale_v": inv("v"),
            "descale_s": 1.0 / s_scale, "scale_s": s_scale, "scale_o": f("o"), "descale_o": inv("o"),
            "descale_dO": inv("do"), "descale_dP": inv("dp"), "scale_dP": f("dp"),
            "scale_dQ": f("dq"), "scale_dK": f("dk"), "scale_dV": f("dv")}


def _dequantize(x8, scale, dtype):
    return (x8.astype(jnp.float32) * (1.0 / scale).reshape(())).astype(dtype)


def _kernel_amax(a, like) -> jax.Array:
    """A kernel's amax as float32 [1], reduced over the manual axes `like` varies along
    (as scaling.amax does for tensors), so every shard updates to the same scale."""
    a = jnp.asarray(a, jnp.float32).reshape(())
    axes = varying_axes(like)
    return (lax.pmax(a, axes) if axes else a).reshape(1)


def _quantize_inputs(q, k, v, scales, dtype):
    return tuple(scaling.quantize(x, scales[t], dtype) for x, t in ((q, "q"), (k, "k"), (v, "v")))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fp8_attention(q, k, v, state, cfg: _Config):
    scales = _scales(state)
    q8, k8, v8 = _quantize_inputs(q, k, v, scales, cfg.recipe.fp8_format.forward_dtype)
    o8, _, _, _ = cfg.kernels.forward(q8, k8, v8, _meta(scales, cfg.recipe.fp8_format),
                                      scale=cfg.scale, causal=cfg.causal, is_training=False)
    return _dequantize(o8, scales["o"], q.dtype)


def _fp8_attention_fwd(q, k, v, state, cfg: _Config):
    scales = _scales(state)
    q8, k8, v8 = _quantize_inputs(q, k, v, scales, cfg.recipe.fp8_format.forward_dtype)
    meta = _meta(scales, cfg.recipe.fp8_format)
    o8, amax_s, amax_o, stats = cfg.kernels.forward(q8, k8, v8, meta, scale=cfg.scale,
                                                    causal=cfg.causal, is_training=True)
    amaxes = {"q": scaling.amax(q), "k": scaling.amax(k), "v": scaling.amax(v),
              "s": _kernel_amax(amax_s, q), "o": _kernel_amax(amax_o, q)}
    # A zero-size array carries the inputs' dtype (the gradients are returned in it).
    like = jnp.zeros((0,), q.dtype)
    return _dequantize(o8, scales["o"], q.dtype), (q8, k8, v8, o8, stats, state, amaxes, like)


def _fp8_attention_bwd(cfg: _Config, residuals, g):
    q8, k8, v8, o8, stats, state, amaxes, like = residuals
    scales = _scales(state)
    fmt = cfg.recipe.fp8_format
    do8 = scaling.quantize(g, scales["do"], fmt.backward_dtype)
    dq8, dk8, dv8, a_dq, a_dk, a_dv, a_dp = cfg.kernels.backward(
        q8, k8, v8, o8, do8, stats, _meta(scales, fmt), scale=cfg.scale, causal=cfg.causal)
    amaxes = dict(amaxes, do=scaling.amax(g), dp=_kernel_amax(a_dp, g), dq=_kernel_amax(a_dq, g),
                  dk=_kernel_amax(a_dk, g), dv=_kernel_amax(a_dv, g))
    grads = tuple(_dequantize(x8, scales[t], like.dtype)
                  for x8, t in ((dq8, "dq"), (dk8, "dk"), (dv8, "dv")))
    new_state = {}
    for t in TENSORS:
        scale, history = state[t]
        fp8_max = fmt.max_fwd if t in ("q", "k", "v", "s", "o") else fmt.max_bwd
        new_state[t] = scaling.update_state(scale, history, amaxes[t], fp8_max, cfg.recipe)
    return (*grads, new_state)


_fp8_attention.defvjp(_fp8_attention_fwd, _fp8_attention_bwd)


# --------------------------------------------------------------------------------------------
# The modules' entry: FP8 attention when the autocast recipe asks for it
# --------------------------------------------------------------------------------------------
def attend_under_autocast(module, arrays: tuple, options: dict) -> jax.Array | None:
    """The attention output in FP8 when the current autocast recipe has `fp8_dpa=True`.

    Returns None outside such a block (the caller runs `flashmesh.attention` as usual) and
    during `init` (after declaring the FP8 attention state in `fp8_metas`, so the variables
    are complete). A call cuDNN's FP8 attention cannot run raises NotImplementedError with the
    reason: asking for FP8 attention never silently gives bf16 attention. `arrays` and
    `options` are `flashmesh.attention`'s positional arrays and keyword options."""
    from flashmesh.attention import layouts
    from flashmesh.quantization.autocast import active_recipe

    recipe = active_recipe()
    if recipe is None or not getattr(recipe, "fp8_dpa", False):
        return None
    options = {k: v for k, v in options.items() if k != "implementation"}
    reason = fp8_attention_support(*arrays, recipe=recipe, **options)
    if reason is not None:
        raise NotImplementedError(f"FP8 attention (the recipe's fp8_dpa=True) cannot run this call: "
                                  f"{reason}. Use a recipe with fp8_dpa=False for bf16 attention")
    state = declare_state(module, recipe)
    if module.is_initializing():
        return None
    spec = api.normalize(*arrays, **dict(options, return_lse=False))[1]
    layout = options.get("layout", "bshd")
    q, k, v = layouts.split(layout, *arrays, *(None,) * (3 - len(arrays)))
    out = fp8_attention(q, k, v, state, recipe, causal=spec.window == (-1, 0), scale=spec.scale)
    return layouts.restore(layout, out)
