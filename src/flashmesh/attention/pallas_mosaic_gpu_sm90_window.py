"""Hopper (sm90) forward kernel for narrow windows in Pallas Mosaic GPU: the K/V band of a
block of 64 query positions stays in shared memory while the query heads that share it stream
through (research/kernels.md §4 #2).

Shape legend: B batch, T query length, S key length, N query heads, K key/value heads,
G = N // K query heads per key/value head, Dqk / Dv head dims; W compute warpgroups.

Where it applies (`pallas_mosaic_gpu_common.window_reason`, with the configuration
`WindowBlockSizes`): a window bounded on both sides (causal counts: right = 0)
whose keys for 64 consecutive queries span at most 256 keys (e.g. window (128, 0): 192
keys, three 64-key tiles), so S = Q Kᵀ of the whole band is one WGMMA (N <= 256) and the
softmax is exact in one pass (no online rescale).

Structure: a grid over (64-position query block, kv head, batch); W compute warpgroups, no
memory warpgroup. Warpgroup 0 loads the band's K and V once (one TMA each, nb * block_kv rows
from tile `lo`, clamped so the band stays inside the padded keys), after the first Q, and the
first head's S GEMM waits only for K. Warpgroup w then takes the group's query heads w, w + W,
...: per head it loads the Q of the head `WindowBlockSizes.ahead` heads ahead into a ring of
`q_buffers` slots (2 and 1: double buffering; more keep more loads in flight for the
memory-bound kernel, Q and O being nearly all its traffic, or let the slot's last O store
finish under a head's work), runs S = Q Kᵀ (WGMMA), masks the band element-wise
(`band_mask`), takes the exact softmax in exp2 (scale folded into exp2's argument, one FMA per
logit), O = P V (P from registers), and stores O from its Q buffer and lse by TMA while the
next head computes. With
`WindowBlockSizes.pingpong` the two warpgroups take turns issuing their GEMMs (named barriers,
as the general kernel), so one's softmax runs under the other's GEMMs. K/V traffic from L2 is
divided by G against the general kernel, and each query block meets ceil((63 + left + right) /
block_kv) + 1 tiles instead of the 128-row tile's.

With `WindowBlockSizes.persistent` the grid is one CTA an SM over the items (batch, kv head,
64-position block) in runs of consecutive items (`window_items`). The band is then a ring of its
nb tiles, slot s holding the tile that is s modulo nb, so S's columns come rotated by lo % nb
slots (the mask reads each column's key from the rotation; softmax and P·V do not care about
the order). Between items of one kv head only the slots whose tile changed are loaded: each
warpgroup arrives on a release barrier after its last S of the item (K) and its last P·V (V),
and warpgroup 0 then loads the next item's new K tiles under its last head's softmax and P·V,
and V's under the next item's first S. The Q ring runs on over the items (one loop over the flat
head index f = item * G / W + head, each head's item and coordinates recomputed from f, so no
per-item value is held across heads), so the next item's first heads load under this one's
last, and no O store is drained before the last item. With `reload_band` each item loads its
whole band in order instead (one TMA each for K and V, after the same releases): no rotated
columns. Not with overlap_heads. On the H200 (2026-12-07) the first form, with a loop over items
around the loop over heads, spilled registers (ptxas: 484 bytes) and ran at 0.340 ms against
the grid's 0.230 on the window anchor.

Implemented: causal and (left, right) windows in both alignments, any scale, GQA/MQA,
Dqk != Dv, bf16/f16, tails (wrapper padding), the soft cap, off-by-one and learnable sinks
(the sink logit is a scalar read from global memory), lse in reference.py's convention, rows
that see no key (out 0, lse EMPTY_ROW_LSE or the sink). Not here (the general kernel runs
them): unbounded windows, dropout, segments, bias. The backward is the general one
(pallas_mosaic_gpu_sm90_bwd), which reads only (out, lse).

Interpret mode: P·V goes through SMEM into a fresh accumulator (`pallas_mosaic_gpu_sm90_parts.pv_from_smem`), as in
the general kernel.

Example:
    >>> spec = pallas_mosaic_gpu_inputs.spec_for(q, k, v, scale=0.125, window=(128, 0))
    >>> out, lse = forward_spec(q, k, v, spec, interpret=True)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from flashmesh.attention import pallas_mosaic_gpu_sm90_parts as parts
from flashmesh.attention.pallas_mosaic_gpu_common import (WARPGROUP, WINDOW_ROWS, WindowBlockSizes,
                                                          check_spec, smem_tile, window_reason)
from flashmesh.attention.pallas_mosaic_gpu_ranges import band_kv_range
from flashmesh.attention.pallas_mosaic_gpu_inputs import check_sink, pad_tail
from flashmesh.attention.spec import EMPTY_ROW_LSE, AttentionSpec

ROWS = WINDOW_ROWS


def window_items(num_blocks: int, num_kv_heads: int, batch: int):
    """A persistent grid's work (axis "sm"): CTA c takes the items [c n / C, (c + 1) n / C) of
    the flat (batch, kv head, query block) order, n items over C CTAs, so consecutive items of
    a CTA are mostly neighbouring blocks of one kv head, whose bands share all but the tiles
    entering. Returns (num_local, coords): the CTA's item count and coords(i) -> (batch, kv
    head, block) of its i-th item."""
    cta, num_ctas = lax.axis_index("sm"), lax.axis_size("sm")
    total = num_blocks * num_kv_heads * batch
    start = lax.div(cta * total, num_ctas)

    def coords(i):
        item = start + i
        rest = lax.div(item, num_blocks)
        return lax.div(rest, num_kv_heads), lax.rem(rest, num_kv_heads), lax.rem(item, num_blocks)

    return lax.div((cta + 1) * total, num_ctas) - start, coords


def _kernel(q_ref, k_ref, v_ref, sink_ref, out_ref, lse_ref, k_smem, v_smem, q_smem, o_smem,
            lse_smem, p_smem, k_ready, v_ready, q_ready, kv_free, *, spec: AttentionSpec,
            bs: WindowBlockSizes, nb: int, interpret: bool):
    # q_ref [B, Tp, N, Dqk], k_ref [B, Sp, K, Dqk], v_ref [B, Sp, K, Dv] (T, S in place),
    # sink_ref [N] f32 (the sink logit) or None; out_ref [B, Tp (T in place), N, Dv], lse_ref
    # [B, N, Tp] f32.
    # k_smem [band, Dqk], v_smem [band, Dv]; q_smem [W, nq, 64, Dqk]; o_smem [W, nq, 64, Dv] or
    # None (O in the Q buffer); lse_smem [W, nq, 64] f32; p_smem [W, 64, band] or None
    # (nq = bs.q_buffers: flat head f's Q, then its O, in slot f % nq). k_ready, v_ready: one
    # barrier (the band in one TMA) or, persistent with the band a ring, nb (slot s holds the
    # band's tile that is s modulo nb); kv_free: persistent only, 2 barriers of W arrivals
    # (every warpgroup past its reads of an item's K, of its V) or None.
    W, bkv, G, nq, ahead = bs.num_compute_wgs, bs.block_kv, spec.group_size, bs.q_buffers, bs.ahead
    band, dtype = nb * bkv, jnp.dtype(spec.dtype)
    wg = lax.axis_index("wg")
    nk = -(-spec.kv_len // bkv)
    heads = G // W  # per warpgroup and item: group heads wg, wg + W, ...
    o_smem = q_smem if o_smem is None else o_smem
    if bs.persistent:
        num_items, coords = window_items(-(-spec.q_len // ROWS), spec.num_kv_heads, spec.batch)
    else:  # one item, the grid's
        num_items = 1

        def coords(i):
            del i
            return lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q")
    total = num_items * heads  # the warpgroup's heads over its items: flat f = i * heads + t

    def item_head(f):
        """(item, its head t) of flat head f."""
        if not bs.persistent:
            return 0, f
        if isinstance(f, int):
            return divmod(f, heads)
        return lax.div(f, heads), lax.rem(f, heads)

    def band_lo(block):  # the band: tiles lo .. lo + nb - 1, inside the tiles
        r = band_kv_range(block, q_len=spec.q_len, kv_len=spec.kv_len, window=spec.window,
                          diagonal_offset=spec.diagonal_offset, block_q=ROWS, block_kv=bkv)
        return jnp.clip(r.lo, 0, nk - nb)

    ring = bs.band_ring

    def tile_in(lo, s):
        """The band's tile in slot s: in the ring, the one that is s modulo nb; else lo + s."""
        return lo + lax.rem(s - lax.rem(lo, nb) + nb, nb) if ring else lo + s

    def head_of(kv_head, t):
        return kv_head * G + wg + t * W

    def slot(f):
        return f % nq if isinstance(f, int) else lax.rem(f, nq)

    def load_q(f):
        i, t = item_head(f)
        batch, kv_head, block = coords(i)
        buf = slot(f)
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(block * ROWS, ROWS), head_of(kv_head, t)],
                                q_smem.at[wg, buf], q_ready.at[wg * nq + buf])

    def slot_changes(i):
        """The ring: per slot, whether item i's band tile there is not item i - 1's (every
        slot at the CTA's first item and where the kv head or batch changes)."""
        batch, kv_head, block = coords(i)
        p_batch, p_kv_head, p_block = coords(jnp.maximum(i - 1, 0))
        lo, p_lo = band_lo(block), band_lo(p_block)
        same = (i > 0) & (batch == p_batch) & (kv_head == p_kv_head)
        return [jnp.logical_not(same & (tile_in(lo, s) == tile_in(p_lo, s))) for s in range(nb)]

    def load_band(i, which):
        """Item i's K (which 0) or V (1) by TMA: the whole band at once, or in the ring, the
        tiles item i - 1 did not hold, each into its slot."""
        ref, smem, ready = (k_ref, k_smem, k_ready) if which == 0 else (v_ref, v_smem, v_ready)
        batch, kv_head, block = coords(i)
        lo = band_lo(block)
        if not ring:
            plgpu.copy_gmem_to_smem(ref.at[batch, pl.ds(lo * bkv, band), kv_head], smem, ready.at[0])
            return
        for s, changed in enumerate(slot_changes(i)):
            pl.when(changed)(lambda s=s: plgpu.copy_gmem_to_smem(
                ref.at[batch, pl.ds(tile_in(lo, s) * bkv, bkv), kv_head],
                smem.at[pl.ds(s * bkv, bkv)], ready.at[s]))

    def wait_band(changes, which):
        ready = k_ready if which == 0 else v_ready
        if changes is None:
            plgpu.barrier_wait(ready.at[0])
            return
        for s, changed in enumerate(changes):
            pl.when(changed)(lambda s=s: plgpu.barrier_wait(ready.at[s]))

    def free_band(i, which, when):
        """Persistent, once the warpgroup's last read of item i's K (V) is done and another item
        follows (`when`): arrive on kv_free; `load_next` then refills the slots."""
        if bs.persistent:
            pl.when((i + 1 < num_items) & when)(lambda: plgpu.barrier_arrive(kv_free.at[which]))

    def load_next(i, which, when):
        """Warpgroup 0: once every warpgroup freed item i's K (V), item i + 1's tiles."""
        if bs.persistent:
            @pl.when((i + 1 < num_items) & when & (wg == 0))
            def _():
                plgpu.barrier_wait(kv_free.at[which])
                load_band(i + 1, which)

    # The first Q, then K, then V: the first S GEMM waits for Q and K only, and V arrives under
    # it and its softmax (awaited before the first P V). Then the next heads' Q up to flat head
    # ahead - 1 (persistent: into the next items where an item has fewer heads, as far as the
    # CTA has heads): head f loads head f + ahead's.
    load_q(0)

    @pl.when(wg == 0)
    def _():
        load_band(0, 0)
        load_band(0, 1)

    for f in range(1, ahead if bs.persistent else min(ahead, heads)):
        if f < heads:
            load_q(f)
        else:
            pl.when(f < total)(lambda f=f: load_q(f))

    pv = parts.pv_from_smem if interpret else parts.pv_from_registers
    scale2 = spec.scale * parts.LOG2E
    cap = spec.logits_soft_cap
    # Fold scale2 into exp2's argument, exp2(s scale2 - m): one FMA per logit, the max taken of
    # the raw logits (scale2 > 0), as the general kernel does.
    fold = cap is None and spec.scale > 0
    kv_tail = spec.kv_len % bkv != 0 or nb * bkv > spec.kv_len

    # Ping-pong: warpgroup w waits on named barrier base + w before issuing a GEMM and signals
    # base + (w + 1) % W once it is issued (each head's S, then its P V), so the other
    # warpgroup's softmax runs under it. Warpgroup 0 skips its first wait and the last warpgroup
    # its last signal: every warpgroup runs G / W heads an item, so the barriers balance.
    # Mosaic GPU owns barrier 0 and 1 + warpgroup index; ours start after those.
    base = parts.first_free_barrier(W)

    def turn(operation: str, barrier, skip=None):
        if bs.pingpong:
            op = lambda: parts.named_barrier(operation, 2 * WARPGROUP)(barrier)
            op() if skip is None else pl.when(jnp.logical_not(skip))(op)

    def turn_wait(skip=None):
        turn("sync", base + wg, skip)

    def turn_signal(skip=None):
        turn("arrive", base + lax.rem(wg + 1, W), skip)

    def wait_q(f):
        plgpu.barrier_wait(q_ready.at[wg * nq + slot(f)])

    def issue_s(s_ref, f):
        plgpu.wgmma(s_ref, q_smem.at[wg, slot(f)], k_smem.transpose((1, 0)))

    def load_ahead(f):
        # Flat head f + ahead's Q into the slot of head f + ahead - nq, once that head's O is
        # out (called after head f's S GEMM: the last head's O store had that GEMM to finish).
        # The heads between issued two stores each (O, lse), which may still be reading.
        @pl.when(f + ahead < total)
        def _():
            plgpu.wait_smem_to_gmem(2 * (nq - 1 - ahead), wait_read_only=True)
            load_q(f + ahead)

    def softmax(s, head, row0, lo):
        """A head's P (16-bit), row max (0 for a row with no key) and row sum from its S; the
        rows from row0, the band from tile lo."""
        if cap is not None:  # as the general kernel: cap tanh(scale s / cap), log2 units
            e = jnp.exp2(s * (2.0 * parts.LOG2E * spec.scale / cap))
            s = (1.0 - 2.0 / (e + 1.0)) * (cap * parts.LOG2E)
        elif not fold:
            s = s * scale2
        # (indices made here, not before the loop, so they are not live across it)
        i = plgpu.broadcasted_iota(jnp.int32, (ROWS, band), 0, layout=plgpu.Layout.WGMMA)
        j = plgpu.broadcasted_iota(jnp.int32, (ROWS, band), 1, layout=plgpu.Layout.WGMMA)
        if ring:  # column j is slot j // bkv's tile: the band rotated by lo % nb slots
            rot = lax.rem(lo, nb)
            key = j + (lo - rot) * bkv + jnp.where(j < rot * bkv, band, 0)
        else:
            key = j + lo * bkv
        s = parts.band_mask(s, i + (row0 + spec.diagonal_offset), key, spec, kv_tail)
        m = s.max(axis=1) * scale2 if fold else s.max(axis=1)
        row = plgpu.Layout.WGMMA.reduce(1)
        if spec.softmax != "vanilla":  # the sink is one more logit z with no value
            z = 0.0 if sink_ref is None else sink_ref[head] * parts.LOG2E
            z = plgpu.layout_cast(jnp.full((ROWS,), z, jnp.float32), row)
            m = jnp.maximum(m, z)
        m_safe = jnp.where(m == -jnp.inf, 0.0, m)  # a row with no key: exact zeros, no NaN
        m_b = lax.broadcast_in_dim(m_safe, s.shape, [0])
        p = jnp.exp2(s * scale2 - m_b) if fold else jnp.exp2(s - m_b)
        l = p.sum(axis=1)
        if spec.softmax != "vanilla":
            l = l + jnp.exp2(z - m_safe)
        return p.astype(dtype), m_safe, l

    def stats(m_safe, l):
        """1 / row sum (0 for a row with no key) and lse."""
        seen = l > 0.0
        inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
        lse = jnp.where(seen, (m_safe + jnp.log(jnp.where(seen, l, 1.0)) * parts.LOG2E) * parts.LN2,
                        EMPTY_ROW_LSE)
        return inv, lse

    def finish(f, where, acc, inv, lse):
        """Flat head f's O = acc / l and lse into its slot (Q's, whose S is done), then to
        memory at where = (batch, head, row0)."""
        (batch, head, row0), buf = where, slot(f)
        o = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()  # every warp is past its reads of Q before O overwrites it
        o_smem.at[wg, buf][...] = o
        lse_smem.at[wg, buf][...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg, buf], out_ref.at[batch, pl.ds(row0, ROWS), head])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg, buf], lse_ref.at[batch, head, pl.ds(row0, ROWS)])

    p_wg = None if p_smem is None else p_smem.at[wg]  # P for P·V in the interpreter

    def zeros(columns):
        return plgpu.layout_cast(jnp.zeros((ROWS, columns), jnp.float32), plgpu.Layout.WGMMA)

    def s_of(f, signal=lambda: None):
        """Flat head f's S, issued and awaited alone."""
        def qk(s_ref):
            issue_s(s_ref, f)
            signal()
            return s_ref[...]

        return pl.run_scoped(qk, plgpu.ACC((ROWS, band), jnp.float32))

    def where(f):
        """(batch, head, row0) of flat head f, and its item's (item i, head t, kv head, band lo)."""
        i, t = item_head(f)
        batch, kv_head, block = coords(i)
        return (batch, head_of(kv_head, t), block * ROWS), (i, t, kv_head, band_lo(block))

    def changes(i):  # the ring: which slots item i loads; else None (one barrier)
        return slot_changes(i) if ring else None

    def at_first(t, fn):  # fn() at an item's first head
        if isinstance(t, int):
            if t == 0:
                fn()
        else:
            pl.when(t == 0)(fn)

    def one_head(f, carry):
        """Flat head f; persistent, an item's first head waits for its band's new tiles and its
        last frees them for the next item's."""
        out_at, (i, t, kv_head, lo) = where(f)
        last = t == heads - 1
        if bs.persistent:
            at_first(t, lambda: wait_band(changes(i), 0))
        wait_q(f)
        turn_wait(skip=(f == 0) & (wg == 0))  # warpgroup 0's first GEMM waits for no one
        s = s_of(f, turn_signal)
        load_ahead(f)
        free_band(i, 0, last)
        p16, m_safe, l = softmax(s, out_at[1], out_at[2], lo)
        load_next(i, 0, last)
        at_first(t, lambda: wait_band(changes(i), 1))
        turn_wait()
        end = (f + 1 == total) & (wg == W - 1)  # the last warpgroup's last GEMM signals no one
        acc = pv(zeros(spec.v_dim), p16, v_smem, p_wg, lambda: turn_signal(skip=end))
        free_band(i, 1, last)
        finish(f, out_at, acc, *stats(m_safe, l))
        load_next(i, 1, last)
        return carry

    def overlapped_head(t, s):
        """Head t from its S (one item: not persistent): P·V_t and S_{t+1} in flight together,
        O_t written under S_{t+1} (the interpreter: P·V through SMEM, O_t, then S_{t+1});
        returns S_{t+1}. Q_{t+1} is awaited after P·V's issue, so a late load holds back only
        S; the row statistics are taken before the GEMMs, so only O's scaling and stores run
        beside S in flight."""
        out_at, (_, _, _, lo) = where(t)
        p16, m_safe, l = softmax(s, out_at[1], out_at[2], lo)
        inv, lse = stats(m_safe, l)
        at_first(t, lambda: wait_band(None, 1))
        if interpret:
            finish(t, out_at, parts.pv_from_smem(zeros(spec.v_dim), p16, v_smem, p_wg, lambda: None),
                   inv, lse)
            wait_q(t + 1)
            s = s_of(t + 1)
        else:
            def pair(refs):
                o_ref, s_ref = refs
                plgpu.wgmma(o_ref, p16, v_smem)
                wait_q(t + 1)
                issue_s(s_ref, t + 1)
                finish(t, out_at, plgpu.wgmma_accumulator_load(o_ref, wait_n=1), inv, lse)

            _, s = pl.run_state(pair)((plgpu.ACC.init(zeros(spec.v_dim)), plgpu.ACC.init(zeros(band))))
        load_ahead(t + 1)
        return s

    if not bs.persistent:
        wait_band(None, 0)  # K, before the first S
    if bs.overlap_heads:
        wait_q(0)
        s = s_of(0)
        load_ahead(0)
        s = lax.fori_loop(0, heads - 1, overlapped_head, s)
        last = heads - 1
        out_at, (_, _, _, lo) = where(last)
        p16, m_safe, l = softmax(s, out_at[1], out_at[2], lo)
        at_first(last, lambda: wait_band(None, 1))
        finish(last, out_at, pv(zeros(spec.v_dim), p16, v_smem, p_wg, lambda: None), *stats(m_safe, l))
    else:
        lax.fori_loop(0, total, one_head, 0)
    plgpu.wait_smem_to_gmem(0)


def forward_spec(q, k, v, spec: AttentionSpec, *, sink=None, block_sizes: WindowBlockSizes | None = None,
                 interpret: "bool | plgpu.InterpretGPUParams" = False):
    """(out [B, T, N, Dv], lse [B, N, T] float32) of a band-mask call the window kernel takes
    (`window_reason` says why not, as NotImplementedError); sink: float32 [N] for "learnable".
    interpret: True runs Mosaic GPU's interpreter, an InterpretGPUParams runs it with those
    settings (e.g. detect_races=True)."""
    bs = block_sizes or WindowBlockSizes()
    check_spec(spec, "window forward")
    if (why := window_reason(spec, bs)) is not None:
        raise NotImplementedError(f"pallas_mosaic_gpu_sm90_window: {why}")
    check_sink(spec, sink)
    if sink is not None:
        sink = sink.astype(jnp.float32)
    nb, W, dtype = bs.band_tiles(spec), bs.num_compute_wgs, jnp.dtype(spec.dtype)
    # Tails: zero-padded copies, or in place (tma_tails: TMA reads zeros past the ends and
    # drops O's rows past T)
    q = pad_tail(q, ROWS, bs.tma_tails)
    k, v = pad_tail(k, bs.block_kv, bs.tma_tails), pad_tail(v, bs.block_kv, bs.tma_tails)
    band, Tp, nq = nb * bs.block_kv, -(-spec.q_len // ROWS) * ROWS, bs.q_buffers
    scratch = [smem_tile((band, spec.qk_dim), dtype), smem_tile((band, spec.v_dim), dtype),
               smem_tile((W, nq, ROWS, spec.qk_dim), dtype),
               None if spec.qk_dim == spec.v_dim else smem_tile((W, nq, ROWS, spec.v_dim), dtype),
               plgpu.SMEM((W, nq, ROWS), jnp.float32),
               smem_tile((W, ROWS, band), dtype) if interpret else None,
               *[plgpu.Barrier(num_barriers=nb if bs.band_ring else 1)] * 2,
               plgpu.Barrier(num_barriers=nq * W),
               plgpu.Barrier(num_arrivals=W, num_barriers=2) if bs.persistent else None]

    def entry(q_ref, k_ref, v_ref, *refs):
        sink_ref = refs[0] if sink is not None else None
        out_ref, lse_ref = refs[-2:]

        def body(*allocated):
            it = iter(allocated)
            args = [None if a is None else next(it) for a in scratch]
            _kernel(q_ref, k_ref, v_ref, sink_ref, out_ref, lse_ref, *args, spec=spec, bs=bs,
                    nb=nb, interpret=interpret)

        pl.run_scoped(body, *[a for a in scratch if a is not None], collective_axes="wg")

    out_type = (jax.ShapeDtypeStruct((spec.batch, q.shape[1], spec.num_heads, spec.v_dim), dtype),
                jax.ShapeDtypeStruct((spec.batch, spec.num_heads, Tp), jnp.float32))
    inputs = (q, k, v) + ((sink,) if sink is not None else ())
    if bs.persistent:  # one CTA an SM, each over a run of consecutive items (window_items)
        from flashmesh.attention.pallas_mosaic_gpu_sm90 import sm_count

        grid = (min(Tp // ROWS * spec.num_kv_heads * spec.batch, sm_count(interpret)),)
        grid_names = ("sm",)
    else:
        grid, grid_names = (Tp // ROWS, spec.num_kv_heads, spec.batch), ("q", "heads", "batch")
    out, lse = plgpu.kernel(
        entry, out_type=out_type, grid=grid, grid_names=grid_names, num_threads=W, thread_name="wg",
        # No reduction scratch: the row max and sum stay within a warp (WGMMA layout).
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        # The interpreter models named barriers (the ping-pong) only in its tokamax mode.
        interpret=(dataclasses.replace(
            interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams(),
            inline_mgpu="_hack_model_inline_mgpu_tokamax") if interpret else None),
    )(*inputs)
    return out[:, :spec.q_len], lse[:, :, :spec.q_len]
