"""FLOP counting against hand-computed pair counts (and a brute-force mask for random cases)."""

import itertools

import numpy as np
import pytest

from flashmesh.bench.flops import attention_flops, visible_pairs, visible_pairs_rectangle
from flashmesh.bench.shapes import Shape


def shape(T, S=None, mask="none", window=None, segments=None, B=1, N=1, K=1, D=8, Dv=None):
    return Shape("t", B=B, T=T, S=S, N=N, K=K, Dqk=D, Dv=Dv, mask=mask, window=window, segments=segments)


@pytest.mark.parametrize("s, pairs", [
    (shape(4, 6), 24),                                          # no mask: T * S
    (shape(4, 6, "causal"), 1 + 2 + 3 + 4),                      # top-left: row i sees keys 0..i
    (shape(4, 6, "causal_bottom_right"), 3 + 4 + 5 + 6),         # bottom-right: row i sees 0..i+2
    (shape(6, 4, "causal"), 1 + 2 + 3 + 4 + 4 + 4),              # T > S, top-left
    (shape(6, 4, "causal_bottom_right"), 0 + 0 + 1 + 2 + 3 + 4),  # T > S: first rows see nothing
    (shape(5, mask="causal", window=(2, 0)), 1 + 2 + 3 + 3 + 3),  # sliding window of 3 keys
    (shape(5, window=(1, 1)), 2 + 3 + 3 + 3 + 2),                # non-causal band
    (shape(5, window=(-1, 1)), 2 + 3 + 4 + 5 + 5),               # only a right bound
    (shape(10, mask="causal", segments=(3, -2, 4)), 6 + 10),      # two documents, padding between
    (shape(10, segments=(3, -2, 4)), 9 + 16),                     # segments without causal
    (shape(10, mask="causal", window=(1, 0), segments=(3, -2, 4)), (1 + 2 + 2) + (1 + 2 + 2 + 2)),
])
def test_hand_computed_pairs(s, pairs):
    assert visible_pairs(s) == pairs


def test_flops_formula():
    s = shape(4, B=2, N=3, K=3, D=8)  # 16 pairs, Dqk + Dv = 16
    assert attention_flops(s, "fwd") == 2 * 2 * 3 * 16 * 16
    assert attention_flops(s, "fwdbwd") == 3.5 * 2 * 2 * 3 * 16 * 16
    mla = shape(4, mask="causal", B=1, N=2, K=1, D=8, Dv=4)  # 10 pairs, Dqk + Dv = 12
    assert attention_flops(mla, "fwd") == 2 * 1 * 2 * 10 * 12
    with pytest.raises(ValueError, match="mode"):
        attention_flops(s, "bwd")


def test_long_sequences_closed_form():
    n, w = 1_000_000, 128
    assert visible_pairs(shape(n, mask="causal")) == n * (n + 1) // 2
    # causal window (w, 0): rows see min(i + 1, w + 1) keys
    expected = (w + 1) * (w + 2) // 2 + (n - w - 1) * (w + 1)
    assert visible_pairs(shape(n, mask="causal", window=(w, 0))) == expected
    # blocks give the same count as one pass
    one_pass = visible_pairs_rectangle(1000, 1500, (10, 3), 500)
    assert visible_pairs_rectangle(1000, 1500, (10, 3), 500, block=7) == one_pass


def brute_force(s: Shape) -> int:
    if s.segments:
        ids, pos = np.zeros(s.T, int), np.zeros(s.T, int)
        start, doc = 0, 0
        for run in s.segments:
            if run > 0:
                doc += 1
                ids[start:start + run], pos[start:start + run] = doc, np.arange(run)
            start += abs(run)
        qp, kp = pos[:, None], pos[None, :]
        ok = (ids[:, None] == ids[None, :]) & (ids[:, None] > 0)
    else:
        off = s.S - s.T if s.bottom_right else 0
        qp, kp = np.arange(s.T)[:, None] + off, np.arange(s.S)[None, :]
        ok = np.ones((s.T, s.S), bool)
    left, right = s.effective_window
    if left >= 0:
        ok &= kp >= qp - left
    if right >= 0:
        ok &= kp <= qp + right
    return int(ok.sum())


@pytest.mark.parametrize("T, S, mask, window", list(itertools.product(
    (1, 7, 33), (1, 9, 40), ("none", "causal", "causal_bottom_right"), (None, (0, 0), (3, 0), (5, 2), (-1, 4)))))
def test_against_brute_force(T, S, mask, window):
    if mask != "none" and window is not None and window[1] > 0:
        return  # causal forbids a right window
    s = shape(T, S, mask, window)
    assert visible_pairs(s) == brute_force(s)


def test_segments_against_brute_force():
    for segs in ((5,), (-3, 4, 2), (1, 1, 1, -1, 6)):
        for mask, window in (("none", None), ("causal", None), ("causal", (2, 0)), ("none", (1, 2))):
            s = shape(12, mask=mask, window=window, segments=segs)
            assert visible_pairs(s) == brute_force(s)
