"""Segments -> what cuDNN is told: the sequence arrays of one cuDNN call (part of `cudnn`).

cuDNN takes padding as lengths [B], and packed rows as lengths [B, M] with segment *starts*
[B, M + 1] (not cumulative lengths), -1 in unused slots. These are derived in-graph from the
one mask form (segment ids), correct by construction and checked whenever they are concrete:
a malformed offsets array crashes the process with an illegal memory access.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flashmesh.attention.sequence import concrete


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sequences:
    """The sequence arguments of one cuDNN call and which rows it computes (None = not used).

    q_seqlen, kv_seqlen: int32 [B] (padding) or [B, M] (packed, -1 = unused slot).
    q_offsets, kv_offsets: int32 [B, M + 1], segment starts, -1 = unused (packed only).
    q_valid: bool [B|1, T], kv_valid: bool [B, S]: rows cuDNN computes; the rest are zeroed.
    stats_index: int32 [B, T]: where a token's statistic lies in the flat [B*M*T] statistics
      of one head (packed only).
    q_bad: bool [B, T]: queries whose segments cuDNN cannot express (traced ids only), NaN.
    """

    q_seqlen: jax.Array | None = None
    kv_seqlen: jax.Array | None = None
    q_offsets: jax.Array | None = None
    kv_offsets: jax.Array | None = None
    q_valid: jax.Array | None = None
    kv_valid: jax.Array | None = None
    stats_index: jax.Array | None = None
    q_bad: jax.Array | None = None


def padding_sequences(q_ids, kv_ids, window_left: int | None) -> Sequences:
    """Padding rows ([1, 1, ..., 0, 0] ids): lengths [B]. Rows that would see no key (no keys
    at all, or a causal window that ends before the keys do) are cut off as padding."""
    T, S = q_ids.shape[1], kv_ids.shape[1]
    q_len = jnp.sum(q_ids != 0, axis=1, dtype=jnp.int32)
    kv_len = jnp.sum(kv_ids != 0, axis=1, dtype=jnp.int32)
    if window_left is not None:  # query i sees keys [i - left, i]: none once i >= kv_len + left
        q_len = jnp.minimum(q_len, kv_len + window_left)
    q_len = jnp.where(kv_len > 0, q_len, 0)
    kv_len = jnp.where(q_len > 0, kv_len, 0)
    return Sequences(q_seqlen=q_len, kv_seqlen=kv_len,
                     q_valid=jnp.arange(T, dtype=jnp.int32)[None] < q_len[:, None],
                     kv_valid=jnp.arange(S, dtype=jnp.int32)[None] < kv_len[:, None])


def trimmed_sequences(B: int, T: int, S: int, window_left: int) -> Sequences:
    """No segments, but queries i >= S + left see no key through a causal window: cut them."""
    return Sequences(q_seqlen=jnp.full((B,), S + window_left, jnp.int32),
                     kv_seqlen=jnp.full((B,), S, jnp.int32),
                     q_valid=(np.arange(T) < S + window_left)[None])


def _runs(ids, M: int):
    """Runs of equal nonzero ids per row. Per token: run index r and offset p inside the run.
    Per run slot m < M: first token, length, id. Comparisons against m fuse into reductions."""
    L = ids.shape[1]
    idx = jnp.arange(L, dtype=jnp.int32)
    prev = jnp.pad(ids[:, :-1], ((0, 0), (1, 0)))
    start = (ids != 0) & (ids != prev)
    r = jnp.cumsum(start, axis=1, dtype=jnp.int32) - 1
    p = idx[None] - jax.lax.cummax(jnp.where(start, idx[None], 0), axis=1)
    mine = (r[:, None, :] == jnp.arange(M, dtype=jnp.int32)[None, :, None]) & (ids != 0)[:, None, :]
    first = jnp.min(jnp.where(mine, idx, L), axis=2)
    length = jnp.sum(mine, axis=2, dtype=jnp.int32)
    seg_id = jnp.max(jnp.where(mine, ids[:, None, :], 0), axis=2)
    return r, p, first, length, seg_id


def packed_sequences(q_ids, kv_ids, max_segments: int, window_left: int | None) -> Sequences:
    """Packed rows: slot m = the m-th run of equal query ids, paired with the keys of that id.

    cuDNN runs each slot as its own sequence (positions from the slot's start). It cannot
    express a query id whose keys are not one contiguous run, a query id repeated in two runs
    (their key gradients would overwrite each other), or more than max_segments runs: concrete
    ids raise; traced ids make those queries NaN instead of silently wrong.
    """
    B, T = q_ids.shape
    S = kv_ids.shape[1]
    M = max_segments
    r, p, q_first, q_len, seg_id = _runs(q_ids, M)
    kv_idx = jnp.arange(S, dtype=jnp.int32)
    match = (kv_ids[:, None, :] == seg_id[:, :, None]) & (seg_id > 0)[:, :, None]  # [B, M, S]
    kv_len = jnp.sum(match, axis=2, dtype=jnp.int32)
    kv_first = jnp.min(jnp.where(match, kv_idx, S), axis=2)
    kv_last = jnp.max(jnp.where(match, kv_idx, -1), axis=2)
    slot = jnp.arange(M)
    earlier = (seg_id[:, :, None] == seg_id[:, None, :]) & (slot[:, None] > slot[None, :])[None]
    repeated = jnp.any(earlier & (q_len > 0)[:, None, :], axis=2)
    live = (q_len > 0) & (kv_len > 0)  # a slot without keys is a fully masked segment: zeros
    bad = live & (repeated | (kv_last - kv_first + 1 != kv_len))
    used = live & ~bad
    q_eff = q_len if window_left is None else jnp.minimum(q_len, kv_len + window_left)

    # cuDNN takes the ragged path only with > 1 slot per row; extra slots stay unused (-1).
    pad = max(M, 2) - M + 1

    def slots(x, last_column: bool):
        x = jnp.where(used, x, -1).astype(jnp.int32)
        return jnp.pad(x, ((0, 0), (0, pad - (0 if last_column else 1))), constant_values=-1)

    used_all = jnp.pad(used, ((0, 0), (0, pad - 1)))
    j = (jnp.cumsum(used_all.reshape(-1), dtype=jnp.int32) - 1).reshape(used_all.shape)
    rc = jnp.clip(r, 0, M - 1)
    tok = lambda table: jnp.take_along_axis(table, rc, axis=1)  # noqa: E731
    in_slot = (q_ids != 0) & (r < M)
    q_valid = in_slot & tok(used) & (p < tok(q_eff))
    overflow = (q_ids != 0) & (r >= M)
    seqs = Sequences(
        q_seqlen=slots(q_eff, False), kv_seqlen=slots(kv_len, False),
        q_offsets=slots(q_first, True), kv_offsets=slots(kv_first, True),
        q_valid=q_valid,
        kv_valid=jnp.any(match & used[:, :, None], axis=1),
        stats_index=jnp.where(q_valid, jnp.take_along_axis(j, rc, axis=1) * T + p, 0),
        q_bad=overflow | (in_slot & tok(bad)))
    if _validate(seqs, overflow, bad, seg_id, M, T, S):
        seqs = dataclasses.replace(seqs, q_bad=None)  # checked: nothing to poison
    return seqs


def _validate(seqs: Sequences, overflow, bad, seg_id, M: int, T: int, S: int) -> bool:
    """Concrete ids: refuse what cuDNN cannot express, and check the ragged arrays (a bad one
    is an illegal memory access, which kills the process instead of raising). Returns whether
    the arrays were concrete (and so checked)."""
    values = [concrete(x) for x in (overflow, bad, seg_id, seqs.q_seqlen, seqs.kv_seqlen,
                                    seqs.q_offsets, seqs.kv_offsets)]
    if any(x is None for x in values):
        return False
    overflow, bad, seg_id, q_len, kv_len, q_off, kv_off = values
    if overflow.any():
        b = int(np.argwhere(overflow)[0, 0])
        raise ValueError(f"max_segments={M} is smaller than the number of segments in row {b}")
    if bad.any():
        b, m = (int(i) for i in np.argwhere(bad)[0])
        raise NotImplementedError(
            f"cuDNN needs each segment id to be one contiguous run of queries and one of keys; "
            f"segment id {seg_id[b, m]} of row {b} is not")
    for name, lens, offs, length in (("q", q_len, q_off, T), ("kv", kv_len, kv_off, S)):
        used = lens >= 0
        ok = ((used == (offs[:, :-1] >= 0)).all() and (offs[:, -1] == -1).all()
              and (used == (q_len >= 0)).all() and (lens[used] >= 1).all()
              and (offs[:, :-1][used] + lens[used] <= length).all())
        if not ok:
            raise RuntimeError(f"flashmesh bug: malformed cuDNN {name} seqlens {lens.tolist()} / "
                               f"offsets {offs.tolist()} for length {length}")
    return True
