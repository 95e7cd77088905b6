"""A GEMM's gradient given in equal parts quantised as the one array they make side by side
(TransformerEngine's cast-transpose with dbias, reading the parts where they lie):

    quantize_parts(parts, scale, dtype) -> (q [M, N], q.T [N, M], amax [1], column sums [N])

parts: p arrays [M, N/p]; q = quantize(concatenate(parts, axis=1), scale, dtype) and the
column sums (float32) are the bias gradient of a projection whose output was split into the
parts. A fused QKV projection's output is split into q, k and v for the attention; its
gradient comes back as dq, dk and dv, which XLA packed into [M, 3F] (with the bias sums) before
the cast-transpose read them again: 0.123 ms of the guide's FP8 layer step
(`input_add_reduce_fusion` in benchmarks/results/2026-12-03-nvidia-h200-layer/c6893e1-profile_fp8.log).
On a lone CUDA device (`kernel=None`, the rule of `layouts.quantize_both`) one Pallas Triton
kernel reads each part's tiles where they lie and writes the packed layouts, the tile amaxes
and the tiles' column sums; elsewhere the parts are concatenated and `layouts.xla_form` quantises
them (XLA fuses the concatenation into the quantisation).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from flashmesh.quantization import layouts, scaling

__all__ = ["quantize_parts", "parts_fit"]


def parts_fit(parts: Sequence[jax.Array]) -> bool:
    """Whether the kernel takes the parts: each fits `layouts.quantize_both`'s kernel."""
    return all(layouts.kernel_fits(p) for p in parts)


def _check(parts: Sequence[jax.Array]) -> None:
    if not parts:
        raise ValueError("parts must hold at least one array, got none")
    first = parts[0]
    if first.ndim != 2:
        raise ValueError(f"parts[0] must be 2-D, got shape {first.shape}")
    for i, p in enumerate(parts):
        if p.shape != first.shape or p.dtype != first.dtype:
            raise ValueError(f"parts[{i}] must have parts[0]'s shape and dtype "
                             f"{first.shape} {first.dtype}, got {p.shape} {p.dtype}")


def quantize_parts(parts: Sequence[jax.Array], scale: jax.Array, dtype, *, kernel: bool | None = None):
    """(q, q.T, amax, column sums) of the parts side by side, see the module docstring. The
    amax is reduced over the devices the parts are split across (inside shard_map), the sums
    are not (the caller sums a bias gradient like its bias). kernel: True the Pallas kernel
    (interpret mode off a GPU; ValueError where the parts do not fit it), False the XLA form,
    None the kernel on a lone CUDA device where the parts fit it."""
    parts = tuple(parts)
    _check(parts)
    interpret = kernel is True and jax.default_backend() != "gpu"

    def xla(scale, *parts):
        g = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        q, qt, amax = layouts.xla_form(g, scale, dtype)
        return q, qt, amax, jnp.sum(g.astype(jnp.float32), axis=0)

    def cuda(scale, *parts):
        return _kernel(parts, scale, dtype, interpret=interpret)

    q, qt, amax, sums = layouts.choose(kernel, parts_fit(parts), cuda, xla, (
        f"parts of shape {parts[0].shape} and dtype {parts[0].dtype} do not fit the kernel: sizes "
        f"multiples of ({layouts.GEOMETRY.rows}, {layouts.GEOMETRY.cols}), bf16/f16/f32, not sharded "
        f"in their type"))(scale, *parts)
    return q, qt, scaling.reduce_amax(amax, parts), sums


def _kernel(parts, scale, dtype, *, interpret: bool):
    """Grid (M / R, p * J): the program at column block c reads part c // J's block c % J
    (only that part's tile is loaded: the other parts' loads sit in untaken branches)."""
    from jax.experimental import pallas as pl

    n = len(parts)
    M, F = parts[0].shape
    R, C = layouts.GEOMETRY.rows, layouts.GEOMETRY.cols
    J = F // C

    def body(*refs):
        part_refs, (s_ref, q_ref, qt_ref, amax_ref, sums_ref) = refs[:n], refs[n:]
        # Each branch loads its part's tile (the pattern of jax's Triton decode attention: a
        # cond returning what its branch loaded); the writes follow outside the branches.
        v = lax.switch(pl.program_id(1) // J, [lambda r=r: r[...].astype(jnp.float32) for r in part_refs])
        layouts.write_tile(v, s_ref[0], dtype, q_ref, qt_ref, amax_ref)
        sums_ref[...] = jnp.sum(v, axis=0).reshape(1, C)

    grid = (M // R, n * J)
    part_spec = pl.BlockSpec((R, C), lambda i, c: (i, c % J))
    q, qt, tiles, sums = pl.pallas_call(
        body, grid=grid, in_specs=[part_spec] * n + [pl.BlockSpec((1,), lambda i, c: (0,))],
        out_specs=layouts.output_specs() + [pl.BlockSpec((1, C), lambda i, c: (i, c))],
        out_shape=[jax.ShapeDtypeStruct((M, n * F), dtype), jax.ShapeDtypeStruct((n * F, M), dtype),
                   jax.ShapeDtypeStruct(grid, jnp.float32),
                   jax.ShapeDtypeStruct((M // R, n * F), jnp.float32)],
        compiler_params=layouts.compiler_params(), interpret=interpret,
        name="fp8_parts_quantize_both")(*parts, scale.reshape(1).astype(jnp.float32))
    return q, qt, jnp.max(tiles), jnp.sum(sums, axis=0)
