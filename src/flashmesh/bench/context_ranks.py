"""The ring's work rank by rank on one device (issue 8, "On the H200"): does CP add compute?

With one device there is no ring to run, but every rank's compute can be: for the workload at
cp = 4 ranks in contiguous order, rank r runs exactly the per-step attention calls the ring
(`flashmesh.parallel.ring`) makes on rank r. The same `steps.attend` calls with the same step
spec (`steps.step_spec` of the call's normalised spec), the same global positions, segment ids
and token indices (`steps.Side`), the same skip test (the static schedule and `steps.may_meet`
under `lax.cond`), and at hop d the K/V block of rank (r - d) mod cp. Only the `ppermute`s are
missing: the blocks are sliced from the global arrays beforehand. Shape legend: B batch, L = T /
cp local tokens, N query heads, K key/value heads, H head dim.

Two programs per rank, timed with the one-device call in interleaved rounds:

* `steps`: the attention calls alone, back to back. Forward: each hop's step. Forward+backward:
  each hop's step and its VJP for the output gradient, which is what one device pays for that
  part of the attention.
* `ring_local`: what `ring.py` computes on the rank, transfers aside: the steps merged through
  the lse (`merge.merge_partials`); forward+backward adds the ring's backward, which runs every
  step again under `jax.vjp` with the cotangents the merge gives it (after ring-flash-attention).

The derived `sum · <program>` rows add the four ranks' medians. If the sum of the `steps` is
within 10% of the one-device call with the same implementation, the CP machinery adds no
attention compute; `ring_local` shows what the merges and the backward's recomputation add. The
steps' implementation is the registry's choice for the step spec (implementation=None), as in
the ring; when it is not the one-device call's choice, the one-device call is also timed with
the steps' implementation, so that the backend's speed and the CP machinery are told apart.

Before timing, every rank's outputs are checked against the one-device outputs: its query rows of
out and dq, and (for ring_local) dk and dv summed over the ranks that visited each block.
"""

from __future__ import annotations

import dataclasses
import gc

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashmesh.attention import api, registry
from flashmesh.attention.spec import AttentionSpec, compute_dtype
from flashmesh.bench import checks, flops, runner, timing
from flashmesh.bench.context import CPResult, Ready, baselines, checked, finish, time_rows
from flashmesh.bench.context_facts import choice, descriptor, segment_arrays
from flashmesh.bench.implementations import DTYPES
from flashmesh.bench.shapes import EMULATED_CP, ONE_DEVICE, CpRow, Group, Shape
from flashmesh.parallel import schedule, steps
from flashmesh.parallel.merge import merge_partials
from flashmesh.parallel.steps import Side

WITHIN = 0.10  # the sum of the ranks may exceed one device by this much


@dataclasses.dataclass(frozen=True)
class Ranks:
    """The static plan of the emulated ring (hashable): step spec, per-step implementation,
    ranks, hops that run and the static (query rank, key rank) table (None with segments)."""

    spec: AttentionSpec
    implementation: str
    cp: int
    hops: tuple[int, ...]
    visible: tuple[tuple[bool, ...], ...] | None


def plan_ranks(shape: Shape, q, k, v, ids, pos, cp: int = EMULATED_CP):
    """(Ranks, q_side, kv_side, inputs): the normalised call as context_parallel_attention sees it
    in contiguous order, its global sides, and the plan of its ring."""
    inputs, spec = api.normalize(q, k, v, mask=shape.mask, window=shape.window,
                                 segments=descriptor(shape, ids, pos), return_lse=True)
    B, T, S = spec.batch, spec.q_len, spec.kv_len
    q_pos, kv_pos = inputs.q_positions, inputs.kv_positions
    if spec.has_window and q_pos is None:  # implicit positions made explicit, as the ring does
        q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + spec.diagonal_offset, (B, T))
        kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    q_side = steps.Side(inputs.q_segment_ids, q_pos, jnp.arange(T, dtype=jnp.int32))
    kv_side = steps.Side(inputs.kv_segment_ids, kv_pos, jnp.arange(S, dtype=jnp.int32))
    # The hops the ring runs: explain's, on an abstract mesh of cp ranks.
    hops = choice(shape, _dtype_label(spec), cp, CpRow("ring", "contiguous"), strategy="ring").hops
    visible = None
    if spec.segments is None:
        sched = schedule.static_schedule(cp, "contiguous", T, S, window=spec.window,
                                         bottom_right=spec.bottom_right)
        visible = tuple(tuple(bool(x) for x in row) for row in sched.visible)
    step = steps.step_spec(spec, T // cp, S // cp, None)
    implementation = registry.select(step, None).name
    return Ranks(step, implementation, cp, tuple(hops), visible), q_side, kv_side, inputs


def _dtype_label(spec: AttentionSpec) -> str:
    """The bench's name of the spec's dtype ("bf16", "f32", ...)."""
    return next(name for name, dt in DTYPES.items() if jnp.dtype(dt).name == spec.dtype)


def _take(side, lo: int, n: int):
    cut = lambda x, axis: None if x is None else lax.slice_in_dim(x, lo, lo + n, axis=axis)  # noqa: E731
    return Side(cut(side.ids, 1), cut(side.positions, 1), cut(side.index, 0))


def rank_args(plan: Ranks, r: int, inputs, q_side, kv_side, do=None) -> tuple:
    """Rank r's arguments (copies, as the rank holds them): its q rows, its side, per hop the K/V
    block it holds, and (for fwd+bwd) its rows of the output gradient."""
    T, S = plan.spec.q_len, plan.spec.kv_len  # local lengths
    q_r = lax.slice_in_dim(inputs.q, r * T, (r + 1) * T, axis=1)
    blocks = []
    for d in plan.hops:
        s = (r - d) % plan.cp
        blocks.append((lax.slice_in_dim(inputs.k, s * S, (s + 1) * S, axis=1),
                       lax.slice_in_dim(inputs.v, s * S, (s + 1) * S, axis=1), _take(kv_side, s * S, S)))
    args = (q_r, _take(q_side, r * T, T), tuple(blocks))
    return args if do is None else (*args, lax.slice_in_dim(do, r * T, (r + 1) * T, axis=1))


def _meets(plan: Ranks, r: int, s: int, q_side, kv_side):
    """ring._meets for a known rank: the static pair table, and the run-time test with segments."""
    dynamic = steps.may_meet(plan.spec, q_side, kv_side) if plan.spec.segments is not None else None
    if plan.visible is None:
        return dynamic
    static = jnp.asarray(plan.visible[r][s])
    return static if dynamic is None else static & dynamic


def _hop(plan: Ranks, r: int, d: int, block, q_side, compute, skip):
    """One hop: `compute` on the block when the rank's queries may meet it, else `skip`."""
    kd, vd, kv_d = block
    return lax.cond(_meets(plan, r, (r - d) % plan.cp, q_side, kv_d), compute, skip, (kd, vd, kv_d))


def program_key(plan: Ranks, r: int) -> tuple | None:
    """What rank r's program depends on beyond its arguments' shapes: the static pair table at
    each hop (None with segments, whose test runs on the ids). Ranks with one key share one
    compiled program; each still runs on its own blocks."""
    if plan.visible is None:
        return None
    return tuple(plan.visible[r][(r - d) % plan.cp] for d in plan.hops)


def program(plan: Ranks, r: int, variant: str, mode: str):
    """Rank r's jitted program f(q_r, q_side, blocks[, do_r]) (see the module docstring)."""
    def attend(q, kd, vd, q_side, kv_d):
        return steps.attend(plan.spec, plan.implementation, q, kd, vd, None, q_side, kv_d, None, None)

    def forward(q, q_side, blocks):
        partials = []
        for d, block in zip(plan.hops, blocks):
            partials.append(_hop(plan, r, d, block, q_side,
                                 lambda a: attend(q, a[0], a[1], q_side, a[2]),
                                 lambda a: steps.empty_result(q, a[1], ())))
        return partials

    def merged(partials, ct):
        out, lse = partials[0][0].astype(ct), partials[0][1]
        for o, l in partials[1:]:
            out, lse = merge_partials(out, lse, o, l)
        return out, lse

    def steps_fwdbwd(q, q_side, blocks, do):
        results = []
        for d, block in zip(plan.hops, blocks):
            def compute(a):
                (o, l), vjp = jax.vjp(lambda q, kd, vd: attend(q, kd, vd, q_side, a[2]), q, a[0], a[1])
                return (o, l, *vjp((do.astype(o.dtype), jnp.zeros_like(l))))

            def skip(a):
                o, l = steps.empty_result(q, a[1], ())
                return (o, l, jnp.zeros_like(q), jnp.zeros_like(a[0]), jnp.zeros_like(a[1]))

            results.append(_hop(plan, r, d, block, q_side, compute, skip))
        return results

    def ring_fwdbwd(q, q_side, blocks, do):  # ring._forward, then ring._backward, one rank
        ct = compute_dtype(q.dtype)
        out, lse = merged(forward(q, q_side, blocks), ct)
        g_out, g_lse = do.astype(ct), jnp.zeros_like(lse)
        dq, grads = jnp.zeros(q.shape, ct), []
        for d, block in zip(plan.hops, blocks):
            def compute(a, dq=dq):
                (o_d, l_d), vjp = jax.vjp(lambda q, kd, vd: attend(q, kd, vd, q_side, a[2]), q, a[0], a[1])
                w = jnp.exp(l_d.astype(ct) - lse)  # [B, N, L]: this hop's share of each row
                w_out = jnp.swapaxes(w, 1, 2)[..., None]
                g_lse_d = w * (g_lse + jnp.einsum("btnh,btnh->bnt", g_out, o_d.astype(ct) - out))
                gq, gk, gv = vjp(((w_out * g_out).astype(o_d.dtype), g_lse_d.astype(l_d.dtype)))
                return dq + gq.astype(ct), gk.astype(ct), gv.astype(ct)

            def skip(a, dq=dq):
                return dq, jnp.zeros(a[0].shape, ct), jnp.zeros(a[1].shape, ct)

            dq, gk, gv = _hop(plan, r, d, block, q_side, compute, skip)
            grads.append((gk, gv))
        return [out.astype(q.dtype), dq.astype(q.dtype), grads]

    if variant == "steps":
        if mode == "fwd":
            return jax.jit(lambda q, q_side, blocks: forward(q, q_side, blocks))
        return jax.jit(steps_fwdbwd)
    if mode == "fwd":
        return jax.jit(lambda q, q_side, blocks: [merged(forward(q, q_side, blocks),
                                                         compute_dtype(q.dtype))[0].astype(q.dtype)])
    return jax.jit(ring_fwdbwd)


def _rank_outputs(plan: Ranks, variant: str, mode: str, outs, ct):
    """(out, dq or None, [(dk, dv) per hop] or None) of one rank's outputs, partials merged."""
    if variant == "ring_local":
        return outs[0], (outs[1] if mode == "fwdbwd" else None), (outs[2] if mode == "fwdbwd" else None)
    out, lse = outs[0][0].astype(ct), outs[0][1]
    for item in outs[1:]:
        out, lse = merge_partials(out, lse, item[0], item[1])
    return out, None, None


def rows_per_mode(group: Group) -> int:
    """Rows measured per mode (a second one-device row, when it runs, and the sums not counted)."""
    variants = [v for v in group.implementations if v != ONE_DEVICE]
    return 1 + EMULATED_CP * len(variants)


def run_group(group: Group, config: runner.RunConfig, one, advance, on_result) -> list[CPResult]:
    """Every row of the emulated_ranks group; `one` is the run's `context.OneDevice`."""
    shape = group.shapes[0]
    cp = EMULATED_CP
    variants = [v for v in group.implementations if v != ONE_DEVICE]
    ids, pos = segment_arrays(shape)
    q, k, v, _, do = one.state(shape).get_inputs(config.dtype)
    ids_j = None if ids is None else jnp.asarray(ids)
    pos_j = None if pos is None else jnp.asarray(pos)
    plan, q_side, kv_side, inputs = plan_ranks(shape, q, k, v, ids_j, pos_j, cp)
    ct = compute_dtype(q.dtype)
    L = shape.T // cp
    # Each rank's share of the visible pairs (its TFLOP/s count only those).
    seg = ids if ids is not None else np.ones((shape.B, shape.T), np.int32)
    owner = np.broadcast_to(np.arange(shape.T) // L, seg.shape)
    positions = schedule.segment_positions(seg)
    pairs = schedule.pair_counts(owner, owner, cp, window=shape.effective_window, q_positions=positions,
                                 kv_positions=positions, q_segment_ids=seg, kv_segment_ids=seg).sum(axis=1)
    programs: dict = {}  # (variant, mode, program_key) -> (compiled, seconds); reused with compile_s 0
    results = []
    for mode in group.modes:
        advance(f"{shape.name} · {ONE_DEVICE} · {mode}")
        pending, ref, against = baselines(group.name, shape, mode, one, plan.implementation)
        # The ranks' shards exist only while this mode is measured, after the one-device rows
        # ran their checks (at the tutorial's size those need most of a GPU's memory).
        args = [rank_args(plan, r, inputs, q_side, kv_side, None if mode == "fwd" else do) for r in range(cp)]
        flop_scale = 1.0 if mode == "fwd" else flops.FWDBWD_FACTOR
        for variant in variants:
            contributions = []
            rank_rows = []
            for r in range(cp):
                advance(f"{shape.name} · rank {r} · {variant} · {mode}")
                call_args = args[r]
                fields = dict(group=group.name, shape=shape, label=f"rank {r} · {variant}", kind="rank",
                              mode=mode, dtype=config.dtype, cp=cp, strategy="ring", order="contiguous", rank=r,
                              implementation=plan.implementation, tolerance=checks.TOLERANCE[config.dtype],
                              flops=flop_scale * 2.0 * shape.N * float(pairs[r]) * (shape.Dqk + shape.Dv),
                              detail=f"steps run {plan.implementation}, {len(plan.hops)} hops")
                try:
                    key = (variant, mode, program_key(plan, r))
                    if key in programs:  # the same program as an earlier rank's, on this rank's blocks
                        compiled, compile_s = programs[key][0], 0.0
                    else:
                        programs[key] = compiled, compile_s = timing.compile_fn(program(plan, r, variant, mode),
                                                                                *call_args)
                    fields.update(compile_s=compile_s, memory_bytes=timing.memory_bytes(compiled))
                    if ref is None:
                        rank_rows.append(Ready(dict(fields, status=runner.UNCHECKED,
                                                    reason="unchecked: the one-device row failed"),
                                               compiled, call_args))
                        continue
                    out, dq, grads = _rank_outputs(plan, variant, mode, compiled(*call_args), ct)
                    rows = slice(r * L, (r + 1) * L)
                    got, want = [out], [ref[0][:, rows]]
                    if dq is not None:
                        got.append(dq)
                        want.append(ref[1][:, rows])
                        contributions.append((r, grads))
                    fields["error"], fields["rel_l2_error"] = checks.compare(got, want)
                    fields["checked_against"] = f"{against}'s query rows of rank {r}" + (
                        " (out, dq; dk, dv summed over ranks)" if dq is not None else " (out)")
                    rank_rows.append(checked(fields, against, compiled, call_args))
                except Exception as e:  # a failing row is a row, never a crash of the sweep
                    status, reason = runner.classify(e)
                    rank_rows.append(CPResult(**fields, status=status, reason=reason))
            if contributions and len(contributions) == cp:
                rank_rows = _check_kv_grads(plan, contributions, ref, rank_rows, L)
            del contributions  # every rank's dK/dV blocks: freed before anything is timed
            pending += rank_rows
        del ref
        timed = finish(time_rows(pending, config))
        del pending, args
        timed += _sums(group, shape, mode, config, timed, plan, variants)
        for row in timed:
            if on_result is not None:
                on_result(row)
        results += timed
        gc.collect()
    return results


def _check_kv_grads(plan: Ranks, contributions, ref, rows, L: int):
    """dk, dv of the whole call = every rank's contribution to each block it visited; a mismatch
    marks every rank's row wrong (their sum is what is wrong)."""
    dk = jnp.zeros(ref[2].shape, jnp.float32)
    dv = jnp.zeros(ref[3].shape, jnp.float32)
    for r, grads in contributions:
        for d, (gk, gv) in zip(plan.hops, grads):
            s = (r - d) % plan.cp
            dk = dk.at[:, s * L:(s + 1) * L].add(gk.astype(jnp.float32))
            dv = dv.at[:, s * L:(s + 1) * L].add(gv.astype(jnp.float32))
    error, _ = checks.compare([dk, dv], [ref[2], ref[3]])
    tol = checks.TOLERANCE[_dtype_label(plan.spec)]
    if error <= tol:
        return rows
    out = []
    for row in rows:
        f = row.fields if isinstance(row, Ready) else {x.name: getattr(row, x.name) for x in dataclasses.fields(row)}
        why = f"dk, dv summed over ranks: error {error:.2e} > tolerance {tol:.0e}"
        out.append(CPResult(**dict(f, error=max(f.get("error") or 0.0, error), status=runner.WRONG, reason=why)))
    return out


def _verdict(ratio: float) -> str:
    if ratio > 1 + WITHIN:
        return f"{100 * (ratio - 1):.0f}% more than one device: the CP machinery adds compute"
    if ratio < 1 - WITHIN:
        return "less than one device: the CP machinery adds no compute"
    return f"within {100 * WITHIN:.0f}% of one device: the CP machinery adds no compute"


def _sums(group: Group, shape: Shape, mode: str, config, rows: list[CPResult], plan: Ranks, variants):
    """A `sum · <variant>` row per variant: the ranks' medians added, against one device."""
    base = next((r for r in rows if r.label == ONE_DEVICE), None)
    same = next((r for r in rows if r.kind == "one_device" and r.implementation == plan.implementation), None)
    out = []
    for variant in variants:
        ranks = [r for r in rows if r.kind == "rank" and r.label.endswith(f"· {variant}")]
        fields = dict(group=group.name, shape=shape, label=f"sum · {variant}", kind="sum", mode=mode,
                      dtype=config.dtype, cp=plan.cp, strategy="ring", order="contiguous",
                      implementation=plan.implementation, flops=flops.attention_flops(shape, mode))
        bad = [r for r in ranks if not r.timed]
        if len(ranks) != plan.cp or bad:
            why = f"rank {bad[0].rank}: {bad[0].status}" if bad else "not every rank ran"
            out.append(CPResult(**fields, status=runner.SKIPPED, reason=why))
            continue
        ms = sum(r.ms for r in ranks)
        f = dict(fields, status=runner.OK, ms=ms, iters=min(r.iters for r in ranks),
                 tflops=flops.tflops_per_s(fields["flops"], ms),
                 speedup=base.ms / ms if base is not None and base.timed else None)
        if same is not None and same.timed:
            f["ratio"] = ms / same.ms
            f["verdict"] = f"{f['ratio']:.2f} x one device ({plan.implementation}): " + _verdict(f["ratio"])
        else:
            f["verdict"] = f"no timed one-device row with {plan.implementation} to compare with"
        out.append(CPResult(**f))
    return out
