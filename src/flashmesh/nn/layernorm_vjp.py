"""`normalize(x, gamma, bias, rms, epsilon)`: LayerNorm / RMSNorm of x [..., H] over its last axis
with a hand-written backward that reads x and dy once.

    forward   mean, rstd per row (float32), y = (x - mean) * rstd * gamma + bias  (x's dtype)
    backward  xhat = (x - mean) * rstd, g = dy * gamma
              dx     = rstd * (g - mean(g) - xhat * mean(g * xhat))     (rms: no mean(g) term)
              dgamma = sum over rows of dy * xhat,  dbias = sum over rows of dy

Only x (the residual stream, alive anyway) and two float32 numbers per row are kept for the
backward. Left to autodiff, XLA wrote float32 arrays of x's size between its fusions: on the
guide's FP8 layer (rows 8192, H 4096) each LayerNorm's backward was four kernels of 0.28-0.32 ms
together (benchmarks/results/2026-12-03-nvidia-h200-bench-gap/profile_fp8_bench_form.log:
fusion.43, input_reduce_fusion.2 and .4, fusion.214), about six passes over the data.

On a lone CUDA device, where the sizes fit (`kernel_fits`), the backward is one Pallas Triton
kernel: each program walks `ROWS_PER_PROGRAM` rows, writes their dx and one row of float32
partial sums of dgamma and dbias (summed by XLA afterwards); elsewhere (CPU, meshes,
`shard_map`, other sizes) the same arithmetic in XLA. The rule is that of
`quantization.layouts.quantize_both` (`lax.platform_dependent` at lowering). Both are plain
functions of the inputs (the kernel's sums run in a different order, so the two agree to
float32 rounding, not bit for bit). The kernel's backward is not itself differentiable
(grad of grad runs the XLA form: `kernel=False`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from flashmesh.attention.varying import varying_axes
from flashmesh.quantization import layouts

__all__ = ["normalize", "backward", "kernel_fits", "ROWS_PER_PROGRAM"]

ROWS_PER_PROGRAM = 32  # rows one kernel program walks (one row of partial sums each)
_MAX_ELEMENTS_PER_STEP = 8192  # elements of x (and of dy) one loop step loads


def normalize(x: jax.Array, gamma: jax.Array, bias: jax.Array | None, *, rms: bool,
              epsilon: float, kernel: bool | None = None) -> jax.Array:
    """x [..., H] normalised over H, times gamma [H] (float32, zero-centring already added), plus
    bias [H] (None for RMSNorm or no bias), in x's dtype. kernel: the backward's form, True
    the Pallas kernel (interpret mode off a GPU), False XLA, None the kernel where it fits on
    a lone CUDA device."""
    if x.ndim < 1 or gamma.shape != x.shape[-1:]:
        raise ValueError(f"gamma must have shape {x.shape[-1:]} (x's last axis), got {gamma.shape}")
    return _normalize(x, gamma, bias, rms, float(epsilon), kernel)


def _stats(x, rms, epsilon):
    xf = x.astype(jnp.float32)
    mean = jnp.zeros(x.shape[:-1] + (1,), jnp.float32) if rms else jnp.mean(xf, axis=-1, keepdims=True)
    centred = xf - mean
    rstd = lax.rsqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True) + jnp.float32(epsilon))
    return centred, mean, rstd


def _apply(x, gamma, bias, rms, epsilon):
    centred, mean, rstd = _stats(x, rms, epsilon)
    y = centred * rstd * _row(gamma, x.ndim)
    if bias is not None:
        y = y + _row(bias, x.ndim)
    return y.astype(x.dtype), mean, rstd


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _normalize(x, gamma, bias, rms, epsilon, kernel):
    return _apply(x, gamma, bias, rms, epsilon)[0]


def _forward(x, gamma, bias, rms, epsilon, kernel):
    y, mean, rstd = _apply(x, gamma, bias, rms, epsilon)
    return y, (x, gamma, bias, mean, rstd)


def _row(v, ndim):
    """v [H] as float32 [1, ..., 1, H] (explicit, for rank promotion set to raise)."""
    return v.astype(jnp.float32).reshape((1,) * (ndim - 1) + v.shape)


def _summed_like(grad, primal_like):
    """Inside `shard_map`: a parameter's gradient summed over the manual axes the rows vary
    along but the parameter does not (what autodiff's transpose of its broadcast does)."""
    extra = tuple(a for a in varying_axes(grad) if a not in varying_axes(primal_like))
    return lax.psum(grad, extra) if extra else grad


def _backward(rms, epsilon, kernel, residuals, dy):
    x, gamma, bias, mean, rstd = residuals
    dx, dgamma, dbias = backward(x, dy, gamma, mean, rstd, rms=rms, with_bias=bias is not None,
                                 kernel=kernel)
    dgamma = _summed_like(dgamma, gamma).astype(gamma.dtype)
    if bias is not None:
        dbias = _summed_like(dbias, bias).astype(bias.dtype)
    return dx, dgamma, dbias


_normalize.defvjp(_forward, _backward)


def backward(x, dy, gamma, mean, rstd, *, rms: bool, with_bias: bool, kernel: bool | None = None):
    """(dx in x's dtype, dgamma, dbias or None in float32) from the forward's row statistics
    (mean, rstd: float32 [..., 1])."""
    xla = functools.partial(_xla, rms=rms, with_bias=with_bias)
    if kernel is None:
        if kernel_fits(x) and layouts.one_device_program():
            return lax.platform_dependent(
                x, dy, gamma, mean, rstd, default=xla,
                cuda=lambda *a: _kernel_nd(*a, rms=rms, with_bias=with_bias, interpret=False))
        return xla(x, dy, gamma, mean, rstd)
    if kernel:
        if not kernel_fits(x):
            raise ValueError(f"x of shape {x.shape} and dtype {x.dtype} does not fit the LayerNorm kernel: "
                             f"H a power of two in [64, 16384], rows a multiple of {ROWS_PER_PROGRAM}, "
                             f"bf16/f16/f32, not sharded in its type")
        return _kernel_nd(x, dy, gamma, mean, rstd, rms=rms, with_bias=with_bias,
                          interpret=jax.default_backend() != "gpu")
    return xla(x, dy, gamma, mean, rstd)


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


def _row_terms(x, dy, gamma, mean, rstd, rms):
    """(dx in float32, dy * xhat) for rows of x, dy (float32 [..., H]); gamma [1, ..., 1, H]."""
    xhat = (x - mean) * rstd
    g = dy * gamma
    dx = g - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True)
    if not rms:
        dx = dx - jnp.mean(g, axis=-1, keepdims=True)
    return dx * rstd, dy * xhat


def _xla(x, dy, gamma, mean, rstd, *, rms, with_bias):
    dyf = dy.astype(jnp.float32)
    dx, dg = _row_terms(x.astype(jnp.float32), dyf, _row(gamma, x.ndim), mean, rstd, rms)
    lead = tuple(range(x.ndim - 1))
    return dx.astype(x.dtype), jnp.sum(dg, axis=lead), jnp.sum(dyf, axis=lead) if with_bias else None


def _kernel_nd(x, dy, gamma, mean, rstd, **options):
    H = x.shape[-1]
    dx, dg, db = _kernel(x.reshape(-1, H), dy.reshape(-1, H), gamma, mean.reshape(-1, 1),
                         rstd.reshape(-1, 1), **options)
    return dx.reshape(x.shape), dg, db


def _kernel(x, dy, gamma, mean, rstd, *, rms, with_bias, interpret: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    R, H = x.shape
    step_rows = min(ROWS_PER_PROGRAM, max(1, _MAX_ELEMENTS_PER_STEP // H))
    programs = R // ROWS_PER_PROGRAM

    def body(x_ref, dy_ref, g_ref, mean_ref, rstd_ref, dx_ref, dg_ref, db_ref):
        gamma_row = g_ref[...].astype(jnp.float32)

        def step(i, sums):
            rows = pl.ds(i * step_rows, step_rows)
            dyf = dy_ref[rows, :].astype(jnp.float32)
            dx, dg = _row_terms(x_ref[rows, :].astype(jnp.float32), dyf, gamma_row,
                                mean_ref[rows, :], rstd_ref[rows, :], rms)
            dx_ref[rows, :] = dx.astype(dx_ref.dtype)
            return (sums[0] + jnp.sum(dg, axis=0, keepdims=True),
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
        compiler_params=pltriton.CompilerParams(num_warps=8),
        interpret=interpret, name="layernorm_backward")(
            x, dy, gamma.astype(jnp.float32).reshape(1, H), mean, rstd)
    return dx, jnp.sum(dg, axis=0), jnp.sum(db, axis=0) if with_bias else None
