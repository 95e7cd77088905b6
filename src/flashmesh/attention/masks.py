"""The mask, in two resolutions, built from the one mask form of `AttentionSpec`.

* `element_mask`: which (query, key) pairs are visible inside one tile (or the whole matrix).
* `block_map`: for tiles of (bq, bk), whether each tile is EMPTY (skip it), FULL (skip the mask
  arithmetic) or PARTIAL. It is computed from per-tile minima and maxima of positions and
  segment ids, so it costs O(B * (T/bq) * (S/bk)) memory, never O(T * S). It is exact for
  implicit positions and conservative (never calls a tile empty or full wrongly) otherwise.
* `dropout_keep`: a counter-based hash of (seed, b, n, i, j), so every backend that implements
  dropout drops the same elements, tile by tile, without storing a mask; `keep_probability`
  is the rate it realises (a multiple of 1/65536) and the kept elements' scale its inverse.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flashmesh.attention.spec import AttentionInputs, AttentionSpec

EMPTY, PARTIAL, FULL = 0, 1, 2


def _positions(spec: AttentionSpec, inputs: AttentionInputs, q_idx, kv_idx):
    """Positions of the given query and key indices, [B|1, tq] and [B|1, tk]."""
    if inputs.q_positions is None:
        q_pos = (q_idx + spec.diagonal_offset)[None, :]
    else:
        q_pos = jnp.take(inputs.q_positions, q_idx, axis=1, mode="clip")
    if inputs.kv_positions is None:
        kv_pos = kv_idx[None, :]
    else:
        kv_pos = jnp.take(inputs.kv_positions, kv_idx, axis=1, mode="clip")
    return q_pos, kv_pos


def element_mask(spec: AttentionSpec, inputs: AttentionInputs, q_idx: jax.Array,
                 kv_idx: jax.Array) -> jax.Array | None:
    """Visible pairs among queries `q_idx` [tq] and keys `kv_idx` [tk]: bool [B|1, tq, tk].

    Indices past the end of the sequence (tile padding) are invisible. Returns None when every
    pair is visible, so callers skip the arithmetic entirely.
    """
    mask = None

    def conj(a, b):
        return b if a is None else a & b

    # Key columns past S (tile padding) are hidden; query rows past T are dropped by the caller.
    if not isinstance(kv_idx, np.ndarray) or kv_idx.max(initial=-1) >= spec.kv_len:
        mask = conj(mask, (kv_idx < spec.kv_len)[None, None, :])
    if spec.has_window:
        q_pos, kv_pos = _positions(spec, inputs, q_idx, kv_idx)
        left, right = spec.window
        diff = q_pos[:, :, None] - kv_pos[:, None, :]  # query position - key position
        if left >= 0:
            mask = conj(mask, diff <= left)
        if right >= 0:
            mask = conj(mask, diff >= -right)
    if spec.segments is not None:
        q_seg = jnp.take(inputs.q_segment_ids, q_idx, axis=1, mode="clip")
        kv_seg = jnp.take(inputs.kv_segment_ids, kv_idx, axis=1, mode="clip")
        mask = conj(mask, (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg != 0)[:, :, None])
    return mask


def without_padding(inputs: AttentionInputs) -> AttentionInputs:
    """inputs with q, k and v zeroed at padding tokens (segment id 0).

    A padding token is masked out of every softmax, but masking alone does not stop it: its
    value enters `p @ v` as 0 * v, which is NaN for a NaN or inf v, and likewise a padded key
    reaches dq (and a padded query dk) through a zero gradient times it. Padding holds whatever
    the data loader left there, so it is cleared before any arithmetic; `where` also gives the
    padded tokens exactly zero gradient, which is their true gradient.
    """
    if inputs.q_segment_ids is None:
        return inputs

    def clear(x, ids):
        return jnp.where((ids != 0)[:, :, None, None], x, jnp.zeros((), x.dtype))

    return dataclasses.replace(inputs, q=clear(inputs.q, inputs.q_segment_ids),
                               k=clear(inputs.k, inputs.kv_segment_ids),
                               v=clear(inputs.v, inputs.kv_segment_ids))


def _tile_min_max(x, block: int, length: int, xp):
    """Per-tile min and max of x [B, L] (padded to whole tiles with its edge value)."""
    n = -(-length // block)
    pad = n * block - length
    x = xp.pad(x, ((0, 0), (0, pad)), mode="edge")
    x = x.reshape(x.shape[0], n, block)
    return x.min(axis=-1), x.max(axis=-1)


def block_map(spec: AttentionSpec, inputs: AttentionInputs, bq: int, bk: int):
    """Tile classes EMPTY / PARTIAL / FULL, int8 [B|1, ceil(T/bq), ceil(S/bk)].

    Static (numpy) when the mask depends only on the spec (no segments, implicit positions),
    so kernels can drop empty tiles at trace time; a jax array otherwise.
    """
    static = spec.segments is None and inputs.q_positions is None and inputs.kv_positions is None
    xp = np if static else jnp
    nq, nk = -(-spec.q_len // bq), -(-spec.kv_len // bk)
    if inputs.q_positions is None:
        q_pos = np.arange(spec.q_len)[None] + spec.diagonal_offset
    else:
        q_pos = inputs.q_positions
    kv_pos = np.arange(spec.kv_len)[None] if inputs.kv_positions is None else inputs.kv_positions
    q_lo, q_hi = _tile_min_max(xp.asarray(q_pos), bq, spec.q_len, xp)
    k_lo, k_hi = _tile_min_max(xp.asarray(kv_pos), bk, spec.kv_len, xp)
    q_lo, q_hi = q_lo[:, :, None], q_hi[:, :, None]
    k_lo, k_hi = k_lo[:, None, :], k_hi[:, None, :]

    empty = xp.zeros((1, nq, nk), bool)
    full = xp.ones((1, nq, nk), bool)
    left, right = spec.window
    if left >= 0:  # visible iff q_pos - k_pos <= left
        empty = empty | (q_lo - k_hi > left)
        full = full & (q_hi - k_lo <= left)
    if right >= 0:  # visible iff k_pos - q_pos <= right
        empty = empty | (k_lo - q_hi > right)
        full = full & (k_hi - q_lo <= right)
    if spec.segments is not None:
        sq_lo, sq_hi = _tile_min_max(inputs.q_segment_ids, bq, spec.q_len, jnp)
        sk_lo, sk_hi = _tile_min_max(inputs.kv_segment_ids, bk, spec.kv_len, jnp)
        sq_lo, sq_hi = sq_lo[:, :, None], sq_hi[:, :, None]
        sk_lo, sk_hi = sk_lo[:, None, :], sk_hi[:, None, :]
        empty = empty | (sq_hi == 0) | (sk_hi == 0) | (sq_hi < sk_lo) | (sk_hi < sq_lo)
        full = full & (sq_lo == sq_hi) & (sk_lo == sk_hi) & (sq_lo == sk_lo) & (sq_lo != 0)
    if spec.kv_len % bk:  # the last key tile holds padding columns that must be masked
        full = full & (xp.arange(nk) < nk - 1)[None, None, :]
    classes = xp.where(empty, EMPTY, xp.where(full, FULL, PARTIAL)).astype(xp.int8)
    return classes


def mix32(x: jax.Array) -> jax.Array:
    """A 32-bit integer finaliser (lowbias32, C. Wellons): good avalanche in four operations."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def dropout_numbers(inputs: AttentionInputs, n, q_idx, kv_idx):
    """The (head, query, key) numbers the dropout hash sees for local indices n, q_idx, kv_idx:
    the same indices, or their global numbers where the inputs carry them (a context-parallel
    shard). Indices past the end (tile padding) are clipped; those elements are hidden anyway."""
    def number(table, idx):
        return idx if table is None else jnp.take(table, jnp.asarray(idx), mode="clip")

    return (number(inputs.head_index, n), number(inputs.q_index, q_idx), number(inputs.kv_index, kv_idx))


DROPOUT_BITS = 16  # bits of hash per dropout decision: one 32-bit hash decides two keys
DROPOUT_BATCH_MULT = 0x9E3779B1  # dropout_keep's multiplier of the batch index (first round)
DROPOUT_KEY_MULT = 0x85EBCA77  # and of the key pair's index (last round)


def dropout_threshold(rate: float) -> int:
    """An element is kept iff its 16-bit share of the hash is >= this: rate in 1/65536ths."""
    return min(int(round(rate * 2.0**DROPOUT_BITS)), 2**DROPOUT_BITS - 1)


def keep_probability(rate: float) -> float:
    """The probability `dropout_keep` keeps an element at `rate`: 1 - rate rounded to a multiple
    of 1/65536 (at most 7.6e-6 away). Every backend scales the kept elements by its inverse, so
    dropout leaves the expected output unchanged exactly."""
    return 1.0 - dropout_threshold(rate) / 2.0**DROPOUT_BITS


def dropout_keep(seed: jax.Array, rate: float, b, n, q_idx, kv_idx) -> jax.Array:
    """Which attention probabilities survive dropout: bool, broadcast of b, n, q_idx, kv_idx.

    A pure function of (seed, batch, head, query index, key index): a tiled backend asks for
    its tile and gets exactly the elements the reference drops, with no mask in memory. Keys
    2m and 2m + 1 share the last round's 32-bit hash, the low 16 bits deciding the even key and
    the high 16 the odd one (a kernel computes it once per pair where a thread holds both, as
    the forward's WGMMA layout does), so rates are multiples of 1/65536 (`keep_probability`).
    """
    u = jnp.uint32
    h = mix32(seed[0] ^ mix32(jnp.asarray(b).astype(u) * u(DROPOUT_BATCH_MULT) + jnp.asarray(n).astype(u)))
    h = mix32(h ^ seed[1] ^ jnp.asarray(q_idx).astype(u))
    kv = jnp.asarray(kv_idx).astype(u)
    return pair_bits(mix32(h + (kv >> 1) * u(DROPOUT_KEY_MULT)), kv) >= u(dropout_threshold(rate))


def pair_bits(h: jax.Array, kv: jax.Array) -> jax.Array:
    """The 16 bits of a key pair's hash h (uint32) that decide key kv (any integer dtype): the
    low half for even keys, the high half for odd ones."""
    return jnp.where((kv & 1) == 1, h >> 16, h & jnp.uint32(0xFFFF))
