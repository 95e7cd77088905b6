"""layouts.byte_transpose: bit-identical to .T for every byte value, shape and FP8 dtype."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from flashmesh.quantization.layouts import byte_transpose


@pytest.mark.parametrize("shape", [(4, 4), (8, 12), (64, 36), (6, 8), (8, 6), (3, 5), (1, 4)])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.uint8, jnp.int8])
def test_byte_transpose_is_the_transpose_bit_for_bit(shape, dtype):
    """Random bytes (every pattern, NaNs and negative zeros included) come out transposed."""
    raw = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    q = lax.bitcast_convert_type(jnp.asarray(raw), dtype)
    got = np.asarray(lax.bitcast_convert_type(jax.jit(byte_transpose)(q), jnp.uint8))
    assert got.shape == shape[::-1]
    np.testing.assert_array_equal(got, raw.T)


def test_byte_transpose_covers_all_256_values_in_one_block_grid():
    raw = np.arange(256, dtype=np.uint8).reshape(16, 16)
    q = lax.bitcast_convert_type(jnp.asarray(raw), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(lax.bitcast_convert_type(byte_transpose(q), jnp.uint8)), raw.T)


def test_byte_transpose_keeps_other_dtypes_and_refuses_other_ranks():
    x = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(byte_transpose(x), x.T)
    with pytest.raises(ValueError, match="q must be 2-D"):
        byte_transpose(jnp.zeros((4, 4, 4), jnp.uint8))
