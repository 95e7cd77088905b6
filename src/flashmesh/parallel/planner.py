"""A host-side planner for packed batches: which tokens each context-parallel rank holds.

Shape legend: B batch rows, T tokens per row, cp ranks, L = T / cp tokens per rank, C chunk size.

Input: segment ids [B, T] (numpy; 0 = padding; each document one contiguous run of one nonzero
id, positions counted from the run's start) and the mask's window (causal by default). Work is
counted in visible (query, key) pairs, which is what attention kernels that skip empty tiles
pay; a rank's work is the pairs of the queries it holds. K/V volume is the number of distinct
key tokens a rank's queries see that live on other ranks (what it must receive).

The algorithm:

1. Contiguous first. If every rank's work under the contiguous split is within `tolerance`
   (default 3%) of the mean, keep it: no data movement at load time, and documents that align
   with shard boundaries then need no K/V exchange at all (TransformerEngine's tutorial workload).
2. Otherwise cut the row into n = T / C chunks and give each rank n / cp of them (equal token
   counts, so the arrays still shard evenly). For chunk-level assignments both quantities are
   exact and cheap: a chunk's work does not depend on where it goes, and a key j is needed by
   rank r iff r holds a chunk of the query range that sees j. That range is an interval (one
   document, positions increasing), so keys collapse into U (key chunk, first query chunk, last
   query chunk) triples with multiplicities; a rank needs a triple's keys iff it holds a chunk
   of its range and not its key chunk.
3. Local search by swapping two chunks of different ranks, all swaps scored at once
   (vectorised, O(n^2 U) per step, so meant for up to a few hundred chunks). While a rank is
   above the cap (tolerance x mean work) a step takes the swap that pays the fewest K/V tokens
   per unit of excess work removed; once all are under it, the swap that cuts the total K/V
   volume most without leaving the cap; it stops when no swap helps. Swaps on disjoint rank
   pairs do not interact, so a step applies the best one and then the best on untouched ranks.
   The search starts from the contiguous split (least K/V to begin with) and, only if that
   ends above the cap, from a snake (chunk c to rank c mod cp, reversed every other round: it
   balances long causal documents) and from LPT (heaviest chunk first to the least-loaded rank
   with room). The first feasible result is returned, else the one with the least excess.

The plan's `permutation` is applied at data loading, to every per-token array alike (tokens,
labels, segment ids, positions): `x_reordered = x[:, plan.permutation]`; rank r then holds
x_reordered[:, r*L:(r+1)*L], and `y[:, plan.inverse]` restores the original order. Its balance
and K/V volume are recomputed exactly, token by token, by `schedule.packed_counts`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flashmesh.parallel import schedule


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """permutation, inverse: int64 [T]; order: "contiguous" or "permuted"; work: visible pairs
    per rank [cp]; balance: max / mean work; kv_volume: K/V tokens each rank receives [cp]
    (summed over the batch); the contiguous_* fields are the contiguous split's, for reference."""

    permutation: np.ndarray
    inverse: np.ndarray
    order: str
    cp_size: int
    chunk_size: int | None
    work: np.ndarray
    balance: float
    kv_volume: np.ndarray
    contiguous_balance: float
    contiguous_kv_volume: np.ndarray

    @property
    def owner(self) -> np.ndarray:
        """int64 [T]: the rank holding each original token."""
        return self.inverse // (self.permutation.size // self.cp_size)

    def describe(self) -> str:
        chunks = "" if self.chunk_size is None else f", chunks of {self.chunk_size} tokens"
        return (f"{self.order} order over cp={self.cp_size}{chunks}: balance {self.balance:.3f} "
                f"(max/mean visible pairs; contiguous {self.contiguous_balance:.3f}), K/V received "
                f"per rank {self.kv_volume.tolist()} tokens (total {int(self.kv_volume.sum())}; "
                f"contiguous {int(self.contiguous_kv_volume.sum())})")


def _documents(ids: np.ndarray):
    """Per token: its document's start and stop (column indices), and whether it is valid."""
    B, T = ids.shape
    starts = np.ones((B, T), bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    rows, cols = np.nonzero(starts & (ids != 0))
    tags = rows * (int(ids.max()) + 1) + ids[rows, cols]
    if np.unique(tags).size != tags.size:
        raise ValueError("segment_ids: a document id appears in two separate runs of one row; "
                         "the planner needs each document as one contiguous run")
    col = np.broadcast_to(np.arange(T), (B, T))
    start = np.maximum.accumulate(np.where(starts, col, 0), axis=1)
    ends = np.ones((B, T), bool)
    ends[:, :-1] = starts[:, 1:]
    stop = np.minimum.accumulate(np.where(ends, col + 1, T)[:, ::-1], axis=1)[:, ::-1]
    return start, stop, ids != 0


def _chunk_model(ids: np.ndarray, window, C: int):
    """Chunk work [n] and the key triples (key chunk, first, last query chunk, count)."""
    left, right = window
    start, stop, valid = _documents(ids)
    col = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    # Query i sees keys [i - left, i + right] of its document; key j is seen by [j - right, j + left].
    k_lo = start if left < 0 else np.maximum(start, col - left)
    k_hi = stop - 1 if right < 0 else np.minimum(stop - 1, col + right)
    q_lo = start if right < 0 else np.maximum(start, col - right)
    q_hi = stop - 1 if left < 0 else np.minimum(stop - 1, col + left)
    n = ids.shape[1] // C
    work = np.bincount((col // C)[valid], weights=(k_hi - k_lo + 1)[valid], minlength=n)
    triples = np.stack([(col // C)[valid], (q_lo // C)[valid], (q_hi // C)[valid]])
    triples, count = np.unique(triples, axis=1, return_counts=True)
    return work.astype(np.int64), triples, count


class _Search:
    """Scores assignments (chunk -> rank) and all their two-chunk swaps at once.

    Arrays over the U key triples: inside[c, u] = chunk c lies in triple u's query range;
    keys_of[c, u] = the triple's key count if its key chunk is c. Float32, exact for counts
    below 2**24, so the products run in BLAS.
    """

    def __init__(self, work, triples, count, cp, tolerance):
        kc, a, b = triples
        self.work, self.kc, self.count = work.astype(float), kc, count.astype(np.float32)
        self.cp, self.n = cp, work.size
        self.cap = tolerance * work.sum() / cp
        c = np.arange(self.n)[:, None]
        self.inside = ((a[None] <= c) & (c <= b[None])).astype(np.float32)
        self.keys_of = np.where(kc[None] == c, self.count[None], 0).astype(np.float32)

    def _loads(self, assign):
        return np.bincount(assign, weights=self.work, minlength=self.cp)

    def _tables(self, assign):
        """held [cp, U]: chunks of rank r in each range; foreign [cp, U]: key count of the
        triples whose key chunk is not on rank r."""
        on = (assign[None] == np.arange(self.cp)[:, None]).astype(np.float32)
        return on @ self.inside, (1 - on) @ self.keys_of

    def score(self, assign):
        """(excess work over the cap summed over ranks, K/V received per rank [cp])."""
        held, foreign = self._tables(assign)
        return np.maximum(self._loads(assign) - self.cap, 0).sum(), ((held > 0.5) * foreign).sum(1)

    def swaps(self, assign, only_overloaded: bool = False):
        """Every swap of two chunks on different ranks, (i, j, change of excess, change of total
        K/V); with only_overloaded, just those touching a rank above the cap."""
        loads = self._loads(assign)
        i, j = np.triu_indices(self.n, 1)
        keep = assign[i] != assign[j]
        if only_overloaded:  # only a swap touching an overloaded rank can lower the excess
            over = loads > self.cap
            keep &= over[assign[i]] | over[assign[j]]
        i, j = i[keep], j[keep]
        ra, rb = assign[i], assign[j]
        dw = self.work[j] - self.work[i]  # load change of rank ra (rb gets -dw)
        f = lambda x: np.maximum(x - self.cap, 0)  # noqa: E731
        d_excess = f(loads[ra] + dw) + f(loads[rb] - dw) - f(loads[ra]) - f(loads[rb])
        # Only ranks ra and rb change what they hold, and the swapped key chunks change owner
        # between them only, so the K/V of every other rank is unchanged. After the swap, ra
        # holds one chunk less in i's ranges and one more in j's; i's keys become foreign to ra
        # and j's become its own (and the reverse for rb).
        held, foreign = self._tables(assign)
        gain = self.inside[j] - self.inside[i]
        moved = self.keys_of[i] - self.keys_of[j]
        new = (((held[ra] + gain) > 0.5) * (foreign[ra] + moved)).sum(1) + (
            ((held[rb] - gain) > 0.5) * (foreign[rb] - moved)).sum(1)
        old = ((held > 0.5) * foreign).sum(1)
        return i, j, d_excess, new - old[ra] - old[rb]

    def step(self, assign):
        """Swaps to apply now, under the rule in the module docstring: the best one, then the
        best of those on other rank pairs, and so on (swaps on disjoint rank pairs do not
        interact: each changes only its two ranks' work and K/V)."""
        overloaded = self.score(assign)[0] > 1e-9
        i, j, d_excess, d_kv = self.swaps(assign, only_overloaded=overloaded)
        if overloaded:  # fewest K/V tokens paid per unit of excess work removed
            ok = d_excess < -1e-9
            cost = np.where(ok, d_kv / np.where(ok, -d_excess, 1.0), np.inf)
        else:  # the largest K/V cut that keeps every rank under the cap
            cost = np.where((d_excess <= 1e-9) & (d_kv < -0.5), d_kv, np.inf)
        order = np.argsort(cost, kind="stable")
        order = order[np.isfinite(cost[order])]
        pair = assign[i[order]] * self.cp + assign[j[order]]
        chosen, used = [], set()
        for k in order[np.sort(np.unique(pair, return_index=True)[1])]:  # best per rank pair
            ra, rb = int(assign[i[k]]), int(assign[j[k]])
            if ra not in used and rb not in used:
                chosen.append((int(i[k]), int(j[k])))
                used |= {ra, rb}
        return chosen

    def improve(self, assign, max_steps):
        assign = assign.copy()
        for _ in range(max_steps):
            swaps = self.step(assign)
            if not swaps:
                break
            for a, b in swaps:
                assign[[a, b]] = assign[[b, a]]
        return assign


def _seeds(work, cp):
    n = work.size
    m = n // cp
    contiguous = np.arange(n) // m
    rnd, pos = np.divmod(np.arange(n), cp)
    snake = np.where(rnd % 2 == 0, pos, cp - 1 - pos)
    lpt, loads, room = np.zeros(n, np.int64), np.zeros(cp), np.full(cp, m)
    for c in np.argsort(-work, kind="stable"):
        r = int(np.argmin(np.where(room > 0, loads, np.inf)))
        lpt[c], loads[r], room[r] = r, loads[r] + work[c], room[r] - 1
    return contiguous, snake, lpt


def _default_chunk(L: int) -> int:
    """The largest divisor of L not above L / 8: eight or more chunks per rank."""
    return max(d for d in range(1, max(1, L // 8) + 1) if L % d == 0)


def _exact(ids, owner, cp, window):
    """Exact (work per rank, K/V received per rank) of a token -> rank map, via the schedule."""
    pairs, needed = schedule.packed_counts(ids, owner, cp, window=window)
    return pairs.sum(axis=1), schedule.received_kv(needed)


def _balance(work) -> float:
    return float(work.max() / work.mean()) if work.sum() else 1.0


def plan_context_parallel(segment_ids, cp_size: int, *, window=(-1, 0), chunk_size=None,
                          tolerance: float = 1.03, max_steps: int | None = None) -> Plan:
    """Plans which tokens each of cp_size ranks holds for a packed batch (see the module doc).

    Args:
      segment_ids: int [B, T], 0 = padding, each document one contiguous run of a nonzero id.
      cp_size: the number of context-parallel ranks; T must be a multiple of it.
      window: (left, right), -1 = unbounded; (-1, 0) is causal, (-1, -1) bidirectional.
      chunk_size: tokens per chunk, a divisor of T / cp_size (default: the largest divisor not
        above T / (8 * cp_size), so each rank gets at least eight chunks).
      tolerance: the allowed max / mean work (1.03: the largest rank within 3% of the mean).
      max_steps: steps per start of the local search (default 4 * number of chunks).

    Example (TE's tutorial, scaled down: 4 slots of 256 tokens, 192 valid, cp = 4):
      ids = np.tile(np.repeat([1, 0, 2, 0, 3, 0, 4, 0], [192, 64] * 4), (2, 1))
      plan_context_parallel(ids, 4).order == "contiguous"   # balance 1.0, no K/V moves
    """
    ids = np.asarray(segment_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"segment_ids must be an integer array [B, T], got {ids.dtype} {ids.shape}")
    if ids.size and ids.min() < 0:
        raise ValueError(f"segment_ids must be >= 0 (0 = padding), got minimum {ids.min()}")
    if isinstance(cp_size, bool) or not isinstance(cp_size, (int, np.integer)) or cp_size < 1:
        raise ValueError(f"cp_size must be an integer >= 1, got {cp_size=}")
    T = ids.shape[1]
    if T % cp_size:
        raise ValueError(f"segment_ids.shape[1]={T} must be a multiple of {cp_size=}")
    if not 1.0 <= tolerance:
        raise ValueError(f"tolerance must be >= 1.0 (a max / mean ratio), got {tolerance=}")
    window = schedule.check_window(window)
    L = T // cp_size
    chunk = _default_chunk(L) if chunk_size is None else chunk_size
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1 or L % chunk:
        raise ValueError(f"chunk_size must be a positive divisor of T / cp_size = {L}, got {chunk_size=}")

    _documents(ids)  # validates the document runs before anything is planned
    identity = np.arange(T, dtype=np.int64)
    work0, kv0 = _exact(ids, identity // L, cp_size, window)
    if _balance(work0) <= tolerance:
        return Plan(identity, identity, "contiguous", cp_size, None, work0, _balance(work0), kv0,
                    _balance(work0), kv0)

    search = _Search(*_chunk_model(ids, window, chunk), cp_size, tolerance)
    steps = 4 * search.n if max_steps is None else max_steps
    results = []
    for seed in _seeds(search.work, cp_size):  # contiguous first; the others if it fails
        assign = search.improve(seed, steps)
        excess, recv = search.score(assign)
        results.append((excess > 1e-9, excess, recv.sum(), assign))
        if excess <= 1e-9:
            break
    assign = min(results, key=lambda r: r[:3])[3]
    chunks = np.arange(search.n)
    by_rank = np.concatenate([chunks[assign == r] for r in range(cp_size)])
    permutation = (by_rank[:, None] * chunk + np.arange(chunk)[None]).reshape(-1)
    inverse = np.argsort(permutation)
    work, kv = _exact(ids, inverse // L, cp_size, window)
    return Plan(permutation, inverse, "permuted", cp_size, int(chunk), work, _balance(work), kv,
                _balance(work0), kv0)
