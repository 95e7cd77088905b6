"""Planning for the Pallas Mosaic GPU (Hopper) attention kernels: pure Python, no kernel code.

What the kernels read from here:
* `kv_ranges`: per query tile, the key tiles [lo, hi) to visit and inside them the run
  [full_lo, full_hi) that needs no mask arithmetic (forward pass, dQ).
* `q_ranges`: the transposed map, per key tile (KV-stationary backward pass: dK, dV).
* `band_kv_range`: `kv_ranges` in closed form for one tile index, traced or not, so a kernel
  can compute its range from `lax.axis_index` instead of reading a table.
* `q_tile_order`, `kv_tile_order`: longest-first (LPT) tile orders for persistent loops.
* `BlockSizes`, `default_for`: the tile configuration, from a table that is data
  (`pallas_mosaic_gpu_configs.json`) or, where no entry matches, a documented heuristic.
* `split_kv`, `split_ranges`: KV splits (flash-decoding) when too few tiles fill the chip.

Tile classes come from `masks.block_map`, the map the `chunked` backend schedules from, so the
two backends skip, mask and run unmasked exactly the same tiles. (Follows FA3's
`get_n_block_min_max` and tokamax's per-tile [lb, ub); research/kernels.md §2.1, §2.5.)

Shape legend: B batch, T query length, S key length, nq = ceil(T / block_q) query tiles,
nk = ceil(S / block_kv) key tiles. A tail tile (T or S not a multiple of the block) is a
whole tile: its query rows past T are dropped by the caller, its key columns past S are masked,
so a key tile holding columns past S is never FULL.

Example:
    >>> spec = AttentionSpec(1, 256, 256, 1, 1, 64, 64, "bfloat16", 0.125, window=(-1, 0))
    >>> r = kv_ranges(spec, 128, 64)
    >>> r.lo.tolist(), r.full_lo.tolist(), r.full_hi.tolist(), r.hi.tolist()
    ([0, 0], [0, 0], [0, 2], [2, 4])
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flashmesh.attention import masks
from flashmesh.attention.spec import SOFTMAX_TYPES, AttentionInputs, AttentionSpec

CONFIGS_PATH = pathlib.Path(__file__).with_name("pallas_mosaic_gpu_configs.json")
SMEM_BYTES = 227 * 1024  # dynamic shared memory one block may use on H100/H200
REGISTERS_PER_SM = 65536  # 32-bit registers, shared by every thread of a block
WARPGROUP = 128  # threads
WGMMA_M = 64  # rows of one warpgroup's WGMMA
SWIZZLE_BYTES = 128  # Mosaic's widest swizzle: a WGMMA K extent is a multiple of 128 B
SWIZZLES = (128, 64, 32)  # the swizzles a tile's minor dim may take, widest first
SMEM_ALIGNMENT = 1024  # Mosaic GPU rounds every shared memory buffer up to this many bytes
_NO_ARRAYS = AttentionInputs(q=None, k=None, v=None)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _xp(*xs):
    return jnp if any(isinstance(x, jax.Array) and not isinstance(x, np.ndarray) for x in xs) else np


class TileRanges(NamedTuple):
    """Per tile of one axis, the tiles of the other axis it meets; int32 [n] (static) or
    [B|1, n] (per batch row, from a traced block map). A pytree, so it passes through jit.

    lo <= full_lo <= full_hi <= hi. Every tile with a visible element lies in [lo, hi); every
    tile of [full_lo, full_hi) has all its elements visible (no mask arithmetic); the rest of
    [lo, hi) needs the mask. A tile that sees nothing has lo == hi (all four 0); one with no
    FULL tile has full_lo == full_hi == lo. For a static map (no segments, implicit positions)
    every tile in [lo, hi) is non-empty; from a traced map the tiles outside the FULL run may
    include EMPTY ones (the mask hides them; a kernel may skip them by reading the map).
    """

    lo: np.ndarray | jax.Array
    full_lo: np.ndarray | jax.Array
    full_hi: np.ndarray | jax.Array
    hi: np.ndarray | jax.Array

    @property
    def count(self):
        """Tiles to visit, hi - lo: the work of each tile."""
        return self.hi - self.lo


def clamp_within(outer: TileRanges, inner: TileRanges) -> TileRanges:
    """inner (the tiles a warpgroup's own rows meet) placed inside outer (its CTA's, whose
    ring streams them all): lo, full_lo, full_hi, hi clipped into outer's [lo, hi) in order;
    an inner range that meets nothing becomes [outer.hi, outer.hi) (every streamed tile
    passed over). numpy or traced int32, elementwise."""
    xp = _xp(*outer, *inner)
    empty = inner.hi <= inner.lo
    lo = xp.where(empty, outer.hi, xp.clip(inner.lo, outer.lo, outer.hi))
    hi = xp.where(empty, outer.hi, xp.clip(inner.hi, lo, outer.hi))
    full_lo = xp.clip(inner.full_lo, lo, hi)
    full_hi = xp.clip(inner.full_hi, full_lo, hi)
    return TileRanges(*(xp.asarray(x).astype(np.int32) for x in (lo, full_lo, full_hi, hi)))


def ranges_from_block_map(classes) -> TileRanges:
    """Ranges along the last axis of a block map (masks.EMPTY/PARTIAL/FULL) [..., n, m]; numpy
    in, numpy out, jax in (usable under jit), jax out. The FULL run is the first run of
    consecutive FULL tiles (for band masks the only one)."""
    xp = _xp(classes)
    m = classes.shape[-1]
    idx = xp.arange(m, dtype=np.int32).reshape((1,) * (classes.ndim - 1) + (m,))
    seen, full = classes != masks.EMPTY, classes == masks.FULL
    any_seen, any_full = seen.any(axis=-1), full.any(axis=-1)
    lo = xp.where(any_seen, xp.argmax(seen, axis=-1), 0).astype(np.int32)
    hi = xp.where(any_seen, m - xp.argmax(seen[..., ::-1], axis=-1), 0).astype(np.int32)
    f_lo = xp.where(any_full, xp.argmax(full, axis=-1), lo).astype(np.int32)
    after = ~full & (idx >= f_lo[..., None])  # the first non-FULL tile after the run starts
    f_hi = xp.where(after.any(axis=-1), xp.argmax(after, axis=-1), m).astype(np.int32)
    f_hi = xp.where(any_full, f_hi, lo).astype(np.int32)
    return TileRanges(lo, f_lo, f_hi, hi)


def _check_blocks(block_q, block_kv):
    for name, b in (("block_q", block_q), ("block_kv", block_kv)):
        if not isinstance(b, int) or b < 1:
            raise ValueError(f"{name}={b!r} must be a positive int")


def _ranges(spec: AttentionSpec, block_q: int, block_kv: int, inputs, transpose: bool) -> TileRanges:
    _check_blocks(block_q, block_kv)
    if inputs is not None:
        classes = masks.block_map(spec, inputs, block_q, block_kv)
        return ranges_from_block_map(classes.swapaxes(-1, -2) if transpose else classes)
    band = dataclasses.replace(spec, segments=None, max_segments=None)
    classes = masks.block_map(band, _NO_ARRAYS, block_q, block_kv)[0]
    r = ranges_from_block_map(classes.T if transpose else classes)
    if spec.segments is None:
        return r
    if spec.segments == "padding" and not spec.bottom_right:
        # Positions stay implicit; padding only hides more, so the band bounds [lo, hi), but
        # which tiles are FULL depends on the lengths.
        return TileRanges(r.lo, r.lo, r.lo, r.hi)
    # Packed segments, or bottom-right padding: positions are data, nothing is known statically.
    n, m = classes.shape[::-1] if transpose else classes.shape
    zero = np.zeros(n, np.int32)
    return TileRanges(zero, zero, zero, np.full(n, m, np.int32))


def kv_ranges(spec: AttentionSpec, block_q: int, block_kv: int,
              inputs: AttentionInputs | None = None) -> TileRanges:
    """Per query tile, the key tiles it must visit (see `TileRanges`).

    spec: the call; only q_len, kv_len, window, bottom_right and segments matter.
    inputs: None for the static ranges, [nq] numpy, exact for calls without segments or
      explicit positions (causal and windows in both alignments, T != S, tails). With segments
      they are a bound: the band's [lo, hi) for padding with implicit positions, everything
      ([0, nk), no FULL tile) for packed segments or bottom-right padding. Pass the call's
      inputs to get the per-batch ranges [B|1, nq] of its block map instead: jax arrays under
      jit when segments or positions are data (the kernel reads them at run time), numpy else.
    Per-warpgroup ranges (research §4 #1) are `kv_ranges(spec, rows_per_wg, block_kv)`: a
    warpgroup's range lies inside its tile's.
    """
    return _ranges(spec, block_q, block_kv, inputs, transpose=False)


def q_ranges(spec: AttentionSpec, block_q: int, block_kv: int,
             inputs: AttentionInputs | None = None) -> TileRanges:
    """Per key tile, the query tiles it meets ([nk] or [B|1, nk]): the KV-stationary backward
    pass's loop. The same (query tile, key tile) pairs and FULL pairs as `kv_ranges`.

    A FULL pair may hold query rows past T (the last query tile): the dK/dV kernel must make
    them contribute nothing, e.g. by loading q, dO, lse and delta zero-filled past T (then
    dS = P * (dP - delta) = 0 and dO = 0 there), as the chunked backend's padding does.
    """
    return _ranges(spec, block_q, block_kv, inputs, transpose=True)


def band_kv_range(q_tile, *, q_len: int, kv_len: int, window: tuple[int, int],
                  diagonal_offset: int, block_q: int, block_kv: int) -> TileRanges:
    """`kv_ranges` of query tile(s) `q_tile` (int, numpy or traced int32) in closed form, for a
    band mask: query i (position i + diagonal_offset) sees key j iff 0 <= j < kv_len and
    -right <= i + diagonal_offset - j <= left (a side of -1 is unbounded).

    The keys a tile sees form one interval: [first - left, last + right] clipped to [0, S), with
    first/last its first/last real query's position. A key tile is FULL iff all its keys lie in
    [last - left, first + right] and it holds no column past S.
    """
    xp = _xp(q_tile)
    left, right = window
    q_tile = xp.asarray(q_tile)
    first = q_tile * block_q + diagonal_offset
    last = xp.minimum(q_tile * block_q + block_q, q_len) - 1 + diagonal_offset
    j_lo = xp.maximum(first - left, 0) if left >= 0 else xp.zeros_like(first)
    j_hi = xp.minimum(last + right, kv_len - 1) if right >= 0 else xp.full_like(first, kv_len - 1)
    seen = (j_lo <= j_hi) & (q_tile * block_q < q_len)
    lo, hi = j_lo // block_kv, j_hi // block_kv + 1
    f_lo = xp.maximum(-((left - last) // block_kv), 0) if left >= 0 else xp.zeros_like(first)
    f_hi = xp.full_like(first, kv_len // block_kv)
    if right >= 0:
        f_hi = xp.minimum((first + right + 1) // block_kv, f_hi)
    has_full = seen & (f_lo < f_hi)
    zero = xp.zeros_like(first)
    lo, hi = xp.where(seen, lo, zero), xp.where(seen, hi, zero)
    f_lo, f_hi = xp.where(has_full, f_lo, lo), xp.where(has_full, f_hi, lo)
    return TileRanges(*(x.astype(np.int32) for x in (lo, f_lo, f_hi, hi)))


def _lpt(work):
    xp = _xp(work)
    if xp is np:
        return np.argsort(-work, axis=-1, kind="stable").astype(np.int32)
    return jnp.argsort(-work, axis=-1, stable=True).astype(jnp.int32)


def q_tile_order(ranges: TileRanges):
    """Query tiles longest first (LPT: largest kv_ranges count first, ties in index order),
    [nq] or [B|1, nq]: a persistent forward kernel that takes tiles in this order starts the
    long causal rows first, so the short ones fill the last wave (FA3's scheduler; tokamax's
    `qi = num_q_tiles - 1 - qi`, which it equals for causal T == S)."""
    return _lpt(ranges.count)


def kv_tile_order(ranges: TileRanges):
    """Key tiles longest first, from `q_ranges`: the backward pass's analogue of
    `q_tile_order` (FA3's `SingleTileBwdLPTScheduler`)."""
    return _lpt(ranges.count)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """The forward kernel's tile configuration (FA3/tokamax structure: compute warpgroups
    plus one memory warpgroup that streams K and V by TMA) and its schedule options.

    block_q: query rows per tile (one CTA; the unit of `kv_ranges`), shared by num_compute_wgs
      warpgroups of block_q // num_compute_wgs rows, each a multiple of WGMMA's M = 64.
    block_kv: keys per step: the N of S = Q Kᵀ (a multiple of 8, at most 256) and the K extent
      of P·V, a multiple of 128 B of the dtype (64 for bf16; `validate_for` checks it).
    num_stages: K/V buffers in shared memory (>= 1).
    num_compute_wgs: compute warpgroups, 1 to 3.
    compute_registers, memory_registers: setmaxnreg per thread of a compute / the memory
      warpgroup (multiples of 8 in [24, 256]); None: 232/40 up to 2 compute warpgroups, 160/32
      with 3 (tokamax, FA3). All warpgroups together get at most 65536 registers.
    pingpong: the compute warpgroups take turns on the tensor cores (FA3's warp scheduler
      barrier, tokamax's schedule barrier): one warpgroup's GEMMs run while the others do
      their softmax. None: on with 2 or more compute warpgroups; True needs 2 or more.
    intra_wg_overlap: within a warpgroup, issue step j's S = Q Kⱼᵀ together with step j-1's
      O += P V and run step j's softmax while that P·V is in flight (FA3's IntraWGOverlap);
      False (the default): S, softmax, P·V one after the other. Measured on the H200
      (benchmarks/results/2026-12-01-nvidia-h200-gpu-tests/probe_mosaic_2.log, forward, ping-pong
      on): off 0.906 ms against on 1.341 on causal_8k_h32_d128, 0.424 against 0.521 on
      seed000_gqa_swa (likely register pressure: S, O and two P tiles live at once).
    reuse_q_for_o: stage the output tile in the warpgroup's Q buffer (Q is dead after the
      last S GEMM; tokamax's RefUnion), which frees block_q * v_dim elements of shared memory;
      only when qk_dim == v_dim, else O gets its own buffer.
    lpt_order: visit the query tiles of each (head, batch) last to first, so the longest
      causal tiles start first and the short ones fill the last wave (tokamax, FA3's LPT).
    num_splits: KV splits (flash-decoding, 1 to 128): each query tile's key tiles are cut into
      num_splits parts (`split_part`) run by separate CTAs, whose normalised outputs and lse XLA
      merges; `split_kv` chooses it when too few tiles fill the chip.
    persistent: one CTA per SM (at most one per tile), each looping over the tiles c, c + C,
      ... of (batch, head, query tile) (tokamax's and FA3's static persistent scheduler for
      non-causal calls): the memory warpgroup streams the next tile's K/V while the compute
      warpgroups finish the last, and with O in its own buffer (not `reuse_q_for_o`) the next
      Q loads under the last P·V and the O store completes under the next tile. Not with
      num_splits > 1.
    tma_tails: a length that is not a multiple of the tiles is read and written in place
      (`in_place`: lengths that are multiples of 8, which Mosaic GPU's TMA tiling needs):
      TMA fills the rows of a tile past the end of Q, K or V with zeros and drops the rows
      of an O tile past T (what the zero padding gives), so Q, K and V are not copied into
      padded arrays and O is not sliced out of one. On by default since its GPU cases passed
      on the H200 (2026-12-06, benchmarks/results/2026-12-06-nvidia-h200-probes); False: the
      padded copies. The lse, dropout hashes, token tables and bias stay padded (`in_place`
      says why; they are small, but for the bias).
    named_release: the compute warpgroups release a K or V slot by `bar.arrive` on a hardware
      named barrier (one per slot and tensor) and one warp of the memory warpgroup, the only
      producer (`warp_map`), waits by `bar.sync` before reusing it (tokamax's form), instead of
      every compute thread arriving on an mbarrier (Mosaic's warpgroup-wide arrive) and the
      memory warpgroup waiting on it. Needs 2 * num_stages named barriers beside the
      ping-pong's (16 per CTA). Off by default until a GPU has timed it (the reading
      benchmarks/notes/2026-12-07-forward-vs-fa3.md expects 1-3%).
    """

    block_q: int = 128
    block_kv: int = 128
    num_stages: int = 2
    num_compute_wgs: int = 2
    compute_registers: int | None = None
    memory_registers: int | None = None
    pingpong: bool | None = None
    intra_wg_overlap: bool = False
    reuse_q_for_o: bool = True
    lpt_order: bool = True
    num_splits: int = 1
    persistent: bool = False
    tma_tails: bool = True
    named_release: bool = False

    def __post_init__(self):
        def check(name, ok, expected):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not ok(value):
                raise ValueError(f"BlockSizes.{name}={value!r} must be {expected}")

        check("num_compute_wgs", lambda w: 1 <= w <= 3, "1, 2 or 3")
        rows = WGMMA_M * self.num_compute_wgs
        check("block_q", lambda b: b > 0 and b % rows == 0,
              f"a positive multiple of 64 * num_compute_wgs = {rows}")
        check("block_kv", lambda b: 0 < b <= 256 and b % 8 == 0, "a multiple of 8 in [8, 256]")
        check("num_stages", lambda s: s >= 1, ">= 1")
        check("num_splits", lambda s: 1 <= s <= 128, "in [1, 128]")
        compute, memory = (232, 40) if self.num_compute_wgs <= 2 else (160, 32)
        if self.compute_registers is None:
            object.__setattr__(self, "compute_registers", compute)
        if self.memory_registers is None:
            object.__setattr__(self, "memory_registers", memory)
        if self.pingpong is None:
            object.__setattr__(self, "pingpong", self.num_compute_wgs >= 2)
        for name in ("pingpong", "intra_wg_overlap", "reuse_q_for_o", "lpt_order", "persistent",
                     "tma_tails", "named_release"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BlockSizes.{name}={getattr(self, name)!r} must be a bool")
        if self.persistent and self.num_splits > 1:
            raise ValueError(f"BlockSizes.persistent=True needs num_splits=1, got "
                             f"{self.num_splits} (a split's CTA owns one part of one tile)")
        if self.pingpong and self.num_compute_wgs < 2:
            raise ValueError(f"BlockSizes.pingpong=True needs num_compute_wgs >= 2, got "
                             f"{self.num_compute_wgs} (one warpgroup has nobody to take turns "
                             "with)")
        for name in ("compute_registers", "memory_registers"):
            check(name, lambda r: 24 <= r <= 256 and r % 8 == 0, "a multiple of 8 in [24, 256]")
        # Mosaic's barriers 0 .. W + 1, the ping-pong's W, then one per slot for K and for V
        named = 2 * (self.num_compute_wgs + 1) + 2 * self.num_stages
        if self.named_release and named > 16:
            raise ValueError(f"BlockSizes.named_release=True with num_stages={self.num_stages} and "
                             f"num_compute_wgs={self.num_compute_wgs} needs {named} named "
                             "barriers, more than the 16 of a CTA")
        total = (self.compute_registers * self.num_compute_wgs + self.memory_registers) * WARPGROUP
        if total > REGISTERS_PER_SM:
            raise ValueError(
                f"BlockSizes.compute_registers={self.compute_registers} * num_compute_wgs="
                f"{self.num_compute_wgs} + memory_registers={self.memory_registers} must be at "
                f"most {REGISTERS_PER_SM // WARPGROUP} (registers per thread of an SM), got "
                f"{total // WARPGROUP}")

    @property
    def rows_per_wg(self) -> int:
        return self.block_q // self.num_compute_wgs

    def o_reuses_q(self, spec: AttentionSpec) -> bool:
        """Whether the forward kernel stages O in the Q buffer for this call."""
        return self.reuse_q_for_o and spec.qk_dim == spec.v_dim

    def smem_bytes(self, spec: AttentionSpec) -> int:
        """Shared memory the forward kernel allocates on a GPU, exactly as Mosaic GPU counts
        it (each buffer rounded up to SMEM_ALIGNMENT, 8 bytes per mbarrier, no reduction
        scratch): Q, num_stages K and V buffers, O unless it reuses Q's buffer, the float32
        lse rows, the learnable sink's rows, and the barriers. Mirrors the scratch list of
        `pallas_mosaic_gpu_sm90.forward_spec` (a test compares the two on compiled kernels)."""
        size, rows, W = jnp.dtype(spec.dtype).itemsize, self.block_q, self.num_compute_wgs
        sink = spec.softmax == "learnable" and self.num_splits == 1  # splits: sink at the merge
        buffers = [rows * spec.qk_dim * size,
                   self.num_stages * self.block_kv * spec.qk_dim * size,
                   self.num_stages * self.block_kv * spec.v_dim * size,
                   0 if self.o_reuses_q(spec) else rows * spec.v_dim * size,
                   rows * 4, rows * 4 if sink else 0]
        # q_ready; k, v ready and (but with named_release) consumed per stage; the sink's
        barriers = W + (2 if self.named_release else 4) * self.num_stages + (W if sink else 0)
        return sum(_cdiv(b, SMEM_ALIGNMENT) * SMEM_ALIGNMENT for b in buffers) + 8 * barriers

    def accumulator_registers(self, spec: AttentionSpec) -> int:
        """Registers per compute thread that the live tiles take: the S and O accumulators in
        float32, plus (intra_wg_overlap) the previous step's P in 16 bits, whose P·V is in
        flight during the softmax. A lower bound: the softmax needs some more."""
        p = self.block_kv // 2 if self.intra_wg_overlap else 0
        return self.rows_per_wg * (self.block_kv + spec.v_dim + p) // WARPGROUP

    def validate_for(self, spec: AttentionSpec) -> "BlockSizes":
        """self, checked against a call: ValueError for a tile that cannot work with its dtype
        and head dims, NotImplementedError for head dims no tile can take."""
        if spec.v_dim > 256 or spec.v_dim % 8:
            raise NotImplementedError(f"v_dim={spec.v_dim}: the O accumulator is WGMMA's N, a "
                                      "multiple of 8 of at most 256")
        size = jnp.dtype(spec.dtype).itemsize
        step = SWIZZLE_BYTES // size
        if self.block_kv % step:
            raise ValueError(f"BlockSizes.block_kv={self.block_kv} must be a multiple of {step} "
                             f"for {spec.dtype} (the K extent of P·V under the 128-byte swizzle)")
        if (acc := self.accumulator_registers(spec)) > self.compute_registers:
            p = " + block_kv / 2 (P in flight, intra_wg_overlap)" if self.intra_wg_overlap else ""
            raise ValueError(
                f"BlockSizes: the S and O accumulators need {acc} registers per thread (rows_per_wg="
                f"{self.rows_per_wg} * (block_kv={self.block_kv} + v_dim={spec.v_dim}{p}) / 128), "
                f"more than compute_registers={self.compute_registers}")
        if (smem := self.smem_bytes(spec)) > SMEM_BYTES:
            raise ValueError(
                f"BlockSizes(block_q={self.block_q}, block_kv={self.block_kv}, num_stages="
                f"{self.num_stages}, reuse_q_for_o={self.reuse_q_for_o}) needs {smem} bytes of "
                f"shared memory for qk_dim={spec.qk_dim}, v_dim={spec.v_dim}, {spec.dtype}, "
                f"softmax={spec.softmax!r}; at most {SMEM_BYTES} (227 KB)")
        return self


def swizzle_for(minor_bytes: int) -> int:
    """The widest swizzle (bytes) that divides a shared-memory tile's minor dim in bytes:
    128 for head dims that are multiples of 64 (bf16), 64 for e.g. 96, 32 for e.g. 80;
    NotImplementedError below 32 bytes."""
    for swizzle in SWIZZLES:
        if minor_bytes % swizzle == 0:
            return swizzle
    raise NotImplementedError(f"a shared-memory tile row of {minor_bytes} bytes: the kernels need "
                              f"a multiple of {SWIZZLES[-1]} bytes (WGMMA's swizzled layouts)")


# Rows of the tiling `smem_tile` gives every TMA-copied tile; Mosaic GPU (0.11.2) applies it to
# the whole global array, whose sequence axis must then be a multiple of it (a shorter axis
# gets a shorter tile than the shared-memory one, so it is padded too).
TMA_TILE_ROWS = 8


def in_place(length: int, tma_tails: bool) -> bool:
    """Whether a kernel reads (and writes) a sequence of `length` rows in place, TMA filling a
    tail tile's rows past the end with zeros and dropping stores past it (`tma_tails`), rather
    than from a copy padded to the tiles: only where Mosaic GPU's TMA tiling allows it. Only
    for arrays staged in `smem_tile` buffers (tiled TMA clips per dimension): the lse, delta,
    hash and table rows go through untiled shared memory, whose copies Mosaic clamps only to
    the end of the whole array (rows past T would land in the next head's), so they stay padded."""
    return tma_tails and length % TMA_TILE_ROWS == 0


def smem_tile(shape, dtype):
    """plgpu.SMEM of `shape` with the tiling and swizzle WGMMA wants for its minor dim
    (`swizzle_for`); the forward, backward and window kernels allocate their tiles with it."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    size = jnp.dtype(dtype).itemsize
    swizzle = swizzle_for(shape[-1] * size)
    transforms = (plgpu.TilingTransform((8, swizzle // size)), plgpu.SwizzleTransform(swizzle))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


# -- the window kernel's tiles --------------------------------------------------------------

WINDOW_ROWS = WGMMA_M  # query positions per block of the window kernel: one WGMMA M
WINDOW_MAX_BAND = 256  # keys in its S = Q Kᵀ: WGMMA's largest N
WINDOW_OVERLAP_REGISTERS = 216  # overlap_heads' accumulators a thread may hold (an estimate)


@dataclasses.dataclass(frozen=True)
class WindowBlockSizes:
    """The window kernel's configuration: block_kv keys per band tile (a multiple of 64 for
    16-bit inputs), num_compute_wgs warpgroups sharing the group's heads (1 or 2; G must be a
    multiple). pingpong: the warpgroups take turns issuing their GEMMs (FA3's warp scheduler
    barrier, as `BlockSizes.pingpong`), so one warpgroup's softmax runs under the other's
    GEMMs; needs 2 warpgroups. q_buffers: each warpgroup's ring of Q tiles (its O staged in
    the same slot; 2: double buffering). q_ahead: how many heads ahead a warpgroup loads Q,
    1 .. q_buffers - 1 (`ahead`; None, to which q_buffers - 1 is normalised: q_buffers - 1, so
    the default follows q_buffers under `dataclasses.replace`). Loading into the slot the last
    head's O has just left waits for that O's store to read it; q_ahead = q_buffers - 2 loads
    into the slot of the head before it, whose store has had a head's time to finish.
    tma_tails: as `BlockSizes.tma_tails` (Q, K, V read and O written in place where the length
    is a multiple of 8; on by default). overlap_heads: on a GPU each warpgroup issues head t's
    P·V and head t + 1's S = Q Kᵀ back to back, waits for P·V only, and normalises and stores
    O_t while S_{t+1} runs (FA3's intra-warpgroup overlap, across heads: the band's softmax is
    exact, so a head has one S); the interpreter runs the two GEMMs in turn. Not with
    pingpong (its turns are per GEMM), nor where S, O and P together exceed
    WINDOW_OVERLAP_REGISTERS a thread (`overlap_registers`: 208 at a band of 192 keys and
    v_dim 128). With 2 Q slots the next-but-one head's load waits for O_t's store: pair it
    with q_ahead <= q_buffers - 2. persistent: one CTA an SM, each taking a run of consecutive
    (batch, kv head, query block) items (`window_items`); K and V are a ring of the band's tiles
    (slot s holds the tile that is s modulo the band's count), so the next block of the same kv
    head loads only the tiles entering its band, once every warpgroup is past its last read of
    the leaving one (K after the item's last S, V after its last P·V: under the last head's
    softmax and P·V), and the Q ring runs on across items (the next item's first heads load
    under this one's last), so no CTA start or store drain sits between blocks; not with
    overlap_heads. reload_band (persistent only): every item loads its whole band into the
    slots in order, K once every warpgroup's last S of the item before is done, V after its
    last P·V (no rotated columns, no per-slot loads; the band's traffic from L2 as without
    persistent). Off by default until a GPU has timed them."""

    block_kv: int = 64
    num_compute_wgs: int = 2
    pingpong: bool = False
    q_buffers: int = 2
    q_ahead: int | None = None
    tma_tails: bool = True
    overlap_heads: bool = False
    persistent: bool = False
    reload_band: bool = False

    def __post_init__(self):
        if self.block_kv not in (64, 128):
            raise ValueError(f"WindowBlockSizes.block_kv={self.block_kv!r} must be 64 or 128")
        if self.num_compute_wgs not in (1, 2):
            raise ValueError(f"WindowBlockSizes.num_compute_wgs={self.num_compute_wgs!r} must be 1 or 2")
        for name in ("pingpong", "tma_tails", "overlap_heads", "persistent", "reload_band"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"WindowBlockSizes.{name} must be a bool, got {getattr(self, name)!r}")
        if self.pingpong and self.num_compute_wgs < 2:
            raise ValueError(f"WindowBlockSizes.pingpong=True needs num_compute_wgs=2, got "
                             f"{self.num_compute_wgs}")
        if self.pingpong and self.overlap_heads:
            raise ValueError("WindowBlockSizes.overlap_heads=True needs pingpong=False (the "
                             "ping-pong's turns are per GEMM)")
        if self.persistent and self.overlap_heads:
            raise ValueError("WindowBlockSizes.persistent=True needs overlap_heads=False (its "
                             "heads pair up within one block)")
        if self.reload_band and not self.persistent:
            raise ValueError("WindowBlockSizes.reload_band=True needs persistent=True")
        if self.q_buffers not in (2, 3, 4):
            raise ValueError(f"WindowBlockSizes.q_buffers={self.q_buffers!r} must be 2, 3 or 4")
        if self.q_ahead is not None and (not isinstance(self.q_ahead, int)
                                         or not 1 <= self.q_ahead < self.q_buffers):
            raise ValueError(f"WindowBlockSizes.q_ahead={self.q_ahead!r} must be None or in 1 .. "
                             f"q_buffers - 1 = {self.q_buffers - 1}")
        if self.q_ahead == self.q_buffers - 1:  # one spelling of the default: equal configs compare equal
            object.__setattr__(self, "q_ahead", None)

    @property
    def band_ring(self) -> bool:
        """Whether the band is a ring of its tiles (persistent without reload_band)."""
        return self.persistent and not self.reload_band

    @property
    def ahead(self) -> int:
        """How many heads ahead a warpgroup loads Q (q_ahead, or its default q_buffers - 1)."""
        return self.q_buffers - 1 if self.q_ahead is None else self.q_ahead

    def band_tiles(self, spec: AttentionSpec) -> int:
        """Key tiles in every block's band: the most any 64-position block meets, at most the
        padded key length's tiles."""
        nq, nk = -(-spec.q_len // WINDOW_ROWS), -(-spec.kv_len // self.block_kv)
        r = band_kv_range(np.arange(nq), q_len=spec.q_len, kv_len=spec.kv_len, window=spec.window,
                          diagonal_offset=spec.diagonal_offset, block_q=WINDOW_ROWS, block_kv=self.block_kv)
        return int(min(max(int(r.count.max(initial=1)), 1), nk))

    def validate_for(self, spec: AttentionSpec) -> "WindowBlockSizes":
        """self, checked against a call: NotImplementedError with the reason it does not fit."""
        if (why := window_reason(spec, self)) is not None:
            raise NotImplementedError(f"the window kernel cannot run this call: {why}")
        return self

    def overlap_registers(self, spec: AttentionSpec) -> int:
        """Accumulator-class registers a thread holds at overlap_heads' issue point: S (64 x band
        float32), O (64 x v_dim float32) and the 16-bit P, each spread over 128 threads."""
        band = self.band_tiles(spec) * self.block_kv
        return (WINDOW_ROWS * band * 4 + WINDOW_ROWS * spec.v_dim * 4 + WINDOW_ROWS * band * 2) // (4 * WARPGROUP)

    def smem_bytes(self, spec: AttentionSpec) -> int:
        """Shared memory as Mosaic GPU counts it: the K and V band, q_buffers Q buffers (O staged
        there when Dqk == Dv, else as many O buffers) and lse rows per warpgroup, P for the
        interpreter excluded, 8 bytes per barrier."""
        size, W, band = jnp.dtype(spec.dtype).itemsize, self.num_compute_wgs, self.band_tiles(spec) * self.block_kv
        slots = W * self.q_buffers

        def aligned(n):
            return -(-n // SMEM_ALIGNMENT) * SMEM_ALIGNMENT

        o = 0 if spec.qk_dim == spec.v_dim else aligned(slots * WINDOW_ROWS * spec.v_dim * size)
        return (aligned(band * spec.qk_dim * size) + aligned(band * spec.v_dim * size)
                + aligned(slots * WINDOW_ROWS * spec.qk_dim * size) + o + aligned(slots * WINDOW_ROWS * 4)
                + 8 * (slots + 2 * (self.band_tiles(spec) if self.band_ring else 1) + 2 * self.persistent))


def window_reason(spec: AttentionSpec, bs: "WindowBlockSizes | None" = None) -> str | None:
    """Why the window kernel (pallas_mosaic_gpu_sm90_window) does not take this call with
    these tiles (None: it does)."""
    bs = bs or WindowBlockSizes()
    left, right = spec.window
    if left < 0 or right < 0:
        return f"window={spec.window}: the window kernel needs both sides bounded"
    for name, used in (("dropout", spec.has_dropout), ("segments", spec.segments is not None),
                       ("bias", spec.has_bias), ("custom positions", not spec.positions_canonical)):
        if used:
            return f"{name}: the window kernel runs band masks only"
    if (band := bs.band_tiles(spec) * bs.block_kv) > WINDOW_MAX_BAND:
        return (f"window={spec.window}: the keys of 64 queries span {band} > {WINDOW_MAX_BAND} "
                f"(block_kv={bs.block_kv})")
    if spec.group_size % bs.num_compute_wgs:
        return (f"{spec.group_size} query heads per kv head is not a multiple of "
                f"num_compute_wgs={bs.num_compute_wgs}")
    if bs.overlap_heads and (regs := bs.overlap_registers(spec)) > WINDOW_OVERLAP_REGISTERS:
        return (f"overlap_heads: S ({band} keys), O (v_dim={spec.v_dim}) and P in flight "
                f"together need {regs} registers a thread, above {WINDOW_OVERLAP_REGISTERS} "
                f"(255 less ~40 for addresses and scalars); use overlap_heads=False")
    if (smem := bs.smem_bytes(spec)) > SMEM_BYTES:
        return f"needs {smem} bytes of shared memory, at most {SMEM_BYTES}"
    return None


# -- what the kernels run ----------------------------------------------------------------------

KERNEL_DTYPES = ("bfloat16", "float16")


def check_spec(spec: AttentionSpec, kernel: str, max_dim: int | None = None) -> None:
    """The checks every Mosaic GPU attention kernel makes of a call: NotImplementedError for
    what none of them runs (other dtypes, head dims that are not a multiple of 32 bytes, the
    narrowest swizzle and WGMMA's K step, or above max_dim), ValueError for values out of
    range. `kernel` names the caller."""
    if not 0.0 <= spec.dropout_rate < 1.0:
        raise ValueError(f"dropout_rate={spec.dropout_rate!r} must be in [0, 1)")
    if spec.softmax not in SOFTMAX_TYPES:
        raise ValueError(f"softmax={spec.softmax!r} must be one of {SOFTMAX_TYPES}")
    if spec.logits_soft_cap is not None and not spec.logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap={spec.logits_soft_cap!r} must be positive or None")
    if spec.dtype not in KERNEL_DTYPES:
        raise NotImplementedError(f"pallas_mosaic_gpu_sm90 {kernel}: dtype={spec.dtype}: the "
                                  f"kernels take {KERNEL_DTYPES}")
    step = SWIZZLES[-1] // jnp.dtype(spec.dtype).itemsize
    for name, dim in (("qk_dim", spec.qk_dim), ("v_dim", spec.v_dim)):
        if dim % step or (max_dim is not None and dim > max_dim):
            bound = "" if max_dim is None else f" of at most {max_dim}"
            raise NotImplementedError(f"pallas_mosaic_gpu_sm90 {kernel}: {name}={dim}: must be a "
                                      f"multiple of {step}{bound} for {spec.dtype} (32-byte "
                                      "rows: the narrowest swizzle and WGMMA's K step)")


# -- the tuned table --------------------------------------------------------------------------

_KEYS = ("qk_dim", "v_dim", "mask", "max_window", "min_len", "max_len", "group", "dtypes")


def mask_kind(spec: AttentionSpec) -> str:
    """The table's mask key: "none", "causal" (window (-1, 0)) or "window" (any other bound)."""
    if not spec.has_window:
        return "none"
    return "causal" if spec.window == (-1, 0) else "window"


def key_matches(key: dict, spec: AttentionSpec) -> bool:
    """Whether a table key (the _KEYS fields it has; absent = any) matches a call."""
    left, right = spec.window
    width = left + right + 1 if min(left, right) >= 0 else None
    length = max(spec.q_len, spec.kv_len)
    return all((
        key.get("qk_dim", spec.qk_dim) == spec.qk_dim,
        key.get("v_dim", spec.v_dim) == spec.v_dim,
        key.get("mask", mask_kind(spec)) == mask_kind(spec),
        "max_window" not in key or (width is not None and width <= key["max_window"]),
        key.get("min_len", 0) <= length <= key.get("max_len", math.inf),
        key.get("group", spec.group_size) == spec.group_size,
        spec.dtype in key.get("dtypes", (spec.dtype,)),
    ))


@functools.cache
def load_table(path: str = str(CONFIGS_PATH)) -> dict:
    """The table {"devices": {family: [device-kind substrings]}, "entries": [{"device",
    "key", "config", ...}], "backward_entries": [the same, configs of BackwardBlockSizes]},
    each config valid and no two keys of a list equal."""
    from flashmesh.attention.pallas_mosaic_gpu_sm90_bwd_tiles import BackwardBlockSizes

    table = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    for name, check in (("entries", forward_config), ("backward_entries", lambda c: BackwardBlockSizes(**c))):
        seen = set()
        for i, entry in enumerate(table.get(name, ())):
            if entry["device"] not in table["devices"]:
                raise ValueError(f"{name}[{i}].device={entry['device']!r} must be one of "
                                 f"{sorted(table['devices'])}")
            if unknown := set(entry["key"]) - set(_KEYS):
                raise ValueError(f"{name}[{i}].key has unknown fields {sorted(unknown)}; known: {_KEYS}")
            check(entry["config"])
            ident = (entry["device"], json.dumps(entry["key"], sort_keys=True))
            if ident in seen:
                raise ValueError(f"{name}[{i}] repeats the key {ident}")
            seen.add(ident)
    return table


def device_family(device_kind: str) -> str:
    """The table's device family of a jax `device_kind` string (e.g. "NVIDIA H100 80GB HBM3")."""
    for family, names in load_table()["devices"].items():
        if any(name.lower() in device_kind.lower() for name in names):
            return family
    raise NotImplementedError(f"device_kind={device_kind!r}: the Mosaic GPU attention kernels are "
                              "written for Hopper (sm90: H100, H200, H800, H20, GH200)")


def matching_entry(spec: AttentionSpec, device_kind: str) -> dict | None:
    """The table entry for a call: of the entries whose key fields all match (absent = any)
    and whose kernel takes the call (a window-kernel entry does not take dropout, segments or
    bias: those calls get the general kernel's entry or heuristic), the one with most fields,
    the first in the file among equals; None if none matches."""
    family = device_family(device_kind)

    def takes(entry):
        config = forward_config(entry["config"])
        return not isinstance(config, WindowBlockSizes) or window_reason(spec, config) is None

    found = [e for e in load_table()["entries"]
             if e["device"] == family and key_matches(e["key"], spec) and takes(e)]
    return max(found, key=lambda e: len(e["key"]), default=None)


def forward_config(config: dict) -> "BlockSizes | WindowBlockSizes":
    """A table entry's config: WindowBlockSizes for {"kernel": "window", ...}, else BlockSizes."""
    config = dict(config)
    kernel = config.pop("kernel", "general")
    if kernel not in ("general", "window"):
        raise ValueError(f"config kernel={kernel!r} must be 'general' or 'window'")
    return WindowBlockSizes(**config) if kernel == "window" else BlockSizes(**config)


def config_fields(bs: "BlockSizes | WindowBlockSizes") -> dict:
    """The table's config dict of a configuration (`forward_config`'s inverse)."""
    fields = dataclasses.asdict(bs)
    return {"kernel": "window", **fields} if isinstance(bs, WindowBlockSizes) else fields


def heuristic(spec: AttentionSpec) -> "BlockSizes | WindowBlockSizes":
    """The configuration when no table entry matches: the window kernel where it takes the call
    (two warpgroups when the group's heads split evenly, else one; untuned: research §4 #2),
    else (tokamax's and FA3's defaults)
    KV splits from `split_kv`;
    2 compute warpgroups of 64 rows (one of 64 rows when T <= 64); block_kv 128 for head dims
    up to 128, else 64, but the 128-byte minimum of the dtype (64 bf16, 128 fp8) for windows at
    most 256 keys wide; 2 stages, then 1, then halved block_kv while shared memory overflows;
    persistent without a band mask (`_persistent_if_unmasked`)."""
    window = WindowBlockSizes(num_compute_wgs=2 if spec.group_size % 2 == 0 else 1)
    if window_reason(spec, window) is None:
        return window
    one = spec.q_len <= WGMMA_M
    step = SWIZZLE_BYTES // jnp.dtype(spec.dtype).itemsize
    kv = 128 if max(spec.qk_dim, spec.v_dim) <= 128 else 64
    left, right = spec.window
    if min(left, right) >= 0 and left + right + 1 <= 256:
        kv = step
    kv = max(kv, step)
    while True:
        for stages in (2, 1):
            bs = BlockSizes(block_q=64 if one else 128, block_kv=kv, num_stages=stages,
                            num_compute_wgs=1 if one else 2)
            if bs.smem_bytes(spec) <= SMEM_BYTES:
                bs = dataclasses.replace(bs, num_splits=split_kv(spec, bs))
                return _persistent_if_unmasked(spec, bs)
        if kv // 2 < step or (kv // 2) % step:
            raise NotImplementedError(f"no tile fits {SMEM_BYTES} bytes of shared memory for "
                                      f"qk_dim={spec.qk_dim}, v_dim={spec.v_dim}, {spec.dtype}")
        kv //= 2


def _persistent_if_unmasked(spec: AttentionSpec, bs: BlockSizes) -> BlockSizes:
    """A call without a band mask (every query tile visits every key tile) runs persistent,
    with O in its own buffer where it fits (tokamax's `persistent=not causal`; chosen from
    flashmesh tune on full_4k_h16_d128 on 2026-12-04, whose report was lost before it reached
    benchmarks/results: its table entry's source holds the figures, a re-run is pending)."""
    if spec.window != (-1, -1) or bs.num_splits > 1:
        return bs
    own_o = dataclasses.replace(bs, persistent=True, reuse_q_for_o=False)
    return own_o if own_o.smem_bytes(spec) <= SMEM_BYTES else dataclasses.replace(bs, persistent=True)


def default_for(spec: AttentionSpec, device_kind: str) -> "BlockSizes | WindowBlockSizes":
    """The forward kernel's configuration for a call on a device (jax's `device_kind`): the
    matching entry of pallas_mosaic_gpu_configs.json (`matching_entry`), else `heuristic`;
    validated against the call. A WindowBlockSizes runs the window kernel. Entries marked
    tuned came from `flashmesh tune` on the H200 (each entry's source names the run); the
    others are the research's starting points (research/kernels.md §2.1, §2.5, §5)."""
    entry = matching_entry(spec, device_kind)
    bs = heuristic(spec) if entry is None else forward_config(entry["config"])
    if entry is not None and isinstance(bs, BlockSizes) and "num_splits" not in entry["config"]:
        splits = split_kv(spec, bs)  # a call too small to fill the chip: split, not persistent
        bs = dataclasses.replace(bs, num_splits=splits, persistent=bs.persistent and splits == 1)
    return bs.validate_for(spec)


# -- KV splits ----------------------------------------------------------------------------------

def split_kv(spec: AttentionSpec, block_sizes: BlockSizes, num_sms: int = 132) -> int:
    """Number of KV splits (flash-decoding; each split returns its lse and XLA merges them).

    Rule (FA3's `num_splits_heuristic`, research §2.1, §4 #9): with C = B * N * nq tiles, no
    split when C >= 0.8 * num_sms. Otherwise, for s = 1 .. min(num_sms, m, 128) where m is the
    most key tiles any query tile visits (static `kv_ranges`), skipping an s that leaves the
    longest split as long as s - 1 did, the wave efficiency of s is w / ceil(w) with
    w = C * s / num_sms; the answer is the smallest s within 85 % of the best efficiency.
    """
    if not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"num_sms={num_sms!r} must be a positive int")
    ranges = kv_ranges(spec, block_sizes.block_q, block_sizes.block_kv)
    tiles = spec.batch * spec.num_heads * len(ranges.lo)
    longest = int(ranges.count.max(initial=0))
    if tiles >= 0.8 * num_sms or longest <= 1:
        return 1
    candidates = [s for s in range(1, min(num_sms, longest, 128) + 1)
                  if s == 1 or _cdiv(longest, s) < _cdiv(longest, s - 1)]
    waves = {s: tiles * s / num_sms for s in candidates}
    eff = {s: w / math.ceil(w) for s, w in waves.items()}
    best = max(eff.values())
    return min(s for s in candidates if eff[s] >= 0.85 * best)


def split_part(ranges: TileRanges, split, num_splits: int) -> TileRanges:
    """Part `split` (int, array or traced int32, broadcasting against the ranges) of each
    tile's range cut into num_splits consecutive parts of ceil(count / num_splits) tiles; a
    part with nothing left is empty (all four 0), and its FULL run is its share of the tile's.
    In a kernel: the key tiles one split's CTA visits."""
    xp = _xp(*ranges, split)
    chunk = (ranges.count + (num_splits - 1)) // num_splits
    lo = xp.minimum(ranges.lo + split * chunk, ranges.hi)
    hi = xp.minimum(lo + chunk, ranges.hi)
    f_lo = xp.clip(ranges.full_lo, lo, hi)
    f_hi = xp.clip(ranges.full_hi, lo, hi)
    seen, has_full = lo < hi, f_lo < f_hi
    lo, hi = xp.where(seen, lo, 0), xp.where(seen, hi, 0)
    f_lo, f_hi = xp.where(has_full, f_lo, lo), xp.where(has_full, f_hi, lo)
    return TileRanges(*(xp.asarray(x).astype(np.int32) for x in (lo, f_lo, f_hi, hi)))


def split_ranges(ranges: TileRanges, num_splits: int) -> TileRanges:
    """Each tile's range cut into num_splits parts (`split_part`): arrays [num_splits, ...]."""
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits={num_splits!r} must be a positive int")
    xp = _xp(*ranges)
    s = xp.arange(num_splits, dtype=np.int32).reshape((num_splits,) + (1,) * ranges.lo.ndim)
    return split_part(TileRanges(*(x[None] for x in ranges)), s, num_splits)
