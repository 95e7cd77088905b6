"""An MLP's activation fused with the FP8 quantisation of its output, and its backward fused with
the quantisation of the pre-activation's gradient (TransformerEngine's `act_lu` + cast-transpose
and `dact_lu` + dbias + cast-transpose).

    act_quantize_both(h, bias, acts, scale, dtype)        -> (q, q.T, amax)           of a
    dact_quantize_both(g, h, bias, acts, scale, dtype)    -> (q, q.T, amax, dbias)    of dh

h [M, n*F] is the first GEMM's output without its bias, n = len(acts) blocks of F columns;
v_k = h[:, kF:(k+1)F] + bias[kF:(k+1)F] in float32, a = acts[0](v_0) (* acts[1](v_1) for a gated
pair), and dh = d<a, g>/dv, [M, n*F]. Everything is computed in float32 and quantised from it
(the unfused composition rounds h + bias and a to the activations' dtype first).

At the guide's layer (M 8192, F 16384, GELU) the unfused forward wrote h + bias and a as bf16
arrays (one fusion) that the cast-transpose read again, and the backward wrote dh before its
cast-transpose read it: 1.3 GB and 0.77 GB of traffic against 0.5 GB and 0.77 GB here
(`loop_add_convert_fusion` 0.254 ms, `loop_convert_fusion` 0.305 ms and two cast-transposes of
0.17 ms in benchmarks/results/2026-12-02-nvidia-h200-fp8-profile/). On a lone CUDA device each
is one Pallas Triton kernel over tiles of `layouts.GEOMETRY` (64 x 64) (`kernel=None`, the rule of
`layouts.quantize_both`); elsewhere the same arithmetic in XLA.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from flashmesh.quantization import layouts, scaling

__all__ = ["act_quantize_both", "dact_quantize_both", "fits", "gelu_tanh"]

_C = 0.7978845608028654  # sqrt(2 / pi)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU's tanh form, TransformerEngine's gelu: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
    The kernels compute it and its derivative with the GPU's one-instruction tanh (tanh.approx.f32,
    relative error about 2^-11, below FP8's rounding)."""
    return jax.nn.gelu(x, approximate=True)


def _gelu_parts(v, tanh):
    """GELU's value and derivative at v from one tanh."""
    v2 = v * v
    t = tanh(_C * v * (1.0 + 0.044715 * v2))
    half = 0.5 * (1.0 + t)
    return v * half, half + 0.5 * v * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * v2)


def _kernel_tanh(interpret: bool):
    if interpret:
        return jnp.tanh
    from jax.experimental.pallas import triton as pltriton
    return pltriton.approx_tanh


def _kernel_activate(acts, vs, interpret):
    """The activation inside a kernel (GELU by its one-tanh form)."""
    if acts[0] is gelu_tanh:
        a = _gelu_parts(vs[0], _kernel_tanh(interpret))[0]
        return a * acts[1](vs[1]) if len(acts) == 2 else a
    return _activate(acts, vs)


def _kernel_gradients(acts, vs, g, interpret):
    """d<act(v), g>/dv_k for each block inside a kernel (GELU's derivative by hand, the rest by
    autodiff)."""
    if acts[0] is gelu_tanh:
        a0, d0 = _gelu_parts(vs[0], _kernel_tanh(interpret))
        if len(acts) == 1:
            return [g * d0]
        a1, pullback = jax.vjp(acts[1], vs[1])
        return [g * a1 * d0, pullback(g * a0)[0]]
    _, pullback = jax.vjp(lambda *vs: _activate(acts, vs), *vs)
    return list(pullback(g))


def fits(h: jax.Array, n: int) -> bool:
    """Whether the kernels take h [M, n*F]: layouts.kernel_fits and F a multiple of the kernels'
    columns (layouts.GEOMETRY)."""
    return (layouts.kernel_fits(h) and h.shape[1] % n == 0
            and (h.shape[1] // n) % layouts.GEOMETRY.cols == 0)


def _activate(acts: Sequence[Callable], vs):
    a = acts[0](vs[0])
    return a * acts[1](vs[1]) if len(acts) == 2 else a


def _blocks(h, bias, n):
    """v_k, the n float32 blocks of h + bias."""
    F = h.shape[1] // n
    v = h.astype(jnp.float32)
    if bias is not None:
        v = v + bias.astype(jnp.float32).reshape(1, -1)
    return [v[:, k * F:(k + 1) * F] for k in range(n)]


def _choose(kernel, h, n, cuda, xla):
    """The kernel (cuda), the XLA form, or the platform's choice between them (kernel=None)."""
    return layouts.choose(kernel, fits(h, n), cuda, xla, (
        f"h of shape {h.shape} and dtype {h.dtype} does not fit the kernel for {n} block(s): sizes "
        f"multiples of ({layouts.GEOMETRY.rows}, {layouts.GEOMETRY.cols}) per block, bf16/f16/f32"))


def act_quantize_both(h: jax.Array, bias: jax.Array | None, acts: Sequence[Callable], scale: jax.Array,
                      dtype, *, kernel: bool | None = None):
    """(q [M, F], q.T [F, M], amax [1]) of a = act(h + bias) (see the module docstring)."""
    n = len(acts)
    if h.ndim != 2 or h.shape[1] % n:
        raise ValueError(f"h must be [M, {n}*F], got shape {h.shape}")
    interpret = kernel is True and jax.default_backend() != "gpu"

    def xla(h, bias, scale):
        return layouts.xla_form(_activate(acts, _blocks(h, bias, n)), scale, dtype)

    def cuda(h, bias, scale):
        return _forward_kernel(h, bias, scale, acts, dtype, interpret=interpret)

    q, qt, amax = _choose(kernel, h, n, cuda, xla)(h, bias, scale)
    return q, qt, scaling.reduce_amax(amax, h)


def dact_quantize_both(g: jax.Array, h: jax.Array, bias: jax.Array | None, acts: Sequence[Callable],
                       scale: jax.Array, dtype, *, kernel: bool | None = None):
    """(q [M, nF], q.T [nF, M], amax [1], dbias [nF] float32 or None) of dh, the gradient of
    <act(h + bias), g> with respect to h (see the module docstring)."""
    n = len(acts)
    if h.ndim != 2 or g.ndim != 2 or h.shape != (g.shape[0], n * g.shape[1]):
        raise ValueError(f"h must be [M, {n}*F] for g [M, F]: got h {h.shape}, g {g.shape}")
    interpret = kernel is True and jax.default_backend() != "gpu"

    def xla(g, h, bias, scale):
        vs = _blocks(h, bias, n)
        _, pullback = jax.vjp(lambda *vs: _activate(acts, vs), *vs)
        dh = jnp.concatenate(pullback(g.astype(jnp.float32)), axis=1)
        return (*layouts.xla_form(dh, scale, dtype), None if bias is None else jnp.sum(dh, axis=0))

    def cuda(g, h, bias, scale):
        return _backward_kernel(g, h, bias, scale, acts, dtype, interpret=interpret)

    q, qt, amax, dbias = _choose(kernel, h, n, cuda, xla)(g, h, bias, scale)
    return q, qt, scaling.reduce_amax(amax, h), dbias


def _specs(n, J, bias, block):
    """In-specs of h's n blocks (and bias's) for the program at (i, j) of block j's columns."""
    from jax.experimental import pallas as pl

    R, C = layouts.GEOMETRY.rows, layouts.GEOMETRY.cols
    specs = [pl.BlockSpec((R, C), (lambda k: lambda i, c: (i, k * J + block(c)))(k)) for k in range(n)]
    if bias is not None:
        specs += [pl.BlockSpec((C,), (lambda k: lambda i, c: (k * J + block(c),))(k)) for k in range(n)]
    return specs


def _read(refs, n, has_bias):
    hs, rest = refs[:n], refs[n:]
    vs = [r[...].astype(jnp.float32) for r in hs]
    if has_bias:
        vs = [v + b[...].astype(jnp.float32).reshape(1, -1) for v, b in zip(vs, rest[:n])]
        rest = rest[n:]
    return vs, rest


def _forward_kernel(h, bias, scale, acts, dtype, *, interpret: bool):
    from jax.experimental import pallas as pl

    n = len(acts)
    M, F = h.shape[0], h.shape[1] // n
    R, C = layouts.GEOMETRY.rows, layouts.GEOMETRY.cols
    J = F // C
    has_bias = bias is not None

    def body(*refs):
        vs, (s_ref, q_ref, qt_ref, amax_ref) = _read(refs, n, has_bias)
        layouts.write_tile(_kernel_activate(acts, vs, interpret), s_ref[0], dtype, q_ref, qt_ref, amax_ref)

    grid = (M // R, J)
    operands = [h] * n + ([bias] * n if has_bias else []) + [scale.reshape(1).astype(jnp.float32)]
    q, qt, tiles = pl.pallas_call(
        body, grid=grid,
        in_specs=_specs(n, J, bias, lambda c: c) + [pl.BlockSpec((1,), lambda i, c: (0,))],
        out_specs=layouts.output_specs(),
        out_shape=[jax.ShapeDtypeStruct((M, F), dtype), jax.ShapeDtypeStruct((F, M), dtype),
                   jax.ShapeDtypeStruct(grid, jnp.float32)],
        compiler_params=layouts.compiler_params(), interpret=interpret,
        name="fp8_act_quantize_both")(*operands)
    return q, qt, jnp.max(tiles)


def _backward_kernel(g, h, bias, scale, acts, dtype, *, interpret: bool):
    """The grid covers dh's n*F columns; a program of block k recomputes every block's
    activation at its rows and columns and keeps the gradient of block k."""
    from jax.experimental import pallas as pl

    n = len(acts)
    M, F = g.shape
    R, C = layouts.GEOMETRY.rows, layouts.GEOMETRY.cols
    J = F // C
    has_bias = bias is not None

    def body(*refs):
        vs, rest = _read(refs[1:], n, has_bias)
        s_ref, q_ref, qt_ref, amax_ref = rest[:4]
        dvs = _kernel_gradients(acts, vs, refs[0][...].astype(jnp.float32), interpret)
        dv = dvs[0]
        if n == 2:
            dv = jnp.where(pl.program_id(1) < J, dvs[0], dvs[1])
        layouts.write_tile(dv, s_ref[0], dtype, q_ref, qt_ref, amax_ref)
        if has_bias:
            rest[4][...] = jnp.sum(dv, axis=0).reshape(1, C)

    grid = (M // R, n * J)
    operands = [g] + [h] * n + ([bias] * n if has_bias else []) + [scale.reshape(1).astype(jnp.float32)]
    out_specs = layouts.output_specs()
    out_shape = [jax.ShapeDtypeStruct((M, n * F), dtype), jax.ShapeDtypeStruct((n * F, M), dtype),
                 jax.ShapeDtypeStruct(grid, jnp.float32)]
    if has_bias:  # each row tile's column sums, summed below (M / R rows of float32)
        out_specs.append(pl.BlockSpec((1, C), lambda i, c: (i, c)))
        out_shape.append(jax.ShapeDtypeStruct((M // R, n * F), jnp.float32))
    outs = pl.pallas_call(
        body, grid=grid,
        in_specs=[pl.BlockSpec((R, C), lambda i, c: (i, c % J))] + _specs(n, J, bias, lambda c: c % J)
        + [pl.BlockSpec((1,), lambda i, c: (0,))],
        out_specs=out_specs, out_shape=out_shape, compiler_params=layouts.compiler_params(),
        interpret=interpret, name="fp8_dact_quantize_both")(*operands)
    q, qt, tiles = outs[:3]
    dbias = jnp.sum(outs[3], axis=0) if has_bias else None
    return q, qt, jnp.max(tiles), dbias
