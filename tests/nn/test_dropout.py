"""flashmesh.nn.dropout: the hashed-mask dropout (rate, scaling, broadcast, keys, gradient,
sharding, the Flax module's call)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

from flashmesh.nn.dropout import Dropout, dropout, dropout_keep


def _x(shape, dtype=jnp.float32, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, dtype) + 3.0  # never 0: kept != 0


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_drops_the_rate_and_scales_the_rest(rate):
    x = _x((64, 4096))
    y = np.asarray(jax.jit(lambda x, k: dropout(x, rate, k))(x, jax.random.key(1)))
    kept = y != 0
    n = kept.size
    assert abs((1 - kept.mean()) - rate) < 4 * np.sqrt(rate * (1 - rate) / n)
    np.testing.assert_allclose(y[kept], np.asarray(x)[kept] / (1 - rate), rtol=1e-6)


def test_mask_has_no_visible_structure():
    keep = np.asarray(dropout_keep(jax.random.bits(jax.random.key(5), (2,), jnp.uint32), 0.5, (512, 512)))
    k = keep.astype(np.float64) - keep.mean()
    # Neighbours along either axis and the diagonal are uncorrelated (|r| ~ 1/512 by chance).
    for a, b in [(k[:, 1:], k[:, :-1]), (k[1:], k[:-1]), (k[1:, 1:], k[:-1, :-1])]:
        assert abs((a * b).mean() / k.var()) < 0.01
    # Row and column densities stay near the rate (no row or column is all kept or dropped).
    assert 0.35 < keep.mean(axis=0).min() and keep.mean(axis=0).max() < 0.65
    assert 0.35 < keep.mean(axis=1).min() and keep.mean(axis=1).max() < 0.65


def test_dtype_and_shape_kept_and_rate_edges():
    x = _x((3, 5, 7), jnp.bfloat16)
    key = jax.random.key(0)
    y = dropout(x, 0.25, key)
    assert y.dtype == jnp.bfloat16 and y.shape == x.shape
    assert dropout(x, 0.0, key) is x
    np.testing.assert_array_equal(dropout(x, 1.0, key), jnp.zeros_like(x))


def test_same_key_same_mask_other_key_other_mask():
    x = _x((16, 256))
    a = dropout(x, 0.5, jax.random.key(1))
    np.testing.assert_array_equal(a, dropout(x, 0.5, jax.random.key(1)))
    assert not np.array_equal(a != 0, dropout(x, 0.5, jax.random.key(2)) != 0)
    # Raw uint32 keys and other PRNG implementations work too.
    dropout(x, 0.5, jax.random.PRNGKey(1))
    dropout(x, 0.5, jax.random.key(1, impl="rbg"))


@pytest.mark.parametrize("dims", [(1,), (-1,), (0, 2), (1, -1)])
def test_broadcast_dims_share_one_decision(dims):
    x = _x((64, 32, 64))  # at least 64 decisions however the dims are shared
    kept = np.asarray(dropout(x, 0.5, jax.random.key(3), dims)) != 0
    for d in dims:
        assert (kept == np.take(kept, [0], axis=d % 3)).all()
    assert 0.2 < kept.mean() < 0.8


def test_gradient_is_the_same_mask_recomputed():
    x, w = _x((8, 128)), _x((8, 128), seed=1)
    key = jax.random.key(4)
    y, grad = jax.value_and_grad(lambda x: jnp.sum(w * dropout(x, 0.3, key)))(x)
    kept = np.asarray(dropout(x, 0.3, key)) != 0
    np.testing.assert_allclose(grad, np.where(kept, np.asarray(w) / 0.7, 0.0), rtol=1e-6)
    # The backward keeps only the key (two words) from the forward, not a mask.
    _, vjp = jax.vjp(lambda x: dropout(x, 0.3, key), x)
    residuals = [leaf for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "shape")]
    assert all(leaf.size <= 2 for leaf in residuals), [leaf.shape for leaf in residuals]


def test_mask_is_the_same_however_the_array_is_sharded():
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = _x((16, 64))
    key = jax.random.key(6)
    whole = dropout(x, 0.5, key)
    for spec in (P("d", None), P(None, "d")):
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        np.testing.assert_array_equal(jax.jit(lambda x: dropout(x, 0.5, key))(xs), whole)


def test_bad_arguments():
    x = _x((2, 3))
    with pytest.raises(ValueError, match="rate=1.5 must be in"):
        dropout(x, 1.5, jax.random.key(0))
    with pytest.raises(ValueError, match="broadcast_dims entry 2"):
        dropout(x, 0.5, jax.random.key(0), (2,))


def test_module_call_as_flax_dropout():
    x = _x((2, 4, 8))
    module = Dropout(0.5, broadcast_dims=(1,))
    np.testing.assert_array_equal(module.apply({}, x, deterministic=True), x)
    key = jax.random.key(2)
    y = module.apply({}, x, deterministic=False, rngs={"dropout": key})
    kept = np.asarray(y) != 0
    assert (kept == kept[:, :1]).all() and 0 < kept.mean() < 1
    # An explicit rng replaces the stream's; the field default for `deterministic` is read.
    np.testing.assert_array_equal(module.apply({}, x, deterministic=False, rng=key),
                                  dropout(x, 0.5, key, (1,)))
    np.testing.assert_array_equal(Dropout(0.5, deterministic=True).apply({}, x), x)
    with pytest.raises(Exception, match="dropout"):
        module.apply({}, x, deterministic=False)  # needs the rng stream

    class Wrapped(nn.Module):  # inside a parent, as the layer blocks use it
        @nn.compact
        def __call__(self, x):
            return Dropout(0.5)(x, deterministic=False)

    a = Wrapped().apply({}, x, rngs={"dropout": key})
    assert not np.array_equal(a, Wrapped().apply({}, x, rngs={"dropout": jax.random.key(3)}))
