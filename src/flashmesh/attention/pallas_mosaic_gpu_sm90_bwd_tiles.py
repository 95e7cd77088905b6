"""The tiles of the Hopper backward kernels (pallas_mosaic_gpu_sm90_bwd): their
configuration, its shared-memory and register counts, the untuned default, and the closed-form
query ranges of a key tile (the dK/dV kernel's loop).

Shape legend: T query length, S key length, W compute warpgroups; Dqk / Dv head dims.

Example:
    >>> bs = default_for(spec)          # BackwardBlockSizes that fit the call
    >>> bs.registers(spec), bs.smem_bytes(spec)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flashmesh.attention import pallas_mosaic_gpu_tokens as tokens
from flashmesh.attention.pallas_mosaic_gpu_common import (REGISTERS_PER_SM, SMEM_BYTES, SWIZZLE_BYTES,
                                                          WARPGROUP, WGMMA_M)
from flashmesh.attention.pallas_mosaic_gpu_ranges import TileRanges
from flashmesh.attention.pallas_mosaic_gpu_table import key_matches, load_table
from flashmesh.attention.spec import AttentionSpec

SMEM_SLACK = 2048  # bytes of shared memory beyond the tiles: barriers, 1024-byte alignment


@dataclasses.dataclass(frozen=True)
class BackwardBlockSizes:
    """The backward kernels' tiles (defaults: FA3's 64 x 128 for d128; untuned on an H200).

    block_q, block_kv: the dK/dV kernel's query step (a multiple of 64: the N of Sᵀ, at most
      256, and the K extent of dV += Pᵀ dO) and key tile per CTA (num_compute_wgs warpgroups
      of block_kv / num_compute_wgs keys, each a multiple of 64).
    block_q_dq, block_kv_dq: the dQ kernel's query tile per CTA (split like block_kv) and key
      step (a multiple of 64, at most 256: the N of S and the K extent of dQ += dS K).
    num_stages: SMEM ring slots of both kernels' streamed tiles (>= 1).
    num_compute_wgs: compute warpgroups of both kernels, 1 or 2 (plus one memory warpgroup).
    compute_registers, memory_registers: setmaxnreg per thread (multiples of 8 in [24, 256]).
    split_dkv: run the dK/dV kernel twice, once accumulating dV only (Sᵀ, Pᵀ, dV) and once dK
      only (Sᵀ, dPᵀ, dSᵀ, dK), so that large head dims (d256, MLA 192/128) fit the register
      file; Sᵀ is computed in both passes (one GEMM more).
    fused_dq: one kernel and five GEMMs (FA3): the dK/dV kernel also computes dQ += dS K per
      step and adds each warpgroup's float32 partial into a dQ accumulator by TMA reduce-add;
      no dQ kernel (whose S and dP are the two GEMMs saved). Not with split_dkv nor a bias (its
      gradient comes from the dQ kernel's dS). The reductions' order varies from run to run,
      so dQ is not bit-reproducible; the default (False) is deterministic. The partial dQ
      leaves through a tiled, 128-byte swizzled SMEM buffer (2026-12-05; row-major before,
      which put each warp's stores on 8 banks): the fused timings quoted below are the
      row-major buffer's.
    stagger_q: with fused_dq, each key tile whose query tiles are all full (no mask) visits
      them from its own starting tile onward and wraps around, so that the key tiles of one
      head do not reduce-add into the same dQ rows at once (full attention: every key tile
      visits every query tile). Opt-in until a GPU has timed it.
    dq_columns: with fused_dq and two warpgroups, the dQ GEMM is split along the head dim
      (FA3's layout): after a barrier between the warpgroups, each computes dS K for its
      qk_dim / 2 columns over all block_kv keys (both warpgroups' dSᵀ, double-buffered in
      SMEM) and reduce-adds that; the default (False) has each warpgroup compute every column
      over its own keys. Half the partial dQ's registers, and each step's two reduce-adds
      (one per warpgroup) half as wide, for one barrier per step; needs qk_dim a multiple of
      2 x the swizzle width (128 for 16-bit inputs). On the H200 it made the fused kernel
      1.07-1.42x faster at d128 but left it 5-31% slower than the two-kernel backward
      (benchmarks/results/2026-12-02-nvidia-h200-tune), so no table entry uses it.
    overlap: on a GPU, each dK/dV step runs its GEMMs under its own arithmetic (FA3's
      intra-warpgroup order): Pᵀ is computed once Sᵀ is in while dPᵀ's GEMM runs
      (`wait_n=1`), dV += Pᵀ dO is issued before dSᵀ is computed, then (fused) dQ's GEMM
      before dK's, the partial dQ awaited and sent out while dK's runs, everything awaited
      once at the end of the step where the default waits two or three times; the dQ kernel
      computes P while dP's GEMM runs. Same arithmetic, same results bit for bit; the
      interpreter runs its usual order. Not with split_dkv (its passes keep
      the default order). Off by default: on the H200 (2026-12-05) it passed the GPU suite and
      ran slower with two kernels (causal_8k_h32_d128 3.161 ms against 2.957), faster but
      still behind them fused by columns (3.273 against 3.386).
    wg_ranges: each compute warpgroup visits only the streamed tiles its own rows meet (the
      dK/dV kernel's block_kv / W keys, the dQ kernel's block_q_dq / W queries: the band of
      `band_q_range` / `band_kv_range` at the warpgroup's granularity); the ring still streams
      the CTA's union, and a warpgroup passes over a tile outside its range by waiting for it
      and releasing it. Under a window (128, 0) with 128-key tiles each warpgroup meets 3 of
      the CTA's 4 query tiles; causal calls save at most one step per head. Band masks only
      (with segments both warpgroups take the block map's range of the tile; with a bias the
      dQ kernel, which writes dbias per visited tile, keeps the CTA's range); not with
      dq_columns (each step needs both warpgroups' dSᵀ) nor stagger_q. Same results bit for
      bit. Off by default: on the H200 (2026-12-05) it pays under narrow windows (with
      persistent_dq the window anchor's backward 0.893 ms against 1.142), not under causal
      masks (the guide layer's attention 0.972 against 0.956); the table gives it to the
      window entry.
    persistent_dq: the dQ kernel on a persistent grid, one CTA per SM looping over (batch,
      head, query tile) tiles (query-tile-major, longest first, where tiles differ in work:
      causal, segments; (batch, head)-major for a band's equal tiles): the K/V ring runs on across
      tiles (the memory warpgroup streams the next tile's keys under this tile's last steps),
      the next tile's Q, dO, lse and delta load while this tile's dQ leaves from a buffer of
      its own (block_q_dq x Dqk more shared memory). For calls of many short tiles (narrow
      windows, short sequences), where each CTA's prologue and epilogue are a large part of
      its work. Not with fused_dq (no dQ kernel). Off by default: on the H200 (2026-12-05) it
      pays on the window anchor (above) and cost under a causal mask (the guide layer's
      attention 1.165 ms against 0.956) in the (batch, head)-major order, where a CTA's
      stride met only some query tile indices (counted: some CTAs 18% more key tiles than the mean);
      the query-tile-major order for such calls is untimed.
    delta_in_dq: the dQ kernel runs first and computes delta = rowsum(O o dO) itself from O's
      rows (one more [block_q_dq, Dv] tile of shared memory), writing it for the dK/dV kernel,
      instead of an XLA reduction over O and dO before both kernels (0.128 ms of the window
      anchor's 0.893 ms backward on the H200, 2026-12-05: a pass over 537 MB). Not with fused_dq
      (no dQ kernel); a call with an lse cotangent takes XLA's delta. Off by default; the tuned
      table turns it on for the window anchor, where `flashmesh tune --backward` measured the
      backward at 0.8395 ms against 0.9342 without it (2026-12-06-nvidia-h200-tune-bwd).
    dq_writer: with fused_dq, the partial dQ's reduce-adds are issued by a writer warp of the
      memory warpgroup (FA3's dQ writer) instead of the compute warpgroups: a compute
      warpgroup waits until the writer has read its last partial, stores the new one to SMEM
      and arrives on a barrier; the writer waits for each warpgroup's partial, issues its TMA
      reduce-add, and releases the buffer once TMA has read it. Takes the bulk-copy wait, a
      warpgroup barrier and the issue out of the compute warpgroups' step. Not with wg_ranges
      (the writer follows every warpgroup through every step). Off by default until a GPU has
      timed it.
    ds_sync: with dq_columns, the warpgroups exchange dSᵀ through one hardware named barrier
      (each thread fences its SMEM stores for WGMMA, then bar.sync over both compute
      warpgroups: FA3's exchange) instead of a warpgroup barrier, an mbarrier arrive and a
      wait on it. Off by default until a GPU has timed it.
    fold_stats: the dK/dV kernel's Sᵀ and dPᵀ accumulators start from -lse / (scale log2 e)
      and -delta (broadcast over the keys) instead of zeros, so Pᵀ = exp2(acc scale log2 e)
      and dSᵀ = Pᵀ acc: the two per-query vectors (16 registers a thread each at block_q 64)
      are dead once the GEMMs are issued instead of live beside Pᵀ and dPᵀ, where the fused
      kernels spill, and one subtraction per element goes. Applies to calls without a soft cap
      (its slope needs the raw logits), dropout (its dropped elements need delta) or a bias
      (a finite additive mask can make |lse| large beside the logits, and the accumulator's
      rounding of s - lse / c then grows with it), and not to split_dkv's passes; the others
      run the usual form. Results differ from the default
      by float32 rounding (the lse enters the accumulator before the products). Off by
      default until a GPU has timed it.
    tma_tails: as `BlockSizes.tma_tails`: Q, dO, O, K and V of a length that is a multiple of 8
      but not of the tiles are read in place (TMA fills the rows past the end with zeros) and
      dQ, dK, dV written in place (TMA drops the rows past it), instead of padded copies in
      and sliced copies out. On by default (its GPU cases passed on the H200 on 2026-12-06).
    """

    block_q: int = 64
    block_kv: int = 128
    block_q_dq: int = 128
    block_kv_dq: int = 64
    num_stages: int = 2
    num_compute_wgs: int = 2
    compute_registers: int = 240  # FA3's split of the register file for its backward
    memory_registers: int = 24
    split_dkv: bool = False
    fused_dq: bool = False
    stagger_q: bool = False
    dq_columns: bool = False
    overlap: bool = False
    wg_ranges: bool = False
    persistent_dq: bool = False
    delta_in_dq: bool = False
    dq_writer: bool = False
    ds_sync: bool = False
    fold_stats: bool = False
    tma_tails: bool = True

    def __post_init__(self):
        def check(name, ok, expected):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not ok(value):
                raise ValueError(f"BackwardBlockSizes.{name}={value!r} must be {expected}")

        check("num_compute_wgs", lambda w: w in (1, 2), "1 or 2")
        rows = WGMMA_M * self.num_compute_wgs
        for name in ("block_kv", "block_q_dq"):
            check(name, lambda b: b > 0 and b % rows == 0,
                  f"a positive multiple of 64 * num_compute_wgs = {rows}")
        for name in ("block_q", "block_kv_dq"):
            check(name, lambda b: 0 < b <= 256 and b % 64 == 0, "a multiple of 64 in [64, 256]")
        check("num_stages", lambda s: s >= 1, ">= 1")
        for name in ("split_dkv", "fused_dq", "stagger_q", "dq_columns", "overlap", "wg_ranges",
                     "persistent_dq", "delta_in_dq", "dq_writer", "ds_sync", "fold_stats",
                     "tma_tails"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BackwardBlockSizes.{name}={getattr(self, name)!r} must be a bool")
        if self.stagger_q and not self.fused_dq:
            raise ValueError("BackwardBlockSizes.stagger_q=True needs fused_dq=True (it spreads the "
                             "fused kernel's dQ reduce-adds)")
        if self.dq_columns and not (self.fused_dq and self.num_compute_wgs == 2):
            raise ValueError("BackwardBlockSizes.dq_columns=True needs fused_dq=True and "
                             f"num_compute_wgs=2 (it splits the fused dQ GEMM between two "
                             f"warpgroups), got fused_dq={self.fused_dq}, "
                             f"num_compute_wgs={self.num_compute_wgs}")
        if self.dq_writer and not self.fused_dq:
            raise ValueError("BackwardBlockSizes.dq_writer=True needs fused_dq=True (it writes the "
                             "fused kernel's partial dQ)")
        if self.ds_sync and not self.dq_columns:
            raise ValueError("BackwardBlockSizes.ds_sync=True needs dq_columns=True (it is the "
                             "warpgroups' dSᵀ exchange)")
        if self.dq_writer and self.wg_ranges:
            raise ValueError("BackwardBlockSizes.dq_writer=True needs wg_ranges=False (the writer "
                             "follows every warpgroup through every step)")
        if self.wg_ranges and (self.dq_columns or self.stagger_q):
            raise ValueError("BackwardBlockSizes.wg_ranges=True needs dq_columns=False and "
                             "stagger_q=False (both make every warpgroup take every step), got "
                             f"dq_columns={self.dq_columns}, stagger_q={self.stagger_q}")
        for name in ("persistent_dq", "delta_in_dq"):
            if getattr(self, name) and self.fused_dq:
                raise ValueError(f"BackwardBlockSizes.{name}=True needs fused_dq=False (the fused "
                                 "backward has no dQ kernel)")
        if self.overlap and self.split_dkv:
            raise ValueError("BackwardBlockSizes.overlap=True needs split_dkv=False (the split "
                             "passes keep the default order)")
        if self.fused_dq and self.split_dkv:
            raise ValueError("BackwardBlockSizes.fused_dq=True needs split_dkv=False (the fused "
                             "step needs dSᵀ, which only the dK pass has)")
        for name in ("compute_registers", "memory_registers"):
            check(name, lambda r: 24 <= r <= 256 and r % 8 == 0, "a multiple of 8 in [24, 256]")
        per_thread = self.compute_registers * self.num_compute_wgs + self.memory_registers
        if per_thread * WARPGROUP > REGISTERS_PER_SM:
            raise ValueError(
                f"BackwardBlockSizes.compute_registers={self.compute_registers} * num_compute_wgs="
                f"{self.num_compute_wgs} + memory_registers={self.memory_registers} must be at "
                f"most {REGISTERS_PER_SM // WARPGROUP}, got {per_thread}")

    def dq_width(self, spec: AttentionSpec) -> int:
        """Columns of one warpgroup's partial dQ in the fused kernel: qk_dim, or its share
        (qk_dim / num_compute_wgs) with dq_columns."""
        return spec.qk_dim // self.num_compute_wgs if self.dq_columns else spec.qk_dim

    def smem_bytes(self, spec: AttentionSpec) -> dict[str, int]:
        """Shared memory of each kernel on a GPU: {"dkv": K, V tiles + the ring of Q, dO, lse,
        delta (and dropout's uint32 row hash); "dq": Q, dO, lse, delta (row hash) + the ring
        of K, V} (the epilogues reuse K/V and Q), plus SMEM_SLACK for the barriers and
        alignment (Mosaic's count, from lowering for cuda, exceeded the tiles alone by 192 to
        1632 bytes)."""
        size, d = jnp.dtype(spec.dtype).itemsize, spec.qk_dim + spec.v_dim
        row = size * d + (12 if spec.has_dropout else 8)  # Q, dO rows; lse, delta (hash)
        dkv = self.num_stages * self.block_q * row + size * self.block_kv * d
        dq = self.block_q_dq * row + self.num_stages * self.block_kv_dq * size * d
        # each option's buffer with 2 KiB more of Mosaic's alignment (lowering for cuda counted
        # 200832 bytes for persistent_dq + delta_in_dq at d128, 1152 past the tiles + SMEM_SLACK)
        if self.persistent_dq:  # dQ's own epilogue buffer
            dq += self.block_q_dq * spec.qk_dim * size + 2048
        if self.delta_in_dq:  # O's rows
            dq += self.block_q_dq * spec.v_dim * size + 2048
        W, stages = self.num_compute_wgs, self.num_stages
        dkv += tokens.smem_bytes(spec, self.block_kv, self.block_q, stages, W)  # segments
        dq += tokens.smem_bytes(spec, self.block_q_dq, self.block_kv_dq, stages, W)
        if spec.has_bias:  # the ring of bias tiles; dQ also stages its dS tile for dbias
            dkv += stages * self.block_kv * self.block_q * size + SMEM_SLACK // 2
            dq += (stages + 1) * self.block_q_dq * self.block_kv_dq * size + SMEM_SLACK // 2
        if self.fused_dq:  # dSᵀ and the float32 partial dQ of each warpgroup; no dQ kernel
            # (dq_columns: dSᵀ double-buffered, each partial qk_dim / W wide)
            buffers = 2 if self.dq_columns else 1
            dkv += (buffers * self.block_kv * self.block_q * size
                    + W * self.block_q * self.dq_width(spec) * 4)
            return {"dkv": dkv + SMEM_SLACK}
        return {"dkv": dkv + SMEM_SLACK, "dq": dq + SMEM_SLACK}

    def registers(self, spec: AttentionSpec) -> dict[str, int]:
        """Accumulator registers per compute thread: dK/dV kernel Sᵀ, dPᵀ, dK, dV in float32
        plus the 16-bit Pᵀ and dSᵀ that feed the dV and dK GEMMs from registers; dQ kernel S,
        dP, dQ plus the 16-bit dS (64-row WGMMA tiles spread over a warpgroup's 128 threads)."""
        kv_rows = self.block_kv // self.num_compute_wgs
        q_rows = self.block_q_dq // self.num_compute_wgs
        p16 = kv_rows * self.block_q // (2 * WARPGROUP)  # one 16-bit [rows, block_q] tile
        if self.split_dkv:  # the dV pass: Sᵀ, dV, Pᵀ; the dK pass: Sᵀ, dPᵀ, dK, dSᵀ
            dkv = max(kv_rows * (self.block_q + spec.v_dim) // WARPGROUP + p16,
                      kv_rows * (2 * self.block_q + spec.qk_dim) // WARPGROUP + p16)
        elif self.fused_dq:  # dK, dV live throughout; Sᵀ, dPᵀ, then the partial dQ and dSᵀ
            dkv = (kv_rows * (spec.qk_dim + spec.v_dim) // WARPGROUP
                   + max(kv_rows * 2 * self.block_q // WARPGROUP + p16,
                         self.block_q * self.dq_width(spec) // WARPGROUP + 2 * p16))
            return {"dkv": dkv}
        else:
            dkv = kv_rows * (2 * self.block_q + spec.qk_dim + spec.v_dim) // WARPGROUP + 2 * p16
        return {"dkv": dkv,
                "dq": q_rows * (2 * self.block_kv_dq + spec.qk_dim) // WARPGROUP
                + q_rows * self.block_kv_dq // (2 * WARPGROUP)}

    def validate_for(self, spec: AttentionSpec) -> "BackwardBlockSizes":
        """self, checked against a call (ValueError naming the field that does not fit)."""
        if self.fused_dq and spec.reproducible:
            raise ValueError("BackwardBlockSizes.fused_dq=True cannot give reproducible=True: its "
                             "dQ is summed by TMA reduce-adds in a varying order; use fused_dq=False")
        if self.fused_dq and spec.has_bias:
            raise ValueError("BackwardBlockSizes.fused_dq=True cannot take a bias: its gradient "
                             "comes from the dQ kernel's dS; use fused_dq=False")
        step = SWIZZLE_BYTES // jnp.dtype(spec.dtype).itemsize
        if self.dq_columns and spec.qk_dim % (step * self.num_compute_wgs):
            raise ValueError(f"BackwardBlockSizes.dq_columns=True needs qk_dim a multiple of "
                             f"{step * self.num_compute_wgs} for {spec.dtype} (each warpgroup's "
                             f"columns a whole swizzle tile), got qk_dim={spec.qk_dim}")
        for name in ("block_q", "block_kv_dq"):
            if getattr(self, name) % step:
                raise ValueError(f"BackwardBlockSizes.{name}={getattr(self, name)} must be a "
                                 f"multiple of {step} for {spec.dtype} (a GEMM's K extent)")
        for kernel, regs in self.registers(spec).items():
            if regs > self.compute_registers:
                raise ValueError(
                    f"BackwardBlockSizes: the {kernel} kernel's accumulators need {regs} registers "
                    f"per thread for qk_dim={spec.qk_dim}, v_dim={spec.v_dim}, more than "
                    f"compute_registers={self.compute_registers}; use smaller blocks")
        for kernel, smem in self.smem_bytes(spec).items():
            if smem > SMEM_BYTES:
                raise ValueError(
                    f"BackwardBlockSizes(num_stages={self.num_stages}, ...): the {kernel} kernel "
                    f"needs {smem} bytes of shared memory for qk_dim={spec.qk_dim}, v_dim="
                    f"{spec.v_dim}, {spec.dtype}; at most {SMEM_BYTES}")
        return self


def measured_entry(spec: AttentionSpec) -> dict | None:
    """The backward_entries entry of pallas_mosaic_gpu_configs.json for a call (the kernels are
    sm90's): of the entries whose key fields all match, the one with most fields, the first
    among equals; None if none matches."""
    entries = [e for e in load_table().get("backward_entries", ())
               if e["device"] == "sm90" and key_matches(e["key"], spec)]
    return max(entries, key=lambda e: len(e["key"]), default=None)


def default_for(spec: AttentionSpec) -> BackwardBlockSizes:
    """The config of the table's matching backward entry (`measured_entry`) where it fits the
    call (not the fused kernel when spec.reproducible: its dQ reductions run in a varying
    order), else the untuned default: 64 x
    128 dK/dV tiles and 128 x 64 dQ tiles with 2 warpgroups and 3 stages where they fit, else
    2, else 1; for head dims whose dK and dV accumulators do not fit the registers together
    (d256, MLA 192/128) the split dK/dV passes, then one warpgroup of 64 keys;
    NotImplementedError if nothing fits."""
    entry = measured_entry(spec)
    if entry is not None:
        try:
            return BackwardBlockSizes(**entry["config"]).validate_for(spec)
        except ValueError:  # e.g. a bias or reproducible=True (no fused kernel): the untuned rule
            pass
    shapes = (dict(), dict(block_kv=64, block_q_dq=64, num_compute_wgs=1))
    for shape in shapes:
        for split in (False, True):
            for stages in (3, 2, 1):
                bs = BackwardBlockSizes(num_stages=stages, split_dkv=split, **shape)
                if (all(b <= SMEM_BYTES for b in bs.smem_bytes(spec).values())
                        and all(r <= bs.compute_registers for r in bs.registers(spec).values())):
                    return bs.validate_for(spec)
    raise NotImplementedError(f"qk_dim={spec.qk_dim}, v_dim={spec.v_dim}: no backward tiles fit the "
                              f"register budget and {SMEM_BYTES} bytes of shared memory")


def band_q_range(kv_tile, *, q_len: int, kv_len: int, window: tuple[int, int],
                 diagonal_offset: int, block_q: int, block_kv: int) -> TileRanges:
    """`q_ranges` of key tile(s) `kv_tile` (int, numpy or traced int32) in closed form, for a
    band mask (query i at position i + diagonal_offset sees key j iff 0 <= j < kv_len and
    -right <= i + diagonal_offset - j <= left): the transpose of `band_kv_range`.

    The queries that see a key tile form one interval: [j0 - off - right, j1 - off + left]
    clipped to [0, T), with j0/j1 its first/last real key. A query tile is FULL iff the key
    tile has no column past S, its first row is >= j0 + block_kv - 1 - off - right and its last
    real row (< T) is <= j0 - off + left.
    """
    traced = isinstance(kv_tile, jax.Array) and not isinstance(kv_tile, np.ndarray)
    xp = jnp if traced else np
    left, right = window
    off, nq = diagonal_offset, -(-q_len // block_q)
    kv_tile = xp.asarray(kv_tile)
    j0 = kv_tile * block_kv
    j1 = xp.minimum(j0 + block_kv, kv_len) - 1
    zero = xp.zeros_like(j0)
    i_lo = xp.maximum(j0 - off - right, 0) if right >= 0 else zero
    i_hi = xp.minimum(j1 - off + left, q_len - 1) if left >= 0 else xp.full_like(j0, q_len - 1)
    seen = (i_lo <= i_hi) & (j0 < kv_len)
    lo, hi = i_lo // block_q, i_hi // block_q + 1
    f_lo = xp.maximum(-((off + right + 1 - j0 - block_kv) // block_q), 0) if right >= 0 else zero
    if left >= 0:
        x = j0 - off + left  # the last row that still sees the tile's first key
        f_hi = xp.where(q_len - 1 <= x, nq, xp.minimum((x + 1) // block_q, nq - 1))
    else:
        f_hi = xp.full_like(j0, nq)
    has_full = seen & (f_lo < f_hi) & (j0 + block_kv <= kv_len)
    lo, hi = xp.where(seen, lo, zero), xp.where(seen, hi, zero)
    f_lo, f_hi = xp.where(has_full, f_lo, lo), xp.where(has_full, f_hi, lo)
    return TileRanges(*(x.astype(np.int32) for x in (lo, f_lo, f_hi, hi)))
