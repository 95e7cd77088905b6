"""Which shards meet which: the static block sparsity of context parallelism, in plain numpy.

Shape legend: B batch, T query length, S key/value length, cp the number of ranks.

Every quantity here is computed exactly from token indices, never estimated. A token is
described by its owner (the rank holding it), its position, and its segment id (0 = padding,
which sees and is seen by nothing). Query i sees key j iff they share a nonzero segment id (when
ids are given) and, with window (left, right) (-1 = unbounded; causal is right = 0),

    -right <= pos_i - pos_j <= left.

The counting trick: map each key to one integer, `group * M + pos`, where group numbers the
(batch row, segment id) pairs and M exceeds the span of positions. Then the keys query i sees
are exactly the keys whose integer lies in [group_i*M + pos_i - left, group_i*M + pos_i + right]
(clipped to the group's band), so sorting the keys once and two `searchsorted` calls count them:
O((T + S) log S) per rank, never O(T * S) memory. The union of one rank's query intervals,
merged, likewise counts the distinct keys it needs (the K/V it must receive).

`static_schedule` applies this to the unsegmented mask of a sharded call (causal, windows,
top-left or bottom-right diagonal) and reads off what the ring and all-gather strategies need:
the (query rank, key rank) pairs with any visible pair, the ring hops that are non-empty for any
rank (step d: query rank r meets the K/V of rank (r - d) mod cp), each rank's work, and the key
range each rank's queries reach. With a causal window of W tokens and contiguous shards of L
tokens, the hops are 0 .. ceil(W / L): a halo of 1 + ceil(W / L) steps instead of cp.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from flashmesh.parallel import layouts

Window = tuple[int, int]


def check_window(window) -> Window:
    """(left, right) as ints, each >= -1; a one-line ValueError naming `window` otherwise."""
    try:
        left, right = (int(w) for w in window)
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right) of ints, got {window=}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window entries must be >= -1 (-1 = unbounded), got {window=}")
    return left, right


def segment_positions(segment_ids: np.ndarray) -> np.ndarray:
    """int64 [B, T]: each token's offset from the start of its run of equal ids (the positions
    packed documents get when each document is one contiguous run)."""
    ids = np.asarray(segment_ids)
    B, T = ids.shape
    starts = np.ones((B, T), bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    idx = np.broadcast_to(np.arange(T), (B, T))
    return idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1)


def _side(owner, positions, segment_ids, name: str):
    """One side's owner, positions and ids as int64 2-D arrays (positions default to arange)."""
    owner = np.asarray(owner, np.int64)
    if owner.ndim not in (1, 2):
        raise ValueError(f"{name} owner must be [L] or [B, L], got shape {owner.shape}")
    L = owner.shape[-1]
    pos = np.arange(L, dtype=np.int64) if positions is None else np.asarray(positions, np.int64)
    ids = np.ones(L, np.int64) if segment_ids is None else np.asarray(segment_ids, np.int64)
    return [np.atleast_2d(a) for a in (owner, pos, ids)]


def _intervals(q_owner, kv_owner, window, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    """Valid queries as (owner, lo, hi) intervals of key integers; valid keys as (owner, key)."""
    left, right = check_window(window)
    sides = (_side(q_owner, q_positions, q_segment_ids, "query"),
             _side(kv_owner, kv_positions, kv_segment_ids, "key"))
    B = max(a.shape[0] for side in sides for a in side)
    try:
        (qo, qp, qi), (ko, kp, ki) = ([np.broadcast_to(a, (B, side[0].shape[1])) for a in side]
                                      for side in sides)
    except ValueError:
        shapes = [[a.shape for a in side] for side in sides]
        raise ValueError(f"owner, positions and segment ids of queries {shapes[0]} and keys "
                         f"{shapes[1]} must broadcast to [B, T] and [B, S]") from None
    qv, kv = qi != 0, ki != 0
    lo_pos = min(qp[qv].min(initial=0), kp[kv].min(initial=0))
    M = max(qp[qv].max(initial=0), kp[kv].max(initial=0)) - lo_pos + 1
    # Dense group numbers for the (row, id) pairs, shared by queries and keys.
    rows = np.arange(B)[:, None]
    width = int(max(qi.max(initial=0), ki.max(initial=0))) + 1
    tags = np.concatenate([(rows * width + qi)[qv], (rows * width + ki)[kv]])
    group = np.unique(tags, return_inverse=True)[1].reshape(-1)
    gq, gk = group[:qv.sum()], group[qv.sum():]
    p = qp[qv] - lo_pos
    # Clipping to the group's band [0, M) keeps an interval from reaching a neighbour group.
    lo = gq * M + (np.maximum(p - left, 0) if left >= 0 else 0)
    hi = gq * M + (np.minimum(p + right, M - 1) if right >= 0 else M - 1)
    return qo[qv], lo, hi, ko[kv], gk * M + (kp[kv] - lo_pos)


def _check_owner(owner, cp_size):
    if owner.size and (owner.min() < 0 or owner.max() >= cp_size):
        raise ValueError(f"owners must lie in [0, {cp_size=}), got range "
                         f"[{owner.min()}, {owner.max()}]")


def pair_counts(q_owner, kv_owner, cp_size: int, *, window: Window = (-1, -1), q_positions=None,
                kv_positions=None, q_segment_ids=None, kv_segment_ids=None) -> np.ndarray:
    """int64 [cp, cp]: counts[r, s] = visible (query, key) pairs with the query on rank r and the
    key on rank s, summed over the batch.

    Args (each [T] / [S] or [B, T] / [B, S], broadcast against each other):
      q_owner, kv_owner: the rank holding each query / key token, in [0, cp_size).
      window: (left, right), -1 = unbounded; causal is (-1, 0).
      q_positions, kv_positions: token positions (default: the index).
      q_segment_ids, kv_segment_ids: segment ids, 0 = padding (default: one segment).
    """
    qo, lo, hi, ko, key = _intervals(q_owner, kv_owner, window, q_positions, kv_positions,
                                     q_segment_ids, kv_segment_ids)
    _check_owner(qo, cp_size)
    _check_owner(ko, cp_size)
    counts = np.zeros((cp_size, cp_size), np.int64)
    for s in range(cp_size):
        keys = np.sort(key[ko == s])
        seen = np.searchsorted(keys, hi, "right") - np.searchsorted(keys, lo, "left")
        counts[:, s] = np.bincount(qo, weights=seen, minlength=cp_size).astype(np.int64)
    return counts


def kv_needed(q_owner, kv_owner, cp_size: int, *, window: Window = (-1, -1), q_positions=None,
              kv_positions=None, q_segment_ids=None, kv_segment_ids=None) -> np.ndarray:
    """int64 [cp, cp]: needed[r, s] = distinct keys held by rank s that at least one query on
    rank r sees, summed over the batch (arguments as `pair_counts`). Off the diagonal, this is
    the K/V that rank r must receive from rank s; `received_kv(needed)` sums it per rank."""
    qo, lo, hi, ko, key = _intervals(q_owner, kv_owner, window, q_positions, kv_positions,
                                     q_segment_ids, kv_segment_ids)
    _check_owner(qo, cp_size)
    _check_owner(ko, cp_size)
    needed = np.zeros((cp_size, cp_size), np.int64)
    sorted_keys = [np.sort(key[ko == s]) for s in range(cp_size)]
    for r in range(cp_size):
        a, b = lo[qo == r], hi[qo == r]
        if a.size == 0:
            continue
        order = np.argsort(a, kind="stable")
        a, b = a[order], b[order]
        # Merge overlapping intervals: a new one starts where lo passes every earlier hi.
        reach = np.maximum.accumulate(b)
        start = np.concatenate([[True], a[1:] > reach[:-1]])
        ends = np.concatenate([np.flatnonzero(start)[1:] - 1, [a.size - 1]])
        a, b = a[start], reach[ends]
        for s, keys in enumerate(sorted_keys):
            needed[r, s] = (np.searchsorted(keys, b, "right") - np.searchsorted(keys, a, "left")).sum()
    return needed


def packed_counts(segment_ids, owner, cp_size: int, *, window: Window, positions=None):
    """(pairs [cp, cp], needed [cp, cp]) of self-attention over packed rows: `pair_counts` and
    `kv_needed` with queries and keys both the tokens of segment_ids [B, T] (0 = padding),
    `owner` [T] or [B, T] the rank of each token and positions [B, T] (default: offsets from
    each run's start, `segment_positions`). pairs.sum(1) is each rank's work."""
    ids = np.asarray(segment_ids)
    if ids.ndim != 2:
        raise ValueError(f"segment_ids must be [B, T], got shape {ids.shape}")
    pos = segment_positions(ids) if positions is None else positions
    kw = dict(window=window, q_positions=pos, kv_positions=pos, q_segment_ids=ids, kv_segment_ids=ids)
    return pair_counts(owner, owner, cp_size, **kw), kv_needed(owner, owner, cp_size, **kw)


def received_kv(needed: np.ndarray) -> np.ndarray:
    """int64 [cp]: K/V tokens each rank receives from the others (row sums off the diagonal)."""
    needed = np.asarray(needed)
    return needed.sum(axis=1) - np.diagonal(needed)


def ring_hops(counts: np.ndarray) -> tuple[int, ...]:
    """The ring steps d (query rank r meets the K/V of rank (r - d) mod cp) that have a visible
    pair on at least one rank, ascending. Step 0 (the local block) is always kept, so a rank
    with all-empty steps still writes its (empty) result."""
    counts = np.asarray(counts)
    cp = counts.shape[0]
    r = np.arange(cp)
    return tuple(d for d in range(cp) if d == 0 or counts[r, (r - d) % cp].any())


def key_range(q_positions, kv_len: int, window: Window) -> tuple[int, int]:
    """Half-open (start, stop) hull of the key indices (positions 0..kv_len-1, no segments) that
    queries at `q_positions` reach; (0, 0) when they reach none."""
    left, right = check_window(window)
    p = np.asarray(q_positions, np.int64)
    lo = np.maximum(p - left, 0) if left >= 0 else np.zeros_like(p)
    hi = np.minimum(p + right, kv_len - 1) if right >= 0 else np.full_like(p, kv_len - 1)
    ok = lo <= hi
    return (int(lo[ok].min()), int(hi[ok].max()) + 1) if ok.any() else (0, 0)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The static plan of one sharded call without segments. Hashable (tuples only), so it can
    be a static argument. `pairs[r][s]` is the number of visible pairs between query shard r and
    key shard s; `key_ranges[r]` the (start, stop) keys, in original order, that rank r's
    queries reach (the slice of the gathered K/V the all_gather strategy attends to)."""

    cp_size: int
    order: str
    stripe_size: int | None
    q_len: int
    kv_len: int
    window: Window
    bottom_right: bool
    pairs: tuple[tuple[int, ...], ...]
    key_ranges: tuple[tuple[int, int], ...]

    @property
    def counts(self) -> np.ndarray:
        return np.asarray(self.pairs, np.int64)

    @property
    def visible(self) -> np.ndarray:
        """bool [cp, cp]: whether query shard r and key shard s share any visible pair."""
        return self.counts > 0

    @property
    def ring_hops(self) -> tuple[int, ...]:
        return ring_hops(self.counts)

    @property
    def work(self) -> np.ndarray:
        """int64 [cp]: visible pairs per query rank (the attention work it does)."""
        return self.counts.sum(axis=1)

    @property
    def balance(self) -> float:
        """max / mean of `work` (1.0 is perfect; 1.0 when there is no work at all)."""
        w = self.work
        return float(w.max() / w.mean()) if w.sum() else 1.0


def static_schedule(cp_size: int, order: str, q_len: int, kv_len: int | None = None, *,
                    window: Window = (-1, -1), bottom_right: bool = False,
                    stripe_size: int | None = None) -> Schedule:
    """The `Schedule` of q [B, T, ...] and k/v [B, S, ...] sharded over cp_size ranks in `order`.

    Args:
      cp_size, order, stripe_size: as `layouts.reorder_for_context_parallel`; q and k/v are both
        laid out in `order` (each along its own length).
      q_len, kv_len: T and S (kv_len defaults to q_len).
      window: (left, right), -1 = unbounded; causal is (-1, 0).
      bottom_right: with T != S, query i sits at position i + S - T (else at i).

    Example: static_schedule(4, "contiguous", 1024, window=(100, 0)).ring_hops == (0, 1):
    shards of 256 tokens and a 100-token causal window need only the left neighbour.
    """
    kv_len = q_len if kv_len is None else kv_len
    stripe_size = layouts.check_order(order, cp_size, q_len, stripe_size, length_name="q_len")
    layouts.check_order(order, cp_size, kv_len, stripe_size, length_name="kv_len")
    return _static_schedule(int(cp_size), order, int(q_len), int(kv_len), check_window(window),
                            bool(bottom_right), stripe_size)


@functools.lru_cache(maxsize=256)  # traced calls ask again for every jit; the answer is static
def _static_schedule(cp_size, order, q_len, kv_len, window, bottom_right, stripe_size) -> Schedule:
    q_pos = np.arange(q_len) + (kv_len - q_len if bottom_right else 0)
    q_owner = layouts.token_owner(order, cp_size, q_len, stripe_size)
    kv_owner = layouts.token_owner(order, cp_size, kv_len, stripe_size)
    counts = pair_counts(q_owner, kv_owner, cp_size, window=window, q_positions=q_pos)
    ranges = tuple(key_range(q_pos[q_owner == r], kv_len, window) for r in range(cp_size))
    return Schedule(cp_size, order, stripe_size, q_len, kv_len, window, bottom_right,
                    tuple(tuple(int(c) for c in row) for row in counts), ranges)
