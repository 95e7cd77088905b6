"""`parallel/layouts.py`: the orders match TransformerEngine's reorders token for token, round
trips are exact for every dtype (numpy and jax, eager and under jit), and bad arguments raise a
one-line ValueError naming the argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashmesh.parallel import layouts
from flashmesh.parallel.layouts import (global_token_index, inverse_reorder_for_context_parallel,
                                        reorder_for_context_parallel)


def oracle_shards(order, cp, seq_len, ss=None):
    """Each rank's original tokens, written from the definitions independently of the module."""
    L = seq_len // cp
    if order == "contiguous":
        return [list(range(r * L, (r + 1) * L)) for r in range(cp)]
    if order == "dual_chunk":
        c = seq_len // (2 * cp)
        return [list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
                for r in range(cp)]
    ss = ss or 1
    return [[t for k in range(seq_len // (cp * ss)) for t in range((k * cp + r) * ss, (k * cp + r + 1) * ss)]
            for r in range(cp)]


def test_te_examples():
    # TE's own numbers (te_jax.md a.5, checked against TE's code, not its docstring).
    np.testing.assert_array_equal(layouts.shard_token_indices("dual_chunk", 4, 16),
                                  [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]])
    np.testing.assert_array_equal(layouts.shard_token_indices("striped", 4, 16)[0], [0, 4, 8, 12])
    np.testing.assert_array_equal(layouts.shard_token_indices("striped", 2, 16, 2)[1],
                                  [2, 3, 6, 7, 10, 11, 14, 15])
    np.testing.assert_array_equal(reorder_for_context_parallel(np.arange(8), "dual_chunk", 2, 0),
                                  [0, 1, 6, 7, 2, 3, 4, 5])


CASES = [(o, cp, ss) for cp in (1, 2, 3, 4, 8) for o, ss in
         (("contiguous", None), ("dual_chunk", None), ("striped", None), ("striped", 1), ("striped", 4))]


@pytest.mark.parametrize("order,cp,ss", CASES)
def test_index_maps_match_definition(order, cp, ss):
    seq_len = 2 * cp * 4 * 3
    want = np.asarray(oracle_shards(order, cp, seq_len, ss))
    np.testing.assert_array_equal(layouts.shard_token_indices(order, cp, seq_len, ss), want)
    g = global_token_index(order, cp, seq_len, ss)
    inv = layouts.reordered_token_index(order, cp, seq_len, ss)
    np.testing.assert_array_equal(g[inv], np.arange(seq_len))
    np.testing.assert_array_equal(layouts.token_owner(order, cp, seq_len, ss)[want],
                                  np.repeat(np.arange(cp), seq_len // cp).reshape(cp, -1))
    for r, runs in enumerate(layouts.shard_runs(order, cp, seq_len, ss)):
        np.testing.assert_array_equal(np.concatenate([np.arange(a, b) for a, b in runs]), want[r])


DTYPES = [np.float32, np.int32, np.uint8, np.bool_, jnp.bfloat16, np.float16]


@settings(max_examples=40, deadline=None)
@given(cp=st.sampled_from([1, 2, 3, 4]), order=st.sampled_from(layouts.ORDERS),
       ss=st.sampled_from([None, 1, 2, 3]), units=st.integers(1, 3), batch=st.integers(1, 2),
       seq_dim=st.sampled_from([0, 1, -2]), dtype=st.sampled_from(DTYPES),
       use_jax=st.booleans(), seed=st.integers(0, 2**16))
def test_round_trip_exact(cp, order, ss, units, batch, seq_dim, dtype, use_jax, seed):
    ss = ss if order == "striped" else None
    unit = {"contiguous": cp, "dual_chunk": 2 * cp}.get(order, (ss or 1) * cp)
    shape = [batch, 3]
    shape.insert(seq_dim % 3, unit * units)
    x = (np.random.default_rng(seed).normal(size=shape) * 50).astype(dtype)
    if use_jax:
        x = jnp.asarray(x)
    y = reorder_for_context_parallel(x, order, cp, seq_dim, ss)
    assert type(y) is type(x) and y.dtype == x.dtype and y.shape == x.shape
    g = global_token_index(order, cp, x.shape[seq_dim], ss)
    np.testing.assert_array_equal(np.asarray(y), np.take(np.asarray(x), g, axis=seq_dim))
    back = inverse_reorder_for_context_parallel(y, order, cp, seq_dim, ss)
    assert back.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))  # bit for bit


def test_under_jit_on_ids_and_positions():
    ids = jnp.asarray(np.repeat(np.arange(1, 5), 8)[None].repeat(2, 0), jnp.int32)  # [2, 32]
    fwd = jax.jit(lambda x: reorder_for_context_parallel(x, "dual_chunk", 4, seq_dim=1))
    inv = jax.jit(lambda x: inverse_reorder_for_context_parallel(x, "dual_chunk", 4, seq_dim=1))
    y = fwd(ids)
    np.testing.assert_array_equal(y, np.asarray(ids)[:, global_token_index("dual_chunk", 4, 32)])
    np.testing.assert_array_equal(inv(y), ids)


@pytest.mark.parametrize("kwargs,match", [
    (dict(order="zigzag", cp_size=2), r"order must be one of"),
    (dict(order="contiguous", cp_size=0), r"cp_size must be an integer >= 1"),
    (dict(order="contiguous", cp_size=2.0), r"cp_size must be an integer >= 1"),
    (dict(order="dual_chunk", cp_size=2, stripe_size=2), r"stripe_size applies only to order='striped'"),
    (dict(order="striped", cp_size=2, stripe_size=0), r"stripe_size must be a positive integer"),
    (dict(order="contiguous", cp_size=5), r"x.shape\[1\]=24 must be a multiple of cp_size=5"),
    (dict(order="dual_chunk", cp_size=8), r"x.shape\[1\]=24 must be a multiple of 2 \* cp_size=16"),
    (dict(order="striped", cp_size=4, stripe_size=4), r"must be a multiple of stripe_size \* cp_size=16"),
    (dict(order="contiguous", cp_size=2, seq_dim=3), r"seq_dim=3 is out of range"),
])
def test_bad_arguments(kwargs, match):
    x = np.zeros((2, 24, 3))
    for fn in (reorder_for_context_parallel, inverse_reorder_for_context_parallel):
        with pytest.raises(ValueError, match=match) as err:
            fn(x, **kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"seq_len=10 must be a multiple of 2 \* cp_size=4"):
        global_token_index("dual_chunk", 2, 10)
