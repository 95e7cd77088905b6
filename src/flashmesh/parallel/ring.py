"""The ring strategy: K/V blocks travel around the ranks; queries stay home.

Shape legend (per rank): B batch, T local queries, S local keys, N query heads, K key/value
heads, H head dim; cp ranks along the mesh axis.

Forward. At hop d rank r holds the K/V block (and its ids, positions and token indices) of rank
s = (r - d) mod cp, attends its queries to it (one `steps.attend` call returning lse) and merges
the partial result in float32 through the lse (`merge.merge_partials`). The block for the next
hop is sent (`ppermute`) before the current one is used, so XLA can overlap the transfer with
the step's compute. Only hops that have a visible pair on some rank run (`Plan.hops`: with a
window narrower than a shard, a halo of 1 + ceil(window / shard) hops instead of cp), and a
rank whose pair is empty at a hop skips the compute; a pair whose keys are all visible runs
with no mask, and a rank's own block with its local mask where positions allow (`hop_kinds`:
statically from the schedule, so those steps can run on cuDNN; packed documents are tested at
run time from their id and position ranges).

Backward (a custom VJP, after ring-flash-attention). The forward keeps only its own q, k, v, the
merged out and lse. The backward sends the K/V blocks around again, each with float32 dK/dV
accumulators that travel with it; at each hop `steps.attend_backward` computes the hop's
gradients from the merged statistics alone (FlashAttention's backward: p = e^(s - lse), delta =
g_out . out - g_lse), without re-running the hop's forward where the implementation offers
that (chunked does); after the last hop the accumulators take one more `ppermute` home. So a rank holds at most
its own K/V, the one in use and the one arriving, never the whole sequence, and autodiff does
not keep every hop's block alive. Any per-step implementation with a VJP can run the steps.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashmesh.attention import varying
from flashmesh.attention.spec import AttentionSpec, compute_dtype
from flashmesh.parallel import steps
from flashmesh.parallel.merge import merge_partials
from flashmesh.parallel.steps import Side


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static part of a ring call (hashable).

    spec: the spec of one step (local lengths, explicit positions, vanilla softmax).
    hops: the hops d that run, ascending, starting at 0.
    kinds: for each hop, each rank's kind of step (`KINDS`), from the static schedule.
    """

    spec: AttentionSpec
    implementation: str | None
    axis: str
    cp: int
    hops: tuple[int, ...]
    kinds: tuple[tuple[str, ...], ...]


# What a rank does at a hop. "empty": no visible pair (nothing computed). "full": every pair
# visible, so the step runs with no mask at all. "local": the rank's own block whose mask in
# local indices is the call's own (a contiguous shard, or any order under a plain causal mask:
# positions rise within a rank), so the step needs no positions. "positions": the general case,
# global positions passed explicitly. The first three can run on cuDNN, the last needs an
# implementation that reads positions. "dynamic": packed segments, decided at run time.
KINDS = ("empty", "full", "local", "positions", "dynamic")


def hop_kinds(counts: np.ndarray, hops, order: str, window, q_len: int, kv_len: int, segments: bool):
    """kinds[i][r] for hop hops[i] and query rank r, from the exact pair counts [cp, cp]."""
    cp = counts.shape[0]
    T, S = q_len // cp, kv_len // cp
    local_ok = T == S and (order == "contiguous" or tuple(window) == (-1, 0))
    kinds = []
    for d in hops:
        row = []
        for r in range(cp):
            c = counts[r, (r - d) % cp]
            if segments:
                row.append("dynamic")
            elif c == 0:
                row.append("empty")
            elif c == T * S:
                row.append("full")
            elif d == 0 and local_ok:
                row.append("local")
            else:
                row.append("positions")
        kinds.append(tuple(row))
    return tuple(kinds)


def _shift(tree, plan: Plan, delta: int):
    """Every leaf sent `delta` ranks forward around the ring."""
    if delta % plan.cp == 0:
        return tree
    perm = [(i, (i + delta) % plan.cp) for i in range(plan.cp)]
    return jax.tree.map(lambda x: lax.ppermute(x, plan.axis, perm), tree)


def _columns(bias, s, S):
    """The bias columns [.., T, S] of key rank s (bias holds every rank's columns, in order)."""
    return None if bias is None else lax.dynamic_slice_in_dim(bias, s * S, S, axis=3)


def _dispatch(plan: Plan, i: int, r, q_side: Side, kv_side: Side, compute, skip, args):
    """Runs `compute(spec, q_side, kv_side, args)` as hop i's kind for rank r says: one static
    branch per kind present at this hop (`lax.switch` on a table indexed by the rank), `skip(args)`
    for empty ones, and for packed segments a run-time test of whether the blocks can meet."""
    kinds = plan.kinds[i]
    present = sorted(set(kinds), key=KINDS.index)

    def branch(kind):
        if kind == "empty":
            return skip
        if kind == "dynamic":
            run = lambda a: compute(plan.spec, q_side, kv_side, a)  # noqa: E731
            canonical = steps.canonical_spec(plan.spec)
            if canonical is not None:
                # Documents that start inside their block (as when they align with the shards)
                # give a mask any implementation derives itself: cuDNN can run those steps.
                explicit = run
                run = lambda a: lax.cond(steps.positions_canonical(q_side) & steps.positions_canonical(kv_side),  # noqa: E731
                                         lambda a: compute(canonical, q_side, kv_side, a), explicit, a)
            return lambda a: lax.cond(steps.may_meet(plan.spec, q_side, kv_side), run, skip, a)
        if kind == "positions":
            return lambda a: compute(plan.spec, q_side, kv_side, a)
        window = (-1, -1) if kind == "full" else plan.spec.window
        spec = dataclasses.replace(plan.spec, window=window, positions_canonical=True)
        bare = lambda side: dataclasses.replace(side, positions=None)  # noqa: E731
        return lambda a: compute(spec, bare(q_side), bare(kv_side), a)

    if len(present) == 1:
        return branch(present[0])(args)
    table = jnp.asarray(np.asarray([present.index(k) for k in kinds], np.int32))
    return lax.switch(table[r], [branch(k) for k in present], args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring(plan: Plan, q, k, v, bias, q_side: Side, kv_side: Side, seed, head_index):
    """(out [B, T, N, Dv], lse [B, N, T]) of the rank's queries against every rank's keys, in
    float32 (float64 for float64 inputs). Runs inside shard_map over `plan.axis`."""
    return _forward(plan, q, k, v, bias, q_side, kv_side, seed, head_index)[0]


def _forward(plan, q, k, v, bias, q_side, kv_side, seed, head_index):
    r = lax.axis_index(plan.axis)
    S = k.shape[1]
    axes = varying.varying_axes(q, k, v, bias, q_side, kv_side, seed)
    out = lse = None
    block, at = (k, v, kv_side), 0
    for i, d in enumerate(plan.hops):
        block, at = _shift(block, plan, d - at), d
        # Send the next hop's block before this one is used: the transfer overlaps the step.
        nxt = _shift(block, plan, plan.hops[i + 1] - d) if i + 1 < len(plan.hops) else None
        kd, vd, kv_d = block
        s = (r - d) % plan.cp

        def compute(spec, q_side, kv_d, args):
            kd, vd, b = args
            return varying.like(steps.attend(spec, plan.implementation, q, kd, vd, b, q_side, kv_d,
                                             seed, head_index), axes)

        o, l = _dispatch(plan, i, r, q_side, kv_d, compute, lambda args: steps.empty_result(q, v, axes),
                         (kd, vd, _columns(bias, s, S)))
        out, lse = (o.astype(compute_dtype(q.dtype)), l) if out is None else merge_partials(out, lse, o, l)
        if nxt is not None:
            block, at = nxt, plan.hops[i + 1]
    out = out.astype(compute_dtype(q.dtype))
    return (out, lse), (q, k, v, bias, q_side, kv_side, seed, head_index, out, lse)


def _backward(plan, residuals, cotangents):
    q, k, v, bias, q_side, kv_side, seed, head_index, out, lse = residuals
    g_out, g_lse = cotangents
    ct = compute_dtype(q.dtype)
    r = lax.axis_index(plan.axis)
    S = k.shape[1]
    axes = varying.varying_axes(q, k, v, bias, q_side, kv_side, seed, out, lse, g_out, g_lse)
    g_out, g_lse = g_out.astype(ct), g_lse.astype(ct)
    dq = varying.like(jnp.zeros(q.shape, ct), axes)
    dbias = None if bias is None else varying.like(jnp.zeros(bias.shape, ct), axes)
    acc = varying.like((jnp.zeros(k.shape, ct), jnp.zeros(v.shape, ct)), axes)
    block, at = (k, v, kv_side, acc), 0
    for i, d in enumerate(plan.hops):
        block, at = _shift(block, plan, d - at), d
        kd, vd, kv_d, (dk_d, dv_d) = block
        s = (r - d) % plan.cp

        def compute(spec, q_side, kv_d, args):
            kd, vd, dq, dk_d, dv_d, dbias = args
            gq, gk, gv, gb = steps.attend_backward(spec, plan.implementation, q, kd, vd, _columns(bias, s, S),
                                                   q_side, kv_d, seed, head_index, out, lse, g_out, g_lse)
            if dbias is not None:
                cols = _columns(dbias, s, S) + gb.astype(ct)
                dbias = lax.dynamic_update_slice_in_dim(dbias, cols, s * S, axis=3)
            return varying.like((dq + gq.astype(ct), dk_d + gk.astype(ct), dv_d + gv.astype(ct), dbias), axes)

        dq, dk_d, dv_d, dbias = _dispatch(plan, i, r, q_side, kv_d, compute, lambda args: args[2:],
                                          (kd, vd, dq, dk_d, dv_d, dbias))
        block = (kd, vd, kv_d, (dk_d, dv_d))
    dk, dv = _shift(block[3], plan, -at)  # the accumulators go home
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None if bias is None else dbias.astype(bias.dtype), None, None, None, None)


ring.defvjp(_forward, _backward)
