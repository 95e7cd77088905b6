"""`parallel/merge.py` against a float64 numpy oracle: merging partials over disjoint key sets
equals softmax over their concatenation; empty rows stay exactly 0 (and at EMPTY_ROW_LSE), never
NaN, with finite gradients; the sink is folded in once and gets its gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashmesh.attention.spec import EMPTY_ROW_LSE
from flashmesh.parallel.merge import finalize_sink, merge_partials

B, T, N, H = 2, 5, 3, 4


def problem(seed, S=12, parts=2):
    """Logits [B, N, T, S], values [B, S, N, H], a visibility mask with rows empty in some key
    sets or in all, and a split of the keys into `parts` disjoint sets."""
    rng = np.random.default_rng(seed)
    s = rng.normal(size=(B, N, T, S)) * 3
    v = rng.normal(size=(B, S, N, H))
    vis = rng.random((B, N, T, S)) < 0.7
    vis[0, 0, 0] = False  # a row that sees no key at all
    vis[1, 2, 1, : S // parts] = False  # a row empty in the first set only
    vis[1, 1, 3, S // parts:] = False  # a row empty in all but the first set
    sets = np.array_split(np.arange(S), parts)
    return s, v, vis, sets


def attend(s, v, vis, keys, sink=None):
    """Oracle attention over the key subset `keys` (float64): out [B, T, N, H], lse [B, N, T]."""
    s, vis, v = s[..., keys], vis[..., keys], v[:, keys]
    e = np.where(vis, np.exp(s), 0.0)
    denom = e.sum(-1) + (0.0 if sink is None else np.exp(sink)[None, :, None])
    p = e / np.where(denom == 0, 1.0, denom)[..., None]
    out = np.einsum("bnts,bsnh->btnh", p, v)
    with np.errstate(divide="ignore"):
        lse = np.where(denom == 0, EMPTY_ROW_LSE, np.log(denom))
    return out, lse


def _partials(s, v, vis, sets, dtype=jnp.float32):
    return [tuple(jnp.asarray(x, dtype) for x in attend(s, v, vis, keys)) for keys in sets]


def merge_all(partials):
    return functools.reduce(lambda a, b: merge_partials(*a, *b), partials)


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_merge_equals_softmax_over_union(parts, seed):
    s, v, vis, sets = problem(seed, S=12, parts=parts)
    out, lse = merge_all(_partials(s, v, vis, sets))
    want_out, want_lse = attend(s, v, vis, np.arange(s.shape[-1]))
    assert out.dtype == lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=2e-6, atol=2e-6)
    assert np.asarray(out)[0, 0, 0].tolist() == [0.0] * H  # saw no key: exactly zero
    assert lse[0, 0, 0] == np.float32(EMPTY_ROW_LSE)


def test_empty_partials_are_exact_identities():
    s, v, vis, sets = problem(2)
    (oa, la), (ob, lb) = _partials(s, v, vis, sets)
    empty_o, empty_l = jnp.zeros_like(oa), jnp.full_like(la, EMPTY_ROW_LSE)
    for o, l in ((oa, la), (ob, lb)):
        for args in ((o, l, empty_o, empty_l), (empty_o, empty_l, o, l)):
            mo, ml = merge_partials(*args)
            np.testing.assert_array_equal(mo, o)  # bit for bit
            np.testing.assert_array_equal(ml, l)
    mo, ml = merge_partials(empty_o, empty_l, empty_o, empty_l)
    assert not np.any(np.asarray(mo)) and np.all(np.asarray(ml) == np.float32(EMPTY_ROW_LSE))
    # Another library's -inf for an empty row means the same and stays NaN-free.
    mo, ml = merge_partials(oa, la, empty_o, jnp.full_like(la, -jnp.inf))
    np.testing.assert_array_equal(mo, oa)
    np.testing.assert_array_equal(ml, la)


def test_merged_lse_agrees_with_exp_under_an_inexact_log(inexact_jnp):
    """A logaddexp off by 3e-5 relative (a TPU's float32 log misses by about that): the merged
    lse still satisfies e^(lse_a - lse) + e^(lse_b - lse) = 1, which the backward's recomputed
    p = e^(s - lse) relies on, and the sink's fold keeps it too."""
    from flashmesh.parallel import merge

    inexact_jnp(merge, "logaddexp", 3e-5)
    s, v, vis, sets = problem(6)
    (oa, la), (ob, lb) = _partials(s, v, vis, sets)
    seen = (np.asarray(la) > EMPTY_ROW_LSE) & (np.asarray(lb) > EMPTY_ROW_LSE)
    _, lse = merge_partials(oa, la, ob, lb)
    total = np.exp(np.asarray(la, np.float64) - lse) + np.exp(np.asarray(lb, np.float64) - lse)
    np.testing.assert_allclose(total[seen], 1.0, rtol=0, atol=1e-6)
    _, with_sink = finalize_sink(oa, la, 0.5)
    total = np.exp(np.asarray(la, np.float64) - with_sink) + np.exp(0.5 - np.asarray(with_sink, np.float64))
    np.testing.assert_allclose(total[np.asarray(la) > EMPTY_ROW_LSE], 1.0, rtol=0, atol=1e-6)


def test_low_precision_inputs_merge_in_float32():
    s, v, vis, sets = problem(3)
    parts = _partials(s, v, vis, sets, jnp.bfloat16)
    out, lse = merge_all(parts)
    assert out.dtype == lse.dtype == jnp.float32


def test_float64_inputs_merge_in_float64():
    s, v, vis, sets = problem(4, parts=3)
    with jax.enable_x64(True):
        out, lse = merge_all(_partials(s, v, vis, sets, jnp.float64))
        assert out.dtype == lse.dtype == jnp.float64
        want_out, want_lse = attend(s, v, vis, np.arange(s.shape[-1]))
        np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-12, atol=1e-12)


def test_gradients_are_finite_with_empty_rows():
    s, v, vis, sets = problem(5)
    (oa, la), (ob, lb) = _partials(s, v, vis, sets)
    # Row (1, 2, 1) is empty in set a; make one row empty in both.
    oa, ob = oa.at[0, 4, 1].set(0.0), ob.at[0, 4, 1].set(0.0)
    la, lb = la.at[0, 1, 4].set(EMPTY_ROW_LSE), lb.at[0, 1, 4].set(EMPTY_ROW_LSE)
    g_out = jnp.asarray(np.random.default_rng(0).normal(size=oa.shape), jnp.float32)

    def loss(oa, la, ob, lb):
        out, lse = merge_partials(oa, la, ob, lb)
        return jnp.sum(out * g_out) + jnp.sum(jnp.where(lse > EMPTY_ROW_LSE, lse, 0.0))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(oa, la, ob, lb)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    # An empty partial gets no weight, so no gradient reaches its output.
    assert not np.any(np.asarray(grads[0])[1, 1, 2])


@pytest.mark.parametrize("softmax", ["off_by_one", "learnable"])
def test_finalize_sink_counts_the_sink_once(softmax):
    s, v, vis, sets = problem(6, parts=3)
    sink = np.zeros(N) if softmax == "off_by_one" else np.array([-1.0, 0.5, 2.0])
    out, lse = merge_all(_partials(s, v, vis, sets))
    c = 0.0 if softmax == "off_by_one" else jnp.asarray(sink, jnp.float32)
    out, lse = finalize_sink(out, lse, c)
    want_out, want_lse = attend(s, v, vis, np.arange(s.shape[-1]), sink=sink)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=2e-6, atol=2e-6)
    assert np.asarray(out)[0, 0, 0].tolist() == [0.0] * H  # empty row: zero, lse = the sink
    assert float(lse[0, 0, 0]) == pytest.approx(sink[0])
    same = finalize_sink(out, lse, None)
    assert same[0] is out and same[1] is lse


def test_sink_gradient_matches_direct_softmax():
    s, v, vis, sets = problem(7)
    g = np.random.default_rng(1).normal(size=(B, T, N, H))
    with jax.enable_x64(True):
        sj, vj, visj, gj = (jnp.asarray(x) for x in (s, v, vis, g))

        def direct(sink):  # softmax with the sink term over all keys at once
            logits = jnp.where(visj, sj, -jnp.inf)
            m = jnp.maximum(jnp.max(logits, -1), sink[None, :, None])
            e = jnp.exp(logits - m[..., None])
            p = e / (e.sum(-1) + jnp.exp(sink[None, :, None] - m))[..., None]
            return jnp.sum(jnp.einsum("bnts,bsnh->btnh", p, vj) * gj)

        partials = _partials(s, v, vis, sets, jnp.float64)

        def merged(sink):
            out, _ = finalize_sink(*merge_all(partials), sink)
            return jnp.sum(out * gj)

        sink = jnp.asarray([0.3, -0.7, 1.1])
        np.testing.assert_allclose(jax.jit(jax.grad(merged))(sink), jax.jit(jax.grad(direct))(sink),
                                   rtol=1e-10)


def test_bad_shapes():
    o, l = jnp.zeros((B, T, N, H)), jnp.zeros((B, N, T))
    with pytest.raises(ValueError, match=r"out_b \[B, T, N, H\] and lse_b \[B, N, T\] disagree"):
        merge_partials(o, l, o, jnp.zeros((B, T, N)))
    with pytest.raises(ValueError, match=r"sink_logit must be a scalar or \[N=3\]"):
        finalize_sink(o, l, jnp.zeros(5))
