"""flashmesh.nn.RelativePositionBiases: T5's bucketed relative bias with TE's fields."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from flashmesh.nn.relative import RelativePositionBiases, relative_position_buckets


def _t5_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """Mesh TensorFlow's _relative_position_bucket for one int (relative = key - query)."""
    ret = 0
    n = -relative_position
    if bidirectional:
        num_buckets //= 2
        ret += num_buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    val = max_exact + int(math.log(n / max_exact + np.finfo(np.float32).eps)
                          / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return ret + min(val, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("buckets, distance", [(32, 128), (8, 20)])
def test_buckets_match_t5(bidirectional, buckets, distance):
    T, S = 7, 150
    got = relative_position_buckets(T, S, num_buckets=buckets, max_distance=distance,
                                    bidirectional=bidirectional)
    want = np.array([[_t5_bucket(j - i, bidirectional, buckets, distance) for j in range(S)]
                     for i in range(T)])
    np.testing.assert_array_equal(got, want)
    assert got.min() >= 0 and got.max() < buckets


def test_small_table_by_hand():
    # 8 buckets bidirectional: 4 per direction, 2 exact, then log-spaced up to distance 8.
    got = relative_position_buckets(1, 9, num_buckets=8, max_distance=8, bidirectional=True)
    np.testing.assert_array_equal(got[0], [0, 5, 6, 6, 7, 7, 7, 7, 7])
    got = relative_position_buckets(9, 1, num_buckets=8, max_distance=8, bidirectional=False)
    # unidirectional: all 8 buckets for keys before the query, 4 exact, a later key is 0.
    np.testing.assert_array_equal(got[:, 0], [0, 1, 2, 3, 4, 5, 6, 7, 7])
    later = relative_position_buckets(1, 3, num_buckets=8, max_distance=8, bidirectional=False)
    np.testing.assert_array_equal(later[0], [0, 0, 0])


def test_module_looks_up_the_table():
    N, T, S = 4, 6, 11
    module = RelativePositionBiases(num_buckets=16, max_distance=32, num_attention_heads=N)
    boxed = module.init(jax.random.key(0), T, S)
    assert boxed["params"]["rel_embedding"].names == ("heads", "relpos_buckets")  # TE's default
    variables = nn.unbox(boxed)
    table = variables["params"]["rel_embedding"]
    assert table.shape == (N, 16) and table.dtype == jnp.float32
    for bidirectional in (True, False):
        bias = module.apply(variables, T, S, bidirectional)
        assert bias.shape == (1, N, T, S)
        buckets = relative_position_buckets(T, S, num_buckets=16, max_distance=32,
                                            bidirectional=bidirectional)
        # TE's formulation: a one-hot [buckets, T, S] contracted with the table.
        one_hot = (buckets[None] == np.arange(16)[:, None, None]).astype(np.float32)
        want = np.einsum("nk,kts->nts", np.asarray(table), one_hot)[None]
        np.testing.assert_allclose(np.asarray(bias), want, rtol=1e-6, atol=1e-7)

    # The table's gradient is the count-weighted sum of the cotangent per bucket.
    cot = jax.random.normal(jax.random.key(1), (1, N, T, S))
    grad = jax.grad(lambda p: jnp.sum(module.apply({"params": p}, T, S) * cot))(variables["params"])
    buckets = relative_position_buckets(T, S, num_buckets=16, max_distance=32)
    want = np.stack([[np.asarray(cot)[0, h][buckets == k].sum() for k in range(16)] for h in range(N)])
    np.testing.assert_allclose(np.asarray(grad["rel_embedding"]), want, rtol=1e-5, atol=1e-6)


def test_dtype_and_bad_input():
    module = RelativePositionBiases(num_buckets=8, max_distance=16, num_attention_heads=2,
                                    dtype=jnp.bfloat16)
    variables = module.init(jax.random.key(0), 4, 4)
    assert module.apply(variables, 4, 4).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="q_seqlen"):
        relative_position_buckets(0, 4, num_buckets=8, max_distance=16)
    with pytest.raises(ValueError, match="num_buckets"):
        relative_position_buckets(4, 4, num_buckets=2, max_distance=16)
