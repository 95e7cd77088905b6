"""Pieces both sm90 backward kernels (pallas_mosaic_gpu_sm90_bwd: dQ; _bwd_dkv: dK/dV) share:
the logits' recomputation, WGMMA products in their GPU and interpreter forms, the ring's drain."""

from __future__ import annotations

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from flashmesh.attention.pallas_mosaic_gpu_sm90_parts import LOG2E
from flashmesh.attention.spec import AttentionSpec

ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per accumulator row
COL = plgpu.Layout.WGMMA.reduce(0)  # one value per accumulator column


def logits2(s, spec: AttentionSpec, bias=None):
    """Raw q.k (and the tile's bias, float32, or None) -> (logits in log2 units, d logit /
    d (scale q.k + bias) or None): the forward's arithmetic exactly (cap tanh(x / cap) of
    x = scale s + bias, tanh x = 1 - 2 / (exp(2x) + 1)), so P recomputed here matches the lse
    it wrote."""
    cap = spec.logits_soft_cap
    if cap is None:
        if bias is None:
            return s * (spec.scale * LOG2E), None
        return s * (spec.scale * LOG2E) + bias * LOG2E, None
    if bias is None:
        e = jnp.exp2(s * (2.0 * LOG2E * spec.scale / cap))
    else:
        e = jnp.exp2((s * spec.scale + bias) * (2.0 * LOG2E / cap))
    t = 1.0 - 2.0 / (e + 1.0)
    return t * (cap * LOG2E), 1.0 - t * t


def wgmma_iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def products_overlapped(a1, b1, a2, b2, shape1, shape2, on_first, overlap: bool):
    """(on_first(a1 b1), a2 b2) of SMEM operands, both issued before either is awaited; with
    `overlap`, on_first runs once the first is in (`wait_n=1`: WGMMA groups complete in order)
    while the second is in flight, else once both are."""
    def mma(acc1, acc2):
        plgpu.wgmma(acc1, a1, b1)
        plgpu.wgmma(acc2, a2, b2)
        first = plgpu.wgmma_accumulator_load(acc1, wait_n=1 if overlap else 0)
        return on_first(first), acc2[...]

    return pl.run_scoped(mma, plgpu.ACC(shape1, jnp.float32), plgpu.ACC(shape2, jnp.float32))


def products_from(a1, b1, a2, b2, init1, init2, on_first, overlap: bool, interpret: bool):
    """`products_overlapped` with accumulators that start from init1, init2 instead of zeros:
    (on_first(init1 + a1 b1), init2 + a2 b2), on_first returning one float32 array of init1's
    shape. On a GPU the accumulators begin as the inits in registers (`ACC.init`), and
    on_first's result goes back into the first one, the only way out of `run_state`; the
    interpreter, which has no `run_state` over an accumulator, adds the inits to products
    started from zero."""
    if interpret:
        first, second = products_overlapped(a1, b1, a2, b2, init1.shape, init2.shape,
                                            lambda x: x, False)
        return on_first(first + init1), second + init2

    def mma(refs):
        acc1, acc2 = refs
        plgpu.wgmma(acc1, a1, b1)
        plgpu.wgmma(acc2, a2, b2)
        acc1[...] = on_first(plgpu.wgmma_accumulator_load(acc1, wait_n=1 if overlap else 0))

    return pl.run_state(mma)((plgpu.ACC.init(init1), plgpu.ACC.init(init2)))


def mma_from_registers(accs, lhs, rhs, staging):
    """acc_i += lhs_i rhs_i with the lhs in registers as WGMMA's A, in place (FA3's RS GEMMs)."""
    del staging

    def mma(acc_refs):
        for acc_ref, a, b in zip(acc_refs, lhs, rhs):
            plgpu.wgmma(acc_ref, a, b)

    return pl.run_state(mma)(tuple(plgpu.ACC.init(acc) for acc in accs))


def mma_from_smem(accs, lhs, rhs, staging):
    """The interpreter's form: the lhs stored to SMEM, fresh accumulators added afterwards."""
    for buf, a in zip(staging, lhs):
        buf[...] = a
    plgpu.commit_smem()  # make the generic-proxy stores visible to WGMMA's async proxy

    def mma(*acc_refs):
        for acc_ref, buf, b in zip(acc_refs, staging, rhs):
            plgpu.wgmma(acc_ref, buf, b)
        return tuple(acc_ref[...] for acc_ref in acc_refs)

    products = pl.run_scoped(mma, *(plgpu.ACC(acc.shape, jnp.float32) for acc in accs))
    return tuple(acc + prod for acc, prod in zip(accs, products))


def walk_ranges(r, own, masked_step, full_step, pass_over, carry):
    """A warpgroup's walk over its CTA's streamed tiles [r.lo, r.hi): masked and full steps
    over its own range `own` (wg_ranges: `clamp_within` of its rows' range; else r itself) and
    pass_over for the tiles outside it. Each callable is (tile index, carry) -> carry."""
    if own is not r:
        carry = lax.fori_loop(r.lo, own.lo, pass_over, carry)
    carry = lax.fori_loop(own.lo, own.full_lo, masked_step, carry)
    carry = lax.fori_loop(own.full_lo, own.full_hi, full_step, carry)
    carry = lax.fori_loop(own.full_hi, own.hi, masked_step, carry)
    if own is not r:
        carry = lax.fori_loop(own.hi, r.hi, pass_over, carry)
    return carry


def zero_acc(shape):
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def ring_drain(consumed, slot_of, total, stages):
    """Wait for the release of the last (up to `stages`) slots, so every phase of the
    consumed barriers is observed exactly once (the interpreter checks it)."""
    @pl.loop(jnp.maximum(total - stages, 0), total)
    def _(step):
        for barrier in consumed:
            plgpu.barrier_wait(barrier.at[slot_of(step)])
