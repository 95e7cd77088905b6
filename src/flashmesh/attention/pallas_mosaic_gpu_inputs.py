"""What the Mosaic GPU attention kernels take, checked and prepared in XLA before a launch:
the spec of a band-mask call, the arguments' checks (dropout row hashes, bias, segment tables,
sink), the first two rounds of the dropout hash, and zero-padding to the tiles.

Shape legend: B batch, T query length, S key length, N query heads.

The forward (pallas_mosaic_gpu_sm90), backward (_sm90_bwd) and window (_sm90_window) wrappers
share these, so a call is refused with the same one-line ValueError whichever kernel runs it.

Example:
    >>> spec = spec_for(q, k, v, scale=0.125, window=(-1, 0))
    >>> dropout_row_hash(spec, seed).shape   # with dropout: uint32 [B, N, T]
"""

from __future__ import annotations

import jax.numpy as jnp

from flashmesh.attention import masks
from flashmesh.attention import pallas_mosaic_gpu_tokens as tokens
from flashmesh.attention.pallas_mosaic_gpu_common import in_place
from flashmesh.attention.spec import AttentionInputs, AttentionSpec

DROPOUT_BATCH_MULT, DROPOUT_KEY_MULT = masks.DROPOUT_BATCH_MULT, masks.DROPOUT_KEY_MULT


def dropout_row_hash(spec: AttentionSpec, seed, *, q_index=None, head_index=None):
    """The first two rounds of masks.dropout_keep (per batch and head, then per query row), the
    same operations in the same order: uint32 [B, N, T]. The kernels finish the hash per key
    pair with `dropout_keep`.

    seed: uint32 [2] (AttentionInputs.dropout_seed); q_index [T], head_index [N] int32 or None:
    the global query and head numbers the hash sees (context parallelism), as
    masks.dropout_numbers takes them.
    """
    if seed is None or seed.shape != (2,) or seed.dtype != jnp.uint32:
        raise ValueError(f"dropout needs seed uint32 of shape (2,), got "
                         f"{None if seed is None else (seed.dtype, seed.shape)}")
    u = jnp.uint32
    numbers = AttentionInputs(q=None, k=None, v=None, q_index=q_index, head_index=head_index)
    n, i, _ = masks.dropout_numbers(numbers, jnp.arange(spec.num_heads), jnp.arange(spec.q_len), 0)
    b = jnp.arange(spec.batch).astype(u)[:, None, None]
    h = masks.mix32(seed[0] ^ masks.mix32(b * u(DROPOUT_BATCH_MULT) + n.astype(u)[None, :, None]))
    return masks.mix32(h ^ seed[1] ^ i.astype(u)[None, None, :])


def spec_for(q, k, v, *, scale: float, window=(-1, -1), bottom_right: bool = False,
             logits_soft_cap: float | None = None, softmax: str = "vanilla",
             dropout_rate: float = 0.0) -> AttentionSpec:
    """The AttentionSpec of a band-mask call (ValueError for inconsistent shapes)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be 4-D [B, T|S, N|K, H], got {q.shape=}, {k.shape=}, {v.shape=}")
    B, T, N, Dqk = q.shape
    S, K, Dv = k.shape[1], k.shape[2], v.shape[3]
    if k.shape != (B, S, K, Dqk) or v.shape != (B, S, K, Dv):
        raise ValueError(f"k.shape={k.shape} and v.shape={v.shape} must be {(B, S, K, Dqk)} and "
                         f"{(B, S, K, Dv)} (from q.shape={q.shape})")
    if N % K:
        raise ValueError(f"num_heads={N} must be a multiple of num_kv_heads={K}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    cap = None if logits_soft_cap is None else float(logits_soft_cap)
    return AttentionSpec(B, T, S, N, K, Dqk, Dv, jnp.dtype(q.dtype).name, float(scale),
                         window=tuple(window), bottom_right=bottom_right, softmax=softmax,
                         logits_soft_cap=cap, dropout_rate=float(dropout_rate))


def check_dropout_hash(spec: AttentionSpec, dropout_hash) -> None:
    """ValueError unless dropout_hash is uint32 [B, N, T] exactly when the spec has dropout."""
    if not spec.has_dropout:
        if dropout_hash is not None:
            raise ValueError("dropout_hash must be None for dropout_rate=0")
        return
    shape = (spec.batch, spec.num_heads, spec.q_len)
    if dropout_hash is None or dropout_hash.shape != shape or dropout_hash.dtype != jnp.uint32:
        got = None if dropout_hash is None else (dropout_hash.dtype, dropout_hash.shape)
        raise ValueError(f"dropout_rate={spec.dropout_rate} needs dropout_hash uint32 {shape} "
                         f"(dropout_row_hash), got {got}")


def check_bias(spec: AttentionSpec, bias) -> None:
    """ValueError unless `bias` is a float array of spec.bias_shape exactly when it has one."""
    if spec.bias_shape is None:
        if bias is not None:
            raise ValueError("bias must be None for a spec without bias_shape")
        return
    if bias is None or bias.shape != spec.bias_shape or not jnp.issubdtype(bias.dtype, jnp.floating):
        got = None if bias is None else (bias.dtype, bias.shape)
        raise ValueError(f"bias must be a float array of shape {spec.bias_shape}, got {got}")


def check_sink(spec: AttentionSpec, sink) -> None:
    """ValueError unless `sink` is float32-castable [N] exactly when softmax is "learnable"."""
    if spec.softmax != "learnable":
        if sink is not None:
            raise ValueError(f"sink must be None for softmax={spec.softmax!r}")
        return
    if sink is None or sink.shape != (spec.num_heads,):
        raise ValueError(f"softmax='learnable' needs sink of shape ({spec.num_heads},), got "
                         f"{None if sink is None else sink.shape}")


def check_tables(spec: AttentionSpec, tables) -> None:
    """ValueError unless `tables` is a TokenTables of the call's shapes exactly when its mask
    reads per-token data (segments or explicit positions)."""
    if not tokens.needed(spec):
        if tables is not None:
            raise ValueError("tables must be None for a call without segments or explicit positions")
        return
    if not isinstance(tables, tokens.TokenTables):
        raise ValueError(f"segments={spec.segments!r} needs tables (pallas_mosaic_gpu_tokens."
                         f"TokenTables), got {type(tables).__name__}")
    B, T, S = spec.batch, spec.q_len, spec.kv_len
    for name, x, shape in zip(tables._fields, tables, ((B, T), (B, S), (B, T), (B, S))):
        if x.shape != shape or x.dtype != jnp.int32:
            raise ValueError(f"tables.{name} must be int32 {shape}, got {x.dtype} {x.shape}")


def pad_to(x, axis: int, multiple: int):
    extra = -x.shape[axis] % multiple
    return jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)]) if extra else x


def pad_tail(x, multiple: int, tma_tails: bool):
    """x [B, L, ...] zero-padded along L to a multiple of `multiple`, unless the kernels read it
    in place (`in_place`: tma_tails and L a multiple of 8)."""
    return x if in_place(x.shape[1], tma_tails) else pad_to(x, 1, multiple)


def inputs_dropout_hash(inputs: AttentionInputs, spec: AttentionSpec):
    """`dropout_row_hash` of a call's inputs (None without dropout); NotImplementedError for
    global key numbers (kv_index), which the kernels' per-element round does not read."""
    if not spec.has_dropout:
        return None
    if inputs.kv_index is not None:
        raise NotImplementedError(
            "pallas_mosaic_gpu: dropout with global key numbers (kv_index, context parallelism) "
            "is not implemented: the kernels hash key indices 0..S-1 from iota")
    return dropout_row_hash(spec, inputs.dropout_seed, q_index=inputs.q_index,
                            head_index=inputs.head_index)
