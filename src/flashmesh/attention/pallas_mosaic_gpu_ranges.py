"""Tile ranges for the Pallas Mosaic GPU (Hopper) attention kernels: pure Python, no kernel code.

What the kernels read from here:
* `kv_ranges`: per query tile, the key tiles [lo, hi) to visit and inside them the run
  [full_lo, full_hi) that needs no mask arithmetic (forward pass, dQ).
* `q_ranges`: the transposed map, per key tile (KV-stationary backward pass: dK, dV).
* `band_kv_range`: `kv_ranges` in closed form for one tile index, traced or not, so a kernel
  can compute its range from `lax.axis_index` instead of reading a table.
* `clamp_within`: a warpgroup's own range placed inside its CTA's.
* `q_tile_order`, `kv_tile_order`: longest-first (LPT) tile orders for persistent loops.
* `split_part`, `split_ranges`: each tile's range cut into KV splits (flash-decoding; how many:
  `pallas_mosaic_gpu_table.split_kv`).

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
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flashmesh.attention import masks
from flashmesh.attention.spec import AttentionInputs, AttentionSpec

_NO_ARRAYS = AttentionInputs(q=None, k=None, v=None)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints."""
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
