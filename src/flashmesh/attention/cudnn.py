"""The `cudnn` backend: cuDNN's fused flash attention, through JAX's own cuDNN entry point.

We call `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` rather than the public
`jax.nn.dot_product_attention`, because only the internal one takes packed segments (ragged
offsets), Dqk != Dv (MLA) and returns the softmax statistics. It is private, so the backend
runs only on the JAX minor versions it was checked against (`JAX_VERSIONS`).

How the spec maps onto cuDNN (layout BTNH = our [B, T, N, H]: no transpose, no copy):

* scale -> `scale`; causal (top-left) -> CAUSAL; window (left, 0) -> `sliding_window_length`
  = left + 1, since cuDNN's window is (pos - length, pos] and ours is [pos - left, pos].
* segments "padding" -> PADDING(_CAUSAL) with q/kv lengths [B] counted from the segment ids.
* segments "packed" -> cuDNN's ragged layout: per row up to M = max(spec.max_segments, 2)
  slots, lengths [B, M] and segment *starts* [B, M + 1] (not cumulative lengths), unused
  slots -1 in all four arrays and the last column always -1. Slot m holds the m-th run of
  equal query ids and the keys of the same id. Derived in-graph (`packed_sequences`); a
  malformed array would crash the process with an illegal memory access, so the arrays are
  correct by construction and also checked whenever they are concrete.
* return_residual=True gives the statistics: natural-log log-sum-exp of the scaled logits,
  [B, N, T] (packed: [B * M, N, T], one row per segment, gathered back to tokens here).

Rows cuDNN never visits hold stale memory in out, lse, dq, dk and dv: padding, gaps between
segments, and rows that see no key (a segment without keys, or a window that ends before the
keys begin, e.g. T > S + left). Such rows are given to cuDNN as padding (their length is cut),
then replaced by exact zeros (lse: EMPTY_ROW_LSE), so a fully masked row never shows NaN and
its gradient is exactly zero.

cuDNN's backward ignores a cotangent on the statistics, so the backward pass is our own
`custom_vjp` around the two cuDNN calls: an lse cotangent g adds g_i p_ij to dS_ij, and one
more cuDNN backward computes exactly that (see `_lse_backward`). It only runs when the lse is
differentiated (symbolic zeros); otherwise the graph is cuDNN's forward and backward alone.

Not supported, with the reason from `unsupported_reason`: float32, sink softmaxes, soft cap,
dropout (cuDNN's Philox mask cannot match `masks.dropout_keep`), windows that look right or
are not causal, bottom-right diagonals that differ from top-left, custom positions, bias not
shared over the batch (cuDNN computes dbias only for [1, N, T, S]).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from flashmesh.attention import masks
from flashmesh.attention.cudnn_sequences import (Sequences, packed_sequences, padding_sequences,
                                                 trimmed_sequences)
from flashmesh.attention.spec import EMPTY_ROW_LSE, AttentionInputs, AttentionSpec, reproducible_reason

# JAX minor versions whose internal cuDNN attention signature this module was written against.
JAX_VERSIONS = ((0, 11),)
# cuDNN versions (cudnnGetVersion: 9.6.0 -> 90600) that features need.
CUDNN_MIN = 90000
CUDNN_SLIDING_WINDOW = 90200
CUDNN_PACKED = 90600  # ragged (THD) offsets; also Hopper or later
CUDNN_MLA = 91000  # Dqk != Dv; also Hopper or later
CUDNN_SM103 = 91100  # compute capability 10.3 itself
# JAX sizes packed statistics [B * max_segments, N, T] float32: automatic choice passes over
# cuDNN when they would exceed this (named explicitly, it runs whatever the size).
AUTO_PACKED_STATS_BYTES = 2**30
# Seen on the H200 (2026-12-01, tutorial 003's packed workload B=2, T=65536, N=128, Dqk=128):
# cuDNN's dq is right for batch row 0 and wrong for row 1 (its fwd+bwd outputs differ from
# chunked's by 1.0 relative: benchmarks/results/2026-12-01-nvidia-h200-cp). q holds 2^31 elements: the float32 dq of row 1
# starts at byte 2^32, which points at 32-bit byte offsets in cuDNN's backward. Until
# benchmarks/probe_cudnn_packed.py pins the bound on a GPU, cuDNN refuses calls whose q holds
# this many elements or more: a slower right answer beats a fast wrong one.
MAX_Q_ELEMENTS = 2**30


# --------------------------------------------------------------------------------------------
# What cuDNN can run
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Device:
    """What cuDNN's limits depend on: its version (91000 = 9.10.0) and the compute capability."""

    cudnn_version: int
    compute_capability: tuple[int, int]


def _version(v: int) -> str:
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


@functools.cache
def local_device() -> Device | str:
    """The first GPU's Device, or why there is none. Cached: it is asked at every trace."""
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        return "no GPU is visible to JAX"
    from jax.extend.backend import get_backend
    platform_version = get_backend("gpu").platform_version
    if "cuda" not in platform_version.lower():
        return f"JAX's GPU backend is not CUDA ({platform_version.strip()})"
    from jax._src.cudnn import fused_attention_stablehlo as fa
    try:
        version = int(fa.check_cudnn_version())
    except RuntimeError as e:
        return f"cuDNN is not available: {e}"
    cc = tuple(int(x) for x in gpu.compute_capability.split("."))
    return Device(version, cc)


def jax_reason() -> str | None:
    if jax.__version_info__[:2] not in JAX_VERSIONS:
        tested = ", ".join(f"{a}.{b}" for a, b in JAX_VERSIONS)
        return (f"uses JAX's internal cuDNN attention, checked against JAX {tested} only; "
                f"this is JAX {jax.__version__}")
    return None


def static_reason(spec: AttentionSpec) -> str | None:
    """Why cuDNN cannot run this call whatever the GPU, or None. Pure: works at trace time."""
    T, S = spec.q_len, spec.kv_len
    left, right = spec.window
    if spec.dtype not in ("bfloat16", "float16"):
        return f"cuDNN fused attention takes bfloat16 or float16 inputs, got {spec.dtype}"
    if T == 1 and S == 1:
        return "T = S = 1: cuDNN's graph validation rejects one query against one key"
    if spec.q_elements >= MAX_Q_ELEMENTS:
        return (f"q holds {spec.q_elements} elements >= 2^30: cuDNN's "
                "dq was wrong beyond the first batch row at 2^31 on the H200 (see MAX_Q_ELEMENTS)")
    if spec.softmax != "vanilla":
        return f"softmax={spec.softmax!r}: cuDNN's softmax has no extra denominator term (sink)"
    if spec.logits_soft_cap is not None:
        return "logits_soft_cap: JAX's cuDNN attention has no logit soft cap"
    if spec.has_dropout:
        return ("dropout: cuDNN draws its own Philox mask from a static integer seed, so it "
                "cannot drop the elements flashmesh's dropout_rng selects (masks.dropout_keep)")
    if right > 0:
        return f"window={spec.window}: cuDNN's sliding window looks left only (right must be 0)"
    if right < 0 and left >= 0:
        return f"window={spec.window}: cuDNN's sliding window is causal only (right must be 0)"
    if spec.causal and spec.bottom_right and spec.segments is not None:
        return "bottom-right causal alignment with segments: cuDNN's masks are top-left"
    if spec.causal and spec.bottom_right and T != S:
        return f"bottom-right causal alignment with T={T} != S={S}: cuDNN's masks are top-left"
    if spec.causal and not spec.positions_canonical:
        return ("custom positions: cuDNN derives positions from each segment's start (or the "
                "sequence's), and these are not offsets from it")
    if spec.qk_dim % 8 or spec.v_dim % 8:
        return f"head dims Dqk={spec.qk_dim}, Dv={spec.v_dim} must be multiples of 8 for cuDNN"
    if max(spec.qk_dim, spec.v_dim) > 256:
        return f"head dims Dqk={spec.qk_dim}, Dv={spec.v_dim}: cuDNN allows at most 256"
    if spec.segments == "packed":
        if spec.max_segments is None:
            return ("packed segments need a static max_segments (pass max_segments= to "
                    "SequenceDescriptor.from_segment_ids_and_pos when the ids are traced)")
        if spec.qk_dim != spec.v_dim:
            return (f"packed segments with Dqk={spec.qk_dim} != Dv={spec.v_dim}: JAX derives "
                    "every ragged offset from the query head dim")
        if spec.has_bias:
            return ("bias with packed segments: cuDNN indexes the bias by position inside each "
                    "segment, not by position in the row")
    if spec.has_bias:
        if spec.bias_shape[0] != 1:
            return (f"bias shape {spec.bias_shape}: cuDNN computes the bias gradient only for a "
                    f"bias shared over the batch, [1, N|1, T, S]")
        if T % 2 or S % 2:
            return (f"bias with odd T={T} or S={S}: cuDNN's backward with a bias needs even "
                    "sequence lengths")
    return None


def device_reason(spec: AttentionSpec, device: Device) -> str | None:
    """Why this GPU's cuDNN cannot run the call (static checks passed), or None."""
    cc, ver = device.compute_capability, device.cudnn_version
    hopper = cc >= (9, 0)
    name = f"compute capability {cc[0]}.{cc[1]}"
    if cc < (8, 0):
        return f"cuDNN flash attention needs compute capability >= 8.0, this GPU has {name}"
    if ver < CUDNN_MIN:
        return f"needs cuDNN >= {_version(CUDNN_MIN)}, found {_version(ver)}"
    if cc == (10, 3) and ver < CUDNN_SM103:
        return f"{name} needs cuDNN >= {_version(CUDNN_SM103)}, found {_version(ver)}"
    head_max = 256 if hopper else 128
    if max(spec.qk_dim, spec.v_dim) > head_max:
        return (f"head dims Dqk={spec.qk_dim}, Dv={spec.v_dim}: cuDNN allows at most {head_max} "
                f"on {name}")
    if spec.qk_dim != spec.v_dim and (ver < CUDNN_MLA or not hopper):
        return (f"Dqk={spec.qk_dim} != Dv={spec.v_dim} needs cuDNN >= {_version(CUDNN_MLA)} and "
                f"compute capability >= 9.0; found cuDNN {_version(ver)}, {name}")
    if spec.segments == "packed" and (ver < CUDNN_PACKED or not hopper):
        return (f"packed segments need cuDNN >= {_version(CUDNN_PACKED)} and compute capability "
                f">= 9.0; found cuDNN {_version(ver)}, {name}")
    if spec.causal and spec.window[0] >= 0 and ver < CUDNN_SLIDING_WINDOW:
        return (f"window={spec.window} needs cuDNN >= {_version(CUDNN_SLIDING_WINDOW)}, "
                f"found {_version(ver)}")
    return None


def unsupported_reason(spec: AttentionSpec, platform: str, *,
                       automatic: bool = False) -> str | None:
    """Why cuDNN cannot run this call here, in one line, or None. Static checks first (they
    need no GPU, so `explain` works at trace time); the GPU's own limits are asked once."""
    reason = jax_reason() or static_reason(spec) or reproducible_reason(spec, "cuDNN's attention")
    if platform != "gpu":  # say both, so `explain` on a laptop tells what a GPU would refuse
        here = f"needs an NVIDIA GPU with CUDA (platform is {platform!r})"
        return here if reason is None else f"{here}; and on one: {reason}"
    if reason is not None:
        return reason
    device = local_device()
    reason = device if isinstance(device, str) else device_reason(spec, device)
    if reason is None and automatic and spec.segments == "packed":
        nbytes = 4 * spec.batch * max(spec.max_segments, 2) * spec.num_heads * spec.q_len
        if nbytes > AUTO_PACKED_STATS_BYTES:
            reason = (f"packed statistics [B * max_segments, N, T] would take "
                      f"{nbytes / 2**30:.2f} GiB (automatic choice limit "
                      f"{AUTO_PACKED_STATS_BYTES / 2**30:.2f} GiB)")
    return reason


# --------------------------------------------------------------------------------------------
# The cuDNN calls (module functions, so CPU tests can stand in for them)
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    """The static arguments of the cuDNN calls."""

    scale: float
    mask_type: str  # MaskType name: NO_MASK, PADDING, CAUSAL, PADDING_CAUSAL
    sliding_window_length: int | None  # window left + 1; None = unbounded
    causal: bool
    window_left: int | None
    # Ask for the softmax statistics. Without them cuDNN runs its inference kernel, which
    # jax.nn uses for forward-only calls; the differentiated path always asks.
    statistics: bool = True


def _cudnn_forward(cfg: Config, q, k, v, bias, seqs: Sequences):
    """(out [B, T, N, Dv], statistics float32 [B, N, T] or, packed, [B*M, N, T]; None when
    cfg.statistics is False)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa
    result = fa.dot_product_attention(
        q, k, v, bias, None, seqs.q_seqlen, seqs.kv_seqlen, seqs.q_offsets, seqs.kv_offsets,
        scale=cfg.scale, mask_type=fa.MaskType[cfg.mask_type], seed=0, dropout_rate=0.0,
        qkv_layout="BTNH", sliding_window_length=cfg.sliding_window_length,
        return_residual=cfg.statistics)
    return result if cfg.statistics else (result, None)


def _cudnn_backward(cfg: Config, q, k, v, bias, seqs: Sequences, stats, out, d_out):
    """cuDNN's backward for given (out, d_out): (dq, dk, dv, dbias or None). It recomputes
    p = exp(s - stats) and uses out only through D_i = sum_h d_out_ih out_ih."""
    from jax._src.cudnn import fused_attention_stablehlo as fa
    unused = jnp.zeros(0, q.dtype)
    opt = lambda x: unused if x is None else x  # noqa: E731  (JAX's placeholder for "absent")
    grads = fa._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, opt(bias), opt(seqs.q_seqlen), opt(seqs.kv_seqlen), opt(seqs.q_offsets),
        opt(seqs.kv_offsets), unused, unused, stats, out, d_out,
        scale=cfg.scale, seed=0, dropout_rate=0.0, variadic_args=(bias is not None,) * 2,
        mask_type=fa.MaskType[cfg.mask_type], layout=fa.AttentionLayout.BTNH.value,
        sliding_window_length=cfg.sliding_window_length)
    return grads[0], grads[1], grads[2], (grads[3] if bias is not None else None)


def _lse_from_stats(stats, seqs: Sequences):
    """The statistics as lse [B, N, T] (rows cuDNN skipped still hold stale values)."""
    if seqs.stats_index is None:
        return stats
    B, T = seqs.stats_index.shape
    N = stats.shape[1]
    flat = jnp.transpose(stats, (1, 0, 2)).reshape(N, -1)  # [N, B*M*T]
    return jnp.transpose(flat[:, seqs.stats_index.reshape(-1)].reshape(N, B, T), (1, 0, 2))


def _lse_backward(cfg: Config, q, k, bias, seqs: Sequences, stats, d_lse):
    """Gradients from a cotangent g [B, N, T] on the lse.

    d lse_i / d s_ij = p_ij, so g adds g_i p_ij to dS_ij. cuDNN's backward forms
    dS = P * (dO V^T - D) with D_i = dO_i . O_i computed from the O it is given. With V = 0,
    dO = e_0 + e_1 and O = -(g_hi e_0 + g_lo e_1) (g split into two input-dtype parts, so
    D = -g keeps float32 precision), dS = g P exactly, and the same call returns dq, dk and
    dbias for it. Costs one more cuDNN backward, only when the lse is differentiated.
    """
    g = jnp.transpose(d_lse, (0, 2, 1))  # [B, T, N]
    hi = g.astype(q.dtype)
    lo = (g - hi.astype(g.dtype)).astype(q.dtype)
    rest = jnp.zeros(q.shape[:-1] + (q.shape[-1] - 2,), q.dtype)
    fake_out = jnp.concatenate([-hi[..., None], -lo[..., None], rest], axis=-1)
    fake_d_out = jnp.concatenate([jnp.ones(q.shape[:-1] + (2,), q.dtype), rest], axis=-1)
    dq, dk, _, dbias = _cudnn_backward(cfg, q, k, jnp.zeros_like(k), bias, seqs, stats,
                                       fake_out, fake_d_out)
    return dq, dk, None, dbias


def _add(a, b):
    return b if a is None else a if b is None else a + b


def _zero_outside(x, valid):
    """x [B, L, H, D] with rows outside valid [B|1, L] set to exact zeros."""
    if x is None or valid is None:
        return x
    return jnp.where(valid[:, :, None, None], x, jnp.zeros((), x.dtype))


def _dbias_visible(cfg: Config, seqs: Sequences, T: int, S: int):
    """bool [T, S]: (query, key) pairs some batch row sees; dbias elsewhere is stale."""
    vis = None
    if cfg.causal:
        i, j = np.arange(T)[:, None], np.arange(S)[None, :]
        vis = (j <= i) & ((i - j <= cfg.window_left) if cfg.window_left is not None else True)
    if seqs.q_valid is not None:
        kv = seqs.kv_valid if seqs.kv_valid is not None else np.ones((1, S), bool)
        pairs = jnp.any(seqs.q_valid[:, :, None] & kv[:, None, :], axis=0)
        vis = pairs if vis is None else pairs & vis
    return vis


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(cfg: Config, q, k, v, bias, seqs: Sequences):
    out, stats = _cudnn_forward(cfg, q, k, v, bias, seqs)
    if not cfg.statistics:
        # Forward only, and nobody asked for the lse (spec.return_lse is False): the caller
        # discards this placeholder; it only keeps the structure of the differentiated path.
        return out, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    return out, _lse_from_stats(stats, seqs)


def _fused_fwd(cfg, q, k, v, bias, seqs):
    cfg = dataclasses.replace(cfg, statistics=True)  # the backward pass needs them
    q, k, v, bias, seqs = custom_vjp_primal_tree_values((q, k, v, bias, seqs))
    out, stats = _cudnn_forward(cfg, q, k, v, bias, seqs)
    return (out, _lse_from_stats(stats, seqs)), (q, k, v, bias, seqs, out, stats)


def _fused_bwd(cfg, res, cts):
    q, k, v, bias, seqs, out, stats = res
    d_out, d_lse = cts
    parts = []
    if not isinstance(d_out, SymbolicZero):
        parts.append(_cudnn_backward(cfg, q, k, v, bias, seqs, stats, out, d_out.astype(q.dtype)))
    if not isinstance(d_lse, SymbolicZero):
        parts.append(_lse_backward(cfg, q, k, bias, seqs, stats, d_lse))
    if not parts:
        return None, None, None, None, None
    dq, dk, dv, dbias = (functools.reduce(_add, grads) for grads in zip(*parts))
    dq = _zero_outside(dq, seqs.q_valid)
    dk, dv = _zero_outside(dk, seqs.kv_valid), _zero_outside(dv, seqs.kv_valid)
    if dbias is not None:
        vis = _dbias_visible(cfg, seqs, q.shape[1], k.shape[1])
        if vis is not None:
            dbias = jnp.where(vis[None, None], dbias, jnp.zeros((), dbias.dtype))
    return dq, dk, dv, dbias, None


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


# --------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------
def plan(spec: AttentionSpec, inputs: AttentionInputs) -> tuple[Config, Sequences]:
    """The cuDNN mask type, window and sequence arrays for this call."""
    left = spec.window[0]
    window_left = left if spec.causal and left >= 0 else None
    mask = "CAUSAL" if spec.causal else "NO_MASK"
    if spec.segments == "packed":
        seqs = packed_sequences(inputs.q_segment_ids, inputs.kv_segment_ids, spec.max_segments,
                                window_left)
    elif spec.segments == "padding":
        seqs = padding_sequences(inputs.q_segment_ids, inputs.kv_segment_ids, window_left)
        mask = "PADDING_" + mask if spec.causal else "PADDING"
    elif window_left is not None and spec.q_len > spec.kv_len + window_left:
        seqs = trimmed_sequences(spec.batch, spec.q_len, spec.kv_len, window_left)
        mask = "PADDING_CAUSAL"
    else:
        seqs = Sequences()  # the common case: cuDNN's call and nothing else
    sliding = None if window_left is None else window_left + 1
    return Config(spec.scale, mask, sliding, spec.causal, window_left, spec.return_lse), seqs


def attention(inputs: AttentionInputs, spec: AttentionSpec) -> tuple[jax.Array, jax.Array]:
    """Returns (out [B, T, N, Dv] in q's dtype, lse [B, N, T] float32).

    q [B, T, N, Dqk], k [B, S, K, Dqk], v [B, S, K, Dv] (bfloat16 / float16); bias, if any,
    [1, N|1, T, S] (cast to q's dtype, broadcast over heads: cuDNN's dbias needs [1, N, T, S]).
    Raises NotImplementedError with the reason for calls cuDNN cannot run (see
    `unsupported_reason`; the GPU-dependent part is checked by JAX when it lowers the call).
    """
    reason = jax_reason() or static_reason(spec)
    if reason is not None:
        raise NotImplementedError(f"cudnn cannot run this call: {reason}")
    return _attention(inputs, spec)


def _attention(inputs: AttentionInputs, spec: AttentionSpec):
    inputs = masks.without_padding(inputs)
    cfg, seqs = plan(spec, inputs)
    bias = inputs.bias
    if bias is not None:
        bias = jnp.broadcast_to(bias.astype(inputs.q.dtype),
                                (1, spec.num_heads, spec.q_len, spec.kv_len))
    out, lse = _fused(cfg, inputs.q, inputs.k, inputs.v, bias, seqs)
    if seqs.q_valid is not None:
        out = _zero_outside(out, seqs.q_valid)
        lse = jnp.where(seqs.q_valid[:, None, :], lse, EMPTY_ROW_LSE)
    if seqs.q_bad is not None:
        out = jnp.where(seqs.q_bad[:, :, None, None], jnp.asarray(np.nan, out.dtype), out)
        lse = jnp.where(seqs.q_bad[:, None, :], np.nan, lse)
    return out, lse
