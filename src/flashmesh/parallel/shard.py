"""The per-shard form of context parallelism, for use inside a user's own `shard_map`.

Shape legend (per rank): B batch, T local queries, S local keys, N query heads, K key/value
heads, H head dim; cp = the size of the mesh axis `axis`.

`context_parallel_attention` wraps this in a `shard_map` of its own; a model that is already
inside one (its layers written per shard, as in Megatron-style code) calls `context_parallel_shard`
on its local shards instead. The arrays are this rank's pieces of sequences stored in `order`;
positions and token indices follow from the rank's index, or, with packed documents, from the
descriptor, which then holds this rank's segment ids and their positions within each document
(`SequenceDescriptor.from_segment_ids_and_pos(local_ids, local_positions)`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from flashmesh.attention import api, layouts as attention_layouts
from flashmesh.attention.reference import sink_logit
from flashmesh.parallel import layouts
from flashmesh.parallel.context import STRATEGIES, static_pairs, choose_strategy, run_strategy
from flashmesh.parallel.merge import finalize_sink
from flashmesh.parallel.steps import Side


def context_parallel_shard(q, k=None, v=None, *, axis: str = "cp", strategy: str = "ring",
                           order: str = "contiguous", stripe_size: int | None = None,
                           implementation: str | None = None, return_lse: bool = False, **options):
    """This rank's attention output [B, T, N, Dv] (and lse [B, N, T]) inside `shard_map`.

    Args: as `flashmesh.context_parallel_attention`, with q, k, v (and bias rows, [B|1, N|1, T,
    cp * S]) being this rank's shards, and segments (if any) given as this rank's segment ids
    and positions. strategy "auto" is refused here: each rank would have to agree on it, so
    name one.
    """
    if strategy not in STRATEGIES or strategy == "auto":
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES[1:]} inside shard_map")
    segments = options.get("segments")
    if segments is not None and segments.kind != "segment_ids":
        raise ValueError("segments inside shard_map must be this rank's segment ids and positions "
                         f"(SequenceDescriptor.from_segment_ids_and_pos), got the {segments.kind!r} form")
    if segments is not None and segments.q_positions is None:
        raise ValueError("segments inside shard_map need segment_pos: a rank's ids alone do not tell "
                         "where its tokens sit in their documents")
    cp = lax.axis_size(axis)
    r = lax.axis_index(axis)
    layout = options.get("layout", "bshd")
    bias = options.pop("bias", None)  # its columns are every rank's keys: checked here
    inputs, local = api.normalize(q, k, v, **options, return_lse=True)
    T, S = local.q_len, local.kv_len
    if bias is not None:
        bias = jnp.asarray(bias)
        B, N = local.batch, local.num_heads
        if bias.ndim != 4 or bias.shape[0] not in (1, B) or bias.shape[1] not in (1, N) or (
                bias.shape[2:] != (T, S * cp)):
            raise ValueError(f"bias shape {bias.shape} must be [B|1, N|1, T, cp * S] = "
                             f"[{B}|1, {N}|1, {T}, {S * cp}] inside shard_map")
        inputs = dataclasses.replace(inputs, bias=bias.astype(inputs.q.dtype))
    # A window is unbounded only when it spans the whole sequence, not this rank's piece of it.
    causal = api.MASKS["none" if options.get("mask", "causal") is None else options.get("mask", "causal")][0]
    limit = max(T, S) * cp if local.positions_canonical else 2**31 - 1
    window = api.normalized_window(options.get("window"), causal, limit)
    spec = dataclasses.replace(local, q_len=T * cp, kv_len=S * cp, window=window)
    stripe_size = layouts.check_order(order, cp, spec.q_len, stripe_size, length_name="q sequence length")
    layouts.check_order(order, cp, spec.kv_len, stripe_size, length_name="k sequence length")

    def index(length, local_len):  # this rank's original token indices, [local_len] int32
        table = jnp.asarray(layouts.global_token_index(order, cp, length, stripe_size), jnp.int32)
        return lax.dynamic_slice_in_dim(table, r * local_len, local_len)

    q_index, kv_index = index(spec.q_len, T), index(spec.kv_len, S)
    q_pos, kv_pos = inputs.q_positions, inputs.kv_positions
    if spec.has_window and q_pos is None:  # positions follow from the token indices
        q_pos = jnp.broadcast_to(q_index + spec.diagonal_offset, (spec.batch, T))
        kv_pos = jnp.broadcast_to(kv_index, (spec.batch, S))
    q_side = Side(inputs.q_segment_ids, q_pos, q_index)
    kv_side = Side(inputs.kv_segment_ids, kv_pos, kv_index)
    hops, kinds = static_pairs(spec, cp, order, stripe_size)
    choice = choose_strategy(spec, cp, hops, strategy)
    if choice.strategy == "all_to_all" and spec.num_heads % cp:
        raise ValueError(f"strategy='all_to_all' needs num_heads ({spec.num_heads}) to be a multiple of cp={cp}")
    out, lse = run_strategy(choice.strategy, spec, axis, cp, implementation, choice.hops, kinds,
                            inputs.q, inputs.k, inputs.v, inputs.bias, q_side, kv_side, inputs.dropout_seed, None)
    out, lse = finalize_sink(out, lse, sink_logit(spec, inputs.sink, out.dtype))
    out = attention_layouts.restore(layout, out.astype(inputs.q.dtype))
    return (out, lse) if return_lse else out

