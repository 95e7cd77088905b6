"""TransformerEngine's `transformer_engine.jax.attention` names, mapped onto `flashmesh.attention`.

A tutorial written for TransformerEngine runs with only its import lines changed:

    from flashmesh.te.attention import (AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVLayout,
                                        SequenceDescriptor, fused_attn,
                                        is_fused_attn_kernel_available)

This module is a translation, not a second implementation: every enum's value is the native
option it stands for (see `flashmesh.te.enums`), and `fused_attn` rewrites its arguments into
one `flashmesh.attention` call. What TransformerEngine does differently is said where it happens:

* A non-padding mask type (NO_MASK, CAUSAL_MASK, CAUSAL_BOTTOM_RIGHT_MASK) on a BSHD layout
  ignores `sequence_descriptor`, as TransformerEngine documents; padding needs a PADDING_* type.
* PRE_SCALE_BIAS, softmax(scale * (qk + bias)), is passed on as the post-scale bias
  `scale * bias`: the same logits, and the bias gradient follows by the chain rule.
* `seed` may be one key or TransformerEngine's per-device keys `[num_devices, ...]` (the first
  is used). flashmesh's dropout hashes the call's local (batch, head, query, key) indices: under
  jit on sharded arrays those are global, so one key serves the whole array; inside `shard_map`
  they are the shard's own, so the key folds in the shard's index, as TransformerEngine gives
  each device its own seed (`per_shard_key`).
* A PADDING_* mask (or a THD layout) without `sequence_descriptor` is refused in
  TransformerEngine's words, before the native call.
* The context-parallel arguments (`context_parallel_axis`, `context_parallel_strategy`,
  `context_parallel_causal_load_balanced`, `stripe_size`, and the current `MeshResource` of
  `te.autocast`) select `flashmesh.context_parallel_attention` when the axis has size > 1 in
  the ambient mesh (`flashmesh.te.context_parallel` says how each maps); the reorders
  `reorder_causal_load_balancing` and its inverse are flashmesh's.
* score_mod is not mapped: any non-default value raises NotImplementedError instead of being
  dropped.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from flashmesh.attention import api, registry, varying
from flashmesh.attention.sequence import SequenceDescriptor
from flashmesh.parallel.context import context_parallel_attention
from flashmesh.quantization.attention import attend_under_autocast
from flashmesh.quantization.autocast import active_recipe
from flashmesh.te.context_parallel import (ContextParallel, context_parallel,
                                           inverse_reorder_causal_load_balancing,
                                           reorder_causal_load_balancing)
from flashmesh.te.enums import (SEQUENCE_MAJOR_LAYOUTS, AttnBiasType, AttnMaskType,
                                AttnSoftmaxType, CPStrategy, QKVFormat, QKVLayout,
                                ReorderStrategy, canonicalize, canonicalize_attn_mask_type)

__all__ = [
    "AttnBiasType", "AttnMaskType", "AttnSoftmaxType", "QKVFormat", "QKVLayout", "CPStrategy",
    "ReorderStrategy", "SequenceDescriptor", "canonicalize_attn_mask_type", "fused_attn",
    "is_fused_attn_kernel_available", "reorder_causal_load_balancing",
    "inverse_reorder_causal_load_balancing",
]

# Implementations that run on any device; every other registered one is a fused GPU kernel.
PORTABLE_IMPLEMENTATIONS = ("reference", "chunked")


def _dropout_key(seed):
    """One PRNG key from `seed`: a typed key, a raw uint32 [2] key, or TransformerEngine's
    per-device split of either (the first one is used; `per_shard_key` makes it per shard)."""
    seed = jnp.asarray(seed) if not isinstance(seed, jax.Array) else seed
    if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        if seed.ndim > 1:
            raise ValueError(f"seed must be one key or [num_devices] keys, got shape {seed.shape}")
        return seed if seed.ndim == 0 else seed[0]
    if seed.dtype != jnp.uint32 or seed.ndim not in (1, 2) or seed.shape[-1] != 2:
        raise ValueError(f"seed must be a PRNG key (uint32 [2] or [num_devices, 2]), got dtype "
                         f"{seed.dtype} shape {seed.shape}")
    return seed if seed.ndim == 1 else seed[0]


def per_shard_key(key, arrays):
    """TransformerEngine's per-device dropout seed, for flashmesh's hash of local indices.

    Outside `shard_map` the call covers the whole array and `key` is returned as is. Inside,
    the key folds in this shard's linear index over the manual mesh axes along which any of
    `arrays` differs (batch- or head-sharded axes), so shards holding different data drop
    different elements while replicas stay identical. With `check_vma=False` jax does not
    track that, and every manual axis is folded in, as TransformerEngine seeds every device.
    """
    manual = jax.sharding.get_abstract_mesh().manual_axes
    if not manual:
        return key
    axes = manual
    if varying.varying_axes(jax.lax.axis_index(manual[0])):  # empty only when check_vma=False
        differ = varying.varying_axes([jnp.asarray(x) for x in arrays if x is not None])
        axes = tuple(a for a in manual if a in differ)
    if not axes:
        return key
    index = 0
    for a in axes:
        index = index * jax.lax.axis_size(a) + jax.lax.axis_index(a)
    return jax.random.fold_in(key, index)


def _sink(softmax_offset, num_heads: int):
    """TransformerEngine's softmax_offset [1, N, 1, 1] (or [N]) as the native sink [N]."""
    softmax_offset = jnp.asarray(softmax_offset)
    if softmax_offset.shape not in ((1, num_heads, 1, 1), (num_heads,)):
        raise ValueError(f"softmax_offset shape {softmax_offset.shape} must be "
                         f"(1, {num_heads}, 1, 1) or ({num_heads},)")
    return softmax_offset.reshape(num_heads)


def native_arguments(qkv, bias, sequence_descriptor, seed, *, attn_bias_type, attn_mask_type,
                     qkv_layout, softmax_type, scaling_factor, dropout_probability, is_training,
                     max_segments_per_seq=1, window_size=None, softmax_offset=None,
                     sequence_major: bool = False) -> tuple[tuple, dict[str, Any]]:
    """`fused_attn`'s arguments as (arrays, options) of one `flashmesh.attention` call.

    `sequence_major=True` reads BSHD layouts as [s, b, ...] (DotProductAttention's
    transpose_batch_sequence), using the native sequence-major layouts.
    """
    attn_bias_type = canonicalize(AttnBiasType, attn_bias_type, "attn_bias_type")
    mask = canonicalize(AttnMaskType, attn_mask_type, "attn_mask_type")
    layout = canonicalize(QKVLayout, qkv_layout, "qkv_layout")
    softmax = canonicalize(AttnSoftmaxType, softmax_type, "softmax_type")
    try:
        scale = float(scaling_factor)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise ValueError(f"scaling_factor must be a static number, got {scaling_factor!r}") from None
    if not math.isfinite(scale):
        raise ValueError(f"scaling_factor must be finite, got {scale}")

    if not isinstance(qkv, (tuple, list)) or len(qkv) != layout.num_arrays:
        got = f"a {len(qkv)}-tuple" if isinstance(qkv, (tuple, list)) else type(qkv).__name__
        raise ValueError(f"qkv must be a tuple of {layout.num_arrays} array(s) for "
                         f"qkv_layout={layout.name}, got {got}")
    arrays = tuple(qkv) + (None,) * (3 - len(qkv))
    native_layout = layout.value
    if sequence_major:
        if layout.is_thd():
            raise ValueError(f"transpose_batch_sequence=True is not defined for qkv_layout="
                             f"{layout.name}: THD rows are batch-major")
        native_layout = SEQUENCE_MAJOR_LAYOUTS[layout]

    if mask.is_padding() and sequence_descriptor is None:
        given = repr(attn_mask_type) if isinstance(attn_mask_type, str) else str(mask)
        raise ValueError(f"attn_mask_type={given} needs "
                         "sequence_descriptor=SequenceDescriptor(...)")
    if layout.is_thd() and not mask.is_padding():
        raise ValueError(f"qkv_layout={layout.name} packs several sequences per row and needs "
                         f"a PADDING_* attn_mask_type, got {mask.name}")
    # TransformerEngine ignores the descriptor for non-padding masks on BSHD layouts.
    segments = sequence_descriptor if mask.is_padding() else None
    if segments is not None and not isinstance(segments, SequenceDescriptor):
        raise ValueError(f"sequence_descriptor must be a SequenceDescriptor (mask arrays are not "
                         f"supported; use SequenceDescriptor.from_seqlens), got "
                         f"{type(segments).__name__}")
    if not (isinstance(max_segments_per_seq, int) and max_segments_per_seq >= 1):
        raise ValueError(f"max_segments_per_seq must be a positive int, got {max_segments_per_seq!r}")
    if layout.is_thd() and segments is not None and segments.max_segments is None:
        # Under jit the segment count of segment ids is unknown; this is the static bound.
        segments = dataclasses.replace(segments, max_segments=max_segments_per_seq)
    if max_segments_per_seq > 1 and not layout.is_thd():
        warnings.warn(f"max_segments_per_seq={max_segments_per_seq} only applies to THD layouts, "
                      f"not qkv_layout={layout.name}", UserWarning, stacklevel=3)

    if attn_bias_type == AttnBiasType.NO_BIAS:
        if bias is not None:
            raise ValueError("bias must be None when attn_bias_type is NO_BIAS")
    elif bias is None:
        raise ValueError(f"attn_bias_type={attn_bias_type.name} needs a bias array")
    elif attn_bias_type == AttnBiasType.PRE_SCALE_BIAS:
        # scale * (qk + bias) == scale * qk + scale * bias: the post-scale bias scale * bias.
        bias = jnp.asarray(bias) * scale

    sink = None
    if softmax == AttnSoftmaxType.LEARNABLE_SOFTMAX:
        if softmax_offset is None:
            raise ValueError("softmax_type=LEARNABLE_SOFTMAX needs softmax_offset [1, N, 1, 1]")
        sink = _sink(softmax_offset, jnp.shape(arrays[0])[-2])  # heads are dim -2 in every layout
    elif softmax_offset is not None:
        raise ValueError(f"softmax_offset is only used with LEARNABLE_SOFTMAX, got {softmax.name}")

    dropout_rng = None
    deterministic = not is_training
    if is_training and dropout_probability > 0:
        if seed is None:
            raise ValueError(f"dropout_probability={dropout_probability} while is_training needs "
                             "a seed (PRNG key)")
        dropout_rng = per_shard_key(_dropout_key(seed), arrays)

    window = None
    if window_size is not None:
        if np.ndim(window_size) != 1 or np.shape(window_size) != (2,):
            raise ValueError(f"window_size must be a (left, right) pair or None, got {window_size!r}")
        window = (int(window_size[0]), int(window_size[1]))
        if window == (-1, -1):
            window = None

    options = dict(mask=mask.value, window=window, segments=segments, bias=bias, scale=scale,
                   softmax=softmax.value, sink=sink, dropout_rate=float(dropout_probability),
                   dropout_rng=dropout_rng, deterministic=deterministic, layout=native_layout)
    return arrays, options


def check_no_score_mod(**score_mod_args) -> None:
    given = [name for name, value in score_mod_args.items() if value is not None]
    if given:
        raise NotImplementedError(
            f"{', '.join(given)}: cuDNN frontend score_mod callbacks are not supported; "
            "flashmesh.attention offers bias, logits_soft_cap, windows and segments instead")


def call_native(qkv, bias, sequence_descriptor, seed, *, sequence_major=False,
                context_checkpoint_name="context",
                context_parallel: ContextParallel | None = None, module=None,
                reproducible: bool = False, **kwargs) -> jax.Array:
    """`native_arguments` then one native call: `flashmesh.attention`, or
    `flashmesh.context_parallel_attention` with `context_parallel`'s arguments when given.
    fused_attn without its unsupported-argument checks (the Flax module makes those itself).
    `module`: the calling Flax module, which holds the FP8 attention state when an autocast
    recipe asks for FP8 attention (`fp8_dpa`; flashmesh.quantization.attention).
    `reproducible`: flashmesh.attention's (bit-identical results run to run; not a TE option).
    """
    if context_parallel is not None and sequence_major:
        # The context-parallel call shards the sequence axis of batch-major arrays;
        # TransformerEngine too turns [s, b, ...] into [b, s, ...] before its primitive.
        qkv = tuple(jnp.swapaxes(x, 0, 1) for x in qkv)
    arrays, options = native_arguments(
        qkv, bias, sequence_descriptor, seed,
        sequence_major=sequence_major and context_parallel is None, **kwargs)
    options["reproducible"] = reproducible
    if context_parallel is None:
        out = None if module is None else attend_under_autocast(module, arrays, options)
        if out is None:
            out = api.attention(*arrays, **options)
    else:
        if getattr(active_recipe(), "fp8_dpa", False):
            raise NotImplementedError("FP8 attention (fp8_dpa=True) with context parallelism is not "
                                      "supported; use a recipe with fp8_dpa=False")
        out = context_parallel_attention(*arrays, **context_parallel.options(), **options)
        if sequence_major:
            out = jnp.swapaxes(out, 0, 1)
    # Same remat name as TransformerEngine, so checkpoint policies written for it still apply.
    return checkpoint_name(out, context_checkpoint_name)


def fused_attn(
    qkv: tuple[jax.Array, ...],
    bias: jax.Array | None,
    sequence_descriptor: SequenceDescriptor | None,
    seed: jax.Array | None,
    attn_bias_type: AttnBiasType,
    attn_mask_type: AttnMaskType,
    qkv_layout: QKVLayout,
    softmax_type: AttnSoftmaxType,
    scaling_factor: float,
    dropout_probability: float,
    is_training: bool,
    max_segments_per_seq: int = 1,
    window_size: tuple[int, int] | None = None,
    context_parallel_strategy: CPStrategy = CPStrategy.DEFAULT,
    context_parallel_causal_load_balanced: bool = False,
    context_parallel_axis: str = "",
    context_checkpoint_name: str = "context",
    softmax_offset: jax.Array | None = None,
    stripe_size: int | None = None,
    score_mod=None,
    score_mod_bprop=None,
    score_mod_tensors=None,
    score_mod_bprop_tensors=None,
) -> jax.Array:
    """TransformerEngine's `fused_attn`, computed by `flashmesh.attention` (or, over a mesh,
    `flashmesh.context_parallel_attention`).

    softmax(scaling_factor * q k^T (+ bias), masked) v, with dropout when training.

    Args:
      qkv: `(qkv_packed,)`, `(q, kv_packed)` or `(q, k, v)` as `qkv_layout` says; q
        [B, T, N, Dqk], k [B, S, K, Dqk], v [B, S, K, Dv] (N a multiple of K; Dv may differ).
      bias: [B|1, N|1, T, S] or None (with attn_bias_type NO_BIAS).
      sequence_descriptor: a `SequenceDescriptor`; required for PADDING_* masks and THD
        layouts, ignored (as in TransformerEngine) for non-padding masks on BSHD layouts.
      seed: a PRNG key for dropout (or TransformerEngine's per-device keys, of which the
        first is used); inside `shard_map` it folds in the shard's index (`per_shard_key`).
      attn_bias_type, attn_mask_type, qkv_layout, softmax_type: the enums of this module
        (their names as strings work too).
      scaling_factor: the logit scale, e.g. head_dim ** -0.5.
      dropout_probability, is_training: dropout rate; no dropout when not training.
      max_segments_per_seq: bound on sequences per THD row, used when the descriptor cannot
        count them (segment ids under jit).
      window_size: (left, right) sliding window, -1 unbounded; None or (-1, -1) = no window.
      context_parallel_axis: the mesh axis the sequence is sharded over ("": the current
        MeshResource's cp_resource, see `te.autocast`). With size > 1 in the ambient mesh
        (`jax.set_mesh`) the call is `flashmesh.context_parallel_attention`; q, k, v, the
        descriptor's ids/positions and the bias' query rows are then global arrays whose
        sequence axis is sharded over it, and the output comes back sharded the same way.
      context_parallel_strategy: CPStrategy.DEFAULT (flashmesh's cost model chooses),
        ALL_GATHER or RING.
      context_parallel_causal_load_balanced: the inputs were reordered by
        `reorder_causal_load_balancing`: with DualChunkSwap when stripe_size is None, with
        Striped and this stripe_size otherwise (THD layouts need the latter).
      stripe_size: the Striped reorder's stripe size (see above).
      context_checkpoint_name: the `checkpoint_name` of the output.
      softmax_offset: the learnable sink logits [1, N, 1, 1] for LEARNABLE_SOFTMAX (float32);
        it gets a gradient.
      score_mod*: not supported (NotImplementedError).

    Returns [B, T, N, Dv] in q's dtype.

    Example:
      >>> out = fused_attn((q, k, v), None, SequenceDescriptor.from_seqlens(lens), None,
      ...                  AttnBiasType.NO_BIAS, AttnMaskType.PADDING_CAUSAL_MASK,
      ...                  QKVLayout.BSHD_BSHD_BSHD, AttnSoftmaxType.VANILLA_SOFTMAX,
      ...                  scaling_factor=q.shape[-1] ** -0.5, dropout_probability=0.0,
      ...                  is_training=True)
    """
    check_no_score_mod(score_mod=score_mod, score_mod_bprop=score_mod_bprop,
                        score_mod_tensors=score_mod_tensors,
                        score_mod_bprop_tensors=score_mod_bprop_tensors)
    cp = context_parallel(context_parallel_strategy, context_parallel_causal_load_balanced,
                          context_parallel_axis, stripe_size,
                          canonicalize(QKVLayout, qkv_layout, "qkv_layout"))
    return call_native(
        qkv, bias, sequence_descriptor, seed, attn_bias_type=attn_bias_type,
        attn_mask_type=attn_mask_type, qkv_layout=qkv_layout, softmax_type=softmax_type,
        scaling_factor=scaling_factor, dropout_probability=dropout_probability,
        is_training=is_training, max_segments_per_seq=max_segments_per_seq,
        window_size=window_size, softmax_offset=softmax_offset,
        context_checkpoint_name=context_checkpoint_name, context_parallel=cp)


def fused_attn_explanation(is_training, q_dtype, kv_dtype, qkv_layout, attn_bias_type,
                           attn_mask_type, softmax_type, dropout_probability, q_num_heads,
                           kv_num_heads, q_max_seqlen, kv_max_seqlen, head_dim_qk, head_dim_v,
                           window_size=None) -> registry.Explanation:
    """`flashmesh.explain` for the configuration `is_fused_attn_kernel_available` describes
    (batch 1, bias [1, N, T, S]); print it to see why each implementation can or cannot run."""
    layout = canonicalize(QKVLayout, qkv_layout, "qkv_layout")
    mask = canonicalize(AttnMaskType, attn_mask_type, "attn_mask_type")
    bias_type = canonicalize(AttnBiasType, attn_bias_type, "attn_bias_type")
    softmax = canonicalize(AttnSoftmaxType, softmax_type, "softmax_type")
    T, S, N, K = q_max_seqlen, kv_max_seqlen, q_num_heads, kv_num_heads
    q = jax.ShapeDtypeStruct((1, T, N, head_dim_qk), q_dtype)
    k = jax.ShapeDtypeStruct((1, S, K, head_dim_qk), kv_dtype)
    v = jax.ShapeDtypeStruct((1, S, K, head_dim_v), kv_dtype)
    bias = None if bias_type == AttnBiasType.NO_BIAS else jax.ShapeDtypeStruct((1, N, T, S), q_dtype)
    segments = None
    if layout.is_thd():  # one packed segment per row: the structure, not the lengths, matters
        segments = SequenceDescriptor.from_seqlens_and_offsets(
            (jnp.full((1, 1), T, jnp.int32), jnp.full((1, 1), S, jnp.int32)),
            jnp.zeros((1, 1), jnp.int32))
    elif mask.is_padding():
        segments = SequenceDescriptor.from_seqlens(
            (jnp.full((1,), T, jnp.int32), jnp.full((1,), S, jnp.int32)))
    specs = []

    def trace(q, k, v, bias):  # shapes suffice: nothing is computed
        sink = jnp.zeros((1, N, 1, 1), jnp.float32) if softmax == AttnSoftmaxType.LEARNABLE_SOFTMAX else None
        arrays, options = native_arguments(
            (q, k, v), bias, segments, jax.random.key(0), attn_bias_type=bias_type,
            attn_mask_type=mask, qkv_layout=layout.to_separate(), softmax_type=softmax,
            scaling_factor=head_dim_qk ** -0.5,
            dropout_probability=dropout_probability, is_training=is_training,
            window_size=window_size, softmax_offset=sink)
        specs.append(api.normalize(*arrays, **options)[1])
        return 0

    jax.eval_shape(trace, q, k, v, bias)
    return registry.explain_spec(specs[0])


def is_fused_attn_kernel_available(is_training, q_dtype, kv_dtype, qkv_layout, attn_bias_type,
                                   attn_mask_type, softmax_type, dropout_probability, q_num_heads,
                                   kv_num_heads, q_max_seqlen, kv_max_seqlen, head_dim_qk,
                                   head_dim_v, window_size=None) -> bool:
    """Whether a fused GPU implementation (cuDNN, or any registered kernel other than the
    portable `chunked` and `reference`) can run this configuration on this device.

    flashmesh runs every configuration somewhere (the portable implementations work on any
    device), so False means "not fused here", never "unsupported". `fused_attn_explanation`
    with the same arguments gives each implementation's reason.
    """
    explanation = fused_attn_explanation(
        is_training, q_dtype, kv_dtype, qkv_layout, attn_bias_type, attn_mask_type, softmax_type,
        dropout_probability, q_num_heads, kv_num_heads, q_max_seqlen, kv_max_seqlen, head_dim_qk,
        head_dim_v, window_size)
    return any(row.reason is None for row in explanation.rows
               if row.name not in PORTABLE_IMPLEMENTATIONS)
