"""`flashmesh.context_parallel_attention`: one attention call over a sequence sharded on a mesh.

Shape legend: B batch, T query length, S key length, N query heads, K key/value heads, H head
dim; cp ranks along the mesh axis `axis`.

The call takes global arrays whose sequence axis is stored in `order` (see `layouts`) and
sharded over `axis`, normalises the options once (`flashmesh.attention`'s own `normalize`),
gives every token its global identity (position, segment id, original index: `steps.Side`),
and runs one strategy per rank inside `shard_map`: `ring`, `all_gather` or `all_to_all`. Steps
run with vanilla softmax and their partials are merged through the lse; a sink is folded in once
at the end (`merge.finalize_sink`). Output and lse come back in the same order and sharding.

Descriptors. seqlens and offsets describe the sequence in its original order (flashmesh puts
their ids and positions into `order`); segment ids and positions describe the arrays as stored,
so with an order other than "contiguous" their positions must be given (TransformerEngine's
tutorial reorders ids and positions with the tensors).

`auto` picks the strategy with the fewest bytes each rank must receive (`choose_strategy`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from flashmesh.attention import api, layouts as attention_layouts
from flashmesh.attention.reference import sink_logit
from flashmesh.attention.spec import AttentionSpec
from flashmesh.parallel import layouts, schedule
from flashmesh.parallel.gather import all_gather
from flashmesh.parallel.merge import finalize_sink
from flashmesh.parallel.ring import Plan, hop_kinds, ring
from flashmesh.parallel.steps import Side, step_spec
from flashmesh.parallel.ulysses import all_to_all, kv_heads_for

STRATEGIES = ("auto", "ring", "all_gather", "all_to_all")


@dataclasses.dataclass(frozen=True)
class Choice:
    """The strategy a call runs, and why: bytes each rank receives under each strategy."""

    strategy: str
    received: dict
    hops: tuple[int, ...]
    reason: str

    def __str__(self) -> str:
        sizes = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in self.received.items())
        return f"context parallel: {self.strategy} ({self.reason}; received per rank: {sizes})"


def choose_strategy(spec: AttentionSpec, cp: int, hops: tuple[int, ...], requested: str,
                    heads_split: bool = False) -> Choice:
    """The cost model of `strategy="auto"`: the strategy whose rank receives the fewest bytes.

    ring: one K/V block per hop that runs (a halo for narrow windows), overlapped with compute;
    all_gather: every other rank's K/V, not overlapped, and the whole K/V in memory;
    all_to_all: (cp-1)/cp of the rank's q, k, v (K/V heads replicated when K % cp != 0) and
    out; it needs N % cp == 0. Ties go to the ring (its transfers hide behind compute).
    """
    item = np.dtype(spec.dtype).itemsize
    T, S = spec.q_len // cp, spec.kv_len // cp
    kv = S * spec.num_kv_heads * (spec.qk_dim + spec.v_dim) * item * spec.batch
    received = {"ring": (len(hops) - 1) * kv, "all_gather": (cp - 1) * kv}
    if spec.num_heads % cp == 0 and not heads_split:  # heads split by a tensor axis: not again
        idx = kv_heads_for(spec.num_heads, spec.num_kv_heads, cp)
        kv_heads = spec.num_kv_heads if idx is None else len(idx)
        local = spec.batch * (T * spec.num_heads * (spec.qk_dim + spec.v_dim)
                              + S * kv_heads * (spec.qk_dim + spec.v_dim)) * item
        received["all_to_all"] = (cp - 1) * local // cp
    if requested != "auto":
        return Choice(requested, received, hops, "as requested")
    best = min(received, key=lambda k: (received[k], k != "ring"))
    why = f"fewest bytes received; ring makes {len(hops)} of {cp} hops"
    return Choice(best, received, hops, why)


def _mesh(mesh) -> Mesh:
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh is None or not mesh.axis_names:
        raise ValueError("mesh=None needs an ambient mesh (jax.set_mesh); pass mesh=Mesh(...)")
    return mesh


def _check_sharding(mesh, axis: str, arrays: dict) -> None:
    """A concrete array already laid out on this mesh must shard its sequence axis (axis 1)
    over `axis`: another layout is a mistake, not something to reshard silently. Arrays with
    no mesh layout yet (host or single-device data, tracers) are placed by shard_map."""
    for name, x in arrays.items():
        sharding = getattr(x, "sharding", None)
        if isinstance(x, jax.core.Tracer) or not isinstance(sharding, jax.sharding.NamedSharding):
            continue
        if tuple(sharding.mesh.axis_names) != tuple(mesh.axis_names) or x.ndim < 2:
            continue
        spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
        seq = spec[1] if isinstance(spec[1], tuple) else (spec[1],)
        if axis not in seq:
            raise ValueError(f"{name} is sharded as {sharding.spec}, expected its sequence axis "
                             f"(axis 1) sharded over {axis!r}")


def _place(tree, mesh, spec_tree):
    """On a mesh of Explicit axes, arrays must already have shard_map's in_specs: reshard them
    (a no-op when they do). Auto axes need nothing: shard_map places the arrays itself."""
    if tree is None or not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return tree
    def one(spec, x):
        if x is None:
            return None
        return jax.reshard(x, jax.sharding.NamedSharding(mesh, spec) if isinstance(mesh, Mesh) else spec)
    return jax.tree.map(one, spec_tree, tree, is_leaf=lambda x: isinstance(x, P) or x is None)


def _positions(spec: AttentionSpec, q_pos, kv_pos, B: int):
    """Global positions [B, T] and [B, S] in original order (implicit ones made explicit)."""
    if q_pos is None:
        q_pos = jnp.broadcast_to(jnp.arange(spec.q_len, dtype=jnp.int32) + spec.diagonal_offset, (B, spec.q_len))
    if kv_pos is None:
        kv_pos = jnp.broadcast_to(jnp.arange(spec.kv_len, dtype=jnp.int32), (B, spec.kv_len))
    return q_pos, kv_pos


def context_parallel_attention(q, k=None, v=None, *, mesh=None, axis: str = "cp", strategy: str = "auto",
                               order: str = "contiguous", stripe_size: int | None = None,
                               batch_axis: str | None = None, head_axis: str | None = None,
                               implementation: str | None = None, return_lse: bool = False, **options):
    """Attention over a sequence sharded along mesh axis `axis`, equal to `flashmesh.attention`
    on one device.

    Args:
      q, k, v: global arrays (any layout `flashmesh.attention` takes), sequence stored in `order`
        and sharded over `axis`; batch may be sharded over `batch_axis` and heads over
        `head_axis` (P(batch_axis, axis, head_axis, None)).
      mesh: the mesh (default: the ambient one of `jax.set_mesh`).
      strategy: "ring", "all_gather", "all_to_all" (needs num_heads % cp == 0) or "auto"
        (`choose_strategy`).
      order, stripe_size: "contiguous", "dual_chunk" or "striped" (stripes of stripe_size
        tokens), as `reorder_for_context_parallel` produced.
      implementation: the single-device implementation of each step (None: the registry's
        choice for the step).
      return_lse: also return the log-sum-exp [B, N, T], in the same order and sharding.
      **options: every other option of `flashmesh.attention` (mask, window, segments, bias,
        scale, softmax, sink, logits_soft_cap, dropout_rate, dropout_rng, deterministic,
        layout, reproducible), with the same meaning. Dropout drops what one device drops for
        the same rng (the hash sees global token and head numbers); with `batch_axis`, give
        each data shard its own key as for any data-parallel dropout. reproducible=True on a
        GPU: the automatic choice of a step has only `reference` (cuDNN and chunked refuse,
        `pallas_mosaic_gpu` is not yet chosen inside steps), so name
        implementation="pallas_mosaic_gpu" for long sequences.

    Example:
      >>> mesh = jax.make_mesh((4,), ("cp",))
      >>> out = flashmesh.context_parallel_attention(q, k, v, mesh=mesh, mask="causal")
    """
    mesh = _mesh(mesh)
    segments = options.get("segments")
    layout = options.get("layout", "bshd")
    inputs, spec = api.normalize(q, k, v, **options, return_lse=True)
    plan = _plan(spec, mesh, axis, strategy, order, stripe_size, batch_axis, head_axis, segments)
    _check_sharding(mesh, axis, {"q": q, "k": k, "v": v})
    if segments is not None:
        _check_sharding(mesh, axis, {f"segments.{f}": getattr(segments, f) for f in (
            "q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions")})
    cp, stripe_size, choice, kinds = plan.cp, plan.stripe_size, plan.choice, plan.kinds
    tp, dp = plan.tp, plan.dp

    # Every token's global identity, in stored order.
    B = spec.batch
    reorder = (lambda x: x) if (segments is not None and segments.kind == "segment_ids") else (
        lambda x: layouts.reorder_for_context_parallel(x, order, cp, 1, stripe_size))
    needs_positions = spec.has_window
    q_pos, kv_pos = inputs.q_positions, inputs.kv_positions
    if needs_positions:
        q_pos, kv_pos = _positions(spec, q_pos, kv_pos, B)
    q_ids, kv_ids = inputs.q_segment_ids, inputs.kv_segment_ids
    q_side = Side(None if q_ids is None else reorder(q_ids), None if q_pos is None else reorder(q_pos),
                  jnp.asarray(layouts.global_token_index(order, cp, spec.q_len, stripe_size), jnp.int32))
    kv_side = Side(None if kv_ids is None else reorder(kv_ids), None if kv_pos is None else reorder(kv_pos),
                   jnp.asarray(layouts.global_token_index(order, cp, spec.kv_len, stripe_size), jnp.int32))

    n_local, k_local = spec.num_heads // tp, spec.num_kv_heads // tp
    T, S = spec.q_len // cp, spec.kv_len // cp
    bias = inputs.bias
    seq = P(batch_axis, axis)
    qkv = P(batch_axis, axis, head_axis, None)
    bias_spec = None if bias is None else P(batch_axis if bias.shape[0] > 1 else None,
                                            head_axis if bias.shape[1] > 1 else None, axis, None)

    def per_rank(q, k, v, bias, q_side, kv_side, seed):
        head_index = None
        if head_axis is not None:
            head_index = jax.lax.axis_index(head_axis) * n_local + jnp.arange(n_local, dtype=jnp.int32)
        local = dataclasses.replace(spec, batch=spec.batch // dp, num_heads=n_local, num_kv_heads=k_local)
        return run_strategy(choice.strategy, local, axis, cp, implementation, choice.hops, kinds,
                            q, k, v, bias, q_side, kv_side, seed, head_index)

    side_spec = Side(None if q_side.ids is None else seq, None if q_side.positions is None else seq, P(axis))
    kv_side_spec = Side(None if kv_side.ids is None else seq, None if kv_side.positions is None else seq, P(axis))
    seed = inputs.dropout_seed
    f = jax.shard_map(per_rank, mesh=mesh,
                      in_specs=(qkv, qkv, qkv, bias_spec, side_spec, kv_side_spec, None if seed is None else P()),
                      out_specs=(qkv, P(batch_axis, head_axis, axis)))
    args = (inputs.q, inputs.k, inputs.v, bias, q_side, kv_side, seed)
    specs = (qkv, qkv, qkv, bias_spec, side_spec, kv_side_spec, None if seed is None else P())
    out, lse = f(*(_place(a, mesh, sp) for a, sp in zip(args, specs)))
    out, lse = finalize_sink(out, lse, sink_logit(spec, inputs.sink, out.dtype))
    out = attention_layouts.restore(layout, out.astype(inputs.q.dtype))
    return (out, lse) if return_lse else out


def run_strategy(strategy: str, spec: AttentionSpec, axis: str, cp: int, implementation, hops, kinds,
                 q, k, v, bias, q_side: Side, kv_side: Side, seed, head_index):
    """(out, lse) in float32 of one rank's queries, inside shard_map over `axis`. `spec` has the
    global lengths and the rank's batch and heads; the arrays are the rank's shards (bias: its
    query rows, every key column)."""
    T, S = spec.q_len // cp, spec.kv_len // cp
    N, K = spec.num_heads, spec.num_kv_heads

    def bias_shape(heads, t, s):
        return None if bias is None else (bias.shape[0], heads if bias.shape[1] > 1 else 1, t, s)

    if strategy == "ring":
        plan = Plan(step_spec(spec, T, S, bias_shape(N, T, S)), implementation, axis, cp, hops, kinds)
        return ring(plan, q, k, v, bias, q_side, kv_side, seed, head_index)
    if strategy == "all_gather":
        step = step_spec(spec, T, spec.kv_len, bias_shape(N, T, spec.kv_len))
        return all_gather(step, implementation, axis, q, k, v, bias, q_side, kv_side, seed, head_index)
    idx = kv_heads_for(N, K, cp)
    step = step_spec(dataclasses.replace(spec, num_heads=N // cp, num_kv_heads=(K if idx is None else len(idx)) // cp),
                     spec.q_len, spec.kv_len, bias_shape(N // cp, spec.q_len, spec.kv_len))
    return all_to_all(step, implementation, axis, cp, q, k, v, bias, q_side, kv_side, seed)


def static_pairs(spec: AttentionSpec, cp: int, order: str, stripe_size):
    """(hops, kinds) from the static mask: which ring hops run and what each rank does there.

    Without segments the schedule is exact. With segments, positions restart in every document,
    so the static table says nothing: every hop runs and each rank decides at run time."""
    if spec.segments is not None:
        hops = tuple(range(cp))
        return hops, hop_kinds(np.ones((cp, cp), np.int64), hops, order, spec.window, spec.q_len,
                               spec.kv_len, segments=True)
    sched = schedule.static_schedule(cp, order, spec.q_len, spec.kv_len, window=spec.window,
                                     bottom_right=spec.bottom_right, stripe_size=stripe_size)
    hops = sched.ring_hops
    return hops, hop_kinds(sched.counts, hops, order, spec.window, spec.q_len, spec.kv_len, segments=False)


class _Plan(NamedTuple):
    cp: int
    tp: int
    dp: int
    stripe_size: int | None
    choice: Choice
    kinds: tuple


def _plan(spec: AttentionSpec, mesh, axis, strategy, order, stripe_size, batch_axis, head_axis,
          segments=None) -> _Plan:
    """The checks of a context-parallel call and its strategy, shared by the call and `explain`
    (so explain says what the call runs, or raises what the call raises)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}")
    if segments is not None and segments.kind == "segment_ids" and order != "contiguous" and (
            segments.q_positions is None):
        raise ValueError(f"segments from segment ids with order={order!r} need segment_pos: ids of "
                         "reordered arrays do not tell where a token sits in its document")
    for name, a in (("axis", axis), ("batch_axis", batch_axis), ("head_axis", head_axis)):
        if a is not None and a not in mesh.axis_names:
            raise ValueError(f"{name}={a!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    cp = mesh.shape[axis]
    stripe_size = layouts.check_order(order, cp, spec.q_len, stripe_size, length_name="q sequence length")
    layouts.check_order(order, cp, spec.kv_len, stripe_size, length_name="k sequence length")
    tp = 1 if head_axis is None else mesh.shape[head_axis]
    dp = 1 if batch_axis is None else mesh.shape[batch_axis]
    for name, size, n in (("num_heads", spec.num_heads, tp), ("num_kv_heads", spec.num_kv_heads, tp),
                          ("batch", spec.batch, dp)):
        if size % n:
            raise ValueError(f"{name}={size} must be a multiple of the mesh axis size {n}")
    hops, kinds = static_pairs(spec, cp, order, stripe_size)
    choice = choose_strategy(spec, cp, hops, strategy, heads_split=head_axis is not None)
    if choice.strategy == "all_to_all" and head_axis is not None:
        raise NotImplementedError("strategy='all_to_all' with head_axis: the heads are already split")
    if choice.strategy == "all_to_all" and (spec.num_heads // tp) % cp:
        raise ValueError(f"strategy='all_to_all' needs num_heads per rank ({spec.num_heads // tp}) to be a "
                         f"multiple of cp={cp}")
    return _Plan(cp, tp, dp, stripe_size, choice, kinds)


def explain(q, k=None, v=None, *, mesh=None, axis="cp", strategy="auto", order="contiguous",
            stripe_size=None, batch_axis=None, head_axis=None, **options) -> Choice:
    """The strategy `context_parallel_attention` runs for these arguments, and why (or the
    error the call raises)."""
    mesh = _mesh(mesh)
    options.pop("implementation", None)
    options.pop("return_lse", None)
    specs = []
    jax.eval_shape(lambda q, k, v: specs.append(api.normalize(q, k, v, **options)[1]) or 0, q, k, v)
    return _plan(specs[0], mesh, axis, strategy, order, stripe_size, batch_axis, head_axis,
                 options.get("segments")).choice


