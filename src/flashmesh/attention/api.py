"""`flashmesh.attention` and `flashmesh.explain`: normalise once, then dispatch.

Every user option (layout, mask string, window, descriptor, scale, softmax, dropout) becomes
one frozen `AttentionSpec` plus one `AttentionInputs` pytree here; backends see nothing else.
"""

from __future__ import annotations

import dataclasses

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from flashmesh.attention import layouts, registry
from flashmesh.attention.sequence import SequenceDescriptor
from flashmesh.attention.spec import SOFTMAX_TYPES, AttentionInputs, AttentionSpec

# mask name -> (causal, bottom-right diagonal, needs a descriptor)
MASKS: dict[str, tuple[bool, bool, bool]] = {
    "none": (False, False, False),
    "causal": (True, False, False),
    "causal_bottom_right": (True, True, False),
    "padding": (False, False, True),
    "padding_causal": (True, False, True),
    "padding_causal_bottom_right": (True, True, True),
}


def normalized_window(window, causal: bool, limit: int) -> tuple[int, int]:
    """(left, right), -1 unbounded. A side of at least `limit`, which no visible pair's position
    difference reaches, is unbounded too: (2**31, 0) and (-1, 0) are one spec and one mask."""
    if window is None:
        return (-1, 0) if causal else (-1, -1)
    if not (isinstance(window, (tuple, list)) and len(window) == 2 and all(
            isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= -1 for w in window)):
        raise ValueError(f"window must be a (left, right) pair of ints >= -1, got {window!r}")
    left, right = (int(w) for w in window)
    if causal:
        if right > 0:
            raise ValueError(f"window={tuple(window)} has right > 0, which a causal mask forbids")
        right = 0
    return (-1 if left >= limit else left, -1 if right >= limit else right)


def _real(x) -> bool:
    """A real number (numpy scalars included) but not a bool: True is no rate or cap."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_bool(name: str, x) -> None:
    if not isinstance(x, (bool, np.bool_)):  # a truthy string or array must not pick a branch
        raise ValueError(f"{name} must be a bool, got {x!r}")


def _check_float(name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")


def normalize(q, k=None, v=None, *, mask="causal", window=None, segments=None, bias=None,
              scale=None, softmax="vanilla", sink=None, logits_soft_cap=None, dropout_rate=0.0,
              dropout_rng=None, deterministic=False, layout="bshd",
              return_lse=True, reproducible=False) -> tuple[AttentionInputs, AttentionSpec]:
    """User options -> (AttentionInputs, AttentionSpec), raising ValueError on bad input."""
    if layout not in layouts.LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {sorted(layouts.LAYOUTS)}")
    q, k, v = (None if x is None else jnp.asarray(x) for x in (q, k, v))
    q, k, v = layouts.split(layout, q, k, v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_float(name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes must match, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    B, T, N, Dqk = q.shape
    _, S, K, _ = k.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}")
    if v.shape[1] != S or v.shape[2] != K:
        raise ValueError(f"v shape {v.shape} must match k shape {k.shape} in sequence and heads")
    if k.shape[3] != Dqk:
        raise ValueError(f"k head dim {k.shape[3]} must equal q head dim {Dqk}")
    if N % K:
        raise ValueError(f"num_heads={N} must be a multiple of num_kv_heads={K}")
    if min(B, T, S, N, Dqk, v.shape[3]) == 0:
        raise ValueError(f"empty dimension in q {q.shape}, k {k.shape} or v {v.shape}")

    mask = "none" if mask is None else mask
    if mask not in MASKS:
        raise ValueError(f"mask={mask!r} must be one of {sorted(MASKS)} or None")
    causal, bottom_right, needs_segments = MASKS[mask]
    if needs_segments and segments is None:
        raise ValueError(f"mask={mask!r} needs segments=SequenceDescriptor(...)")
    if layouts.is_packed(layout) and segments is None:
        raise ValueError(f"{layout=} packs several sequences per row and needs segments=...")

    q_ids = kv_ids = q_pos = kv_pos = None
    seg_kind, max_segments, canonical = None, None, True
    if segments is not None:
        if not isinstance(segments, SequenceDescriptor):
            raise ValueError(f"segments must be a SequenceDescriptor, got {type(segments).__name__}")
        if segments.batch != B:
            raise ValueError(f"segments batch {segments.batch} must equal q batch {B}")
        q_ids, kv_ids, q_pos, kv_pos = segments.to_segments(T, S, bottom_right)
        seg_kind = "padding" if segments.kind == "seqlens" else "packed"
        max_segments, canonical = segments.max_segments, segments.positions_canonical
    # Positions we derive (bottom-right shifts included) put every visible pair's difference
    # within max(T, S) - 1 either way; positions a user chose are bounded only by int32.
    win = normalized_window(window, causal, max(T, S) if canonical else 2**31 - 1)

    bias_shape = None
    if bias is not None:
        bias = jnp.asarray(bias)
        _check_float("bias", bias)
        if bias.ndim != 4 or bias.shape[0] not in (1, B) or bias.shape[1] not in (1, N) or (
                bias.shape[2:] != (T, S)):
            raise ValueError(f"bias shape {bias.shape} must be [B|1, N|1, T, S] = "
                             f"[{B}|1, {N}|1, {T}, {S}]")
        bias_shape = tuple(bias.shape)

    if scale is None:
        scale = 1.0 / math.sqrt(Dqk)
    if not _real(scale) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite real number, got {scale!r}")
    if softmax not in SOFTMAX_TYPES:
        raise ValueError(f"softmax={softmax!r} must be one of {SOFTMAX_TYPES}")
    if softmax == "learnable":
        if sink is None:
            raise ValueError("softmax='learnable' needs sink=[num_heads] logits")
        sink = jnp.asarray(sink)
        _check_float("sink", sink)
        if sink.shape != (N,):
            raise ValueError(f"sink shape {sink.shape} must be (num_heads,) = ({N},)")
    elif sink is not None:
        raise ValueError(f"sink is only used with softmax='learnable', got softmax={softmax!r}")
    cap = logits_soft_cap
    if cap is not None and not (_real(cap) and 0 < cap < math.inf):
        raise ValueError(f"logits_soft_cap must be a positive finite number or None, got {cap!r}")

    if not (_real(dropout_rate) and 0.0 <= dropout_rate < 1.0):
        raise ValueError(f"dropout_rate must be a real number in [0, 1), got {dropout_rate!r}")
    _check_bool("deterministic", deterministic)
    _check_bool("return_lse", return_lse)
    _check_bool("reproducible", reproducible)
    seed = None
    if deterministic:
        dropout_rate = 0.0
    elif dropout_rate > 0:
        if dropout_rng is None:
            raise ValueError(f"dropout_rate={dropout_rate} while training needs dropout_rng "
                             "(or deterministic=True)")
        seed = _seed(dropout_rng)

    spec = AttentionSpec(
        batch=B, q_len=T, kv_len=S, num_heads=N, num_kv_heads=K, qk_dim=Dqk, v_dim=v.shape[3],
        dtype=jnp.dtype(q.dtype).name, scale=float(scale), window=win, bottom_right=bottom_right,
        softmax=softmax, logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        dropout_rate=float(dropout_rate), bias_shape=bias_shape, segments=seg_kind,
        max_segments=max_segments, positions_canonical=canonical, return_lse=bool(return_lse),
        reproducible=reproducible)
    inputs = AttentionInputs(q=q, k=k, v=v, bias=bias, sink=sink, q_segment_ids=q_ids,
                             kv_segment_ids=kv_ids, q_positions=q_pos, kv_positions=kv_pos,
                             dropout_seed=seed)
    return inputs, spec


def _seed(rng) -> jax.Array:
    """Two uint32 words from one typed or raw PRNG key (or an integer seed)."""
    if isinstance(rng, numbers.Integral) and not isinstance(rng, bool):
        rng = jax.random.key(rng)
    rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
    typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
    one_key = rng.shape == () if typed else (rng.dtype == jnp.uint32 and rng.shape == (2,))
    if not one_key:  # a batch (jax.random.split) would fail deep inside jax.random.bits
        raise ValueError(f"dropout_rng must be a PRNG key: one typed key of shape () or uint32 of "
                         f"shape (2,), got dtype {rng.dtype} shape {rng.shape}")
    return jax.random.bits(rng if typed else jax.random.wrap_key_data(rng), (2,), jnp.uint32)


def attention(
    q: Float[Array, "B T N Dqk"] | Any,
    k: Float[Array, "B S K Dqk"] | None = None,
    v: Float[Array, "B S K Dv"] | None = None,
    *,
    mask: str | None = "causal",
    window: tuple[int, int] | None = None,
    segments: SequenceDescriptor | None = None,
    bias: Float[Array, "#B #N T S"] | None = None,
    scale: float | None = None,
    softmax: str = "vanilla",
    sink: Float[Array, "N"] | None = None,
    logits_soft_cap: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = False,
    layout: str = "bshd",
    implementation: str | None = None,
    return_lse: bool = False,
    reproducible: bool = False,
):
    """Fused scaled dot-product attention.

    Shapes (layout "bshd"): q [B, T, N, Dqk], k [B, S, K, Dqk], v [B, S, K, Dv], with N a
    multiple of K (MHA K = N, GQA, MQA K = 1) and Dv possibly != Dqk (MLA). Output
    [B, T, N, Dv] in q's dtype. B batch, T query length, S key length, N query heads,
    K key/value heads.

    Args:
      q, k, v: the arrays, laid out as `layout` says. Packed layouts pass the packed array as q
        (`bs3hd`, `sb3hd`, `t3hd`: [B, S, 3, N, H]) or k (`bshd_bs2hd`, `sbhd_sb2hd`,
        `thd_t2hd`: [B, S, 2, K, H]) and None for the rest. `sbhd` is sequence-major. THD
        layouts are batch-major rows that pack several sequences and need `segments`.
      mask: "none" (or None), "causal" (query i sees keys <= i, top-left diagonal),
        "causal_bottom_right" (the diagonal ends at the last query and key, for T != S), and
        "padding", "padding_causal", "padding_causal_bottom_right" (same, requiring segments).
      window: (left, right): query at position i sees keys at [i - left, i + right]; -1 is
        unbounded, and so is any side of at least max(T, S) (e.g. 2**31) with the positions
        flashmesh derives. With a causal mask right must be 0 or -1.
      segments: a `SequenceDescriptor`: padding lengths, packed offsets or segment ids and
        positions. Tokens attend only within their own segment; id 0 is padding. Bottom-right
        masks align each segment's diagonal to its last query and key in every form; explicit
        segment positions must then be canonical (see `SequenceDescriptor`).
      bias: added to the scaled logits, broadcastable as [B|1, N|1, T, S]; it gets a gradient.
      scale: logit scale, default 1 / sqrt(Dqk).
      softmax: "vanilla"; "off_by_one" (denominator + 1); "learnable" (denominator +
        exp(sink[n]); `sink` [N] gets a gradient).
      logits_soft_cap: c in s -> c * tanh(s / c), applied after scale and bias.
      dropout_rate, dropout_rng: attention-probability dropout from one PRNG key (typed,
        uint32 [2], or an int seed). Which probabilities drop is a hash of the key and the
        call's own (b, n, i, j) indices, identical on every implementation. Under jit on
        sharded arrays those indices are global; inside `shard_map` they are the shard's
        local ones, so shards given one key drop the same elements: give each its own key,
        e.g. `jax.random.fold_in(key, jax.lax.axis_index("data"))`.
      deterministic: a bool; True turns dropout off.
      implementation: None picks the fastest that supports the call on this device (see
        `explain`); a name ("cudnn", "chunked", "reference") runs exactly that one.
      return_lse: a bool; also return the float32 log-sum-exp [B, N, T] of the softmax
        denominator.
      reproducible: a bool; True asks for bit-identical outputs and gradients run to run (the
        same inputs, device and compiled program). The automatic choice then takes only
        implementations whose reductions run in a fixed order: `pallas_mosaic_gpu` with its
        two-kernel backward (not the fused one, whose dQ is summed by TMA reduce-adds in a
        varying order), `chunked` off a GPU (on one its backward's scatter-adds with repeated
        indices are atomics), `reference`; cuDNN refuses. Not `deterministic`,
        which is Flax's name for "no dropout".

    A query that sees no key returns exactly 0 with zero gradient.

    Example:
      >>> q = jax.random.normal(jax.random.key(0), (2, 128, 8, 64), jnp.bfloat16)
      >>> kv = jax.random.normal(jax.random.key(1), (2, 128, 2, 64), jnp.bfloat16)
      >>> out = flashmesh.attention(q, kv, kv, mask="causal", window=(32, 0))
      >>> out.shape
      (2, 128, 8, 64)
    """
    inputs, spec = normalize(q, k, v, mask=mask, window=window, segments=segments, bias=bias,
                             scale=scale, softmax=softmax, sink=sink, logits_soft_cap=logits_soft_cap,
                             dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                             deterministic=deterministic, layout=layout, return_lse=return_lse,
                             reproducible=reproducible)
    impl = registry.select(spec, implementation)
    out, lse = impl.module.attention(inputs, spec)
    out = layouts.restore(layout, out)
    return (out, lse) if return_lse else out


CONTEXT_PARALLEL_OPTIONS = ("mesh", "axis", "strategy", "order", "stripe_size", "batch_axis", "head_axis")


def explain(q, k=None, v=None, **options):
    """Which implementations can run this call on this device, which one runs, and why the
    others cannot. Takes the same arguments as `attention` (arrays or jax.ShapeDtypeStruct);
    with implementation= the one named runs, where it can.

    Given `mesh=` (and the other options of `flashmesh.context_parallel_attention`), it explains
    that call instead: the strategy chosen and why (`flashmesh.parallel.Choice`)."""
    if any(name in options for name in CONTEXT_PARALLEL_OPTIONS):
        from flashmesh.parallel import context  # the parallel layer is built on this module
        return context.explain(q, k, v, **options)
    requested = options.pop("implementation", None)
    options.pop("return_lse", None)
    specs = []

    def trace(q, k, v):  # shapes suffice: nothing is computed
        specs.append(normalize(q, k, v, **options)[1])
        return 0

    jax.eval_shape(trace, q, k, v)
    explanation = registry.explain_spec(specs[0], requested=requested)
    from flashmesh.quantization import attention as fp8, active_recipe  # built on this module
    recipe = active_recipe()
    if getattr(recipe, "fp8_dpa", False):
        reason = fp8.fp8_attention_support(q, k, v, recipe=recipe, **options)
        text = "runs cuDNN's FP8 attention" if reason is None else f"refused (NotImplementedError): {reason}"
        explanation = dataclasses.replace(explanation, fp8=text)
    return explanation
