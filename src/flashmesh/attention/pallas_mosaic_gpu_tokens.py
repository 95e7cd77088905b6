"""Packed segments and explicit positions in the Mosaic GPU kernels: the per-token tables.

Shape legend: B batch, T query length, S key length; Tp, Sp the kernels' padded lengths;
n the tiles of the kernel's stationary axis.

A call with segments (packing or padding, `spec.segments`) or positions that are not the
implicit ones hands the kernels, per token, its segment id (int32, 0 = padding) and, when the
mask has a window (causal included), its position. Query i sees key j iff
q_seg[i] == kv_seg[j] != 0 and, with a window (left, right),
-right <= q_pos[i] - kv_pos[j] <= left: masks.element_mask's rule. The tables are zero-padded
to the kernels' tile multiples, so every padded token is padding (segment 0) and needs no
separate tail mask.

Which tiles a CTA visits comes from the call's block map (`masks.block_map` through
`pallas_mosaic_gpu_ranges.kv_ranges` / `q_ranges`), computed in XLA per batch row: int32
[B, n, 4] of (lo, full_lo, full_hi, hi), read by the kernels as scalars from global memory
(`load_ranges`). Tiles outside [lo, hi) are never loaded; tiles in [full_lo, full_hi) (one
segment, every pair visible) run without the mask; the others are masked element-wise from the
tables (`mask`): the stationary side's ids and positions are copied into shared memory once,
the streamed side's arrive with each K/V (or Q/dO) tile.

Example (a kernel wrapper's view):
    >>> t = from_inputs(spec, inputs)                    # None without segments / positions
    >>> arrays = kernel_arrays(spec, t, 128, 64, q_len=256, kv_len=256)
    >>> arrays.ranges.shape                                # [B, 256 // 128, 4]
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from flashmesh.attention import pallas_mosaic_gpu_common as common
from flashmesh.attention import pallas_mosaic_gpu_ranges as tile_ranges
from flashmesh.attention.spec import AttentionInputs, AttentionSpec


class TokenTables(NamedTuple):
    """Per token int32 segment ids (0 = padding) and positions: q [B, T], kv [B, S]."""

    q_segment_ids: jax.Array
    kv_segment_ids: jax.Array
    q_positions: jax.Array
    kv_positions: jax.Array

    def as_inputs(self) -> AttentionInputs:
        """The tables as the mask fields of an AttentionInputs (what masks.block_map reads)."""
        return AttentionInputs(q=None, k=None, v=None, q_segment_ids=self.q_segment_ids,
                               kv_segment_ids=self.kv_segment_ids, q_positions=self.q_positions,
                               kv_positions=self.kv_positions)


class KernelArrays(NamedTuple):
    """What a kernel reads: ranges int32 [B, n, 4] (lo, full_lo, full_hi, hi per tile of its
    stationary axis), segment ids q [B, Tp], kv [B, Sp] and, when the mask has a window,
    positions (else None), zero-padded to the kernel's lengths."""

    ranges: jax.Array
    q_segment_ids: jax.Array
    kv_segment_ids: jax.Array
    q_positions: jax.Array | None
    kv_positions: jax.Array | None

    @property
    def q_side(self) -> tuple:
        return tuple(x for x in (self.q_segment_ids, self.q_positions) if x is not None)

    @property
    def kv_side(self) -> tuple:
        return tuple(x for x in (self.kv_segment_ids, self.kv_positions) if x is not None)


def needed(spec: AttentionSpec) -> bool:
    """Whether a call's mask reads per-token data (segments or explicit positions)."""
    return spec.segments is not None or not spec.positions_canonical


def per_side(spec: AttentionSpec) -> int:
    """Tables per side the kernels copy: the segment ids, plus positions under a window."""
    return 0 if not needed(spec) else (2 if spec.has_window else 1)


def from_inputs(spec: AttentionSpec, inputs: AttentionInputs) -> TokenTables | None:
    """The tables of a normalised call (None when its mask needs none): missing ids are one
    segment per row, missing positions the implicit ones (query i at i + diagonal offset)."""
    if not needed(spec):
        return None
    B, T, S = spec.batch, spec.q_len, spec.kv_len

    def table(x, length, implicit):
        if x is None:
            x = implicit
        x = jnp.asarray(x).astype(jnp.int32)
        return jnp.broadcast_to(x, (B, length))

    return TokenTables(
        table(inputs.q_segment_ids, T, jnp.ones((1, T), jnp.int32)),
        table(inputs.kv_segment_ids, S, jnp.ones((1, S), jnp.int32)),
        table(inputs.q_positions, T, jnp.arange(T, dtype=jnp.int32)[None] + spec.diagonal_offset),
        table(inputs.kv_positions, S, jnp.arange(S, dtype=jnp.int32)[None]))


def _pad(x, length: int):
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1])))


def kernel_arrays(spec: AttentionSpec, tables: TokenTables, block_q: int, block_kv: int, *,
                  q_len: int, kv_len: int, transpose: bool = False,
                  num_tiles: int | None = None) -> KernelArrays:
    """The tables padded to the kernel's lengths q_len, kv_len (Tp, Sp, multiples of the tiles)
    with the ranges of its (block_q, block_kv) tiles: per query tile the key tiles, or with
    transpose=True per key tile the query tiles (the KV-stationary kernel's loop). num_tiles:
    the kernel's grid along its stationary axis when the padding adds whole tiles past the
    map (they get empty ranges: lo == hi == 0)."""
    get = tile_ranges.q_ranges if transpose else tile_ranges.kv_ranges
    r = get(spec, block_q, block_kv, tables.as_inputs())
    ranges = jnp.stack([jnp.broadcast_to(jnp.asarray(x, jnp.int32), (spec.batch, x.shape[-1]))
                        for x in r], axis=-1)
    if num_tiles is not None and num_tiles > ranges.shape[1]:
        ranges = jnp.pad(ranges, ((0, 0), (0, num_tiles - ranges.shape[1]), (0, 0)))
    window = spec.has_window
    return KernelArrays(
        ranges,
        _pad(tables.q_segment_ids, q_len), _pad(tables.kv_segment_ids, kv_len),
        _pad(tables.q_positions, q_len) if window else None,
        _pad(tables.kv_positions, kv_len) if window else None)


def load_ranges(ranges_ref, batch, tile) -> tile_ranges.TileRanges:
    """In a kernel: the four int32 scalars of one tile, from global memory."""
    return tile_ranges.TileRanges(*(ranges_ref[batch, tile, i] for i in range(4)))


def mask(s, q_tokens, kv_tokens, spec: AttentionSpec, q_dim: int):
    """In a kernel: s (WGMMA layout) with -inf where the query does not see the key.
    q_tokens, kv_tokens: (segment ids, positions or None) vectors of the tile's queries along
    dim q_dim and its keys along the other dim (WGMMA row / column layouts)."""
    shape, kv_dim = s.shape, 1 - q_dim

    def along(x, dim):
        return lax.broadcast_in_dim(x, shape, [dim])

    q_seg = along(q_tokens[0], q_dim)
    visible = (q_seg == along(kv_tokens[0], kv_dim)) & (q_seg != 0)
    left, right = spec.window
    if spec.has_window:
        d = along(q_tokens[1], q_dim) - along(kv_tokens[1], kv_dim)
        if left >= 0:
            visible = visible & (d <= left)
        if right >= 0:
            visible = visible & (d >= -right)
    return jnp.where(visible, s, -jnp.inf)


def smem_bytes(spec: AttentionSpec, stationary_rows: int, streamed_rows: int, stages: int,
               stationary_barriers: int) -> int:
    """Shared memory of the tables in one kernel, as Mosaic GPU counts it: per table, the
    stationary side's rows (one buffer) and the ring of the streamed side's, each rounded up to
    SMEM_ALIGNMENT, plus 8 bytes per barrier (`stationary_barriers` + `stages` per table)."""
    def aligned(nbytes):
        return -(-nbytes // common.SMEM_ALIGNMENT) * common.SMEM_ALIGNMENT

    n = per_side(spec)
    return n * (aligned(4 * stationary_rows) + aligned(4 * stages * streamed_rows)
                + 8 * (stationary_barriers + stages))
