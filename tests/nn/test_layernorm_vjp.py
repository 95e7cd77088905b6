"""layernorm_vjp.normalize: LayerNorm's backward kernel (interpret mode on CPU, compiled on the
GPU) and the autodiff form against autodiff of the plain formula, for LayerNorm and RMSNorm,
with and without a bias; under shard_map; where the kernel applies."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashmesh.nn import layernorm, layernorm_vjp
from flashmesh.nn.layernorm_vjp import normalize


def _plain(x, gamma, bias, rms, eps):
    """The formula left to autodiff (float32 inside, x's dtype out)."""
    xf = x.astype(jnp.float32)
    centred = xf if rms else xf - jnp.mean(xf, axis=-1, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True) + eps)
    shape = (1,) * (x.ndim - 1) + gamma.shape
    y = centred * rstd * gamma.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y.astype(x.dtype)


def _inputs(shape, seed=0, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 4)
    H = shape[-1]
    x = (jax.random.normal(k[0], shape) * 3.0 + 1.5).astype(dtype)
    gamma = 1.0 + 0.3 * jax.random.normal(k[1], (H,))
    bias = 0.2 * jax.random.normal(k[2], (H,))
    dy = jax.random.normal(k[3], shape).astype(dtype)
    return x, gamma, bias, dy


def _grads(f, x, gamma, bias, dy):
    y, pull = jax.vjp(f, x, gamma, bias)
    return (y,) + pull(dy)


def _close(got, want, tol):
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.max(np.abs(g - w)) <= tol * np.max(np.abs(w)), np.max(np.abs(g - w)) / np.max(np.abs(w))


@pytest.mark.parametrize("shape", [(3, 7, 64), (2, 32, 128), (64, 256), (32, 2048)])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("kernel", [False, True, None], ids=["autodiff", "kernel", "auto"])
def test_backward_equals_autodiff_of_the_formula(shape, rms, kernel):
    """Output, dx, dgamma and dbias within float32 rounding of autodiff (kernel=True runs the
    kernel for LayerNorm; on sizes that do not fit it, and for RMSNorm, a ValueError)."""
    x, gamma, bias, dy = _inputs(shape, seed=sum(shape))
    bias = None if rms else bias
    want = _grads(lambda x, g, b: _plain(x, g, b, rms, 1e-5), x, gamma, bias, dy)
    f = lambda x, g, b: normalize(x, g, b, rms=rms, epsilon=1e-5, kernel=kernel)
    if kernel and rms:
        with pytest.raises(ValueError, match="kernel=True: the backward kernel is LayerNorm's"):
            f(x, gamma, bias)
        return
    if kernel and not layernorm_vjp.kernel_fits(x):
        with pytest.raises(ValueError, match="does not fit the LayerNorm kernel"):
            _grads(f, x, gamma, bias, dy)
        return
    _close(jax.jit(lambda *a: _grads(f, *a))(x, gamma, bias, dy), want, 2e-6)


def test_rmsnorm_with_a_bias_and_bf16_inputs():
    """A bias on RMSNorm is added (as `layernorm` always did); bf16 x and dy give dx in bf16
    within its rounding of the float32 result, the parameter gradients in float32."""
    x, gamma, bias, dy = _inputs((4, 32, 512), seed=3)
    want = _grads(lambda x, g, b: _plain(x, g, b, True, 1e-6), x, gamma, bias, dy)
    got = _grads(lambda x, g, b: normalize(x, g, b, rms=True, epsilon=1e-6),
                 x.astype(jnp.bfloat16), gamma, bias, dy.astype(jnp.bfloat16))
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.bfloat16
    assert got[2].dtype == jnp.float32 and got[3].dtype == jnp.float32
    _close(got[:2], want[:2], 2e-2)
    _close(got[2:], want[2:], 2e-2)


def test_layernorm_wrapper_zero_centred_gamma_gradient():
    """`nn.layernorm` with zero-centred gamma: the stored scale's gradient is gamma's."""
    x, gamma, bias, dy = _inputs((2, 16, 64), seed=4)
    scale = gamma - 1.0
    got = jax.grad(lambda s, b: jnp.sum(layernorm(x, s, b, epsilon=1e-5, zero_centered_gamma=True) * dy),
                   argnums=(0, 1))(scale, bias)
    want = jax.grad(lambda g, b: jnp.sum(_plain(x, g, b, False, 1e-5) * dy), argnums=(0, 1))(gamma, bias)
    _close(got, want, 2e-6)


def test_second_derivative_with_kernel_false():
    """grad of grad runs with kernel=False (autodiff throughout) and matches the formula's."""
    x, gamma, bias, _ = _inputs((8, 64), seed=5)

    def inner(f):
        return lambda x: jnp.sum(jnp.square(jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))(x)))

    got = jax.grad(inner(lambda x: normalize(x, gamma, bias, rms=False, epsilon=1e-5, kernel=False)))(x)
    want = jax.grad(inner(lambda x: _plain(x, gamma, bias, False, 1e-5)))(x)
    _close((got,), (want,), 1e-5)


def test_inside_shard_map_the_parameter_gradients_are_summed_over_the_rows_shards():
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x, gamma, bias, dy = _inputs((16, 128), seed=6)

    def grads(x, gamma, bias, dy):
        return jax.vjp(lambda x, g, b: normalize(x, g, b, rms=False, epsilon=1e-5), x, gamma, bias)[1](dy)

    rows, rep = jax.P("data"), jax.P()
    sharded = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(rows, rep, rep, rows),
                                    out_specs=(rows, rep, rep)))(x, gamma, bias, dy)
    _close(sharded, grads(x, gamma, bias, dy), 1e-6)


def test_kernel_fits_only_power_of_two_widths_and_whole_programs():
    fits = lambda shape, dtype=jnp.float32: layernorm_vjp.kernel_fits(jax.ShapeDtypeStruct(shape, dtype))
    assert fits((32, 64)) and fits((4, 2048, 4096), jnp.bfloat16) and fits((64, 16384))
    assert not fits((32, 96)) and not fits((32, 32768)) and not fits((31, 64)) and not fits((0, 64))
    assert not fits((32, 64), jnp.int32)
    with pytest.raises(ValueError, match="gamma must have shape"):
        normalize(jnp.zeros((4, 8)), jnp.ones(4), None, rms=True, epsilon=1e-6)


@pytest.mark.gpu
def test_gpu_backward_runs_the_kernel_and_equals_the_xla_form():
    """On one GPU LayerNorm's default backward compiles to the Triton kernel (RMSNorm's stays
    autodiff's) and agrees with autodiff (float32 rounding; bf16 dx within one rounding step)."""
    for shape, dtype in [((8192, 4096), jnp.bfloat16), ((2, 256, 1024), jnp.float32), ((256, 128), jnp.float16)]:
        x, gamma, bias, dy = _inputs(shape, seed=7, dtype=dtype)
        for rms in (False, True):
            b = None if rms else bias
            step = lambda kernel: jax.jit(lambda x, g, b, dy: jax.vjp(
                lambda x, g, b: normalize(x, g, b, rms=rms, epsilon=1e-6, kernel=kernel), x, g, b)[1](dy))
            text = step(None).lower(x, gamma, b, dy).compile().as_text()
            assert ("layernorm_backward" in text) == (jax.device_count() == 1 and not rms)
            got, want = step(None)(x, gamma, b, dy), step(False)(x, gamma, b, dy)
            _close(got[:1], want[:1], 1e-2 if dtype != jnp.float32 else 1e-5)
            _close(got[1:], want[1:], 1e-5)
