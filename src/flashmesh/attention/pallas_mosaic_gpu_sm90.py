"""Hopper (sm90) forward attention kernel in Pallas Mosaic GPU (FA3's structure).

Shape legend: B batch, T query length, S key length, N query heads, K key/value heads
(query head n reads key/value head n // (N // K)), Dqk / Dv head dims; block_q query rows per
CTA, split into num_compute_wgs warpgroups of rows_per_wg = block_q // num_compute_wgs rows.

Structure (FA3 / tokamax sm90, research/kernels.md §2.1, §2.5): a grid over (query tile, query
head, batch); per CTA `num_compute_wgs` compute warpgroups and one memory warpgroup. The memory
warpgroup streams K and V tiles by TMA into a ring of `num_stages` SMEM buffers (separate
"ready" barriers for K and V, so P·V waits only for V; "consumed" barriers release a slot once
every compute warpgroup is done with it). Each compute warpgroup loads its Q rows once, then per
key tile runs S = Q Kᵀ (WGMMA), an exp2 online softmax in float32 (scale and log2 e folded
into exp2's argument: one FMA per logit) and O += P V (WGMMA, P from registers).

Schedule (BlockSizes fields, each selectable so the variants can be timed against each other):
* `pingpong` (FA3's warp scheduler barrier): the compute warpgroups take turns issuing GEMMs,
  so one warpgroup's softmax runs under another's GEMMs. Warpgroup w waits on hardware named
  barrier base + w before a block of GEMMs and signals base + (w + 1) % W after issuing it;
  warpgroup 0 skips its first wait and the last warpgroup its last signal, which balances
  every barrier (one range per CTA, so all warpgroups run the same number of blocks).
* `intra_wg_overlap` (FA3's IntraWGOverlap): a prologue issues S_lo; step j issues S_j and
  O += P_j-1 V_j-1 as one block, waits for S_j only (`wgmma_accumulator_load(wait_n=1)`), runs
  softmax(S_j) while the P·V is in flight, then waits, releases V_j-1, rescales O and only
  then casts P_j to 16 bits (FA3's order: P_j-1's registers are free by then; 2026-12-07,
  untimed; the cast inside the in-flight scope measured 1.402 ms against 0.909 without the
  overlap on causal_8k_h32_d128, 2026-12-03-nvidia-h200-tune); an epilogue issues the last
  P·V. Without it: S_j, softmax, P_j V_j, with the softmax finished
  before the barriers and the next K awaited under the P·V (jax's attention_mgpu, tokamax).
* `reuse_q_for_o`: O is staged in the warpgroup's Q buffer for the TMA store (Dqk == Dv), so
  3 stages fit at d128 (`BlockSizes.smem_bytes` counts the bytes as Mosaic GPU does).
* `lpt_order`: query tiles of each (head, batch) run last to first, the longest causal ones first.
  The grid is head-major (head, query tile, batch), so that the CTAs on the chip at once share
  a few heads' K/V in L2.
* `persistent` (tokamax's and FA3's static persistent scheduler): a grid of one CTA per SM,
  CTA c running tiles c, c + C, ... of (batch, head, query tile) in a loop; under a causal
  mask, where tiles differ in work, of (query tile, batch, head), longest first, in snake rounds
  (`persistent_tiles`; FA3 uses a dynamic counter there), untimed for causal calls. The K/V ring's
  slots and barrier phases run on across tiles (`stream_kv`'s `issued`), so the memory
  warpgroup streams the next tile's keys under the last one's compute; with O in its own buffer
  the next Q is loaded after the tile's last S GEMM and an O store's TMA is awaited only before
  the next tile writes O.
Compiled without Mosaic's automatic barriers (the kernel orders its own SMEM accesses) and
without reduction scratch (row reductions of the WGMMA layout stay within a warp).

Tile skipping: the key tiles of a query tile come from `band_kv_range` (the closed form of
`kv_ranges`) evaluated on the traced tile index: tiles outside [lo, hi) are never loaded or
computed, tiles inside [full_lo, full_hi) run without mask arithmetic, the rest are masked
element-wise. A query tile that sees no key writes exactly 0 and lse = EMPTY_ROW_LSE.

Tails (T or S not a multiple of block_q / block_kv): the wrapper zero-pads q, k, v to the
block multiples (`jnp.pad`), the kernel masks keys past S in the last key tile (never FULL in
`band_kv_range`) and out / lse are sliced back to T. Padded query rows (q = 0, finite logits,
no NaN) are computed and dropped; TMA stores do not mask out-of-bounds rows (research/
kernels.md §3.2 item 6), so the outputs need the padding in any case.

Soft cap and sinks: with `logits_soft_cap` the logits are cap * tanh(scale * q.k / cap)
(after the scale, before the mask, as reference.py). A sink (softmax "off_by_one": z = 0,
"learnable": z = sink[n], float32 [N]) is one more logit without a value: the online softmax
starts from m = z, l = 1 instead of m = -inf, l = 0, so lse = log(sum_j exp(s_ij) + exp(z)),
and a row that sees no key gets output 0 and lse = z (never EMPTY_ROW_LSE). The learnable
sink reaches the kernel as [N, rows_per_wg] float32 (sink * log2 e, broadcast in the wrapper)
and each compute warpgroup copies its head's row into SMEM by TMA.

Dropout (spec.dropout_rate > 0): the elements kept are masks.dropout_keep's, bit for bit.
That hash has three rounds: one per (batch, head), one per query row, one per key pair. The
first two run in XLA (`dropout_row_hash`, uint32 [B, N, T], like the lse in size), so
context parallelism's global head and query numbers (`head_index`, `q_index`) cost nothing
in the kernel. Each compute warpgroup copies its rows by TMA, like the sink. The last round
runs in the kernel (`dropout_keep`, uint32 arithmetic on WGMMA-layout arrays: iota,
multiply, xor, logical right shift, unsigned compare), after the online softmax, once per
pair of adjacent keys (a thread holds both; each takes 16 bits of the hash). l sums the
undropped probabilities, so lse is unchanged. Only the P of O += P V loses the dropped
elements, and the 1 / (1 - rate) rescale (1 - rate being `masks.keep_probability`, the rate
rounded to 1/65536ths) is folded into the final 1 / l. Key numbers other than 0..S-1
(`kv_index`) are not implemented.

Segments and explicit positions (`tables`, pallas_mosaic_gpu_tokens): the CTA's key-tile
range is read from the block map's per-batch ranges (int32 scalars in global memory) instead
of `band_kv_range`; each compute warpgroup copies its rows' segment ids (and positions, under a
window) by TMA like the row hashes, and the memory warpgroup sends each key tile's ids (and
positions) with V into the same ring slot, released with V. Masked tiles compare ids and
positions element-wise (`tokens.mask`); FULL tiles (one segment, all visible) skip it.
Padded tokens (past T, S) are segment 0, so the tables need no separate tail mask.

Bias ([B|1, N|1, T, S], read in q's dtype, zero-padded to the tiles): the memory warpgroup
sends each key tile's bias rows with V, one TMA per compute warpgroup into [stages, W, rows,
block_kv] (the ready barrier takes W arrivals); the logit is scale q.k + bias, before the soft
cap (reference.py), so the scale is not folded into exp2 then.

KV splits (`BlockSizes.num_splits` > 1, flash-decoding for calls with too few query tiles to
fill the chip): the grid's query axis runs (tile, split) pairs; CTA (tile, s) visits part s
of the tile's key range (`split_part`, traced) and writes its normalised O (in the input
dtype) and lse into output slot s; `merge_splits` combines them in XLA by their lse weights.
Each split runs the vanilla softmax, the sink joining at the merge as one more term.

Implemented: causal and (left, right) windows in both alignments (top-left, bottom-right),
any scale, GQA/MQA, Dqk != Dv, bf16/f16 inputs with float32 accumulation, lse [B, N, T] in
the natural-log convention of reference.py, sequence tails (wrapper padding), the logit soft
cap, the off-by-one and learnable sink softmax, dropout, packed segments and explicit
positions, a post-scale bias; head dims that are multiples of 16 up to 256 (the widest
swizzle their rows allow, `swizzle_for`). Not implemented (NotImplementedError): other head
dims, dropout with global key numbers (kv_index). The backward pass is in
pallas_mosaic_gpu_sm90_bwd. Tails (lengths not multiples of the tiles) are read in place where
the length is a multiple of 8 (`BlockSizes.tma_tails`, the default: TMA's zero fill and
clipped stores), else padded copies. Opt-in, passed on the H200 but not yet timed:
`named_release` (named barriers for the K/V "consumed" handshakes, a one-warp producer;
benchmarks/notes/2026-12-07-forward-vs-fa3.md). Not yet done for speed: per-warpgroup ranges,
the lazy (thresholded) O rescale, a dynamic (LPT) persistent scheduler for causal calls.

Argument checks, the spec of a band-mask call and the dropout row hashes are in
pallas_mosaic_gpu_inputs; the K/V ring, band mask, dropout round and the P·V forms shared with
the backward and window kernels in pallas_mosaic_gpu_sm90_parts.

Interpret mode (`interpret=True`, CPU): the Mosaic GPU interpreter in jax 0.11.2 cannot take a
register operand as WGMMA's A, nor `pl.run_state` over an accumulator (it meets the discharged
`wgmma` primitive). So there P goes through an SMEM buffer and each step's P·V goes into a fresh
zero accumulator that is added to O (`pv_from_smem`), and the overlapped step issues its two
GEMMs one after the other (`_pair_in_turn`). On a GPU the kernel uses the FA3 form, P from
registers accumulated in place (`pv_from_registers`, `_pair_in_flight`). Everything else,
barriers and ping-pong turns included, is shared; the interpreter models the named barriers
(a miscounted turn deadlocks there too). The GPU form is lowered on CPU by the tests.

Example:
    >>> q = jax.random.normal(jax.random.key(0), (1, 256, 2, 64), jnp.bfloat16)
    >>> kv = jax.random.normal(jax.random.key(1), (1, 256, 1, 64), jnp.bfloat16)
    >>> out, lse = forward(q, kv, kv, scale=0.125, window=(-1, 0), interpret=True)
    >>> out.shape, lse.shape
    ((1, 256, 2, 64), (1, 2, 256))
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from flashmesh.attention import masks
from flashmesh.attention import pallas_mosaic_gpu_tokens as tokens
from flashmesh.attention.pallas_mosaic_gpu_common import (SMEM_ALIGNMENT, SMEM_BYTES, WARPGROUP, BlockSizes,
                                                          check_spec, smem_tile)
from flashmesh.attention.pallas_mosaic_gpu_ranges import split_part
from flashmesh.attention.pallas_mosaic_gpu_inputs import (check_bias, check_dropout_hash, check_sink,
                                                            check_tables, dropout_row_hash,
                                                            inputs_dropout_hash,
                                                            pad_tail, pad_to, spec_for)
from flashmesh.attention.pallas_mosaic_gpu_sm90_parts import (LN2, LOG2E, NamedRing, band_mask,
                                                                dropout_keep, first_free_barrier,
                                                                for_each_tile, named_barrier,
                                                                persistent_tiles, release,
                                                                pv_from_registers, pv_from_smem,
                                                                ring_slot, stream_tiles,
                                                                tile_kv_range)
from flashmesh.attention.spec import EMPTY_ROW_LSE, AttentionInputs, AttentionSpec


def smem_bytes(spec: AttentionSpec, bs: BlockSizes) -> int:
    """The forward's shared memory as Mosaic GPU counts it: `BlockSizes.smem_bytes` plus, with
    dropout, the warpgroups' uint32 row hashes and their W barriers, with a bias its ring of
    tiles, and with segments or positions the token tables (`pallas_mosaic_gpu_tokens.
    smem_bytes`)."""
    extra = tokens.smem_bytes(spec, bs.block_q, bs.block_kv, bs.num_stages, bs.num_compute_wgs)
    if spec.has_bias:  # the ring of bias tiles [stages, block_q, block_kv] and its barriers
        size = bs.num_stages * bs.block_q * bs.block_kv * jnp.dtype(spec.dtype).itemsize
        extra += -(-size // SMEM_ALIGNMENT) * SMEM_ALIGNMENT + 8 * bs.num_stages
    if spec.has_dropout:
        extra += -(-bs.block_q * 4 // SMEM_ALIGNMENT) * SMEM_ALIGNMENT + 8 * bs.num_compute_wgs
    return bs.smem_bytes(spec) + extra


def _pair_in_flight(acc, s_zero, q_tile, k_t, p_prev, v_tile, p_smem, outs, after_issue, on_s):
    """FA3's intra-warpgroup overlap: issue S = Q Kᵀ and O += P_prev V back to back, wait for
    S only (`wait_n=1`: WGMMA groups complete in order), run `on_s(S)` while P·V is in flight;
    then wait for P·V. `outs` holds arrays shaped like on_s's results (run_state refs)."""
    del p_smem

    def body(refs):
        s_ref, o_ref, out_refs = refs
        plgpu.wgmma(s_ref, q_tile, k_t)
        plgpu.wgmma(o_ref, p_prev, v_tile)
        after_issue()
        for ref, x in zip(out_refs, on_s(plgpu.wgmma_accumulator_load(s_ref, wait_n=1))):
            ref[...] = x

    _, acc, outs = pl.run_state(body)((plgpu.ACC.init(s_zero), plgpu.ACC.init(acc), outs))
    return acc, outs


def _pair_in_turn(acc, s_zero, q_tile, k_t, p_prev, v_tile, p_smem, outs, after_issue, on_s):
    """`_pair_in_flight` in the interpreter's form: S, then P·V through SMEM, then on_s(S)."""
    del s_zero, outs

    def qk(s_ref):
        plgpu.wgmma(s_ref, q_tile, k_t)
        return s_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((q_tile.shape[0], k_t.shape[1]), jnp.float32))
    acc = pv_from_smem(acc, p_prev, v_tile, p_smem, after_issue)
    return acc, on_s(s)


def _kernel(q_ref, k_ref, v_ref, sink_ref, hash_ref, bias_ref, tok_refs, out_ref, lse_ref, smem,
            barriers, *, spec: AttentionSpec, bs: BlockSizes, interpret: bool):
    # q_ref [B, Tp, N, Dqk], k_ref [B, Sp, K, Dqk], v_ref [B, Sp, K, Dv] (GMEM, padded to the
    # block multiples Tp, Sp, or T and S in place: `in_place`); sink_ref [N, rows] f32 (the
    # sink logit times log2 e) or None;
    # hash_ref [B, N, Tp] uint32 (dropout_row_hash) or None; bias_ref [B|1, N|1, Tp, Sp] in
    # the input dtype or None; tok_refs None or (ranges
    # [B, Tp / block_q, 4], q tables ([B, Tp] ids, positions under a window), kv tables [B, Sp])
    # out_ref [B, Tp (T in place), N, Dv], lse_ref [B, N, Tp] float32 (GMEM)
    # q_smem [W, rows, Dqk], k_smem [stages, block_kv, Dqk], v_smem [stages, block_kv, Dv],
    # o_smem [W, rows, Dv] or None (O staged in q_smem), lse_smem [W, rows] f32,
    # p_smem [W, rows, block_kv] or None, sink_smem [W, rows] f32 or None,
    # hash_smem [W, rows] uint32 or None; bias_smem [stages, W, rows, block_kv] or None;
    # qtok_smem: [W, rows] int32 per q table, kvtok_smem: [stages, block_kv] int32 per kv
    # table (empty without tables)
    q_smem, k_smem, v_smem, o_smem, lse_smem, p_smem, sink_smem, hash_smem, bias_smem = smem[:9]
    (q_ready, k_ready, v_ready, k_consumed, v_consumed, sink_ready, hash_ready,
     bias_ready) = barriers[:8]
    n_tok = len(smem[9:]) // 2
    qtok_smem, kvtok_smem = smem[9:9 + n_tok], smem[9 + n_tok:]
    qtok_ready, kvtok_ready = barriers[8:8 + n_tok], barriers[8 + n_tok:]
    W, rows, stages, bkv = bs.num_compute_wgs, bs.rows_per_wg, bs.num_stages, bs.block_kv
    if bs.named_release:  # the slots' releases: named barriers after the ping-pong's, over the
        # compute threads and one producer warp (the interpreter has no named barriers in warp
        # threads: there the whole memory warpgroup produces and syncs)
        first, producer = first_free_barrier(W + 1) + W, WARPGROUP if interpret else 32
        k_consumed, v_consumed = (NamedRing(first + i * stages, W * WARPGROUP + producer)
                                  for i in range(2))
    o_in_q = o_smem is None
    o_smem = q_smem if o_in_q else o_smem
    dtype = jnp.dtype(spec.dtype)
    num_q_tiles = -(-spec.q_len // bs.block_q)
    splits = bs.num_splits
    wg = lax.axis_index("wg")
    if bs.persistent:  # CTA c takes the tiles c, c + C, c + 2C, ... of (batch, head, q tile);
        # under a causal mask (one side unbounded: tiles differ in work) of (q tile, batch,
        # head), longest first, in snake rounds (FA3 is persistent there with a dynamic LPT
        # counter; the static snake order comes within 0.15% of the ideal in a model). Segments
        # keep the (batch, head)-major order that unmasked calls with tables run by default.
        uneven = min(spec.window) < 0 <= max(spec.window)
        num_local, coords = persistent_tiles(num_q_tiles, spec.num_heads, spec.batch,
                                             q_major=uneven, snake=uneven)
    else:  # one tile per CTA: grid (head, q tile [x split], batch)
        num_local = None  # one tile (for_each_tile)
        q_axis, split = lax.axis_index("q"), None
        if splits > 1:  # KV splits: CTA (tile, split) visits its part of the tile's key range
            split = lax.rem(q_axis, jnp.int32(splits))
            q_axis = lax.div(q_axis, jnp.int32(splits))
            out_ref, lse_ref = out_ref.at[split], lse_ref.at[split]
        head_axis, batch_axis = lax.axis_index("heads"), lax.axis_index("batch")

        def coords(i):
            del i
            return q_axis, head_axis, batch_axis

    def tile(i):
        """(query tile, head, batch, key-tile ranges) of the CTA's i-th tile. One range per
        tile for all warpgroups, so every compute warpgroup consumes every key tile the
        producer loads (and the ping-pong turns pair up)."""
        q_tile, head, batch = coords(i)
        if bs.lpt_order:  # the longest (causal: last) query tiles of each head first
            q_tile = num_q_tiles - 1 - q_tile
        r = tile_kv_range(spec, tok_refs, q_tile, batch, bs.block_q, bkv)
        if splits > 1:
            r = split_part(r, split, splits)
        return q_tile, head, batch, r

    @pl.when(wg < W)
    def _compute():
        plgpu.set_max_registers(bs.compute_registers, action="increase")
        q_wg = q_smem.at[wg]
        # Persistent with O in its own buffer: the next tile's Q loads during this tile's
        # last P·V and store (Q is dead after the last S GEMM), and a store's TMA finishes
        # under the next tile (awaited before O's buffer is written again).
        prefetch = bs.persistent and not o_in_q

        def load_q(i):
            q_tile, head, batch, _ = tile(i)
            plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_tile * bs.block_q + wg * rows, rows),
                                             head], q_wg, q_ready.at[wg])

        if prefetch:
            load_q(jnp.int32(0))

        def run_tile(i, issued):
            q_tile, head, batch, r = tile(i)
            lo, full_lo, full_hi, hi = r.lo, r.full_lo, r.full_hi, r.hi
            row0 = q_tile * bs.block_q + wg * rows
            if not prefetch:
                load_q(i)

            slot_of = ring_slot(issued, lo, stages)

            if sink_ref is not None:
                plgpu.copy_gmem_to_smem(sink_ref.at[head], sink_smem.at[wg], sink_ready.at[wg])
            if hash_ref is not None:
                plgpu.copy_gmem_to_smem(hash_ref.at[batch, head, pl.ds(row0, rows)], hash_smem.at[wg],
                                        hash_ready.at[wg])
            for ref, buf, ready in zip(tok_refs[1] if tok_refs else (), qtok_smem, qtok_ready):
                plgpu.copy_gmem_to_smem(ref.at[batch, pl.ds(row0, rows)], buf.at[wg], ready.at[wg])
            pv = pv_from_smem if interpret else pv_from_registers
            pair = _pair_in_turn if interpret else _pair_in_flight
            p_wg = None if p_smem is None else p_smem.at[wg]
            scale2 = spec.scale * LOG2E  # logits in log2 units: exp(x) = exp2(x log2 e)
            cap = spec.logits_soft_cap
            # Fold scale2 into exp2's argument, exp2(s scale2 - m): one FMA per logit (FA3).
            fold = cap is None and spec.scale > 0 and bias_ref is None
            kv_tail = spec.kv_len % bkv != 0  # the last key tile holds padded columns past S
            has_sink = spec.softmax != "vanilla"
            row_hash = None  # dropout: the warpgroup's row hashes, loaded before the main loop
            q_tokens = None  # segments: the warpgroup's (ids, positions), loaded before the loop

            # Ping-pong (FA3's warp scheduler barrier): warpgroup w waits on named barrier
            # base + w before issuing a block of GEMMs and then signals base + (w + 1) % W. Mosaic
            # GPU owns barrier 0 and 1 + warpgroup index (W compute + 1 memory warpgroup).
            base = first_free_barrier(W + 1)

            def turn_wait():
                if bs.pingpong:
                    named_barrier("sync", 2 * WARPGROUP)(base + wg)

            def turn_signal():
                if bs.pingpong:
                    named_barrier("arrive", 2 * WARPGROUP)(base + lax.rem(wg + 1, jnp.int32(W)))

            def first_turn_wait():  # warpgroup 0 issues the first block without waiting
                pl.when(wg != 0)(turn_wait)

            def last_turn_signal():  # the last warpgroup's last signal would have no taker
                pl.when(wg != W - 1)(turn_signal)

            def wait_k(step):
                plgpu.barrier_wait(k_ready.at[slot_of(step)])

            def qk(slot, during):
                def mma(s_ref):
                    plgpu.wgmma(s_ref, q_wg, k_smem.at[slot].transpose((1, 0)))
                    during()
                    return s_ref[...]

                s = pl.run_scoped(mma, plgpu.ACC((rows, bkv), jnp.float32))
                release(k_consumed, slot)
                return s

            def softmax(s, m_i, l_i, step, masked: bool, cast: bool = True):
                """Online softmax of one tile of raw logits s: (P in the input dtype (float32
                unless cast), new m, new l, alpha = exp2(m_old - m_new), the factor O must be
                rescaled by)."""
                # else every tile is FULL
                masked = masked and (spec.has_window or kv_tail or bool(tok_refs))
                slot = slot_of(step)
                for ready in kvtok_ready:  # every step observes its phase, masked or not
                    plgpu.barrier_wait(ready.at[slot])
                bias = None
                if bias_ref is not None:  # this warpgroup's rows of the key tile's bias
                    plgpu.barrier_wait(bias_ready.at[slot])
                    bias = bias_smem.at[slot, wg][...].astype(jnp.float32)
                if cap is not None:  # cap tanh(scale s / cap) in log2 units, tanh x = 1 - 2 /
                    # (exp(2x) + 1): exact at both ends, finer than approx_math's tanh.approx.
                    if bias is None:
                        e = jnp.exp2(s * (2.0 * LOG2E * spec.scale / cap))
                    else:  # the bias joins the scaled logit before the cap (reference.py)
                        e = jnp.exp2((s * spec.scale + bias) * (2.0 * LOG2E / cap))
                    s = (1.0 - 2.0 / (e + 1.0)) * (cap * LOG2E)
                elif bias is not None:
                    s = s * scale2 + bias * LOG2E
                elif not fold:
                    s = s * scale2
                if masked and tok_refs:  # ids (and positions) of this key tile, from the ring
                    kv_tokens = [plgpu.load(buf.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                                 for buf in kvtok_smem]
                    s = tokens.mask(s, q_tokens, kv_tokens + [None], spec, q_dim=0)
                elif masked:  # only the boundary tiles of [lo, hi) pay for the mask
                    i = plgpu.broadcasted_iota(jnp.int32, (rows, bkv), 0, layout=plgpu.Layout.WGMMA)
                    j = plgpu.broadcasted_iota(jnp.int32, (rows, bkv), 1, layout=plgpu.Layout.WGMMA)
                    s = band_mask(s, i + (row0 + spec.diagonal_offset), j + step * bkv, spec, kv_tail)
                m_tile = s.max(axis=1) * scale2 if fold else s.max(axis=1)
                m_new = jnp.maximum(m_i, m_tile)
                if (masked or bias is not None) and not has_sink:  # with a sink m starts finite
                    # A row with no visible key so far keeps m = -inf (a mask, or a bias of -inf
                    # even in a FULL tile); shift it by 0 instead, so exp2 gives exact zeros
                    # rather than NaN (-inf - -inf).
                    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                else:
                    m_safe = m_new  # an unmasked tile gives every row a finite maximum
                alpha = jnp.exp2(m_i - m_safe)
                m_b = lax.broadcast_in_dim(m_safe, s.shape, [0])
                p = jnp.exp2(s * scale2 - m_b) if fold else jnp.exp2(s - m_b)
                l_new = l_i * alpha + p.sum(axis=1)  # undropped: dropout acts after the softmax
                if row_hash is not None:  # only P·V's P loses them (1 / keep prob. in store)
                    keep = dropout_keep(row_hash, step * bkv, s.shape, 1, spec.dropout_rate)
                    p = jnp.where(keep, p, 0.0)
                return (p.astype(dtype) if cast else p), m_new, l_new, alpha

            def rescale(acc, alpha):
                return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            def run_steps(step, carry):
                """step(j, carry, masked) over [lo, hi) ([lo + 1, hi) after the overlap's
                prologue): the masked boundary runs around the unmasked middle [full_lo, full_hi)."""
                a = lo + 1 if bs.intra_wg_overlap else lo  # overlap: step lo is the prologue
                b, c = jnp.maximum(a, full_lo), jnp.maximum(a, full_hi)
                carry = lax.fori_loop(a, b, functools.partial(step, masked=True), carry)
                carry = lax.fori_loop(b, c, functools.partial(step, masked=False), carry)
                return lax.fori_loop(c, hi, functools.partial(step, masked=True), carry)

            def plain_loop(acc, m_i, l_i):
                # Per step: [S_j] turn_signal, softmax, turn_wait, [P_j V_j] (waits for K_j+1).
                wait_k(lo)
                first_turn_wait()

                def step(j, carry, masked):
                    acc, m_i, l_i = carry
                    slot = slot_of(j)
                    s = qk(slot, turn_signal)
                    p16, m_i, l_i, alpha = softmax(s, m_i, l_i, j, masked)
                    # Finish the softmax before the barriers (jax's attention_mgpu and tokamax
                    # found this order much faster for head dims up to 128).
                    acc, p16, m_i, l_i = lax.optimization_barrier((rescale(acc, alpha), p16, m_i, l_i))
                    plgpu.barrier_wait(v_ready.at[slot])
                    turn_wait()
                    acc = pv(acc, p16, v_smem.at[slot], p_wg,
                             lambda: pl.when(j + 1 < hi)(lambda: wait_k(j + 1)))
                    release(v_consumed, slot)
                    return acc, m_i, l_i

                acc, m_i, l_i = run_steps(step, (acc, m_i, l_i))
                last_turn_signal()
                return acc, m_i, l_i

            def overlap_loop(acc, m_i, l_i):
                # Prologue [S_lo]; step j: [S_j, P_j-1 V_j-1] with softmax(S_j) under P·V;
                # epilogue [P_hi-1 V_hi-1]. Each [...] is one ping-pong turn.
                s_zero = plgpu.layout_cast(jnp.zeros((rows, bkv), jnp.float32), plgpu.Layout.WGMMA)
                wait_k(lo)
                first_turn_wait()
                s = qk(slot_of(lo), turn_signal)
                p16, m_i, l_i, _ = softmax(s, m_i, l_i, lo, masked=True)  # acc is 0: no rescale

                def step(j, carry, masked):
                    acc, m_i, l_i, p_prev = carry
                    slot, prev = slot_of(j), slot_of(j - 1)
                    wait_k(j)
                    plgpu.barrier_wait(v_ready.at[prev])
                    turn_wait()

                    def on_s(s):  # S_j is complete, P_j-1 V_j-1 may still run
                        release(k_consumed, slot)
                        return softmax(s, m_i, l_i, j, masked, cast=False)

                    acc, (p, m_new, l_new, alpha) = pair(
                        acc, s_zero, q_wg, k_smem.at[slot].transpose((1, 0)), p_prev,
                        v_smem.at[prev], p_wg, (s_zero, m_i, l_i, m_i), turn_signal, on_s)
                    # FA3's order: P_j is cast once P_j-1 V_j-1 is done (its registers free),
                    # the float32 P pinned after that wait, so the 16-bit P_j and P_j-1 are
                    # never live together (one 64 x bkv operand more at the peak otherwise)
                    p16 = lax.optimization_barrier(p).astype(dtype)
                    release(v_consumed, prev)
                    return rescale(acc, alpha), m_new, l_new, p16

                acc, m_i, l_i, p16 = run_steps(step, (acc, m_i, l_i, p16))
                last = slot_of(hi - 1)
                plgpu.barrier_wait(v_ready.at[last])
                turn_wait()
                acc = pv(acc, p16, v_smem.at[last], p_wg, last_turn_signal)
                release(v_consumed, last)
                return acc, m_i, l_i

            def store(acc, m_i, l_i):
                seen = l_i > 0.0  # always true with a sink: an empty row gives 0 and lse = z
                inv = jnp.where(seen, 1.0 / jnp.where(seen, l_i, 1.0), 0.0)  # an empty row gives 0
                if spec.has_dropout:  # the kept probabilities' 1 / keep_probability
                    inv = inv * (1.0 / masks.keep_probability(spec.dropout_rate))
                o = rescale(acc, inv).astype(dtype)
                log2_l = jnp.log(jnp.where(seen, l_i, 1.0)) * LOG2E
                if o_in_q:  # a warpgroup barrier: every warp is past its last read of Q
                    plgpu.commit_smem()
                if bs.persistent and not o_in_q:  # the last tile's stores have read O, lse
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # (the issuing thread)
                    plgpu.commit_smem()  # and the warpgroup waits for it
                o_smem.at[wg][...] = o
                lse_smem.at[wg][...] = jnp.where(seen, (m_i + log2_l) * LN2, EMPTY_ROW_LSE)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg], out_ref.at[batch, pl.ds(row0, rows), head])
                plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, pl.ds(row0, rows)])
                if not prefetch:  # Q's buffer (O's, too) is rewritten by the next tile's load
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            acc = plgpu.layout_cast(jnp.zeros((rows, spec.v_dim), jnp.float32), plgpu.Layout.WGMMA)
            row_layout = plgpu.Layout.WGMMA.reduce(1)
            if spec.softmax == "vanilla":
                m_i = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), row_layout)
                l_i = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), row_layout)
            else:
                # The sink is one more logit z (0 or sink[n]) with no value: start the online
                # softmax from it, m = z and l = exp(z - m) = 1 (log2 units).
                if sink_ref is None:  # off_by_one
                    m_i = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), row_layout)
                else:
                    plgpu.barrier_wait(sink_ready.at[wg])
                    m_i = plgpu.load(sink_smem.at[wg], layout=row_layout)
                l_i = plgpu.layout_cast(jnp.ones((rows,), jnp.float32), row_layout)
            if hash_ref is not None:
                plgpu.barrier_wait(hash_ready.at[wg])
                row_hash = plgpu.load(hash_smem.at[wg], layout=row_layout)
            if tok_refs:
                for ready in qtok_ready:
                    plgpu.barrier_wait(ready.at[wg])
                q_tokens = [plgpu.load(buf.at[wg], layout=row_layout) for buf in qtok_smem] + [None]
            plgpu.barrier_wait(q_ready.at[wg])
            main_loop = overlap_loop if bs.intra_wg_overlap else plain_loop

            def finish(acc, m_i, l_i):
                if prefetch:  # every S GEMM of the tile is done: Q's buffer is free
                    pl.when(i + 1 < num_local)(lambda: load_q(i + 1))
                store(acc, m_i, l_i)

            @pl.when(hi > lo)
            def _():
                finish(*main_loop(acc, m_i, l_i))

            @pl.when(hi <= lo)  # the tile sees no key: out 0, lse EMPTY_ROW_LSE or the sink
            def _():
                finish(acc, m_i, l_i)

            return issued + jnp.maximum(hi - lo, 0)

        for_each_tile(run_tile, num_local)
        if prefetch:  # the last tile's stores
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == W)
    def _memory():
        plgpu.set_max_registers(bs.memory_registers, action="decrease")

        def stream():
            stream_tiles(tile, num_local,
                         kv=((k_ref, v_ref), (k_smem, v_smem), (k_ready, v_ready),
                             (k_consumed, v_consumed)),
                         tok=(tok_refs, kvtok_smem, kvtok_ready),
                         bias=(bias_ref, bias_smem, bias_ready), group_size=spec.group_size,
                         block_q=bs.block_q, rows=rows, num_wgs=W, bkv=bkv, stages=stages)

        if interpret or not bs.named_release:
            stream()
            return

        @plgpu.warp_map
        def _(warp):  # one producer warp: the named barriers count its 32 threads
            pl.when(warp == 0)(stream)


def check(spec: AttentionSpec, bs: BlockSizes) -> None:
    """NotImplementedError for a call this kernel cannot run, ValueError for a bad tile."""
    check_spec(spec, "forward")
    bs.validate_for(spec)
    if (smem := smem_bytes(spec, bs)) > SMEM_BYTES:
        raise ValueError(f"BlockSizes(block_q={bs.block_q}, block_kv={bs.block_kv}, num_stages="
                         f"{bs.num_stages}) needs {smem} bytes of shared memory with dropout's "
                         f"row hashes and the segment tables; at most {SMEM_BYTES} (use fewer "
                         "stages)")


INTERPRET_CTAS = 3  # a persistent grid's CTAs in interpret mode (each runs several tiles)
SM90_SMS = 132  # H100 SXM / H200 streaming multiprocessors


def sm_count(interpret: bool) -> int:
    """CTAs of a persistent grid: the GPU's SM count (`core_count`), INTERPRET_CTAS in the
    interpreter, and SM90_SMS where no GPU is attached (the tests lower the GPU form on a CPU;
    nothing runs there)."""
    if interpret:
        return INTERPRET_CTAS
    try:
        return jax.devices("gpu")[0].core_count
    except RuntimeError:  # no GPU backend
        return SM90_SMS


def _sink_rows(spec: AttentionSpec, sink, rows: int):
    """The learnable sink as the kernel reads it: [N, rows] f32 of sink[n] * log2 e (one row
    of a warpgroup's TMA copy per head), None for the other softmax types."""
    check_sink(spec, sink)
    if spec.softmax != "learnable":
        return None
    z2 = sink.astype(jnp.float32) * jnp.float32(LOG2E)
    return jnp.broadcast_to(z2[:, None], (spec.num_heads, rows))


def forward_spec(q, k, v, spec: AttentionSpec, *, sink=None, dropout_hash=None, tables=None,
                 bias=None, block_sizes: BlockSizes | None = None, interpret: bool = False):
    """`forward` for a normalised spec (what the registry calls). dropout_hash: uint32
    [B, N, T] from `dropout_row_hash` when spec.dropout_rate > 0, else None. tables: the
    call's `pallas_mosaic_gpu_tokens.TokenTables` when it has segments or explicit positions
    (`tokens.from_inputs`), else None. bias: [B|1, N|1, T, S] (spec.bias_shape), added to the
    scaled logits; the kernel reads it in q's dtype. With block_sizes.num_splits > 1 each query
    tile's key range is split over that many CTAs, whose outputs `merge_splits` combines."""
    bs = BlockSizes() if block_sizes is None else block_sizes
    check(spec, bs)
    check_dropout_hash(spec, dropout_hash)
    check_tables(spec, tables)
    check_bias(spec, bias)
    sink_rows = _sink_rows(spec, sink, bs.rows_per_wg)
    splits, full_spec = bs.num_splits, spec
    if splits > 1:  # each split runs vanilla; the sink joins when they are merged
        spec, sink_rows = dataclasses.replace(spec, softmax="vanilla"), None
    if dropout_hash is not None:
        dropout_hash = pad_to(dropout_hash, 2, bs.block_q)  # padded rows are dropped anyway
    # Tails: zero-pad T and S to the block multiples (padded keys are masked in the kernel),
    # then slice the outputs back to T; in place (tma_tails) TMA reads zeros past the ends
    # and drops O's rows past T, so only the small arrays (and the bias) are padded.
    Tp = -(-spec.q_len // bs.block_q) * bs.block_q
    Sp = -(-spec.kv_len // bs.block_kv) * bs.block_kv
    q = pad_tail(q, bs.block_q, bs.tma_tails)
    k, v = pad_tail(k, bs.block_kv, bs.tma_tails), pad_tail(v, bs.block_kv, bs.tma_tails)
    if bias is not None:  # padded rows and columns are dropped or masked: zeros
        bias = pad_to(pad_to(bias.astype(q.dtype), 2, bs.block_q), 3, bs.block_kv)
    W = bs.num_compute_wgs
    dtype = jnp.dtype(spec.dtype)
    tok = None if tables is None else tokens.kernel_arrays(spec, tables, bs.block_q, bs.block_kv,
                                                           q_len=Tp, kv_len=Sp)
    n_tok = tokens.per_side(spec)
    smem = [
        smem_tile((W, bs.rows_per_wg, spec.qk_dim), dtype),
        smem_tile((bs.num_stages, bs.block_kv, spec.qk_dim), dtype),
        smem_tile((bs.num_stages, bs.block_kv, spec.v_dim), dtype),
        None if bs.o_reuses_q(spec) else smem_tile((W, bs.rows_per_wg, spec.v_dim), dtype),
        plgpu.SMEM((W, bs.rows_per_wg), jnp.float32),
        smem_tile((W, bs.rows_per_wg, bs.block_kv), dtype) if interpret else None,
        plgpu.SMEM((W, bs.rows_per_wg), jnp.float32) if sink_rows is not None else None,
        plgpu.SMEM((W, bs.rows_per_wg), jnp.uint32) if dropout_hash is not None else None,
        smem_tile((bs.num_stages, W, bs.rows_per_wg, bs.block_kv), dtype) if bias is not None else None,
    ] + [plgpu.SMEM((W, bs.rows_per_wg), jnp.int32)] * n_tok + [
        plgpu.SMEM((bs.num_stages, bs.block_kv), jnp.int32)] * n_tok
    barriers = [
        plgpu.Barrier(num_barriers=W),
        plgpu.Barrier(num_barriers=bs.num_stages),
        plgpu.Barrier(num_barriers=bs.num_stages),
        *[None if bs.named_release else plgpu.Barrier(num_arrivals=W, num_barriers=bs.num_stages)] * 2,
        plgpu.Barrier(num_barriers=W) if sink_rows is not None else None,
        plgpu.Barrier(num_barriers=W) if dropout_hash is not None else None,
        plgpu.Barrier(num_arrivals=W, num_barriers=bs.num_stages) if bias is not None else None,
    ] + [plgpu.Barrier(num_barriers=W)] * n_tok + [plgpu.Barrier(num_barriers=bs.num_stages)] * n_tok
    n_smem = len(smem)
    optional = (sink_rows, dropout_hash, bias)
    tok_inputs = () if tok is None else (tok.ranges,) + tok.q_side + tok.kv_side

    def entry(q_ref, k_ref, v_ref, *refs):
        it = iter(refs[:-2])  # the optional inputs that are present, then out and lse
        sink_ref, hash_ref, bias_ref = (None if x is None else next(it) for x in optional)
        tok_refs = None
        if tok is not None:
            ranges_ref, *tables_refs = (next(it) for _ in tok_inputs)
            tok_refs = (ranges_ref, tables_refs[:n_tok], tables_refs[n_tok:])
        out_ref, lse_ref = refs[-2:]

        def body(*scratch):
            it = iter(scratch)  # the None entries take no scratch
            allocated = [None if a is None else next(it) for a in smem + barriers]
            _kernel(q_ref, k_ref, v_ref, sink_ref, hash_ref, bias_ref, tok_refs, out_ref, lse_ref,
                    allocated[:n_smem], allocated[n_smem:], spec=spec, bs=bs, interpret=interpret)

        pl.run_scoped(body, *[a for a in smem + barriers if a is not None], collective_axes="wg")

    lead = (splits,) if splits > 1 else ()  # one normalised output and lse per split
    To = q.shape[1]  # T in place (O's tail rows dropped by TMA), else Tp
    out_type = (jax.ShapeDtypeStruct(lead + (spec.batch, To, spec.num_heads, spec.v_dim), dtype),
                jax.ShapeDtypeStruct(lead + (spec.batch, spec.num_heads, Tp), jnp.float32))
    inputs = (q, k, v) + tuple(x for x in optional if x is not None) + tok_inputs
    if bs.persistent:
        grid = (min(Tp // bs.block_q * spec.num_heads * spec.batch, sm_count(interpret)),)
        grid_names = ("sm",)
    else:
        # head-major: the CUDA launch runs the last axis fastest, so the CTAs resident at once
        # are a few heads' query tiles sharing their K/V in L2 (a (q, heads, batch) grid ran a
        # few tiles of every head at once: causal 8k, 32 heads, 4 CTAs per head's K/V)
        grid = (spec.num_heads, Tp // bs.block_q * splits, spec.batch)
        grid_names = ("heads", "q", "batch")
    out, lse = plgpu.kernel(
        entry, out_type=out_type, grid=grid, grid_names=grid_names,
        num_threads=W + 1, thread_name="wg",
        # No automatic barriers: the kernel orders its own SMEM accesses (commit_smem before
        # every TMA store and before O overwrites Q). No reduction scratch: the only
        # reductions are over a row of the WGMMA layout, within a warp.
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True,
                                             reduction_scratch_bytes=0),
        # The interpreter models named barriers (the ping-pong) only in its tokamax mode.
        interpret=(plgpu.InterpretGPUParams(inline_mgpu="_hack_model_inline_mgpu_tokamax")
                   if interpret else None),
    )(*inputs)
    if splits > 1:  # lse is padded to the tiles, out may be in place (T rows)
        out, lse = merge_splits(out, lse[..., :To], full_spec, sink)
    return out[:, :spec.q_len], lse[:, :, :spec.q_len]


def merge_splits(out, lse, spec: AttentionSpec, sink=None):
    """The KV splits' normalised outputs [splits, B, T, N, Dv] and lse [splits, B, N, T]
    (vanilla softmax each) -> (out, lse) of the whole range, with the sink (spec.softmax) as
    one more term without a value: lse = log(sum_s exp(lse_s) + exp(z)), out = sum_s
    exp(lse_s - lse) out_s in float32. A split that saw no key has lse_s = EMPTY_ROW_LSE and
    weight exp(-1e30 - lse) = 0; a row no split saw keeps out 0 and lse EMPTY_ROW_LSE (or z)."""
    terms = lse
    if spec.softmax != "vanilla":
        z = jnp.zeros((spec.num_heads,), jnp.float32) if sink is None else sink.astype(jnp.float32)
        terms = jnp.concatenate([lse, jnp.broadcast_to(z[None, None, :, None], (1,) + lse.shape[1:])])
    m = terms.max(axis=0)
    total = m + jnp.log(jnp.exp(terms - m[None]).sum(axis=0))
    if spec.softmax == "vanilla":
        total = jnp.where(m <= EMPTY_ROW_LSE, EMPTY_ROW_LSE, total)
    w = jnp.exp(lse - total[None])  # [splits, B, N, T]
    merged = jnp.einsum("sbnt,sbtnd->btnd", w, out.astype(jnp.float32))
    return merged.astype(out.dtype), total


def forward(q: Float[Array, "B T N Dqk"], k: Float[Array, "B S K Dqk"],
            v: Float[Array, "B S K Dv"], *, scale: float, window: tuple[int, int] = (-1, -1),
            bottom_right: bool = False, logits_soft_cap: float | None = None,
            softmax: str = "vanilla", sink: Float[Array, "N"] | None = None,
            dropout_rate: float = 0.0, dropout_seed=None, block_sizes: BlockSizes | None = None,
            interpret: bool = False) -> tuple[Float[Array, "B T N Dv"], Float[Array, "B N T"]]:
    """Band-mask attention forward: (out [B, T, N, Dv] in q's dtype, lse [B, N, T] float32).

    Args:
      q, k, v: bf16 or f16; N a multiple of K (query head n reads kv head n // (N // K)).
      scale: logit scale (the caller's 1/sqrt(Dqk) default is applied by api.py).
      window: (left, right): query at position i sees keys [i - left, i + right], -1 unbounded;
        causal is (-1, 0).
      bottom_right: query i sits at position i + S - T (the diagonal ends at the last query
        and key) instead of i.
      logits_soft_cap: s = cap * tanh(s / cap) after the scale, before the mask; None: off.
      softmax: "vanilla", "off_by_one" (an extra exp(0) in the denominator) or "learnable"
        (an extra exp(sink[n]) per query head).
      sink: float32 [N] sink logits, for softmax="learnable" only.
      dropout_rate, dropout_seed: with rate in (0, 1), probabilities are dropped where
        masks.dropout_keep(dropout_seed, rate, b, n, i, j) is False and the rest scaled by
        1 / masks.keep_probability(rate); dropout_seed is uint32 [2] (what api.normalize makes
        of a PRNG key).
      block_sizes: the tile configuration, `BlockSizes()` by default (the registry passes
        `default_for`); T and S need not be multiples of block_q and block_kv (tails are
        padded in the wrapper).
      interpret: run on CPU in Mosaic GPU's interpreter (P·V through SMEM, see module doc).
    lse is log(sum_j exp(s_ij) + z) with z = 0, 1 or exp(sink[n]) (as reference.py); under
    vanilla softmax a row that sees no key gets output 0 and lse = EMPTY_ROW_LSE; with a sink
    it gets output 0 and lse = the sink logit (0 for off_by_one). Dropout leaves lse alone.
    """
    spec = spec_for(q, k, v, scale=scale, window=window, bottom_right=bottom_right,
                    logits_soft_cap=logits_soft_cap, softmax=softmax, dropout_rate=dropout_rate)
    dropout_hash = dropout_row_hash(spec, dropout_seed) if spec.has_dropout else None
    return forward_spec(q, k, v, spec, sink=sink, dropout_hash=dropout_hash,
                        block_sizes=block_sizes, interpret=interpret)


def attention(inputs: AttentionInputs, spec: AttentionSpec, *,
              block_sizes: BlockSizes | None = None, interpret: bool = False):
    """Forward only, no custom VJP (pallas_mosaic_gpu.attention is the registered backend)."""
    inputs = masks.without_padding(inputs)
    return forward_spec(inputs.q, inputs.k, inputs.v, spec, sink=inputs.sink,
                        dropout_hash=inputs_dropout_hash(inputs, spec),
                        tables=tokens.from_inputs(spec, inputs), bias=inputs.bias,
                        block_sizes=block_sizes, interpret=interpret)
