"""layouts: byte_transpose bit-identical to .T for every byte value, shape and FP8 dtype;
quantize_both's kernel and XLA forms with the same bytes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from flashmesh.quantization import layouts, scaling
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


def _specials(shape, dtype, seed):
    """Random values over FP8's range and past it, with NaN, +-inf, -0 and zeros mixed in."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 5, shape)
    flat = x.reshape(-1)
    flat[:6] = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e6]
    rng.shuffle(flat)
    return jnp.asarray(x, dtype)


def _bytes(a):
    """An array's bytes (one-byte dtypes) with every NaN as one pattern: conversions may keep
    different NaN payloads."""
    a = np.asarray(a)
    if a.dtype.itemsize != 1:
        return a
    return np.where(np.isnan(a.astype(np.float32)), 0xFF, a.view(np.uint8))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_quantize_both_kernel_equals_xla_bit_for_bit(dtype, fp8):
    """The Pallas kernel (interpret mode here, compiled on the GPU suite's run) and the XLA form
    give the same bytes in both layouts (NaN payloads aside) and the same amax (inf included). A NaN makes the
    kernel's amax NaN, as XLA's max on the GPU; XLA on the CPU skips NaN in max reductions,
    so with a NaN only the bytes are compared here."""
    x = _specials((128, 192), dtype, 3)
    scale = jnp.full((1,), 7.5, jnp.float32)
    plain = layouts.quantize_both(x, scale, fp8, kernel=False)
    fused = layouts.quantize_both(x, scale, fp8, kernel=True)
    want_q = scaling.quantize(x, scale, fp8)
    np.testing.assert_array_equal(_bytes(plain[0]), _bytes(want_q))
    np.testing.assert_array_equal(_bytes(plain[1]), _bytes(want_q).T)
    for a, b in zip(plain[:2], fused[:2]):
        np.testing.assert_array_equal(_bytes(a), _bytes(b))
    assert np.isnan(np.asarray(fused[2])).all() and fused[2].shape == (1,)
    no_nan = jnp.nan_to_num(x, nan=0.0, posinf=jnp.inf, neginf=-jnp.inf)
    amaxes = [layouts.quantize_both(no_nan, scale, fp8, kernel=k)[2] for k in (False, True)]
    np.testing.assert_array_equal(amaxes[0], amaxes[1])
    np.testing.assert_array_equal(amaxes[0], scaling.amax(no_nan))
    assert np.isinf(np.asarray(amaxes[0])).all()


def test_quantize_both_refuses_what_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="x must be 2-D"):
        layouts.quantize_both(jnp.zeros((2, 64, 64)), jnp.ones(1), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="does not fit the kernel"):
        layouts.quantize_both(jnp.zeros((64, 96)), jnp.ones(1), jnp.float8_e4m3fn, kernel=True)
    q, qt, amax = layouts.quantize_both(jnp.ones((6, 10)), jnp.ones(1), jnp.float8_e4m3fn)
    assert q.shape == (6, 10) and qt.shape == (10, 6) and float(amax[0]) == 1.0


def test_quantize_both_automatic_choice(monkeypatch):
    """kernel=None: the XLA form with several devices or sizes the kernel cannot take; with one
    device the choice is made per platform when lowering (the CPU lowers the XLA form)."""
    x = _specials((128, 192), jnp.bfloat16, 4)
    scale = jnp.full((1,), 2.0, jnp.float32)
    want = layouts.quantize_both(x, scale, jnp.float8_e4m3fn, kernel=False)

    def check():
        f = jax.jit(lambda x, s: layouts.quantize_both(x, s, jnp.float8_e4m3fn))
        text = f.lower(x, scale).compile().as_text()
        assert "fp8_quantize_both" not in text and "triton" not in text
        for a, b in zip(f(x, scale), want):
            np.testing.assert_array_equal(_bytes(a), _bytes(b))

    assert jax.device_count() > 1
    check()
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    check()
    # Inside shard_map (even over one device) or under a mesh: the XLA form, which carries the
    # manual axes; a Pallas call's outputs would not (tracing failed there).
    mesh = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,))
    inside = jax.shard_map(lambda x, s: layouts.quantize_both(x, s, jnp.float8_e4m3fn)[:2], mesh=mesh,
                           in_specs=(jax.P("d"), jax.P()), out_specs=(jax.P("d"), jax.P(None, "d")))
    for a, b in zip(jax.jit(inside)(x, scale), want[:2]):
        np.testing.assert_array_equal(_bytes(a), _bytes(b))
    with jax.set_mesh(mesh):
        assert layouts.one_device_program()  # a mesh of one device is one device
    with jax.set_mesh(jax.make_mesh((2,), ("d",), devices=jax.devices()[:2],
                                    axis_types=(jax.sharding.AxisType.Auto,))):
        assert not layouts.one_device_program()
    assert layouts.kernel_fits(x) and not layouts.kernel_fits(x[:, :100])
    assert not layouts.kernel_fits(x.astype(jnp.int8))


@pytest.mark.gpu
def test_gpu_quantize_both_takes_the_kernel_by_itself_on_one_device():
    x = _specials((1024, 512), jnp.bfloat16, 6)
    scale = jnp.full((1,), 3.0, jnp.float32)
    f = jax.jit(lambda x, s: layouts.quantize_both(x, s, jnp.float8_e4m3fn))
    assert ("triton" in f.lower(x, scale).compile().as_text()) == (jax.device_count() == 1)
    for a, b in zip(f(x, scale), layouts.quantize_both(x, scale, jnp.float8_e4m3fn, kernel=False)):
        np.testing.assert_array_equal(_bytes(a), _bytes(b))


@pytest.mark.gpu
def test_gpu_quantize_both_runs_the_kernel_and_equals_xla():
    """On the GPU the kernel compiles to a Triton custom call and its bytes and amax equal the
    XLA form's."""
    for shape, dtype in [((8192, 4096), jnp.bfloat16), ((4096, 1024), jnp.float32)]:
        x = _specials(shape, dtype, 5)
        scale = jnp.full((1,), 3.0, jnp.float32)
        f = jax.jit(lambda x, s: layouts.quantize_both(x, s, jnp.float8_e5m2, kernel=True))
        assert "triton" in f.lower(x, scale).compile().as_text()
        for a, b in zip(f(x, scale), layouts.quantize_both(x, scale, jnp.float8_e5m2, kernel=False)):
            np.testing.assert_array_equal(_bytes(a), _bytes(b))


GEOMETRIES = [layouts.Geometry(32, 64), layouts.Geometry(64, 128, 8), layouts.Geometry(128, 64)]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_quantize_both_kernel_geometries_equal_xla(geometry, monkeypatch):
    """Other program shapes (what benchmarks/probe_fp8_transpose.py --geometries times): the same
    bytes in both layouts and the same amax, sizes checked against the geometry's tile."""
    monkeypatch.setattr(layouts, "GEOMETRY", geometry)
    x = (jax.random.normal(jax.random.key(4), (256, 384), jnp.float32) * 30).astype(jnp.bfloat16)
    scale = jnp.full((1,), 7.5, jnp.float32)
    plain = layouts.quantize_both(x, scale, jnp.float8_e4m3fn, kernel=False)
    fused = layouts.quantize_both(x, scale, jnp.float8_e4m3fn, kernel=True)
    for a, b in zip(plain[:2], fused[:2]):
        np.testing.assert_array_equal(_bytes(a), _bytes(b))
    np.testing.assert_array_equal(plain[2], fused[2])
    rows, cols = geometry.rows, geometry.cols
    assert layouts.kernel_fits(jnp.zeros((rows, cols))) and not layouts.kernel_fits(jnp.zeros((rows, cols + 16)))
    with pytest.raises(ValueError, match=rf"multiples of \({rows}, {cols}\)"):
        layouts.quantize_both(jnp.zeros((rows + 16, cols)), scale, jnp.float8_e4m3fn, kernel=True)


@pytest.mark.parametrize("geometry, words", [
    (layouts.Geometry(48, 64), "rows must be a power of two >= 16, got 48"),
    (layouts.Geometry(64, 8), "cols must be a power of two >= 16, got 8"),
    (layouts.Geometry(64, 64, 3), "num_warps must be None or a power of two <= 16, got 3"),
], ids=str)
def test_quantize_both_refuses_geometries_triton_cannot_take(geometry, words, monkeypatch):
    monkeypatch.setattr(layouts, "GEOMETRY", geometry)
    with pytest.raises(ValueError, match=words):
        layouts.quantize_both(jnp.zeros((192, 192)), jnp.ones(1), jnp.float8_e4m3fn, kernel=True)
