"""`normalize(x, gamma, bias, rms, epsilon)`: LayerNorm / RMSNorm of x [..., H] over its last
axis, with LayerNorm's backward as one Pallas Triton kernel on a lone CUDA device.

    forward   mean, rstd per row (float32), y = (x - mean) * rstd * gamma + bias  (x's dtype)
    backward  xhat = (x - mean) * rstd, g = dy * gamma
              dx     = rstd * (g - mean(g) - xhat * mean(g * xhat))     (rms: no mean(g) term)
              dgamma = sum over rows of dy * xhat,  dbias = sum over rows of dy

Left to autodiff, XLA wrote float32 arrays of x's size between the fusions of LayerNorm's
backward: on the guide's FP8 layer (rows 8192, H 4096) four kernels of about 0.3 ms together
for each LayerNorm (benchmarks/results/2026-12-03-nvidia-h200-bench-gap/profile_fp8_bench_form.log:
fusion.43, input_reduce_fusion.2 and .4, fusion.214). The kernel reads x and dy once: each
program walks `ROWS_PER_PROGRAM` rows, writes their dx and one row of float32 partial sums of
dgamma and dbias (summed by XLA afterwards). H200, [8192, 4096] bf16, forward + backward back to
back: 0.143 ms against autodiff's 0.219 (benchmarks/results/2026-12-03-nvidia-h200-layernorm/).
RMSNorm's autodiff backward was already one pass (0.101 ms; the kernel 0.117), so RMSNorm stays
with autodiff, and so does LayerNorm wherever the kernel does not run (CPU, meshes, `shard_map`,
sizes outside `kernel_fits`); the choice is `quantization.layouts.quantize_both`'s rule
(`lax.platform_dependent` at lowering). Only x (the residual stream, alive anyway) and two
float32 numbers per row are kept for the kernel's backward. The kernel's sums run in their own
order (agreement with autodiff to float32 rounding), and its backward is not differentiable
again: grad of grad takes `kernel=False`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from flashmesh.attention.varying import summed_like
from flashmesh.quantization import layouts

__all__ = ["normalize", "statistics", "kernel_backward", "kernel_fits", "along_features",
           "ROWS_PER_PROGRAM"]

ROWS_PER_PROGRAM = 32  # rows one kernel program walks (one row of partial sums each)
NUM_WARPS = 8
_MAX_ELEMENTS_PER_STEP = 8192  # elements of x (and of dy) one loop step loads


def normalize(x: jax.Array, gamma: jax.Array, bias: jax.Array | None, *, rms: bool,
              epsilon: float, kernel: bool | None = None) -> jax.Array:
    """x [..., H] normalised over H, times gamma [H] (float32, zero-centring already added), plus
    bias [H] (None: no bias), in x's dtype. kernel: LayerNorm's backward, True the Pallas kernel
    (interpret mode off a GPU; a ValueError where x does not fit it), False autodiff, None the
    kernel where it fits on a lone CUDA device. RMSNorm always differentiates by autodiff
    (kernel None or False; True is a ValueError)."""
    if x.ndim < 1 or gamma.shape != x.shape[-1:]:
        raise ValueError(f"gamma must have shape {x.shape[-1:]} (x's last axis), got {gamma.shape}")
    if rms and kernel:
        raise ValueError("kernel=True: the backward kernel is LayerNorm's; rms=True differentiates "
                         "by autodiff (kernel None or False)")
    if kernel and not kernel_fits(x):
        raise ValueError(f"x of shape {x.shape} and dtype {x.dtype} does not fit the LayerNorm kernel: "
                         f"H a power of two in [64, 16384], rows a multiple of {ROWS_PER_PROGRAM}, "
                         f"bf16/f16/f32, not sharded in its type")
    epsilon = float(epsilon)
    gamma, bias = along_features(gamma, x), along_features(bias, x)
    if rms or kernel is False or (kernel is None and not (kernel_fits(x) and layouts.one_device_program())):
        return _apply(x, gamma, bias, rms, epsilon)[0]
    return _layernorm(x, gamma, bias, epsilon, kernel is None)


def along_features(v: jax.Array | None, x: jax.Array) -> jax.Array | None:
    """v [H] laid out as x's last axis on a mesh of Explicit axes (a scale sharded over an axis
    that x's rows use, as an FSDP scale is, would make the product illegally sharded: JAX refuses
    `f32[B@data, T, H] * f32[H@data]`); v itself elsewhere. Its gradient comes back as v lies."""
    if v is None or not (layouts.typed_sharding(v) or layouts.typed_sharding(x)):
        return v
    mesh = jax.typeof(v if layouts.typed_sharding(v) else x).sharding.mesh
    spec = tuple(jax.typeof(x).sharding.spec) if layouts.typed_sharding(x) else ()
    last = spec[x.ndim - 1] if len(spec) >= x.ndim else None
    return jax.sharding.reshard(v, jax.sharding.NamedSharding(mesh, jax.P(last)))


def _row(v, ndim):
    """v [H] as float32 [1, ..., 1, H] (explicit, for rank promotion set to raise)."""
    return v.astype(jnp.float32).reshape((1,) * (ndim - 1) + v.shape)


def statistics(x: jax.Array, *, rms: bool, epsilon: float) -> tuple[jax.Array, jax.Array]:
    """(mean, rstd) of x [..., H] over H, float32 [..., 1] (mean zero for RMSNorm): the forward's
    own reduction (the same operations, so XLA computes them once where both are traced)."""
    return _statistics(x, rms, epsilon)[:2]


def _statistics(x, rms, epsilon):
    """(mean, rstd, x - mean in float32)."""
    xf = x.astype(jnp.float32)
    mean = jnp.zeros(x.shape[:-1] + (1,), jnp.float32) if rms else jnp.mean(xf, axis=-1, keepdims=True)
    centred = xf - mean
    rstd = lax.rsqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True) + jnp.float32(float(epsilon)))
    return mean, rstd, centred


def _apply(x, gamma, bias, rms, epsilon):
    """(y, mean, rstd), mean and rstd float32 [..., 1]."""
    mean, rstd, centred = _statistics(x, rms, epsilon)
    y = centred * rstd * _row(gamma, x.ndim)
    if bias is not None:
        y = y + _row(bias, x.ndim)
    return y.astype(x.dtype), mean, rstd


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _layernorm(x, gamma, bias, epsilon, by_platform):
    return _apply(x, gamma, bias, False, epsilon)[0]


def _forward(x, gamma, bias, epsilon, by_platform):
    y, mean, rstd = _apply(x, gamma, bias, False, epsilon)
    return y, (x, gamma, bias, mean, rstd)


def _backward(epsilon, by_platform, residuals, dy):
    x, gamma, bias, mean, rstd = residuals
    with_bias = bias is not None

    def by_kernel(x, dy, gamma, mean, rstd):
        return kernel_backward(x, dy, gamma, mean, rstd, with_bias=with_bias,
                               interpret=not by_platform and jax.default_backend() != "gpu")

    def by_autodiff(x, dy, gamma, mean, rstd):
        b = jnp.zeros(x.shape[-1:], jnp.float32) if with_bias else None
        return jax.vjp(lambda x, g, b: _apply(x, g, b, False, epsilon)[0], x, gamma, b)[1](dy)

    if by_platform:  # the kernel on CUDA, autodiff's backward on any other platform
        dx, dgamma, dbias = lax.platform_dependent(x, dy, gamma, mean, rstd, cuda=by_kernel,
                                                   default=by_autodiff)
    else:
        dx, dgamma, dbias = by_kernel(x, dy, gamma, mean, rstd)
    dgamma = summed_like(dgamma, gamma).astype(gamma.dtype)
    if with_bias:
        dbias = summed_like(dbias, bias).astype(bias.dtype)
    return dx, dgamma, dbias


_layernorm.defvjp(_forward, _backward)


def kernel_fits(x) -> bool:
    """Whether the backward kernel takes x [..., H]: H a power of two from 64 to 16384 (Triton's
    block shapes), R (the other axes' product) a multiple of ROWS_PER_PROGRAM, a float dtype,
    no typed sharding."""
    if x.ndim < 1:
        return False
    H = x.shape[-1]
    R = x.size // H if H else 0
    return (64 <= H <= 16384 and H & (H - 1) == 0 and R > 0 and R % ROWS_PER_PROGRAM == 0
            and x.dtype in (jnp.bfloat16, jnp.float16, jnp.float32) and not layouts.typed_sharding(x))


def kernel_backward(x, dy, gamma, mean, rstd, *, with_bias: bool, interpret: bool):
    """LayerNorm's (dx in x's dtype, dgamma, dbias or None in float32) from the forward's row
    statistics (mean, rstd: float32 [..., 1]), by the Pallas kernel."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    H = x.shape[-1]
    R = x.size // H
    step_rows = min(ROWS_PER_PROGRAM, max(1, _MAX_ELEMENTS_PER_STEP // H))
    programs = R // ROWS_PER_PROGRAM

    def body(x_ref, dy_ref, g_ref, mean_ref, rstd_ref, dx_ref, dg_ref, db_ref):
        gamma_row = g_ref[...]

        def step(i, sums):
            rows = pl.ds(i * step_rows, step_rows)
            dyf = dy_ref[rows, :].astype(jnp.float32)
            xhat = (x_ref[rows, :].astype(jnp.float32) - mean_ref[rows, :]) * rstd_ref[rows, :]
            g = dyf * gamma_row
            dx = g - jnp.mean(g, axis=1, keepdims=True) - xhat * jnp.mean(g * xhat, axis=1, keepdims=True)
            dx_ref[rows, :] = (dx * rstd_ref[rows, :]).astype(dx_ref.dtype)
            return (sums[0] + jnp.sum(dyf * xhat, axis=0, keepdims=True),
                    sums[1] + jnp.sum(dyf, axis=0, keepdims=True))

        zero = jnp.zeros((1, H), jnp.float32)
        dg, db = lax.fori_loop(0, ROWS_PER_PROGRAM // step_rows, step, (zero, zero))
        dg_ref[...] = dg
        db_ref[...] = db

    rows = pl.BlockSpec((ROWS_PER_PROGRAM, H), lambda p: (p, 0))
    stats = pl.BlockSpec((ROWS_PER_PROGRAM, 1), lambda p: (p, 0))
    sums = pl.BlockSpec((1, H), lambda p: (p, 0))
    dx, dg, db = pl.pallas_call(
        body, grid=(programs,),
        in_specs=[rows, rows, pl.BlockSpec((1, H), lambda p: (0, 0)), stats, stats],
        out_specs=[rows, sums, sums],
        out_shape=[jax.ShapeDtypeStruct((R, H), x.dtype), jax.ShapeDtypeStruct((programs, H), jnp.float32),
                   jax.ShapeDtypeStruct((programs, H), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS),
        interpret=interpret, name="layernorm_backward")(
            x.reshape(R, H), dy.reshape(R, H), gamma.astype(jnp.float32).reshape(1, H),
            mean.reshape(R, 1), rstd.reshape(R, 1))
    return dx.reshape(x.shape), jnp.sum(dg, axis=0), jnp.sum(db, axis=0) if with_bias else None
