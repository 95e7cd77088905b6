"""Hopper (sm90) backward attention kernels in Pallas Mosaic GPU: dQ and dK/dV.

Shape legend: B batch, T query length, S key length, N query heads, K key/value heads
(G = N // K query heads per key/value head), Dqk / Dv head dims; W compute warpgroups per CTA.

Math (FlashAttention-2, Dao 2023, Alg. 2; the residuals are the forward's out and lse):
with c_ij the logit after scale and soft cap (masked: -inf) and lse_i the forward's
log-sum-exp (the sink included), P_ij = exp(c_ij - lse_i), dV = Pᵀ dO, dP = dO Vᵀ,
delta_i = rowsum(dO ∘ O) (= Σ_j P_ij dP_ij, a plain-JAX preprocess), dC = P ∘ (dP - delta),
dS = dC ∘ (1 - tanh²) under the soft cap, dQ = scale dS K, dK = scale dSᵀ Q. A sink logit z
has probability exp(z - lse) and no value, so dz = -exp(z - lse) delta (plain JAX).

Dropout (rate r, 1 - r being masks.keep_probability; keep_ij is masks.dropout_keep, bit for
bit: `sm90.dropout_keep` on the forward's row hashes, streamed like lse):
dV = (P ∘ keep / (1 - r))ᵀ dO and dC = P ∘ (dP ∘ keep / (1 - r) - delta), where
delta = rowsum(dO ∘ O) uses the forward's dropped O (chunked_vjp's form). The kernels run the
r-free form dV += (P ∘ keep)ᵀ dO and dC' = P ∘ (dP ∘ keep - (1 - r) delta), with (1 - r) delta
scaled in XLA. dQ, dK and dV take the 1 / (1 - r) at the end, with the logit scale, so each
element pays two selects on top of its hash.

Two forms; `default_for` picks by the tile table's backward_entries (the fused one for head
dim 64 self-attention, as measured; never under spec.reproducible). Two kernels, deterministic
(no atomics), as tokamax's sm90 VJP and jax's attention_mgpu:
Grids are head-major (kv head or query head, then tiles, then batch; the CUDA launch runs the
last named axis fastest): the CTAs on the chip at once are a few heads' tiles, whose streamed
Q / dO (dK/dV kernel), K / V (dQ kernel) and fused dQ reduce-adds stay in L2 (FA3 groups by
head the same way), where a (tiles, heads, batch) grid ran a few tiles of every head at once
(causal 8k, 32 heads: 128 MB of each head's rows against a 50 MB L2).
* dK/dV (KV-stationary, FA2/FA3): grid (kv head, key tile, batch); each of W compute
  warpgroups owns block_kv / W keys and keeps dK, dV in registers; the memory warpgroup streams
  (Q, dO, lse, delta) tiles of block_q rows by TMA into a ring of num_stages SMEM slots, over the
  G query heads of the group and, for each, only the query tiles of the key tile's band
  (`band_q_range`). Per step, transposed so that Pᵀ and dSᵀ are WGMMA's register A operand:
  Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (issued together), Pᵀ = exp2(Sᵀ log2e - lse log2e),
  dSᵀ = Pᵀ (dPᵀ - delta), then dV += Pᵀ dO and dK += dSᵀ Q (issued together).
* dQ (Q-stationary): grid (query head, query tile, batch), query tiles last to first (the
  longest causal ones first); each compute warpgroup owns
  block_q_dq / W query rows; the memory warpgroup streams K and V tiles of block_kv_dq keys over
  `band_kv_range`. Per step S = Q Kᵀ and dP = dO Vᵀ, then dQ += dS K (dS from registers).
* Fused (`BackwardBlockSizes.fused_dq`; FA3's five GEMMs): the dK/dV kernel alone,
  each step also storing dSᵀ to SMEM and computing dQ_part = dS K over the warpgroup's keys
  (dSᵀ as WGMMA's transposed A), which leaves by TMA reduce-add into a float32 accumulator
  [B, Tp, N, Dqk] (a jax.Ref, zeroed); the wrapper scales and casts it. The dQ kernel's S and
  dP GEMMs are saved; the float32 additions' order varies, so dQ is not bit-reproducible. The
  interpreter has no TMA reduction: there each (key tile, warpgroup) writes its own slice of a
  [nkv * W, B, Tp, N, Dqk] accumulator, summed afterwards. Not with a bias or split_dkv.
  `stagger_q` (opt-in, untimed): key tiles whose query tiles are all full visit them from a
  start of their own, so one head's key tiles do not reduce-add into the same dQ rows at once.
Tiles outside a band are never loaded or computed; tiles whose pairs are all visible (FULL)
run without mask arithmetic. GQA sums dK/dV over the group's heads inside the kernel.

Zero contributions, never NaN: padded query rows (T tail) carry q = dO = 0, lse = delta = 0, so
P is finite and dV, dS get exactly 0 from them; padded keys (S tail) lie in the last key tile,
never FULL, where they are masked. A query row that sees no key has -inf logits wherever it
meets a tile (its tiles are never FULL), so P = 0 whatever its lse (EMPTY_ROW_LSE is finite).

Interpret mode (`interpret=True`, CPU): the Mosaic GPU interpreter (jax 0.11.2) cannot take a
register A operand nor `pl.run_state` over an accumulator, so there Pᵀ, dSᵀ and dS are stored
to SMEM buffers and each GEMM accumulates into a fresh zero accumulator added afterwards
(`_mma_from_smem`); on a GPU the register forms run (`_mma_from_registers`). Nothing else
differs.

Segments and explicit positions (`tables`, as the forward's): both kernels take their tile
ranges from the block map (per batch row; the dK/dV kernel's per key tile, transposed); the
stationary side's ids (and positions) are copied once per warpgroup, the streamed side's
arrive with each Q/dO tile (dK/dV kernel, released with it) or K/V tile (dQ kernel, read before
V's release frees the slot). Masked tiles use `tokens.mask`.

Bias (the forward's, in q's dtype): the dQ kernel streams its tiles with K/V as the forward
does and writes dS (dropout's 1 / (1 - r) included) per visited tile into a [B, N, T, S]
output by TMA; the wrapper zeroes the tiles no CTA visited (EMPTY in the block map) and sums
over the dims the bias broadcasts (`_reduce_dbias`). The dK/dV kernel reads the bias
transposed ([B|1, N|1, S, T], an XLA transpose), streamed with the Q/dO tiles. The [B, N, T, S]
intermediate costs B x N x T x S x 2 bytes, like a full bias.

Large head dims (d256, MLA 192/128), whose dK and dV accumulators do not fit the registers
together, run the dK/dV kernel twice (`BackwardBlockSizes.split_dkv`): a dV pass (Sᵀ, Pᵀ,
dV += Pᵀ dO) and a dK pass (Sᵀ, dPᵀ, dSᵀ, dK += dSᵀ Q).

The dK/dV kernel lives in pallas_mosaic_gpu_sm90_bwd_dkv, the pieces both kernels share in
pallas_mosaic_gpu_sm90_bwd_parts; tiles, their register and shared-memory counts and the default
in pallas_mosaic_gpu_sm90_bwd_tiles; argument checks in pallas_mosaic_gpu_inputs; the K/V ring,
band mask and dropout round shared with the forward in pallas_mosaic_gpu_sm90_parts.

`BackwardBlockSizes.wg_ranges` (the narrow-window table entry's, with `persistent_dq`): each
compute warpgroup computes only the streamed tiles its own rows meet (`clamp_within` of its own band range inside
the CTA's) and passes over the rest (waits for the tile, releases it); under a window (128, 0)
that is a quarter of each kernel's warpgroup-steps.

`BackwardBlockSizes.overlap` reorders a dK/dV step on a GPU after FA3 (`pipelined`): Sᵀ and
dPᵀ issued, Pᵀ computed once Sᵀ is in (`wait_n=1`) while dPᵀ runs, dSᵀ computed (fused: stored
for dQ) before dV += Pᵀ dO is issued, then (fused) dQ's GEMM, dK's, and the partial dQ sent out
while dK's runs; all awaited once per step; the dQ kernel computes P while dP runs. The
arithmetic is unchanged. With the fused kernel by columns it is the fastest d128 causal form
measured (2.840 ms against 3.036 for two kernels on causal 8k, H200, 2026-12-06: the table's
entry for lengths 4097-8192); with two kernels it stays slower (3.143).

Not implemented (NotImplementedError): head dims not multiples of 16 (32-byte rows), above
256, dropout with global key numbers (kv_index). Not yet done for speed: overlap of a step's
GEMMs with the next step's, ping-pong between warpgroups, a persistent LPT grid (tails: padded
copies where the length is not a multiple of 8, else in place: `tma_tails`); at d128 the
fused kernel was slower than the two (3.28 against 2.95 ms causal 8k, 4.81 against 3.02 full 4k on the H200,
`benchmarks/probe_mosaic.py --bwd-grid`, before its partial-dQ buffer was swizzled and the
automatic barriers went).

Example (sm90 = flashmesh.attention.pallas_mosaic_gpu_sm90, q/k/v/do as sm90.forward's):
    >>> spec = sm90.spec_for(q, k, v, scale=0.125, window=(-1, 0))
    >>> out, lse = sm90.forward_spec(q, k, v, spec, interpret=True)
    >>> dq, dk, dv, dsink, dbias = backward_spec(q, k, v, out, lse, do, spec, interpret=True)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashmesh.attention import masks
from flashmesh.attention import pallas_mosaic_gpu_tokens as tokens
from flashmesh.attention.pallas_mosaic_gpu_common import check_spec, smem_tile
from flashmesh.attention.pallas_mosaic_gpu_ranges import band_kv_range, clamp_within
from flashmesh.attention.pallas_mosaic_gpu_sm90_bwd_dkv import kernel_dkv, step_copies
from flashmesh.attention.pallas_mosaic_gpu_inputs import (check_bias, check_dropout_hash, check_sink,
                                                            check_tables, pad_tail, pad_to)
from flashmesh.attention.pallas_mosaic_gpu_sm90_bwd_parts import (COL, ROW, logits2, mma_from_registers,
                                                                    mma_from_smem, products_overlapped,
                                                                    walk_ranges, wgmma_iota, zero_acc)
from flashmesh.attention.pallas_mosaic_gpu_sm90_bwd_tiles import BackwardBlockSizes, default_for
from flashmesh.attention.pallas_mosaic_gpu_sm90_parts import (LOG2E, band_mask, dropout_keep,
                                                                for_each_tile, persistent_tiles,
                                                                ring_slot, stream_tiles,
                                                                tile_kv_range)
from flashmesh.attention.spec import AttentionInputs, AttentionSpec


# -- the dQ kernel ------------------------------------------------------------------------------

def _kernel_dq(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, hash_ref, bias_ref, tok_refs, dq_ref,
               dbias_ref, delta_out_ref, smem, barriers, *, spec: AttentionSpec,
               bs: BackwardBlockSizes, interpret: bool):
    # q_ref / dq_ref [B, Tp, N, Dqk], do_ref [B, Tp, N, Dv], k_ref [B, Sp, K, Dqk] (T, S in
    # place),
    # v_ref [B, Sp, K, Dv], lse_ref (natural log, times log2 e once loaded),
    # delta_ref [B, N, Tp] f32,
    # hash_ref [B, N, Tp] uint32 (dropout's row hash) or None (GMEM)
    # q_smem [W, rows, Dqk] (then dQ's epilogue, unless dq_smem), do_smem [W, rows, Dv], lse_smem,
    # delta_smem [W, rows] f32, k_smem [stages, bkv, Dqk], v_smem [stages, bkv, Dv],
    # ds_smem [W, rows, bkv] (interpret only, else None), hash_smem [W, rows] uint32 or None;
    # bias_ref [B|1, N|1, Tp, Sp] or None, then dbias_ref [B, N, Tp, Sp] (dS per tile, the
    # caller sums broadcast dims and zeroes tiles never visited); bias_smem [stages, W, rows,
    # bkv], dbias_smem [W, rows, bkv]; dq_smem [W, rows, Dqk] (persistent_dq: dQ's own
    # epilogue buffer, so the next tile's Q loads while it drains) or None;
    # tok_refs None or (ranges [B, Tp / block_q_dq, 4], q tables [B, Tp], kv tables [B, Sp]);
    # qtok_smem [W, rows] int32 per q table, kvtok_smem [stages, bkv] int32 per kv table;
    # delta_in_dq: delta_ref is O [B, Tp, N, Dv] (into o_smem [W, rows, Dv]), and the kernel
    # computes delta = rowsum(O o dO) (times 1 - r under dropout) itself, writes it from
    # delta_smem into delta_out_ref [B, N, Tp] f32 for the dK/dV kernel; else delta_out_ref
    # and o_smem are None
    (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, hash_smem, bias_smem,
     dbias_smem, dq_smem, o_smem) = smem[:12]
    (q_ready, do_ready, lse_ready, delta_ready, k_ready, v_ready, k_consumed, v_consumed,
     hash_ready, bias_ready) = barriers[:10]
    n_tok = len(smem[12:]) // 2
    qtok_smem, kvtok_smem = smem[12:12 + n_tok], smem[12 + n_tok:]
    qtok_ready, kvtok_ready = barriers[10:10 + n_tok], barriers[10 + n_tok:]
    dropout = hash_ref is not None
    W, stages, bkv = bs.num_compute_wgs, bs.num_stages, bs.block_kv_dq
    rows = bs.block_q_dq // W
    dtype = jnp.dtype(spec.dtype)
    num_q_tiles = lse_ref.shape[-1] // bs.block_q_dq  # lse is padded to the tiles (q may not be)
    wg = lax.axis_index("wg")
    num_local = None  # one tile per CTA
    if bs.persistent_dq:  # CTA c takes the tiles c, c + C, c + 2C, ... of the flat order:
        # query-tile-major where tiles differ in work (an unbounded side, segments), so that the
        # longest tiles of every head come first and each CTA meets every length; (batch,
        # head)-major for a band's equal tiles (as measured on the window anchor); in snake
        # rounds (`persistent_tiles`)
        q_major = tok_refs is not None or min(spec.window) < 0
        num_local, coords = persistent_tiles(num_q_tiles, spec.num_heads, spec.batch,
                                             q_major=q_major, snake=q_major)
    else:  # one tile per CTA: grid (head, q tile, batch)
        def coords(i):
            del i
            return lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("batch")

    def tile(i):
        """(query tile, head, batch, key-tile ranges) of the CTA's i-th tile. Longest first (LPT,
        as the forward's lpt_order): under a causal mask the last query tiles of a head see the
        most keys, so they start first and the short ones fill the end."""
        q_index, head, batch = coords(i)
        q_tile = num_q_tiles - 1 - q_index
        return q_tile, head, batch, tile_kv_range(spec, tok_refs, q_tile, batch, bs.block_q_dq, bkv)

    def _dq_steps(r, q_tile, head, batch, row0, slot_of, lse, delta, row_hash, q_tokens):
        """One query tile's dQ rows of this warpgroup: its loop over the streamed key tiles."""
        accumulate = mma_from_smem if interpret else mma_from_registers
        staging = None if ds_smem is None else (ds_smem.at[wg],)
        kv_tail = spec.kv_len % bkv != 0

        def kv_step(step, dq, *, masked: bool):
            masked = masked and (spec.has_window or kv_tail or bool(tok_refs))
            slot = slot_of(step)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            for ready in kvtok_ready:  # every step observes its phase, masked or not
                plgpu.barrier_wait(ready.at[slot])
            kv_tokens = None  # read before V's release, which frees the slot's tables too
            if masked and tok_refs:
                kv_tokens = [plgpu.load(buf.at[slot], layout=COL) for buf in kvtok_smem] + [None]
            bias = None
            if bias_ref is not None:
                plgpu.barrier_wait(bias_ready.at[slot])
                bias = bias_smem.at[slot, wg][...].astype(jnp.float32)
            k_tile = k_smem.at[slot]

            def probabilities(s):  # computed while dP's GEMM runs
                s2, dcap = logits2(s, spec, bias)
                if masked and tok_refs:
                    s2 = tokens.mask(s2, q_tokens, kv_tokens, spec, q_dim=0)
                elif masked:
                    key = wgmma_iota((rows, bkv), 1) + step * bkv
                    q_pos = wgmma_iota((rows, bkv), 0) + (row0 + spec.diagonal_offset)
                    s2 = band_mask(s2, q_pos, key, spec, kv_tail)
                return jnp.exp2(s2 - lax.broadcast_in_dim(lse, s2.shape, [0])), dcap

            (p, dcap), dp = products_overlapped(q_smem.at[wg], k_tile.transpose((1, 0)),
                                                 do_smem.at[wg], v_smem.at[slot].transpose((1, 0)),
                                                 (rows, bkv), (rows, bkv), probabilities,
                                                 bs.overlap)
            plgpu.barrier_arrive(v_consumed.at[slot])
            if dropout:
                keep = dropout_keep(row_hash, step * bkv, p.shape, 1, spec.dropout_rate)
                dp = jnp.where(keep, dp, 0.0)
            ds = p * (dp - lax.broadcast_in_dim(delta, p.shape, [0]))
            if dcap is not None:
                ds = ds * dcap
                if masked:  # a masked pair's cap slope may be NaN (its bias: padding)
                    ds = jnp.where(p == 0.0, 0.0, ds)
            if dbias_ref is not None:  # dbias = dS (dropout's 1 / (1 - r) included)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store read it
                keep_scale = 1.0 / masks.keep_probability(spec.dropout_rate)
                dbias_smem.at[wg][...] = (ds * keep_scale if dropout else ds).astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(dbias_smem.at[wg], dbias_ref.at[
                    batch, head, pl.ds(row0, rows), pl.ds(step * bkv, bkv)])
            (dq,) = accumulate((dq,), (ds.astype(dtype),), (k_tile,), staging)
            plgpu.barrier_arrive(k_consumed.at[slot])
            return dq

        def pass_over(step, dq):  # a streamed tile outside this warpgroup's own range
            slot = slot_of(step)
            for ready in (k_ready, v_ready, *kvtok_ready):
                plgpu.barrier_wait(ready.at[slot])
            plgpu.barrier_arrive(v_consumed.at[slot])
            plgpu.barrier_arrive(k_consumed.at[slot])
            return dq

        # wg_ranges: the key tiles this warpgroup's rows meet, inside the CTA's streamed ones
        # (not with a bias: dbias's unvisited tiles are zeroed at the CTA's granularity)
        own = r
        if bs.wg_ranges and tok_refs is None and dbias_ref is None:
            own = clamp_within(r, band_kv_range(
                q_tile * W + wg, q_len=spec.q_len, kv_len=spec.kv_len, window=spec.window,
                diagonal_offset=spec.diagonal_offset, block_q=rows, block_kv=bkv))
        return walk_ranges(r, own, functools.partial(kv_step, masked=True),
                           functools.partial(kv_step, masked=False), pass_over,
                           zero_acc((rows, spec.qk_dim)))

    @pl.when(wg < W)
    def _compute():
        plgpu.set_max_registers(bs.compute_registers, action="increase")

        def load_rows(i):  # the warpgroup's Q, dO, lse, delta (row hashes, q tables) of tile i
            q_tile, head, batch, _ = tile(i)
            row0 = q_tile * bs.block_q_dq + wg * rows
            q_rows, stats = (batch, pl.ds(row0, rows), head), (batch, head, pl.ds(row0, rows))
            plgpu.copy_gmem_to_smem(q_ref.at[q_rows], q_smem.at[wg], q_ready.at[wg])
            plgpu.copy_gmem_to_smem(do_ref.at[q_rows], do_smem.at[wg], do_ready.at[wg])
            plgpu.copy_gmem_to_smem(lse_ref.at[stats], lse_smem.at[wg], lse_ready.at[wg])
            if o_smem is None:
                plgpu.copy_gmem_to_smem(delta_ref.at[stats], delta_smem.at[wg], delta_ready.at[wg])
            else:  # O's rows: delta is computed here
                plgpu.copy_gmem_to_smem(delta_ref.at[q_rows], o_smem.at[wg], delta_ready.at[wg])
            if dropout:
                plgpu.copy_gmem_to_smem(hash_ref.at[stats], hash_smem.at[wg], hash_ready.at[wg])
            for ref, buf, ready in zip(tok_refs[1] if tok_refs else (), qtok_smem, qtok_ready):
                plgpu.copy_gmem_to_smem(ref.at[batch, pl.ds(row0, rows)], buf.at[wg], ready.at[wg])

        if bs.persistent_dq:
            load_rows(jnp.int32(0))

        def run_tile(i, issued):
            q_tile, head, batch, r = tile(i)
            slot_of = ring_slot(issued, r.lo, stages)
            row0 = q_tile * bs.block_q_dq + wg * rows
            if not bs.persistent_dq:
                load_rows(i)
            for barrier in (q_ready, do_ready, lse_ready, delta_ready) + tuple(qtok_ready):
                plgpu.barrier_wait(barrier.at[wg])
            q_tokens = [plgpu.load(buf.at[wg], layout=ROW) for buf in qtok_smem] + [None]
            lse = plgpu.load(lse_smem.at[wg], layout=ROW) * LOG2E
            if o_smem is None:
                delta = plgpu.load(delta_smem.at[wg], layout=ROW)
            else:  # delta = rowsum(O o dO) in float32 (the r-free form's (1 - r) under dropout),
                # 128 columns at a time past that (O and dO in float32 registers: 2 x 64 / thread)
                width = 128 if spec.v_dim > 128 and spec.v_dim % 128 == 0 else spec.v_dim
                delta = None
                for c in range(0, spec.v_dim, width):
                    cols = pl.ds(c, width)
                    o = plgpu.load(o_smem.at[wg, :, cols], layout=plgpu.Layout.WGMMA)
                    d_o = plgpu.load(do_smem.at[wg, :, cols], layout=plgpu.Layout.WGMMA)
                    part = jnp.sum(o.astype(jnp.float32) * d_o.astype(jnp.float32), axis=1)
                    delta = part if delta is None else delta + part
                if dropout:
                    delta = delta * jnp.float32(masks.keep_probability(spec.dropout_rate))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's delta has left
                delta_smem.at[wg][...] = delta
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(delta_smem.at[wg],
                                        delta_out_ref.at[batch, head, pl.ds(row0, rows)])
            row_hash = None
            if dropout:
                plgpu.barrier_wait(hash_ready.at[wg])
                row_hash = plgpu.load(hash_smem.at[wg], layout=ROW)
            dq = _dq_steps(r, q_tile, head, batch, row0, slot_of, lse, delta, row_hash, q_tokens)
            out = q_smem if dq_smem is None else dq_smem
            if bs.persistent_dq:
                # Q, dO, lse, delta of this tile are dead (their last GEMMs were awaited, the
                # rest is in registers): the next tile's rows load while dQ leaves
                @pl.when(i + 1 < num_local)
                def _():
                    plgpu.commit_smem()  # this tile's reads of lse, delta (...) before TMA rewrites
                    load_rows(i + 1)

                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's dQ has left
            else:  # Q's buffer takes dQ once every warp's last GEMM has read Q (a barrier)
                plgpu.commit_smem()
            dq_scale = spec.scale / masks.keep_probability(spec.dropout_rate)  # dropout's too
            out.at[wg][...] = (dq * dq_scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out.at[wg], dq_ref.at[batch, pl.ds(row0, rows), head])
            return issued + r.hi - r.lo

        for_each_tile(run_tile, num_local)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # SMEM read out; the writes land anyway

    @pl.when(wg == W)
    def _memory():
        plgpu.set_max_registers(bs.memory_registers, action="decrease")

        stream_tiles(tile, num_local,
                     kv=((k_ref, v_ref), (k_smem, v_smem), (k_ready, v_ready), (k_consumed, v_consumed)),
                     tok=(tok_refs, kvtok_smem, kvtok_ready), bias=(bias_ref, bias_smem, bias_ready),
                     group_size=spec.group_size, block_q=bs.block_q_dq, rows=rows, num_wgs=W,
                     bkv=bkv, stages=stages)


# -- the wrapper --------------------------------------------------------------------------------

def check(spec: AttentionSpec, bs: BackwardBlockSizes) -> None:
    """NotImplementedError for a call these kernels cannot run, ValueError for a bad tile."""
    check_spec(spec, "backward", max_dim=256)  # 256: WGMMA's N
    bs.validate_for(spec)


def _check_arrays(q, k, v, out, lse, do, spec: AttentionSpec, sink):
    B, T, S, N, K = spec.batch, spec.q_len, spec.kv_len, spec.num_heads, spec.num_kv_heads
    expected = {"q": (q, (B, T, N, spec.qk_dim)), "k": (k, (B, S, K, spec.qk_dim)),
                "v": (v, (B, S, K, spec.v_dim)), "out": (out, (B, T, N, spec.v_dim)),
                "do": (do, (B, T, N, spec.v_dim)), "lse": (lse, (B, N, T))}
    for name, (x, shape) in expected.items():
        if x.shape != shape:
            raise ValueError(f"{name}.shape={x.shape} must be {shape} (from the spec)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != jnp.dtype(spec.dtype):
            raise ValueError(f"{name}.dtype={x.dtype} must be spec.dtype={spec.dtype}")
    if lse.dtype != jnp.float32:
        raise ValueError(f"lse.dtype={lse.dtype} must be float32")
    check_sink(spec, sink)


def _launch(kernel, inputs, out_type, smem, barriers, grid, grid_names, bs, interpret):
    """plgpu.kernel over `grid` with W compute + 1 memory warpgroup; None inputs and scratch
    entries are passed through as None. The segment tables come last in `inputs`, as None or
    (ranges, q tables, kv tables), and reach the kernel in that structure."""
    n_smem = len(smem)
    *plain, tok = inputs
    tok_flat = [] if tok is None else [tok[0], *tok[1], *tok[2]]
    present = [x for x in plain if x is not None] + tok_flat

    def entry(*refs):
        it = iter(refs[:len(present)])
        in_refs = [None if x is None else next(it) for x in plain]
        if tok is not None:
            n = len(tok[1])
            flat = [next(it) for _ in tok_flat]
            in_refs.append((flat[0], flat[1:1 + n], flat[1 + n:]))
        else:
            in_refs.append(None)

        def body(*scratch):
            it = iter(scratch)
            allocated = [None if a is None else next(it) for a in smem + barriers]
            kernel(*in_refs, *refs[len(present):], allocated[:n_smem], allocated[n_smem:])

        pl.run_scoped(body, *[a for a in smem + barriers if a is not None], collective_axes="wg")

    return plgpu.kernel(
        entry, out_type=out_type, grid=grid, grid_names=grid_names,
        num_threads=bs.num_compute_wgs + 1, thread_name="wg",
        # No automatic barriers (a bar.sync around every SMEM store and before every TMA
        # issue): the kernels order their own SMEM accesses. Threads write only buffers that
        # WGMMA or TMA read (dSᵀ, partial dQ, dbias, delta, the dQ / dK / dV epilogues), each
        # behind commit_smem (a fence and a warpgroup barrier), after wait_smem_to_gmem (also a
        # barrier) where the last store may still be reading; threads read only TMA-written
        # buffers, released by an arrive of every thread (release semantics) or, before a
        # persistent tile's loads, by commit_smem. The forward does the same.
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
        interpret=_interpret_params(interpret),
    )(*present)


def _interpret_params(interpret):
    """True: the interpreter's defaults; an InterpretGPUParams (e.g. detect_races=True) as is;
    either in the mode that models the kernels' inline PTX (ds_sync's fence and named barrier;
    jax 0.11.2 runs it only in its tokamax mode)."""
    if not interpret:
        return None
    if not isinstance(interpret, plgpu.InterpretGPUParams):
        interpret = plgpu.InterpretGPUParams()
    return dataclasses.replace(interpret, inline_mgpu="_hack_model_inline_mgpu_tokamax")


def _dkv(q, k, v, do, lse, delta, row_hash, bias_t, tables, spec, bs, interpret):
    W, stages, bq, dtype = bs.num_compute_wgs, bs.num_stages, bs.block_q, jnp.dtype(spec.dtype)
    rows, dropout = bs.block_kv // W, row_hash is not None
    Tp, Sp = padded_lengths(spec, bs)
    nkv = Sp // bs.block_kv
    n_tok, grid = tokens.per_side(spec), (spec.num_kv_heads, nkv, spec.batch)  # head-major (L2)
    tok = None
    if tables is not None:
        arrays = tokens.kernel_arrays(spec, tables, bq, bs.block_kv, q_len=Tp, kv_len=Sp,
                                      transpose=True, num_tiles=nkv)
        tok = (arrays.ranges, arrays.q_side, arrays.kv_side)
    smem = [smem_tile((W, rows, spec.qk_dim), dtype), smem_tile((W, rows, spec.v_dim), dtype),
            smem_tile((stages, bq, spec.qk_dim), dtype), smem_tile((stages, bq, spec.v_dim), dtype),
            plgpu.SMEM((stages, bq), jnp.float32), plgpu.SMEM((stages, bq), jnp.float32),
            smem_tile((W, rows, bq), dtype) if interpret else None,
            smem_tile((W, rows, bq), dtype) if interpret else None,
            plgpu.SMEM((stages, bq), jnp.uint32) if dropout else None,
            smem_tile((stages, W, rows, bq), dtype) if bias_t is not None else None,
            smem_tile(((2,) if bs.dq_columns else ()) + (W, rows, bq), dtype) if bs.fused_dq else None,
            smem_tile((W, bq, bs.dq_width(spec)), jnp.float32) if bs.fused_dq else None]
    smem += [plgpu.SMEM((W, rows), jnp.int32)] * n_tok + [plgpu.SMEM((stages, bq), jnp.int32)] * n_tok
    copies = step_copies(spec, bs, dropout=dropout, bias=bias_t is not None)
    barriers = [plgpu.Barrier(num_barriers=W), plgpu.Barrier(num_barriers=W),
                plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
                plgpu.Barrier(num_arrivals=W, num_barriers=stages)]
    barriers += ([None if bs.ds_sync else plgpu.Barrier(num_arrivals=W, num_barriers=2),
                  plgpu.Barrier(num_arrivals=W)] if bs.dq_columns else [None, None])
    barriers += [plgpu.Barrier(num_barriers=W) if bs.dq_writer else None] * 2  # dq_full, dq_empty
    barriers += [plgpu.Barrier(num_barriers=W)] * n_tok
    dq_acc = None
    if bs.fused_dq:  # float32, zeroed, updated in place (a jax.Ref the kernel adds into)
        slices = (nkv * W,) if interpret else ()
        dq_acc = jax.new_ref(jnp.zeros(slices + q.shape[:3] + (spec.qk_dim,), jnp.float32))
    inputs = (q, k, v, do, lse, delta, row_hash, bias_t, dq_acc, tok)
    dk_type, dv_type = jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype)
    if not bs.split_dkv:
        kernel = functools.partial(kernel_dkv, spec=spec, bs=bs, interpret=interpret)
        dk, dv = _launch(kernel, inputs, (dk_type, dv_type), smem, barriers, grid,
                         ("heads", "kv", "batch"), bs, interpret)
        if dq_acc is None:
            return dk, dv, None
        dq = dq_acc[...]
        return dk, dv, dq.sum(axis=0) if interpret else dq
    outs = []
    for part, out_type in (("dk", dk_type), ("dv", dv_type)):  # one accumulator per pass
        one = functools.partial(kernel_dkv, spec=spec, bs=bs, interpret=interpret, part=part)

        def kernel(*refs, one=one, part=part):  # (inputs..., dk | dv, smem, barriers)
            out = (refs[-3], None) if part == "dk" else (None, refs[-3])
            return one(*refs[:-3], *out, *refs[-2:])

        outs += _launch(kernel, inputs, (out_type,), smem, barriers, grid, ("heads", "kv", "batch"),
                        bs, interpret)
    return (*outs, None)


def _dq(q, k, v, do, lse, delta, row_hash, bias, tables, spec, bs, interpret, out=None):
    """(dq, dbias or None, delta or None): with `out` (O, padded; delta None) the kernel
    computes delta itself and returns it (delta_in_dq)."""
    W, stages, bkv, dtype = bs.num_compute_wgs, bs.num_stages, bs.block_kv_dq, jnp.dtype(spec.dtype)
    rows, dropout = bs.block_q_dq // W, row_hash is not None
    Tp, Sp = padded_lengths(spec, bs)
    nq = Tp // bs.block_q_dq
    n_tok, grid = tokens.per_side(spec), (spec.num_heads, nq, spec.batch)  # head-major (L2)
    tok = None
    if tables is not None:
        arrays = tokens.kernel_arrays(spec, tables, bs.block_q_dq, bkv, q_len=Tp, kv_len=Sp,
                                      num_tiles=nq)
        tok = (arrays.ranges, arrays.q_side, arrays.kv_side)
    smem = [smem_tile((W, rows, spec.qk_dim), dtype), smem_tile((W, rows, spec.v_dim), dtype),
            plgpu.SMEM((W, rows), jnp.float32), plgpu.SMEM((W, rows), jnp.float32),
            smem_tile((stages, bkv, spec.qk_dim), dtype), smem_tile((stages, bkv, spec.v_dim), dtype),
            smem_tile((W, rows, bkv), dtype) if interpret else None,
            plgpu.SMEM((W, rows), jnp.uint32) if dropout else None,
            smem_tile((stages, W, rows, bkv), dtype) if bias is not None else None,
            smem_tile((W, rows, bkv), dtype) if bias is not None else None,
            smem_tile((W, rows, spec.qk_dim), dtype) if bs.persistent_dq else None,
            smem_tile((W, rows, spec.v_dim), dtype) if out is not None else None]
    smem += [plgpu.SMEM((W, rows), jnp.int32)] * n_tok + [plgpu.SMEM((stages, bkv), jnp.int32)] * n_tok
    barriers = [plgpu.Barrier(num_barriers=W) for _ in range(4)]
    barriers += [plgpu.Barrier(num_barriers=stages) for _ in range(2)]
    barriers += [plgpu.Barrier(num_arrivals=W, num_barriers=stages) for _ in range(2)]
    barriers += [plgpu.Barrier(num_barriers=W) if dropout else None]
    barriers += [plgpu.Barrier(num_arrivals=W, num_barriers=stages) if bias is not None else None]
    barriers += [plgpu.Barrier(num_barriers=W)] * n_tok + [plgpu.Barrier(num_barriers=stages)] * n_tok
    dq_kernel = functools.partial(_kernel_dq, spec=spec, bs=bs, interpret=interpret)
    out_type = (jax.ShapeDtypeStruct(q.shape, dtype),)
    if bias is not None:  # dS of every visited tile, per batch row and head
        out_type += (jax.ShapeDtypeStruct((spec.batch, spec.num_heads) + bias.shape[2:], dtype),)
    if out is not None:  # delta, for the dK/dV kernel
        out_type += (jax.ShapeDtypeStruct(lse.shape, jnp.float32),)

    def kernel(*refs):  # (inputs..., dq[, dbias][, delta], smem, barriers)
        *head, smem_refs, barrier_refs = refs
        outs = head[len(head) - len(out_type):]
        dbias_ref = outs[1] if bias is not None else None
        delta_out_ref = outs[-1] if out is not None else None
        return dq_kernel(*head[:len(head) - len(out_type)], outs[0], dbias_ref, delta_out_ref,
                         smem_refs, barrier_refs)

    grid_names = ("heads", "q", "batch")
    if bs.persistent_dq:  # one CTA per SM (at most one per tile), looping over its tiles
        from flashmesh.attention.pallas_mosaic_gpu_sm90 import sm_count

        grid, grid_names = (min(sm_count(interpret), int(np.prod(grid))),), ("sm",)
    outs = _launch(kernel, (q, k, v, do, lse, delta if out is None else out, row_hash, bias, tok),
                   out_type, smem, barriers, grid, grid_names, bs, interpret)
    return (outs[0], outs[1] if bias is not None else None, outs[-1] if out is not None else None)


def backward_spec(q, k, v, out, lse, do, spec: AttentionSpec, *, sink=None, d_lse=None,
                  dropout_hash=None, tables=None, bias=None, block_sizes: BackwardBlockSizes | None = None,
                  interpret: bool | plgpu.InterpretGPUParams = False):
    """The gradients of `forward_spec(q, k, v, spec, sink=sink)` at cotangent `do`.

    Args:
      q [B, T, N, Dqk], k [B, S, K, Dqk], v [B, S, K, Dv]: what the forward took (bf16/f16).
      out [B, T, N, Dv], lse [B, N, T] float32: what it returned (natural-log lse with the sink
        included; EMPTY_ROW_LSE for vanilla rows that see no key).
      do [B, T, N, Dv]: the cotangent of out.
      d_lse [B, N, T] float32 or None: the cotangent of lse. It adds d_lse_i p_ij to dS_ij,
        which is delta_i - d_lse_i in place of delta_i (and the same for the sink).
      spec: the forward's spec; sink: float32 [N] for softmax="learnable", else None.
      dropout_hash: uint32 [B, N, T], the forward's `sm90.dropout_row_hash`, when
        spec.dropout_rate > 0 (else None); out is then the forward's dropped output.
      tables: the forward's `pallas_mosaic_gpu_tokens.TokenTables` for a call with segments or
        explicit positions, else None.
      bias: the forward's bias [B|1, N|1, T, S] (spec.bias_shape), else None.
      block_sizes: `default_for(spec)` when None; T and S need not be block multiples.
      interpret: run in Mosaic GPU's interpreter on CPU (see the module doc); an
        `plgpu.InterpretGPUParams` runs it with those settings (e.g. detect_races=True).
    Returns:
      (dq [B, T, N, Dqk] in q's dtype, dk [B, S, K, Dqk], dv [B, S, K, Dv] in k's and v's dtype,
      dsink float32 [N] for softmax="learnable", else None, dbias of the bias's shape and dtype
      or None). Rows that see no key get zero gradient.
    """
    bs = default_for(spec) if block_sizes is None else block_sizes
    check(spec, bs)
    _check_arrays(q, k, v, out, lse, do, spec, sink)
    check_dropout_hash(spec, dropout_hash)
    check_tables(spec, tables)
    check_bias(spec, bias)
    if d_lse is not None and d_lse.shape != lse.shape:
        raise ValueError(f"d_lse.shape={d_lse.shape} must be lse's {lse.shape}")
    # delta_in_dq: the dQ kernel (run first) computes delta from O and dO itself; the fused
    # backward (no dQ kernel) and an lse cotangent take XLA's
    in_dq = bs.delta_in_dq and not bs.fused_dq and d_lse is None
    delta = None
    if not in_dq:
        delta = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32), do.astype(jnp.float32))
        if d_lse is not None:
            delta = delta - d_lse.astype(jnp.float32)
        if spec.has_dropout:  # the kernels' r-free form: dC' = P (dP keep - (1 - r) delta)
            delta = delta * jnp.float32(masks.keep_probability(spec.dropout_rate))
    # Tails: zero-pad T and S to multiples of both kernels' tiles. Padded query rows get
    # q = dO = lse = delta = 0 (finite P, exactly zero dS and dV terms); padded keys are masked.
    # In place (tma_tails) TMA reads those zeros past the ends of q, dO, O, k, v and drops the
    # rows of dQ, dK, dV past them; lse, delta, the hashes, tables and bias are padded still.
    q_mult, kv_mult = tile_multiples(bs)
    qp, dop = pad_tail(q, q_mult, bs.tma_tails), pad_tail(do.astype(q.dtype), q_mult, bs.tma_tails)
    kp, vp = pad_tail(k, kv_mult, bs.tma_tails), pad_tail(v, kv_mult, bs.tma_tails)
    lse_p = pad_to(lse, 2, q_mult)  # natural log: the kernels scale it by log2 e as they load it
    delta = None if delta is None else pad_to(delta, 2, q_mult)
    if dropout_hash is not None:  # padded rows have dO = 0: their hash does not matter
        dropout_hash = pad_to(dropout_hash, 2, q_mult)
    bias_p = bias_t = None
    if bias is not None:  # zero-padded like q, k; the dK/dV kernel reads it transposed
        bias_p = pad_to(pad_to(bias.astype(q.dtype), 2, q_mult), 3, kv_mult)
        bias_t = bias_p.swapaxes(2, 3)
    if in_dq:  # the dQ kernel first: it writes the delta the dK/dV kernel reads
        outp = pad_tail(out.astype(q.dtype), q_mult, bs.tma_tails)
        dq, dbias, delta = _dq(qp, kp, vp, dop, lse_p, None, dropout_hash, bias_p, tables, spec, bs,
                               interpret, out=outp)
    dk, dv, dq_fused = _dkv(qp, kp, vp, dop, lse_p, delta, dropout_hash, bias_t, tables, spec, bs,
                            interpret)
    if dq_fused is not None:  # fused: dS K summed over the key tiles; the scale and dropout's
        dq_scale = spec.scale / masks.keep_probability(spec.dropout_rate)
        dq, dbias = (dq_fused * dq_scale).astype(q.dtype), None
    elif not in_dq:
        dq, dbias, _ = _dq(qp, kp, vp, dop, lse_p, delta, dropout_hash, bias_p, tables, spec, bs,
                           interpret)
    dsink = None
    if spec.softmax == "learnable":
        # The sink's probability exp(z - lse) times its (zero) dP minus delta, summed over b, t
        # (delta without dropout's (1 - r), which only the kernels' r-free form carries).
        p_sink = jnp.exp(sink.astype(jnp.float32)[None, :, None] - lse)
        unscaled = delta[:, :, :spec.q_len] / jnp.float32(masks.keep_probability(spec.dropout_rate))
        dsink = -jnp.sum(p_sink * unscaled, axis=(0, 2))
    S, T = spec.kv_len, spec.q_len
    if dbias is not None:
        dbias = _reduce_dbias(dbias[:, :, :T, :S], spec, tables, bs).astype(bias.dtype)
    return dq[:, :T], dk[:, :S], dv[:, :S], dsink, dbias


def tile_multiples(bs: BackwardBlockSizes) -> tuple[int, int]:
    """The multiples of both kernels' query and key tiles."""
    return int(np.lcm(bs.block_q, bs.block_q_dq)), int(np.lcm(bs.block_kv, bs.block_kv_dq))


def padded_lengths(spec: AttentionSpec, bs: BackwardBlockSizes) -> tuple[int, int]:
    """(Tp, Sp): T and S rounded up to `tile_multiples`, the lengths the kernels' grids, lse,
    delta and tables cover (q, k, v themselves in place or padded)."""
    q_mult, kv_mult = tile_multiples(bs)
    return -(-spec.q_len // q_mult) * q_mult, -(-spec.kv_len // kv_mult) * kv_mult


def _reduce_dbias(dbias, spec: AttentionSpec, tables, bs: BackwardBlockSizes):
    """The dQ kernel's dS [B, N, T, S] -> the bias's gradient: tiles it never visited (EMPTY in
    the block map, their memory unwritten) set to 0, then summed in float32 over the dims the
    bias broadcasts (B or N of size 1)."""
    from flashmesh.attention import masks

    inputs = AttentionInputs(q=None, k=None, v=None) if tables is None else tables.as_inputs()
    classes = masks.block_map(spec, inputs, bs.block_q_dq, bs.block_kv_dq)  # [B|1, nq, nk]
    seen = jnp.repeat(jnp.repeat(jnp.asarray(classes != masks.EMPTY), bs.block_q_dq, axis=1),
                      bs.block_kv_dq, axis=2)[:, None, :spec.q_len, :spec.kv_len]
    dbias = jnp.where(seen, dbias.astype(jnp.float32), 0.0)
    axes = tuple(a for a, n in enumerate(spec.bias_shape[:2]) if n == 1)
    return dbias.sum(axis=axes, keepdims=True) if axes else dbias
