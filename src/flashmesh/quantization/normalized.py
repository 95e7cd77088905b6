"""A LayerNorm's (or RMSNorm's) output quantised to FP8 in both layouts straight from its input
(TransformerEngine's layernorm + cast-transpose into an FP8 GEMM).

    quantize_both(source, y, scale, dtype) -> (q [M, K], q.T [K, M], amax [1])    of y

`Normalization` holds what the LayerNorm's output y [M, K] is made of: its input x [M, K], the
row statistics (float32 [M, 1]; no mean for RMSNorm) and gamma, beta [K] (float32; no beta for
RMSNorm), with y = ((x - mean) * rstd * gamma + beta) in x's dtype, the arithmetic and the
rounding of `nn.layernorm_vjp.normalize`'s forward. A LayerNorm in front of an FP8 GEMM
(`LayerNormDenseGeneral`, `LayerNormMLP`) hands its GEMM this beside y. On a lone CUDA device
(`kernel=None`, the rule of `layouts.quantize_both`) the quantising kernel normalises each tile
as it reads x, so y is never written (on the guide's layer each LayerNorm wrote y, 64 MiB of
bf16, in a fusion of 0.043 ms that the cast-transpose then read back: `loop_convert_fusion` in
benchmarks/results/2026-12-03-nvidia-h200-layer/c6893e1-profile_fp8.log); the statistics stay
XLA's reduction over x (the LayerNorm's backward keeps them). Elsewhere y itself is quantised
as `layouts.quantize_both` does, so other platforms compute exactly what they did without the
source (XLA, recomputing y inside its fusions, may keep it in more than x's precision).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from flashmesh.quantization import layouts, scaling

__all__ = ["Normalization", "quantize_both"]


class Normalization(NamedTuple):
    """y = ((x - mean) * rstd * gamma + beta) in x's dtype, x [M, K]; mean and rstd float32
    [M, 1] (mean None: RMSNorm), gamma and beta float32 [K] (beta None: no bias)."""

    x: jax.Array
    mean: jax.Array | None
    rstd: jax.Array
    gamma: jax.Array
    beta: jax.Array | None

    def check(self) -> "Normalization":
        M, K = self.x.shape if self.x.ndim == 2 else (None, None)
        if M is None:
            raise ValueError(f"Normalization.x must be 2-D, got shape {self.x.shape}")
        for name, v, shape in (("mean", self.mean, (M, 1)), ("rstd", self.rstd, (M, 1)),
                               ("gamma", self.gamma, (K,)), ("beta", self.beta, (K,))):
            if v is not None and tuple(v.shape) != shape:
                raise ValueError(f"Normalization.{name} must have shape {shape}, got {v.shape}")
        return self


def quantize_both(n: Normalization, y: jax.Array, scale: jax.Array, dtype, *, kernel: bool | None = None):
    """(q, q.T, amax) of the LayerNorm's output y [M, K] (made as n says), as
    `layouts.quantize_both(y, scale, dtype)` gives them. kernel: True the Pallas kernel from n
    (interpret mode off a GPU; ValueError where x does not fit it; y is not read), False
    `layouts.quantize_both` of y, None the kernel on a lone CUDA device where x fits it."""
    n = n.check()
    if y.shape != n.x.shape or y.dtype != n.x.dtype:
        raise ValueError(f"y must have x's shape and dtype {n.x.shape} {n.x.dtype}, got {y.shape} {y.dtype}")
    interpret = kernel is True and jax.default_backend() != "gpu"

    def xla(n, y, scale):
        return layouts.xla_form(y, scale, dtype)

    def cuda(n, y, scale):
        return _kernel(n, scale, dtype, interpret=interpret)

    q, qt, amax = layouts.choose(kernel, layouts.kernel_fits(n.x), cuda, xla, (
        f"x of shape {n.x.shape} and dtype {n.x.dtype} does not fit the kernel: sizes multiples of "
        f"({layouts.GEOMETRY.rows}, {layouts.GEOMETRY.cols}), bf16/f16/f32"))(n, y, scale)
    return q, qt, scaling.reduce_amax(amax, n.x)


def _kernel(n: Normalization, scale, dtype, *, interpret: bool):
    from jax.experimental import pallas as pl

    M, K = n.x.shape
    R, C = layouts.GEOMETRY.rows, layouts.GEOMETRY.cols
    has_mean, has_beta = n.mean is not None, n.beta is not None
    rows = pl.BlockSpec((R, 1), lambda i, j: (i, 0))
    cols = pl.BlockSpec((1, C), lambda i, j: (0, j))

    def body(*refs):
        refs = list(refs)
        v = refs.pop(0)[...].astype(jnp.float32)
        if has_mean:
            v = v - refs.pop(0)[...]
        v = v * refs.pop(0)[...] * refs.pop(0)[...]
        if has_beta:
            v = v + refs.pop(0)[...]
        v = v.astype(n.x.dtype).astype(jnp.float32)  # y as the LayerNorm rounds it
        s_ref, *outs = refs
        layouts.write_tile(v, s_ref[0], dtype, *outs)

    row = lambda a: a.astype(jnp.float32).reshape(1, K)  # noqa: E731
    operands = [n.x] + ([n.mean] if has_mean else []) + [n.rstd, row(n.gamma)] + (
        [row(n.beta)] if has_beta else []) + [scale.reshape(1).astype(jnp.float32)]
    in_specs = [pl.BlockSpec((R, C), lambda i, j: (i, j))] + ([rows] if has_mean else []) + [rows, cols] + (
        [cols] if has_beta else []) + [pl.BlockSpec((1,), lambda i, j: (0,))]
    grid = (M // R, K // C)
    q, qt, tiles = pl.pallas_call(
        body, grid=grid, in_specs=in_specs, out_specs=layouts.output_specs(),
        out_shape=[jax.ShapeDtypeStruct((M, K), dtype), jax.ShapeDtypeStruct((K, M), dtype),
                   jax.ShapeDtypeStruct(grid, jnp.float32)],
        compiler_params=layouts.compiler_params(), interpret=interpret,
        name="fp8_layernorm_quantize_both")(*operands)
    return q, qt, jnp.max(tiles)
