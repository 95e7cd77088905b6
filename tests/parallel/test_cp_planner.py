"""`parallel/planner.py`: TE's tutorial workload stays contiguous (balance 1.0, no K/V moves);
random packed batches with long-tail documents get a valid chunk permutation within 3% balance,
whose reported work and K/V volume equal the exact token-level counts."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashmesh.parallel import planner, schedule
from flashmesh.parallel.planner import plan_context_parallel


def tutorial_ids(B=2, T=1024, slots=4, valid=192):
    """TE's CP tutorial (4 slots of 16384, 12288 valid) scaled to T: ids 1..slots, then padding."""
    slot = T // slots
    row = np.concatenate([np.repeat([s + 1, 0], [valid, slot - valid]) for s in range(slots)])
    return np.tile(row, (B, 1))


def long_tail_ids(rng, B, T):
    """Rows packed with Pareto-length documents (many short, a few long), some padding gaps."""
    rows = []
    for _ in range(B):
        parts, doc = [], 1
        while sum(p.size for p in parts) < T:
            parts.append(np.full(int(min(T, 8 + 40 * rng.pareto(1.2))), doc))
            doc += 1
            if rng.random() < 0.2:
                parts.append(np.zeros(int(rng.integers(1, 30)), np.int64))
        rows.append(np.concatenate(parts)[:T])
    return np.stack(rows)


def exact(ids, owner, cp, window):
    pos = schedule.segment_positions(ids)
    kw = dict(window=window, q_positions=pos, kv_positions=pos, q_segment_ids=ids, kv_segment_ids=ids)
    work = schedule.pair_counts(owner, owner, cp, **kw).sum(1)
    return work, schedule.received_kv(schedule.kv_needed(owner, owner, cp, **kw))


@pytest.mark.parametrize("window", [(-1, 0), (128, 0), (-1, -1)])
def test_tutorial_workload_stays_contiguous(window):
    plan = plan_context_parallel(tutorial_ids(), 4, window=window)
    assert plan.order == "contiguous" and plan.balance == 1.0
    assert plan.kv_volume.tolist() == [0, 0, 0, 0]
    np.testing.assert_array_equal(plan.permutation, np.arange(1024))
    assert "contiguous order over cp=4: balance 1.000" in plan.describe()


def check_plan(plan, ids, cp, window):
    T = ids.shape[1]
    assert np.array_equal(np.sort(plan.permutation), np.arange(T))  # a permutation
    np.testing.assert_array_equal(plan.permutation[plan.inverse], np.arange(T))
    work, kv = exact(ids, plan.owner, cp, window)
    np.testing.assert_array_equal(plan.work, work)
    np.testing.assert_array_equal(plan.kv_volume, kv)
    assert plan.balance == pytest.approx(work.max() / work.mean())
    # Rank r holds x[:, permutation][:, r*L:(r+1)*L]: the same work, counted on reordered arrays.
    L = T // cp
    reordered = ids[:, plan.permutation]
    owner = np.arange(T) // L
    pos = schedule.segment_positions(ids)[:, plan.permutation]
    counts = schedule.pair_counts(owner, owner, cp, window=window, q_positions=pos, kv_positions=pos,
                                  q_segment_ids=reordered, kv_segment_ids=reordered)
    np.testing.assert_array_equal(counts.sum(1), plan.work)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**20), cp=st.sampled_from([2, 4]),
       window=st.sampled_from([(-1, 0), (64, 0), (-1, -1)]))
def test_random_packed_batches_balance(seed, cp, window):
    ids = long_tail_ids(np.random.default_rng(seed), 2, 1024)
    plan = plan_context_parallel(ids, cp, window=window, chunk_size=16)
    check_plan(plan, ids, cp, window)
    assert plan.balance <= 1.03, plan.describe()
    if plan.order == "permuted":
        assert plan.contiguous_balance > 1.03
        chunks = plan.permutation.reshape(-1, 16)  # whole chunks move
        np.testing.assert_array_equal(chunks - chunks[:, :1], np.broadcast_to(np.arange(16), chunks.shape))


def test_one_long_causal_document_is_balanced():
    ids = np.ones((1, 512), np.int64)
    plan = plan_context_parallel(ids, 4, chunk_size=8)
    assert plan.order == "permuted" and plan.balance <= 1.03
    check_plan(plan, ids, 4, (-1, 0))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunk_model_is_exact(seed):
    rng = np.random.default_rng(seed)
    ids, cp, C, window = long_tail_ids(rng, 2, 256), 4, 8, (40, 0)
    search = planner._Search(*planner._chunk_model(ids, window, C), cp, 1.03)
    for _ in range(3):
        assign = rng.permutation(np.arange(search.n) % cp)
        excess, recv = search.score(assign)
        work, kv = exact(ids, np.repeat(assign, C), cp, window)
        np.testing.assert_array_equal(recv, kv)
        assert excess == pytest.approx(np.maximum(work - search.cap, 0).sum())
        # Every swap's predicted changes are what the swap then scores.
        i, j, d_excess, d_kv = search.swaps(assign)
        for k in rng.choice(i.size, 10, replace=False):
            swapped = assign.copy()
            swapped[[i[k], j[k]]] = assign[[j[k], i[k]]]
            e2, r2 = search.score(swapped)
            assert d_kv[k] == r2.sum() - recv.sum()
            assert d_excess[k] == pytest.approx(e2 - excess, abs=1e-6)


@pytest.mark.parametrize("call,match", [
    (lambda: plan_context_parallel(np.ones((2, 30), int), 4),
     r"segment_ids.shape\[1\]=30 must be a multiple of cp_size=4"),
    (lambda: plan_context_parallel(np.ones((2, 32), int), 4, chunk_size=3),
     r"chunk_size must be a positive divisor of T / cp_size = 8"),
    (lambda: plan_context_parallel(np.array([[1, 1, 2, 1]]), 2),
     r"a document id appears in two separate runs"),
    (lambda: plan_context_parallel(np.array([[1, -1, 2, 2]]), 2), r"segment_ids must be >= 0"),
    (lambda: plan_context_parallel(np.ones(8, int), 2), r"segment_ids must be an integer array \[B, T\]"),
    (lambda: plan_context_parallel(np.ones((1, 8), int), 0), r"cp_size must be an integer >= 1"),
    (lambda: plan_context_parallel(np.ones((1, 8), int), 2, window=(0, -3)), r"window entries must be >= -1"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)
