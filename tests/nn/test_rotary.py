"""flashmesh.nn.rotary: TransformerEngine's rotary embeddings against a complex-number formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashmesh.nn.rotary import canonical_group_method, rotary_pos_emb, timescales

B, T, N, H = 2, 9, 3, 16


def _x(seed=0, shape=(B, T, N, H), dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _direct(x, positions, windows, method):
    """Pair j as one complex number, multiplied by exp(i * pos / timescale_j), in float64."""
    x = np.asarray(x, np.float64)
    h = x.shape[-1]
    low, high = windows
    scale = low * (high / low) ** (2.0 * np.arange(h // 2) / h)
    theta = np.asarray(positions, np.float64)[..., None] / scale  # [B|1, T, H/2]
    rot = np.exp(1j * theta)[:, :, None, :]  # over heads
    if method == "consecutive":
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * rot
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out
    z = (x[..., : h // 2] + 1j * x[..., h // 2:]) * rot
    return np.concatenate([z.real, z.imag], axis=-1)


@pytest.mark.parametrize("method", ["consecutive", "alternate"])
@pytest.mark.parametrize("windows", [(1, 10000), (2, 500)])
def test_matches_the_complex_rotation(method, windows):
    x = _x()
    got = rotary_pos_emb(x, windows, group_method=method)
    want = _direct(x, np.arange(T)[None], windows, method)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)


def test_the_two_methods_pair_different_coordinates():
    """consecutive rotates (x0, x1) together, alternate (x0, x_{H/2}): a vector with only x0
    set moves into x1 under one and into x_{H/2} under the other."""
    x = jnp.zeros((1, 2, 1, H), jnp.float32).at[..., 0].set(1.0)
    angle = 1.0  # position 1, pair 0 has timescale 1
    cons = np.asarray(rotary_pos_emb(x, group_method="consecutive"))[0, 1, 0]
    alt = np.asarray(rotary_pos_emb(x, group_method="alternate"))[0, 1, 0]
    np.testing.assert_allclose(cons[:2], [np.cos(angle), np.sin(angle)], atol=1e-6)
    np.testing.assert_allclose(alt[[0, H // 2]], [np.cos(angle), np.sin(angle)], atol=1e-6)
    assert np.abs(np.delete(cons, [0, 1])).max() == 0 and np.abs(np.delete(alt, [0, H // 2])).max() == 0


@pytest.mark.parametrize("method", ["consecutive", "alternate"])
def test_given_positions_and_relative_invariance(method):
    x, y = _x(1), _x(2)
    pos = jax.random.randint(jax.random.key(3), (B, T), 0, 1000)
    got = rotary_pos_emb(x, group_method=method, positions=pos)
    np.testing.assert_allclose(np.asarray(got), _direct(x, pos, (1, 10000), method), atol=2e-4, rtol=1e-4)
    # <rope(x, m), rope(y, n)> depends on m - n only: shifting every position changes nothing.
    def dots(shift):
        p = jnp.arange(T, dtype=jnp.int32) + shift
        a = rotary_pos_emb(x, group_method=method, positions=p)
        b = rotary_pos_emb(y, group_method=method, positions=p)
        return jnp.einsum("btnh,bsnh->bnts", a, b)
    np.testing.assert_allclose(np.asarray(dots(0)), np.asarray(dots(37)), atol=2e-4, rtol=1e-4)


def test_sequence_major_and_dtype():
    x = _x(4)
    got = rotary_pos_emb(jnp.swapaxes(x, 0, 1), transpose_batch_sequence=True)
    np.testing.assert_allclose(np.asarray(jnp.swapaxes(got, 0, 1)),
                               np.asarray(rotary_pos_emb(x)), atol=1e-6)
    xb = x.astype(jnp.bfloat16)
    out = rotary_pos_emb(xb, group_method="alternate")
    assert out.dtype == jnp.bfloat16
    want = _direct(xb.astype(jnp.float32), np.arange(T)[None], (1, 10000), "alternate")
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=3e-2, rtol=1e-2)


def test_timescales_and_spellings():
    np.testing.assert_allclose(np.asarray(timescales(8, (1, 10000))),
                               10000.0 ** (np.arange(4) / 4), rtol=1e-6)
    assert canonical_group_method("Consecutive") == "consecutive"
    assert canonical_group_method("al-ter_nate ") == "alternate"


def test_bad_input():
    with pytest.raises(ValueError, match="group_method"):
        rotary_pos_emb(_x(), group_method="interleaved")
    with pytest.raises(ValueError, match="even head dim"):
        rotary_pos_emb(_x(shape=(1, 4, 2, 7)))
    with pytest.raises(ValueError, match="positions shape"):
        rotary_pos_emb(_x(), positions=jnp.arange(T + 1))
    with pytest.raises(ValueError, match="integer"):
        rotary_pos_emb(_x(), positions=jnp.arange(T, dtype=jnp.float32))
    with pytest.raises(ValueError, match="windows"):
        rotary_pos_emb(_x(), (0, 100))
