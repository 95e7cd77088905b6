"""The sm90 backward's dK/dV kernel (KV-stationary; with `fused_dq` also FA3's fifth GEMM,
partial dQ by TMA reduce-add; with `overlap` its GEMMs under its arithmetic): its math, grid,
buffers and forms are described in pallas_mosaic_gpu_sm90_bwd, which launches it."""

from __future__ import annotations

import functools

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from flashmesh.attention import masks
from flashmesh.attention import pallas_mosaic_gpu_tokens as tokens
from flashmesh.attention.pallas_mosaic_gpu_common import WARPGROUP
from flashmesh.attention.pallas_mosaic_gpu_ranges import clamp_within
from flashmesh.attention.pallas_mosaic_gpu_sm90_bwd_parts import (COL, ROW, logits2, mma_from_registers,
                                                                    mma_from_smem, products_from,
                                                                    products_overlapped, ring_drain,
                                                                    walk_ranges, wgmma_iota, zero_acc)
from flashmesh.attention.pallas_mosaic_gpu_sm90_bwd_tiles import BackwardBlockSizes, band_q_range
from flashmesh.attention.pallas_mosaic_gpu_sm90_parts import (LOG2E, band_mask, dropout_keep,
                                                               fence_async_shared, first_free_barrier,
                                                               named_barrier)
from flashmesh.attention.spec import AttentionSpec


def step_copies(spec: AttentionSpec, bs: BackwardBlockSizes, *, dropout: bool, bias: bool) -> int:
    """The TMA copies of one streamed step of the dK/dV kernel, all arriving on its one
    step_ready barrier: Q, lse, dO, delta, the dropout row hashes, a bias tile per warpgroup, a
    q table per segment table (one wait per step where there were up to seven)."""
    return 4 + dropout + (bs.num_compute_wgs if bias else 0) + tokens.per_side(spec)


def kernel_dkv(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, hash_ref, bias_ref, dq_ref, tok_refs,
                dk_ref, dv_ref, smem, barriers, *, spec: AttentionSpec, bs: BackwardBlockSizes,
                interpret: bool, part: str = "both"):
    # q_ref [B, Tp, N, Dqk], do_ref [B, Tp, N, Dv], k_ref / dk_ref [B, Sp, K, Dqk] (T, S in place),
    # v_ref / dv_ref [B, Sp, K, Dv], lse_ref (natural log, times log2 e once loaded),
    # delta_ref [B, N, Tp] f32,
    # hash_ref [B, N, Tp] uint32 (dropout's row hash) or None (GMEM)
    # k_smem [W, rows, Dqk], v_smem [W, rows, Dv] (this CTA's keys; then dK, dV's epilogue),
    # q_smem [stages, bq, Dqk], do_smem [stages, bq, Dv], lse_smem, delta_smem [stages, bq] f32,
    # pt_smem, dst_smem [W, rows, bq] (interpret only, else None),
    # hash_smem [stages, bq] uint32 or None; bias_ref: the bias transposed, [B|1, N|1, Sp, Tp],
    # or None, bias_smem [stages, W, rows, bq]; tok_refs None or (ranges [B, Sp / block_kv, 4],
    # q tables [B, Tp], kv tables [B, Sp]) (segments: ids, positions under a window);
    # kvtok_smem [W, rows] int32 per kv table, qtok_smem [stages, bq] int32 per q table;
    # fused dQ (bs.fused_dq, else None): dq_ref the float32 accumulator [B, Tp, N, Dqk] (a GPU:
    # TMA reduce-add) or [nkv * W, B, Tp, N, Dqk] (interpret: one slice per key tile and
    # warpgroup, summed by the caller), ds_smem [W, rows, bq] (dSᵀ, the dQ GEMM's A
    # transposed), dq_smem [W, bq, Dqk] float32 (the warpgroup's partial dQ on its way out);
    # bs.dq_columns: ds_smem [2, W, rows, bq] (by step parity), dq_smem [W, bq, Dqk / W], and
    # the barriers ds_ready [2] (both warpgroups' dSᵀ are in SMEM), dq_done (both have left
    # the loop: K's SMEM, which the other warpgroup's dQ GEMMs read, may take dK); else None;
    # bs.dq_writer: dq_full [W] (a warpgroup's partial dQ is in dq_smem), dq_empty [W] (the
    # writer warp's reduce-add has read it); else None.
    # Barriers: k_ready, v_ready [W], step_ready [stages] (every copy of a streamed step arrives
    # on it: Q, lse, dO, delta, hashes, the bias tiles, the q tables; `step_copies`), consumed
    # [stages], ds_ready, dq_done, dq_full, dq_empty, then kvtok_ready [W] per kv table.
    (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, pt_smem, dst_smem, hash_smem,
     bias_smem, ds_smem, dq_smem) = smem[:12]
    (k_ready, v_ready, step_ready, consumed, ds_ready, dq_done, dq_full, dq_empty) = barriers[:8]
    n_tok = len(smem[12:]) // 2
    kvtok_smem, qtok_smem = smem[12:12 + n_tok], smem[12 + n_tok:]
    kvtok_ready = barriers[8:]
    dropout = hash_ref is not None
    W, stages, bq, G = bs.num_compute_wgs, bs.num_stages, bs.block_q, spec.group_size
    rows = bs.block_kv // W
    dtype = jnp.dtype(spec.dtype)
    kv_tile, kv_head, batch = lax.axis_index("kv"), lax.axis_index("heads"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    if tok_refs is None:
        r = band_q_range(kv_tile, q_len=spec.q_len, kv_len=spec.kv_len, window=spec.window,
                         diagonal_offset=spec.diagonal_offset, block_q=bq, block_kv=bs.block_kv)
    else:  # segments: the block map's ranges of this batch row
        r = tokens.load_ranges(tok_refs[0], batch, kv_tile)
    count = r.hi - r.lo  # query tiles per query head; G * count steps in all
    # stagger_q: where every query tile of the range is full, each key tile starts at its own
    # query tile (evenly spread over the range) and wraps around, so that the key tiles of a
    # head do not add into the same dQ rows at the same time; elsewhere the order is unchanged.
    rot = None  # unstaggered: the loop's order, and no index arithmetic in the kernel
    if bs.stagger_q and dq_ref is not None:
        all_full = (r.full_lo == r.lo) & (r.full_hi == r.hi) & (count > 0)
        n_kv = -(-spec.kv_len // bs.block_kv)
        rot = jnp.where(all_full, lax.div(kv_tile * count, jnp.int32(n_kv)), 0)

    def visit(q_tile):  # the query tile of loop index q_tile (in [lo, hi))
        return q_tile if rot is None else r.lo + lax.rem(q_tile - r.lo + rot, jnp.maximum(count, 1))

    def slot_of(step):
        return lax.rem(step, jnp.int32(stages))

    dq_width = bs.dq_width(spec)  # the fused partial dQ's columns

    def _dq_reduce(w, q_tile, head):
        """Warpgroup w's partial dQ (in dq_smem) added into the accumulator by TMA."""
        cols = pl.ds(w * dq_width, dq_width) if bs.dq_columns else slice(None)
        rows_q = pl.ds(q_tile * bq, bq)
        if interpret:  # no TMA reduction in the interpreter: this (key tile, wg)'s slice
            plgpu.copy_smem_to_gmem(dq_smem.at[w],
                                    dq_ref.at[kv_tile * W + w, batch, rows_q, head, cols])
        else:
            plgpu.copy_smem_to_gmem(dq_smem.at[w], dq_ref.at[batch, rows_q, head, cols],
                                    reduction_op="add")

    @pl.when(wg < W)
    def _compute():
        plgpu.set_max_registers(bs.compute_registers, action="increase")
        key0 = kv_tile * bs.block_kv + wg * rows
        kv_rows = (batch, pl.ds(key0, rows), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[kv_rows], k_smem.at[wg], k_ready.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[kv_rows], v_smem.at[wg], v_ready.at[wg])
        for ref, buf, ready in zip(tok_refs[2] if tok_refs else (), kvtok_smem, kvtok_ready):
            plgpu.copy_gmem_to_smem(ref.at[batch, pl.ds(key0, rows)], buf.at[wg], ready.at[wg])
        plgpu.barrier_wait(k_ready.at[wg])
        plgpu.barrier_wait(v_ready.at[wg])
        kv_tokens = None
        if tok_refs:  # the ids (and positions) of this warpgroup's keys, along the rows
            for ready in kvtok_ready:
                plgpu.barrier_wait(ready.at[wg])
            kv_tokens = [plgpu.load(buf.at[wg], layout=ROW) for buf in kvtok_smem] + [None]
        accumulate = mma_from_smem if interpret else mma_from_registers
        staging = None if pt_smem is None else (pt_smem.at[wg], dst_smem.at[wg])
        kv_tail = spec.kv_len % bs.block_kv != 0
        # fold_stats: Sᵀ's accumulator starts at -lse / scale (natural lse), dPᵀ's at -delta;
        # not with a bias, whose finite masks can make |lse| large beside s (the accumulator's
        # float32 rounding of s - lse / scale would then carry |lse| 2^-24 into P)
        fold = (bs.fold_stats and part == "both" and not dropout and spec.scale != 0
                and spec.logits_soft_cap is None and bias_ref is None)

        def q_step(q_tile, carry, *, g, masked: bool):
            # part "both": dK and dV; "dv": Sᵀ and dV only; "dk": Sᵀ, dPᵀ and dK only
            masked = masked and (spec.has_window or kv_tail or bool(tok_refs))
            step = g * count + q_tile - r.lo  # this warpgroup's step count so far
            slot = slot_of(step)
            q_tile = visit(q_tile)
            plgpu.barrier_wait(step_ready.at[slot])
            q_tile_s, do_tile = q_smem.at[slot], do_smem.at[slot]

            def probabilities(st):  # Sᵀ -> (Pᵀ, the Pᵀ of dV, cap slope); under dropout Pᵀ is signed
                bias = None if bias_ref is None else bias_smem.at[slot, wg][...].astype(jnp.float32)
                st2, dcap = logits2(st, spec, bias)
                if masked and tok_refs:  # rows are keys, columns queries
                    q_tokens = [plgpu.load(buf.at[slot], layout=COL) for buf in qtok_smem] + [None]
                    st2 = tokens.mask(st2, q_tokens, kv_tokens, spec, q_dim=1)
                elif masked:  # rows are keys, columns queries
                    key = wgmma_iota((rows, bq), 0) + key0
                    q_pos = wgmma_iota((rows, bq), 1) + (q_tile * bq + spec.diagonal_offset)
                    st2 = band_mask(st2, q_pos, key, spec, kv_tail)
                if fold:  # the accumulator started at -lse / scale
                    pt = jnp.exp2(st2)
                else:
                    lse = plgpu.load(lse_smem.at[slot], layout=COL) * LOG2E
                    pt = jnp.exp2(st2 - lax.broadcast_in_dim(lse, st2.shape, [1]))
                if not dropout:  # the P of dV: the kept elements (1 / (1 - r) at the end)
                    return pt, pt, dcap
                # keys are rows here: the queries' hashes run along the columns
                keep = dropout_keep(plgpu.load(hash_smem.at[slot], layout=COL), key0, pt.shape,
                                    0, spec.dropout_rate)
                # FA2's sign trick: a dropped element's P is held negated, so no mask lives
                # through the step (bools cost registers beside dK, dV, Pᵀ and dPᵀ): the Pᵀ of
                # dV is max(ps, 0) and `score_grads` reads keep back from the sign.
                ps = jnp.where(keep, pt, -pt)
                return ps, jnp.maximum(ps, 0.0), dcap

            def products():  # ((Pᵀ, the Pᵀ of dV, cap slope), dPᵀ (- delta with fold))
                operands = (k_smem.at[wg], q_tile_s.transpose((1, 0)), v_smem.at[wg],
                            do_tile.transpose((1, 0)))
                if not fold:
                    return products_overlapped(*operands, (rows, bq), (rows, bq), probabilities,
                                               bs.overlap)
                inits = [lax.broadcast_in_dim(plgpu.load(buf.at[slot], layout=COL) * factor,
                                              (rows, bq), [1])
                         for buf, factor in ((lse_smem, -1.0 / spec.scale),
                                             (delta_smem, -1.0))]
                inits = [plgpu.layout_cast(x, plgpu.Layout.WGMMA) for x in inits]
                pt, dpt = products_from(*operands, *inits, lambda st: probabilities(st)[0],
                                        bs.overlap, interpret)
                return (pt, pt, None), dpt

            def score_grads(pt, dpt, dcap):  # dSᵀ in the inputs' dtype
                if fold:  # dPᵀ's accumulator started at -delta
                    return (pt * dpt).astype(dtype)
                delta = lax.broadcast_in_dim(plgpu.load(delta_smem.at[slot], layout=COL), pt.shape,
                                             [1])
                if dropout:  # pt is ps: kept P (dPᵀ - delta); dropped P (0 - delta) = ps delta;
                    dst = pt * jnp.where(pt > 0.0, dpt - delta, delta)  # P = 0 gives 0 either way
                else:
                    dst = pt * (dpt - delta)
                if dcap is not None:
                    dst = dst * dcap
                    if masked:  # a masked pair's cap slope may be NaN (its bias: padding)
                        dst = jnp.where(pt == 0.0, 0.0, dst)
                return dst.astype(dtype)

            if bs.overlap and not interpret and part == "both":
                carry = pipelined(carry, q_tile_s, do_tile, products, score_grads, step, q_tile,
                                  kv_head * G + g)
                plgpu.barrier_arrive(consumed.at[slot])
                return carry
            if part == "dv":
                def qk(acc):
                    plgpu.wgmma(acc, k_smem.at[wg], q_tile_s.transpose((1, 0)))
                    return acc[...]

                (pt, pt_v, dcap), dpt = probabilities(
                    pl.run_scoped(qk, plgpu.ACC((rows, bq), jnp.float32))), None
            else:
                (pt, pt_v, dcap), dpt = products()
            lhs, rhs = [], []
            if part != "dv":
                lhs, rhs = [score_grads(pt, dpt, dcap)], [q_tile_s]
            if part != "dk":
                lhs, rhs = lhs + [pt_v.astype(dtype)], rhs + [do_tile]
            used = None if staging is None else staging[:len(lhs)]
            carry = accumulate(carry, tuple(lhs), tuple(rhs), used)
            plgpu.barrier_arrive(consumed.at[slot])
            if dq_ref is not None:
                _ds_exchange(lhs[0], step)  # before the dQ accumulator's (zeroed) scope opens

                def mma(acc):
                    _dq_gemm(acc, step)
                    return acc[...]

                part_dq = pl.run_scoped(mma, plgpu.ACC((bq, dq_width), jnp.float32))
                _dq_store(part_dq, q_tile, kv_head * G + g, step)
            return carry

        def pipelined(carry, q_tile_s, do_tile, products, score_grads, step, q_tile, head):
            """One step on a GPU with its GEMMs overlapping its arithmetic (FA3's order): Sᵀ
            and dPᵀ issued together, Pᵀ computed once Sᵀ is in (`wait_n=1`) while dPᵀ runs;
            dSᵀ computed (and, fused, stored to SMEM) before dV += Pᵀ dO is issued, so that
            the float32 Pᵀ and dPᵀ are dead by then and only the 16-bit Pᵀ and dSᵀ (the
            register operands of dV's and dK's GEMMs, live until those complete) stay beside
            dK and dV (issuing dV first held the 16-bit Pᵀ through dSᵀ's arithmetic: a peak of
            one more 64 x 64 operand, 16 registers a thread, where the kernel spills); then
            (fused) dQ's GEMM issued before dK += dSᵀ Q, so that the partial dQ leaves
            (`_dq_store`, its SMEM store and TMA reduce-add) while dK's GEMM runs (FA3's
            mainloop); all awaited once per step. Returns the carry (dK, dV)."""
            fused = dq_ref is not None

            def body(refs):
                dk_ref, dv_ref = refs

                (pt, pt_v, dcap), dpt = products()
                pv = pt_v.astype(dtype)  # FA3's rP: the float32 Pᵀ dies with dSᵀ below
                dst = score_grads(pt, dpt, dcap)
                if fused:
                    _ds_to_smem(dst, step)  # dQ's GEMM reads dSᵀ there
                plgpu.wgmma(dv_ref, pv, do_tile)
                if not fused:
                    plgpu.wgmma(dk_ref, dst, q_tile_s)
                    return
                _ds_wait(step)  # while dV runs, and before the dQ accumulator is zeroed

                def dq_then_dk(acc):  # the dQ accumulator lives only in this scope
                    _dq_gemm(acc, step)
                    plgpu.wgmma(dk_ref, dst, q_tile_s)
                    # WGMMA groups complete in order: dV's and dQ's are in, dK's still runs
                    _dq_store(plgpu.wgmma_accumulator_load(acc, wait_n=1), q_tile, head, step)

                pl.run_scoped(dq_then_dk, plgpu.ACC((bq, dq_width), jnp.float32))

            return pl.run_state(body)(tuple(plgpu.ACC.init(x) for x in carry))

        def _ds_to_smem(ds16, step):
            """dSᵀ into this warpgroup's SMEM buffer (by step parity with dq_columns, which
            then tells the other warpgroup it is there: an mbarrier arrive, or with ds_sync
            only the fence before `_ds_wait`'s named barrier)."""
            if bs.dq_columns:
                parity = lax.rem(step, 2)
                ds_smem.at[parity, wg][...] = ds16
                if bs.ds_sync:
                    fence_async_shared()
                    return
                plgpu.commit_smem()
                plgpu.barrier_arrive(ds_ready.at[parity])
            else:
                ds_smem.at[wg][...] = ds16
                plgpu.commit_smem()

        def _ds_wait(step):
            """dq_columns: wait until both warpgroups' dSᵀ of this step are in SMEM (ds_sync:
            one bar.sync over both compute warpgroups, FA3's exchange)."""
            if bs.ds_sync:
                named_barrier("sync", W * WARPGROUP)(jnp.int32(first_free_barrier(W + 1)))
            elif bs.dq_columns:
                plgpu.barrier_wait(ds_ready.at[lax.rem(step, 2)])

        def _ds_exchange(ds16, step):
            """dSᵀ to SMEM, then (dq_columns) the other warpgroup's awaited: done before the
            dQ accumulator's scope opens, so its 32 zeroed registers a thread are not live
            through the wait (ptxas injected warpgroup.arrive in the fused kernels)."""
            _ds_to_smem(ds16, step)
            _ds_wait(step)

        def _dq_gemm(acc, step):
            """acc += dS K (FA3's fifth GEMM, dSᵀ from SMEM as the transposed A, put there and
            awaited by `_ds_exchange`): over this warpgroup's keys and every column, or
            (dq_columns) over both warpgroups' keys and this warpgroup's share of the columns."""
            if bs.dq_columns:
                parity = lax.rem(step, 2)
                cols = pl.ds(wg * dq_width, dq_width)
                pairs = [(ds_smem.at[parity, w], k_smem.at[w, :, cols]) for w in range(W)]
            else:
                pairs = [(ds_smem.at[wg], k_smem.at[wg])]
            for ds_t, k_part in pairs:
                plgpu.wgmma(acc, ds_t.transpose((1, 0)), k_part)

        def _dq_store(part_dq, q_tile, head, step):
            """The step's float32 partial dQ out of SMEM by a TMA reduce-add: issued here, or
            (dq_writer) handed to the memory warpgroup's writer warp (FA3's dQ writer)."""
            if bs.dq_writer:
                @pl.when(step > 0)
                def _():  # the writer has read the last step's partial
                    plgpu.barrier_wait(dq_empty.at[wg])

                dq_smem.at[wg][...] = part_dq
                fence_async_shared()  # each thread's stores, for TMA's proxy, before its arrive
                plgpu.barrier_arrive(dq_full.at[wg])  # (every thread arrives: release order)
                return
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last step's partial has left
            dq_smem.at[wg][...] = part_dq
            plgpu.commit_smem()
            _dq_reduce(wg, q_tile, head)

        def pass_over(q_tile, carry, *, g):
            # a streamed tile outside this warpgroup's own range (wg_ranges): observe its
            # phase and release it, computing nothing
            slot = slot_of(g * count + q_tile - r.lo)
            plgpu.barrier_wait(step_ready.at[slot])
            plgpu.barrier_arrive(consumed.at[slot])
            return carry

        own = r  # the query tiles this warpgroup's keys meet, inside the CTA's streamed range
        if bs.wg_ranges and tok_refs is None:
            own = clamp_within(r, band_q_range(
                kv_tile * W + wg, q_len=spec.q_len, kv_len=spec.kv_len, window=spec.window,
                diagonal_offset=spec.diagonal_offset, block_q=bq, block_kv=rows))

        def head(g, carry):  # the group's query heads share the band, so one range serves all
            return walk_ranges(r, own, functools.partial(q_step, g=g, masked=True),
                               functools.partial(q_step, g=g, masked=False),
                               functools.partial(pass_over, g=g), carry)

        zeros = ((() if part == "dv" else (zero_acc((rows, spec.qk_dim)),))
                 + (() if part == "dk" else (zero_acc((rows, spec.v_dim)),)))
        accs = list(lax.fori_loop(0, G, head, zeros))
        if bs.dq_writer:
            @pl.when(G * count > 0)
            def _():  # the writer has read the last partial (every phase observed)
                plgpu.barrier_wait(dq_empty.at[wg])

        if bs.dq_columns:  # the other warpgroup's dQ GEMMs read this one's K until it is done
            plgpu.barrier_arrive(dq_done)
            plgpu.barrier_wait(dq_done)
        # K and V are no longer read (their last GEMMs were awaited): their SMEM takes dK, dV,
        # after a warpgroup barrier (commit_smem's): no warp's store may land before every
        # warp's last GEMM has read (the automatic barriers are off; once per CTA).
        plgpu.commit_smem()
        keep_scale = 1.0 / masks.keep_probability(spec.dropout_rate)
        if part != "dv":
            dk = accs.pop(0)
            k_smem.at[wg][...] = (dk * (spec.scale * keep_scale)).astype(dtype)
        if part != "dk":
            dv = accs.pop(0)
            v_smem.at[wg][...] = (dv * keep_scale if dropout else dv).astype(dtype)
        plgpu.commit_smem()
        if part != "dv":
            plgpu.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[kv_rows])
        if part != "dk":
            plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[kv_rows])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # SMEM read out; the writes land anyway

    def step_tile(step):  # (query head, query tile) of streamed step `step`
        per_head = jnp.maximum(count, 1)
        return kv_head * G + lax.div(step, per_head), visit(r.lo + lax.rem(step, per_head))

    def load_steps():
        @pl.loop(0, G * count)
        def _(step):
            head, q_tile = step_tile(step)
            slot = slot_of(step)
            q_rows = (batch, pl.ds(q_tile * bq, bq), head)
            stats = (batch, head, pl.ds(q_tile * bq, bq))

            @pl.when(step >= stages)
            def _():
                plgpu.barrier_wait(consumed.at[slot])

            ready = step_ready.at[slot]  # one barrier, every copy of the step (`step_copies`)
            plgpu.copy_gmem_to_smem(q_ref.at[q_rows], q_smem.at[slot], ready)
            plgpu.copy_gmem_to_smem(lse_ref.at[stats], lse_smem.at[slot], ready)
            plgpu.copy_gmem_to_smem(do_ref.at[q_rows], do_smem.at[slot], ready)
            plgpu.copy_gmem_to_smem(delta_ref.at[stats], delta_smem.at[slot], ready)
            if dropout:
                plgpu.copy_gmem_to_smem(hash_ref.at[stats], hash_smem.at[slot], ready)
            for ref, buf in zip(tok_refs[1] if tok_refs else (), qtok_smem):
                plgpu.copy_gmem_to_smem(ref.at[batch, pl.ds(q_tile * bq, bq)], buf.at[slot], ready)
            if bias_ref is not None:  # each warpgroup's keys x the query tile, transposed
                b = batch if bias_ref.shape[0] > 1 else 0
                n = head if bias_ref.shape[1] > 1 else 0
                for w in range(W):
                    plgpu.copy_gmem_to_smem(
                        bias_ref.at[b, n, pl.ds(kv_tile * bs.block_kv + w * rows, rows),
                                    pl.ds(q_tile * bq, bq)],
                        bias_smem.at[slot, w], ready)

        ring_drain((consumed,), slot_of, G * count, stages)

    def write_steps():  # dq_writer: each step's partial dQ of every warpgroup, reduce-added
        @pl.loop(0, G * count)
        def _(step):
            head, q_tile = step_tile(step)
            for w in range(W):
                plgpu.barrier_wait(dq_full.at[w])
                _dq_reduce(w, q_tile, head)
            for w in range(W):  # in issue order: the first partial is read first
                plgpu.wait_smem_to_gmem(W - 1 - w, wait_read_only=True)
                plgpu.barrier_arrive(dq_empty.at[w])

    @pl.when(wg == W)
    def _memory():
        plgpu.set_max_registers(bs.memory_registers, action="decrease")
        if not bs.dq_writer:
            load_steps()
            return

        @plgpu.warp_map
        def _(warp):  # FA3's producer warpgroup: warp 0 loads, warp 1 writes dQ out
            pl.when(warp == 0)(load_steps)
            pl.when(warp == 1)(write_steps)
