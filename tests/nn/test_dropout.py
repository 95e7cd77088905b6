"""flashmesh.nn.dropout: the hashed-mask dropout (rate, scaling, broadcast, keys, gradient,
sharding, the Flax module's call)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.errors
from flax import linen as nn
from jax.sharding import PartitionSpec as P

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
    kept = np.asarray(y) != 0
    assert 0 < kept.mean() < 1
    want = (np.asarray(x, np.float32) / 0.75).astype(jnp.bfloat16)  # x / (1 - rate) in x's dtype
    np.testing.assert_array_equal(np.asarray(y)[kept], want[kept])
    assert dropout(x, 0.0, key) is x
    np.testing.assert_array_equal(dropout(x, 1.0, key), jnp.zeros_like(x))
    np.testing.assert_array_equal(dropout(x, 1.0, None), jnp.zeros_like(x))  # no key needed


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
    shared = {d % 3 for d in dims}
    for d in set(range(3)) - shared:  # and varies along every other axis
        assert not (kept == np.take(kept, [0], axis=d)).all(), d
    assert 0.2 < kept.mean() < 0.8


def test_gradient_is_the_same_mask_recomputed():
    x, w = _x((8, 128)), _x((8, 128), seed=1)
    key = jax.random.key(4)
    kept = np.asarray(dropout(x, 0.3, key)) != 0
    grad_fn = jax.grad(lambda x, key: jnp.sum(w * dropout(x, 0.3, key)))
    for grad in (grad_fn(x, key), jax.jit(grad_fn)(x, key)):
        np.testing.assert_allclose(grad, np.where(kept, np.asarray(w) / 0.7, 0.0), rtol=1e-6)
    # Forward mode: the tangent takes the same mask.
    _, tangent = jax.jvp(lambda x: dropout(x, 0.3, key), (x,), (w,))
    np.testing.assert_allclose(tangent, np.where(kept, np.asarray(w) / 0.7, 0.0), rtol=1e-6)
    # The backward keeps only the key (two words) from the forward, not a mask.
    _, vjp = jax.vjp(lambda x: dropout(x, 0.3, key), x)
    residuals = [leaf for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "shape")]
    assert all(leaf.size <= 2 for leaf in residuals), [leaf.shape for leaf in residuals]


def test_inside_shard_map_the_indices_are_the_shards_own():
    """Each shard draws from its own indices: the same key gives every shard the same mask (as
    flax's dropout does), a key folded with the shard's index independent ones."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    x = _x((64, 32))
    key = jax.random.key(6)

    def run(per_shard_key):
        def body(x):
            k = jax.random.fold_in(key, jax.lax.axis_index("d")) if per_shard_key else key
            return dropout(x, 0.5, k)
        return np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x)) != 0

    same, folded = run(False).reshape(8, 8, 32), run(True).reshape(8, 8, 32)
    local = np.asarray(dropout(x[:8], 0.5, key)) != 0
    assert all((s == local).all() for s in same)
    assert not all((f == folded[0]).all() for f in folded[1:])


def test_bad_arguments():
    x = _x((2, 3))
    with pytest.raises(ValueError, match="rate=1.5 must be in"):
        dropout(x, 1.5, jax.random.key(0))
    with pytest.raises(ValueError, match="broadcast_dims entry 2"):
        dropout(x, 0.5, jax.random.key(0), (2,))
    with pytest.raises(ValueError, match="x must be floating point, got dtype int32"):
        dropout(jnp.ones((2, 3), jnp.int32), 0.5, jax.random.key(0))
    with pytest.raises(ValueError, match="must each be below 2"):
        jax.eval_shape(lambda: dropout_keep(jnp.zeros(2, jnp.uint32), 0.5, (2**32, 1)))


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
    with pytest.raises(flax.errors.InvalidRngError, match='needs PRNG for "dropout"'):
        module.apply({}, x, deterministic=False)  # needs the rng stream
    np.testing.assert_array_equal(Dropout(1.0).apply({}, x, deterministic=False), jnp.zeros_like(x))

    class Wrapped(nn.Module):  # inside a parent, as the layer blocks use it
        @nn.compact
        def __call__(self, x):
            return Dropout(0.5)(x, deterministic=False)

    a = Wrapped().apply({}, x, rngs={"dropout": key})
    assert not np.array_equal(a, Wrapped().apply({}, x, rngs={"dropout": jax.random.key(3)}))
