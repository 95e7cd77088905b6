"""`parallel/schedule.py`: pair counts and K/V needs equal a brute-force O(T*S) oracle on random
owners, positions, ids and windows; the static schedule gives the halo hop counts, dual-chunk's
exact causal balance, and key ranges equal to the oracle's."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashmesh.parallel import layouts, schedule


def visible(q_pos, kv_pos, q_ids, kv_ids, window):
    """Oracle: bool [B, T, S] from the definition."""
    left, right = window
    d = q_pos[:, :, None] - kv_pos[:, None, :]
    vis = (q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids != 0)[:, :, None]
    if left >= 0:
        vis &= d <= left
    if right >= 0:
        vis &= d >= -right
    return vis


def oracle(vis, q_owner, kv_owner, cp):
    qo = np.eye(cp, dtype=np.int64)[q_owner]  # [T, cp]
    ko = np.eye(cp, dtype=np.int64)[kv_owner]  # [S, cp]
    counts = np.einsum("bts,tr,su->ru", vis.astype(np.int64), qo, ko)
    seen_by = np.einsum("bts,tr->bsr", vis.astype(np.int64), qo) > 0  # key s seen by rank r
    needed = np.einsum("bsr,su->ru", seen_by.astype(np.int64), ko)
    return counts, needed


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**20), cp=st.integers(1, 4), B=st.integers(1, 3),
       T=st.integers(1, 24), S=st.integers(1, 24), left=st.integers(-1, 8), right=st.integers(-1, 8),
       segments=st.booleans(), pos_spread=st.integers(1, 40))
def test_counts_match_brute_force(seed, cp, B, T, S, left, right, segments, pos_spread):
    rng = np.random.default_rng(seed)
    q_owner, kv_owner = rng.integers(0, cp, T), rng.integers(0, cp, S)
    q_pos, kv_pos = rng.integers(-5, pos_spread, (B, T)), rng.integers(-5, pos_spread, (B, S))
    q_ids = rng.integers(0, 4, (B, T)) if segments else np.ones((B, T), np.int64)
    kv_ids = rng.integers(0, 4, (B, S)) if segments else np.ones((B, S), np.int64)
    kw = dict(window=(left, right), q_positions=q_pos, kv_positions=kv_pos,
              q_segment_ids=q_ids if segments else None, kv_segment_ids=kv_ids if segments else None)
    want_counts, want_needed = oracle(visible(q_pos, kv_pos, q_ids, kv_ids, (left, right)),
                                      q_owner, kv_owner, cp)
    np.testing.assert_array_equal(schedule.pair_counts(q_owner, kv_owner, cp, **kw), want_counts)
    needed = schedule.kv_needed(q_owner, kv_owner, cp, **kw)
    np.testing.assert_array_equal(needed, want_needed)
    np.testing.assert_array_equal(schedule.received_kv(needed),
                                  want_needed.sum(1) - np.diagonal(want_needed))


STATIC = [(cp, order, ss, T, S, window, br)
          for cp in (2, 4, 8) for order, ss in (("contiguous", None), ("dual_chunk", None), ("striped", 2))
          for T, S, br in ((64, 64, False), (32, 64, True), (64, 32, True), (32, 64, False))
          for window in ((-1, 0), (5, 0), (20, 3), (-1, -1))]


@pytest.mark.parametrize("cp,order,ss,T,S,window,br", STATIC)
def test_static_schedule_matches_oracle(cp, order, ss, T, S, window, br):
    sched = schedule.static_schedule(cp, order, T, S, window=window, bottom_right=br, stripe_size=ss)
    q_pos = np.arange(T)[None] + (S - T if br else 0)
    vis = visible(q_pos, np.arange(S)[None], np.ones((1, T)), np.ones((1, S)), window)
    qo, ko = layouts.token_owner(order, cp, T, ss), layouts.token_owner(order, cp, S, ss)
    counts, _ = oracle(vis, qo, ko, cp)
    np.testing.assert_array_equal(sched.counts, counts)
    np.testing.assert_array_equal(sched.work, counts.sum(1))
    r = np.arange(cp)
    hops = tuple(d for d in range(cp) if d == 0 or counts[r, (r - d) % cp].any())
    assert sched.ring_hops == hops
    for rank in range(cp):
        keys = np.flatnonzero(vis[0][qo == rank].any(axis=0))
        want = (int(keys.min()), int(keys.max()) + 1) if keys.size else (0, 0)
        assert sched.key_ranges[rank] == want, (rank, sched.key_ranges[rank], want)
    hash(sched)  # usable as a static argument


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("W", [1, 7, 16, 17, 40, 100, 1000])
def test_window_halo_hops(cp, W):
    T = 16 * cp
    L = T // cp
    sched = schedule.static_schedule(cp, "contiguous", T, window=(W, 0))
    n = min(cp, 1 + math.ceil(W / L))
    assert sched.ring_hops == tuple(range(n)), (W, L, sched.ring_hops)
    both = schedule.static_schedule(cp, "contiguous", T, window=(W, W))
    k = min(cp - 1, math.ceil(W / L))
    assert both.ring_hops == tuple(sorted({0, *range(1, k + 1), *range(cp - k, cp)}))


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_dual_chunk_balances_causal_exactly(cp):
    T = 2 * cp * 16
    dual = schedule.static_schedule(cp, "dual_chunk", T, window=(-1, 0))
    assert dual.balance == 1.0 and len(set(dual.work.tolist())) == 1
    contiguous = schedule.static_schedule(cp, "contiguous", T, window=(-1, 0))
    assert contiguous.work.sum() == dual.work.sum() == T * (T + 1) // 2
    assert cp == 1 or contiguous.balance > 1.4  # (2cp-1)/cp of the mean, roughly
    assert schedule.static_schedule(cp, "striped", T, window=(-1, 0)).balance < 1.1


@pytest.mark.parametrize("window", [(-1, 0), (3, 0), (-1, -1), (2, 2)])
def test_packed_counts_match_brute_force(window):
    rng = np.random.default_rng(sum(window) + 7)
    ids = np.repeat(rng.integers(0, 3, (2, 10)), rng.integers(1, 5, 10), axis=1)  # runs of ids
    owner = rng.integers(0, 3, ids.shape[1])
    pos = schedule.segment_positions(ids)
    want_pairs, want_needed = oracle(visible(pos, pos, ids, ids, window), owner, owner, 3)
    pairs, needed = schedule.packed_counts(ids, owner, 3, window=window)
    np.testing.assert_array_equal(pairs, want_pairs)
    np.testing.assert_array_equal(needed, want_needed)


def test_static_schedule_normalises_and_caches():
    a = schedule.static_schedule(4, "contiguous", 64, window=[8, 0])  # a list is fine
    assert a.window == (8, 0) and a is schedule.static_schedule(4, "contiguous", 64, 64, window=(8, 0))


def test_segment_positions():
    ids = np.array([[1, 1, 2, 2, 2, 0, 0, 3], [0, 4, 4, 4, 4, 4, 4, 4]])
    np.testing.assert_array_equal(schedule.segment_positions(ids),
                                  [[0, 1, 0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4, 5, 6]])


def test_ring_hops_keep_step_zero():
    assert schedule.ring_hops(np.zeros((4, 4), np.int64)) == (0,)
    counts = np.zeros((4, 4), np.int64)
    counts[3, 1] = 1  # rank 3 meets rank 1 at step 2
    assert schedule.ring_hops(counts) == (0, 2)


@pytest.mark.parametrize("call,match", [
    (lambda: schedule.static_schedule(4, "contiguous", 64, window=(-2, 0)), r"window entries must be >= -1"),
    (lambda: schedule.static_schedule(4, "contiguous", 64, window=5), r"window must be a pair"),
    (lambda: schedule.static_schedule(4, "dual_chunk", 64, 36),
     r"kv_len=36 must be a multiple of 2 \* cp_size=8"),
    (lambda: schedule.static_schedule(4, "striped", 36, stripe_size=2), r"q_len=36 must be a multiple"),
    (lambda: schedule.pair_counts(np.array([0, 5]), np.array([0, 1]), 2),
     r"owners must lie in \[0, cp_size=2\)"),
    (lambda: schedule.pair_counts(np.zeros(3, int), np.zeros(3, int), 1, q_positions=np.zeros(4)),
     r"must broadcast"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)
