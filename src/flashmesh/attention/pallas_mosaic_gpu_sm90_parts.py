"""In-kernel pieces the Mosaic GPU attention kernels share (forward, dK/dV and dQ, window):
the memory warpgroup's K/V ring with its extra copies (segment tables, bias tiles), the band
mask, the last round of the dropout hash, O += P V in the GPU's and the interpreter's forms,
and the hardware named barriers of the ping-pong schedules.

Shape legend: rows query rows of a warpgroup, bkv keys per tile; WGMMA layouts throughout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm

from flashmesh.attention import masks
from flashmesh.attention import pallas_mosaic_gpu_tokens as tokens
from flashmesh.attention.pallas_mosaic_gpu_inputs import DROPOUT_KEY_MULT
from flashmesh.attention.pallas_mosaic_gpu_ranges import band_kv_range
from flashmesh.attention.spec import AttentionSpec

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


MAX_NAMED_BARRIERS = 16  # hardware named barriers per CTA


def first_free_barrier(num_warpgroups: int) -> int:
    """The first hardware named barrier a kernel of num_warpgroups warpgroups may use: Mosaic GPU
    owns barrier 0 (`gpu.barrier`) and 1 + warpgroup index (`warpgroup_barrier_idx`)."""
    return num_warpgroups + 1


def named_barrier(operation: str, num_threads: int):
    """`bar.sync` / `bar.arrive` on the hardware named barrier given as a traced int32, over
    num_threads threads (Mosaic GPU exposes named barriers only through inline PTX).

    The function and closure names (bar_op, operation, num_threads) are the ones Mosaic GPU's
    interpreter recognises as a named barrier (jaxpr_interpret.py), so interpret mode runs
    the same schedule."""
    if operation not in ("sync", "arrive"):
        raise ValueError(f"operation={operation!r} must be 'sync' or 'arrive'")

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
    def bar_op(_, barrier_id):
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [barrier_id.registers[()]],
                        f"bar.{operation} $0, {num_threads};", "r", has_side_effects=True)

    return bar_op


@dataclasses.dataclass(frozen=True)
class NamedRing:
    """A K/V ring's release barriers as hardware named barriers (BlockSizes.named_release):
    slot s is barrier first + s, over num_threads threads (the compute warpgroups, which
    arrive, and the producer warp, which syncs)."""
    first: int
    num_threads: int


def release(consumed, slot):
    """A reader's release of ring slot `slot`: an mbarrier arrive, or bar.arrive (NamedRing)."""
    if isinstance(consumed, NamedRing):
        named_barrier("arrive", consumed.num_threads)(consumed.first + slot)
    else:
        plgpu.barrier_arrive(consumed.at[slot])


def await_release(consumed, slot):
    """The producer's wait for slot `slot`'s release: an mbarrier wait, or bar.sync."""
    if isinstance(consumed, NamedRing):
        named_barrier("sync", consumed.num_threads)(consumed.first + slot)
    else:
        plgpu.barrier_wait(consumed.at[slot])


def fence_async_shared():
    """`fence.proxy.async.shared::cta`: this thread's SMEM stores made visible to WGMMA and TMA
    (commit_smem without its warpgroup barrier, for a barrier of the kernel's own after it).
    The function's name is the one Mosaic GPU's interpreter runs as commit_smem."""
    @plgpu.inline_mgpu()
    def fence_async_shared_cta(_):
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.proxy.async.shared::cta;", "",
                        has_side_effects=True)

    fence_async_shared_cta()


def dropout_keep(row_hash, key0, shape, key_dim: int, rate: float):
    """In a kernel: the last round of masks.dropout_keep over a tile, bool `shape` (WGMMA
    layout). row_hash: `dropout_row_hash` of the tile's queries, a uint32 vector along the
    other dim (WGMMA row or column layout); the keys are key0 + iota along key_dim (key0 an
    even int32 scalar: tiles start at multiples of 64). Keys 2m and 2m + 1 share one hash of
    m, m = key0 / 2 + iota // 2, and m * M = (key0 / 2) * M + (iota // 2) * M modulo 2**32, so
    the scalar part joins the vector and each pair pays one multiply-add before the mixer;
    along the columns (the forward, the dQ kernel) a thread holds both keys of a pair in
    adjacent registers, and the compiler computes their hash once."""
    u = jnp.uint32
    base = row_hash + (jnp.asarray(key0) >> 1).astype(u) * u(DROPOUT_KEY_MULT)
    keys = plgpu.broadcasted_iota(jnp.int32, shape, key_dim, layout=plgpu.Layout.WGMMA)
    x = lax.broadcast_in_dim(base, shape, [1 - key_dim]) + (keys >> 1).astype(u) * u(DROPOUT_KEY_MULT)
    return masks.pair_bits(masks.mix32(x), keys) >= u(masks.dropout_threshold(rate))


def pv_from_registers(acc, p16, v_tile, p_smem, during):
    """O += P V with P as WGMMA's register operand, accumulated in place (FA3); `during()` runs
    while the GEMM is in flight."""
    del p_smem

    def mma(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_tile)
        during()

    return pl.run_state(mma)(plgpu.ACC.init(acc))


def pv_from_smem(acc, p16, v_tile, p_smem, during):
    """O += P V with P staged in SMEM and a fresh accumulator (what interpret mode runs)."""
    p_smem[...] = p16
    plgpu.commit_smem()  # make the generic-proxy stores visible to WGMMA's async proxy

    def mma(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v_tile)
        during()
        return acc_ref[...]

    return acc + pl.run_scoped(mma, plgpu.ACC(acc.shape, jnp.float32))


def persistent_tiles(num_q_tiles: int, num_heads: int, batch: int, *, q_major: bool = False,
                     snake: bool = False):
    """A persistent grid (axis "sm", at most one CTA per tile): CTA c takes the tiles c, c + C,
    c + 2C, ... of the flat (batch, head, query tile) order, or with q_major of the flat (query
    tile, batch, head) order; with snake, in odd rounds (flat indices [iC, (i + 1)C), i odd)
    CTA c takes iC + C - 1 - c instead. Returns (num_local, coords), the CTA's tile count and
    coords(i) -> (query tile index, head, batch) of its i-th tile.

    q_major is for tiles of unequal work (causal: the query tile index sets it): each CTA's
    stride then visits every query tile index about equally often, where in the (batch, head)-
    major order a CTA's indices repeat with the stride's residue modulo the tile count (the
    guide layer's dQ, 16 tiles a head on 132 SMs: counted, some CTAs got 18% more key tiles
    than the mean). snake evens out what q_major leaves: with the tiles in decreasing work
    (longest first), the CTA that took the longest tile of a round takes the shortest of the
    next (a list-scheduling model of causal 8k's 2048 forward tiles on 132 SMs: 0.15% over the
    ideal finish against 6.3% for q_major alone; `benchmarks/notes/2026-12-07-forward-vs-fa3.md`)."""
    cta, num_ctas = lax.axis_index("sm"), lax.axis_size("sm")
    total = num_q_tiles * num_heads * batch
    if snake:  # full rounds, then this CTA's place in the last, partial one
        last = lax.div(jnp.int32(total), num_ctas)
        place = jnp.where(lax.rem(last, 2) == 1, num_ctas - 1 - cta, cta)
        num_local = last + (place < total - last * num_ctas).astype(jnp.int32)
    else:
        num_local = lax.div(total - 1 - cta, num_ctas) + 1  # the grid has at most `total` CTAs

    def coords(i):
        place = jnp.where(lax.rem(i, 2) == 1, num_ctas - 1 - cta, cta) if snake else cta
        flat = i * num_ctas + place
        if q_major:
            rest = lax.rem(flat, jnp.int32(num_heads * batch))
            return (lax.div(flat, jnp.int32(num_heads * batch)), lax.rem(rest, jnp.int32(num_heads)),
                    lax.div(rest, jnp.int32(num_heads)))
        rest = lax.div(flat, jnp.int32(num_q_tiles))
        return (lax.rem(flat, jnp.int32(num_q_tiles)), lax.rem(rest, jnp.int32(num_heads)),
                lax.div(rest, jnp.int32(num_heads)))

    return num_local, coords


def tile_kv_range(spec: AttentionSpec, tok_refs, q_tile, batch, block_q: int, block_kv: int):
    """The key tiles query tile `q_tile` of batch row `batch` meets (forward, dQ): the band's
    closed form, or with segments (tok_refs) the block map's ranges of that row."""
    if tok_refs is None:
        return band_kv_range(q_tile, q_len=spec.q_len, kv_len=spec.kv_len, window=spec.window,
                             diagonal_offset=spec.diagonal_offset, block_q=block_q, block_kv=block_kv)
    return tokens.load_ranges(tok_refs[0], batch, q_tile)


def for_each_tile(run_tile, num_local):
    """run_tile(i, issued) -> issued + the tile's key tiles, over a CTA's tiles (num_local of
    them, or one with Python ints when None: no constant closes over the inner jaxprs);
    issued counts the key tiles streamed before, so a K/V ring's slots and barrier phases run
    on across tiles (`stream_kv`). Returns the final count."""
    if num_local is None:
        return run_tile(0, 0)
    return lax.fori_loop(jnp.int32(0), num_local, run_tile, jnp.int32(0))


def ring_slot(issued, lo, stages: int):
    """slot_of(step) of a K/V ring that streamed `issued` key tiles before this tile's
    lo .. hi - 1 (a persistent kernel's ring runs on across tiles)."""
    return lambda step: lax.rem(issued + step - lo, jnp.int32(stages))


def stream_tiles(tile, num_local, *, kv, tok, bias, group_size: int, block_q: int, rows: int,
                 num_wgs: int, bkv: int, stages: int):
    """The memory warpgroup of a query-stationary kernel (forward, dQ): over the CTA's tiles
    (`for_each_tile`; tile(i) -> (query tile, head, batch, key-tile ranges)) stream each
    tile's key tiles, with their segment tables and bias, through the one K/V ring
    (`stream_kv`), then observe the last slots' releases once (`drain_ring`).
    kv: ((k_ref, v_ref), smems, ready, consumed) pairs; tok: (tok_refs, kvtok_smem,
    kvtok_ready); bias: (bias_ref or None, bias_smem, bias_ready)."""
    refs, smems, ready, consumed = kv
    tok_refs, kvtok_smem, kvtok_ready = tok
    bias_ref, bias_smem, bias_ready = bias

    def run_tile(i, issued):
        q_tile, head, batch, r = tile(i)
        extra = table_copies(tok_refs, kvtok_smem, kvtok_ready, batch, bkv)
        if bias_ref is not None:
            extra += (bias_copy(bias_ref, bias_smem, bias_ready, batch, head, q_tile * block_q,
                                rows, num_wgs, bkv),)
        stream_kv(refs, smems, ready, consumed, batch=batch,
                  kv_head=lax.div(head, jnp.int32(group_size)), lo=r.lo, hi=r.hi, bkv=bkv,
                  stages=stages, slot_of=ring_slot(issued, r.lo, stages), extra=extra,
                  issued=issued, drain=False)
        return issued + jnp.maximum(r.hi - r.lo, 0)

    drain_ring(consumed, for_each_tile(run_tile, num_local), stages)


def table_copies(tok_refs, smems, ready, batch, block: int) -> tuple:
    """`stream_kv` extras for the streamed side's token tables (segments): tile `step` of each
    table [B, L] into its ring slot."""
    def copy(ref, smem, arrived):
        def issue(step, slot):
            plgpu.copy_gmem_to_smem(ref.at[batch, pl.ds(step * block, block)], smem.at[slot],
                                    arrived.at[slot])
        return issue

    return tuple(copy(*x) for x in zip(tok_refs[2], smems, ready)) if tok_refs else ()


def bias_copy(bias_ref, smem, ready, batch, head, row0, rows: int, num_wgs: int, block: int):
    """A `stream_kv` extra: the bias of query rows row0 .. row0 + num_wgs * rows and key tile
    `step`, one TMA per compute warpgroup into smem [stages, W, rows, block] (the ready barrier
    expects W arrivals). bias_ref [B|1, N|1, Tp, Sp]: a broadcast dim reads index 0."""
    b = batch if bias_ref.shape[0] > 1 else 0
    n = head if bias_ref.shape[1] > 1 else 0

    def issue(step, slot):
        for w in range(num_wgs):
            plgpu.copy_gmem_to_smem(
                bias_ref.at[b, n, pl.ds(row0 + w * rows, rows), pl.ds(step * block, block)],
                smem.at[slot, w], ready.at[slot])
    return issue


def band_mask(s, q_pos, key, spec: AttentionSpec, kv_tail: bool):
    """s with -inf where query position q_pos does not see key index key (same shapes): the
    window's bounds, and with kv_tail the padded keys past S (forward and backward kernels)."""
    left, right = spec.window
    d = q_pos - key
    visible = []
    if left >= 0:
        visible.append(d <= left)
    if right >= 0:
        visible.append(d >= -right)
    if kv_tail:  # padded keys past S get zero weight
        visible.append(key < spec.kv_len)
    return jnp.where(functools.reduce(operator.and_, visible), s, -jnp.inf)


def stream_kv(refs, smems, ready, consumed, *, batch, kv_head, lo, hi, bkv: int, stages: int, slot_of,
              extra=(), issued=0, drain: bool = True):
    """The memory warpgroup's K/V ring (forward and dQ kernels): for key tiles lo .. hi - 1,
    wait until the slot's last reader released it (once `stages` tiles have been loaded), then
    TMA K and V into it, each with its own ready barrier (so P·V waits only for V). `extra`:
    callables issue(step, slot) that copy more of the key tile's data (segment tables, bias)
    after V into the same slot, released with V. refs, smems, ready, consumed: (K, V) pairs;
    slot_of(step) -> slot. issued: key tiles this ring streamed before (a persistent kernel's
    earlier tiles; slot_of counts them too). With `drain`, then observe the release of the last
    (up to `stages`) slots too (`drain_ring`); a persistent kernel drains once, after its last
    tile."""
    @pl.loop(lo, hi)
    def _(step):
        slot, reuse = slot_of(step), issued + step - lo >= stages
        rows = (batch, pl.ds(step * bkv, bkv), kv_head)
        for ref, smem, arrived, released in zip(refs, smems, ready, consumed):
            @pl.when(reuse)
            def _():
                await_release(released, slot)

            plgpu.copy_gmem_to_smem(ref.at[rows], smem.at[slot], arrived.at[slot])
        for issue in extra:
            issue(step, slot)

    if drain:
        drain_ring(consumed, issued + jnp.maximum(hi - lo, 0), stages)


def drain_ring(consumed, issued, stages: int):
    """Wait for the release of the last (up to `stages`) of `issued` ring loads, so every phase
    of the consumed barriers is waited for exactly once (the interpreter checks this at
    deallocation; on hardware it keeps the phases in step). Slot of load c: c % stages."""
    @pl.loop(jnp.maximum(jnp.asarray(issued, jnp.int32) - stages, 0), issued)
    def _(c):
        for released in consumed:
            await_release(released, lax.rem(c, jnp.int32(stages)))
