"""An FP8 tensor in both layouts: `quantize_both(x, scale, dtype)` -> (q, q.T, amax(x)), and
`byte_transpose(q)`, the transpose of a 2-D array of one-byte elements moved as 4 x 4 blocks of
bytes packed in uint32 words.

Hopper's FP8 GEMMs take both operands contiguous along the contracted axis, so the weight
gradient (contracted over tokens) needs every FP8 activation and gradient transposed. XLA's
own transpose of a one-byte array ran at about 0.6 TB/s on the H200 (`wrapped_transpose`,
2026-12-02 profile of the FP8 TransformerLayer); a transpose of 4-byte words is XLA's fast,
tiled case. The bytes of each 4 x 4 block are regrouped within its four words (shifts and
masks) and the words transposed; the result is bit-identical to `q.T` on every platform.

`quantize_both`'s kernel is one Pallas Triton kernel that reads x once and writes both layouts
and per-tile amaxes (TransformerEngine's cast-transpose), the same bytes as the XLA form (NaN
payloads aside). H200, 2026-12-02 (x read once, both layouts written,
`benchmarks/probe_fp8_transpose.py`): bf16 [8192, 16384] 0.158 ms for that kernel, 0.257 for
quantise + byte_transpose, 0.342 for quantise + `.T`. `kernel=None` (what `dense` passes) takes
it where it can run as one kernel: a CUDA device, sizes multiples of GEOMETRY's tile, a process with one
device and no mesh or `shard_map` around the call (with several devices the SPMD partitioner
would gather a Pallas call's operands); the XLA form elsewhere. `kernel=True` forces it
(interpret mode off a GPU), `kernel=False` refuses it. The choice between the two is made when
lowering for the platform (`lax.platform_dependent`); a `jax.export` for several platforms at
once from a one-device process would lower the CUDA branch's Pallas call for the CPU and fail.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from typing import NamedTuple

from jax import lax

from flashmesh.quantization import scaling

__all__ = ["GEOMETRY", "Geometry", "byte_transpose", "kernel_fits", "one_device_program", "quantize_both", "write_tile",
           "xla_form", "choose", "typed_sharding"]

class Geometry(NamedTuple):
    """The quantise kernels' programs (this module's and `activation`'s): rows x cols of the
    input per program (powers of two from 16) and Triton's num_warps (None: its default, 4)."""

    rows: int = 64
    cols: int = 64
    num_warps: int | None = None


# 64 x 64, 4 warps: the only geometry timed so far (2026-12-02, 2.4-3.4 TB/s in the FP8 layer);
# benchmarks/probe_fp8_transpose.py --geometries times others. Sizes must be multiples of it.
GEOMETRY = Geometry()


def output_specs():
    """The Pallas out-specs every quantise kernel writes at program (i, j) of GEOMETRY: q's tile,
    q.T's tile and the tile's amax."""
    from jax.experimental import pallas as pl

    R, C = GEOMETRY.rows, GEOMETRY.cols
    return [pl.BlockSpec((R, C), lambda i, j: (i, j)), pl.BlockSpec((C, R), lambda i, j: (j, i)),
            pl.BlockSpec((1, 1), lambda i, j: (i, j))]


def compiler_params():
    """The Pallas Triton compiler params of GEOMETRY (None: Triton's defaults); ValueError for a
    geometry Triton cannot take. GEOMETRY is read when a kernel is traced: a jitted function
    traced before it changed keeps the old one."""
    rows, cols, warps = GEOMETRY
    for name, n in (("rows", rows), ("cols", cols)):
        if not isinstance(n, int) or n < 16 or n & (n - 1):
            raise ValueError(f"layouts.GEOMETRY.{name} must be a power of two >= 16, got {n!r}")
    if warps is not None and warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"layouts.GEOMETRY.num_warps must be None or a power of two <= 16, got {warps!r}")
    if GEOMETRY.num_warps is None:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=GEOMETRY.num_warps)


def byte_transpose(q: jax.Array) -> jax.Array:
    """q [M, K] of a one-byte dtype -> q.T [K, M], bit-identical. Sizes that are not multiples
    of 4, other dtypes and arrays sharded in their type (Explicit mesh axes, where the block
    reshape would need its own output sharding) take the plain transpose."""
    if q.ndim != 2:
        raise ValueError(f"q must be 2-D, got shape {q.shape}")
    M, K = q.shape
    if jnp.dtype(q.dtype).itemsize != 1 or M % 4 or K % 4 or M == 0 or K == 0 or typed_sharding(q):
        return q.T
    u8 = lax.bitcast_convert_type(q, jnp.uint8)
    # w[a, i, b] holds row 4a+i's bytes of columns 4b .. 4b+3 (byte j = column 4b+j).
    w = lax.bitcast_convert_type(u8.reshape(M // 4, 4, K // 4, 4), jnp.uint32)
    rows = [w[:, i, :] for i in range(4)]
    mask = jnp.uint32(0xFF)
    # p[a, j, b] holds column 4b+j's bytes of rows 4a .. 4a+3 (byte i = row 4a+i).
    p = jnp.stack([
        (((rows[0] >> (8 * j)) & mask) | (((rows[1] >> (8 * j)) & mask) << 8)
         | (((rows[2] >> (8 * j)) & mask) << 16) | (((rows[3] >> (8 * j)) & mask) << 24))
        for j in range(4)], axis=1)
    out = lax.bitcast_convert_type(jnp.transpose(p, (2, 1, 0)), jnp.uint8)  # [K/4, 4, M/4, 4]
    return lax.bitcast_convert_type(out.reshape(K, M), q.dtype)


def typed_sharding(x) -> bool:
    """Whether x's type carries a sharding over Explicit mesh axes."""
    types = getattr(getattr(jax.typeof(x).sharding, "mesh", None), "axis_types", ())
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def quantize_both(x: jax.Array, scale: jax.Array, dtype, *, kernel: bool | None = None):
    """x [M, K] (bf16, f16 or f32) -> (q [M, K], q.T [K, M], amax [1]): q = quantize(x, scale,
    dtype) as `scaling.quantize`, amax = `scaling.amax(x)` (reduced over the devices x is split
    across inside shard_map). kernel: True the Pallas kernel, False the XLA form, None the
    kernel on a lone CUDA device where x fits it (see the module docstring)."""
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D, got shape {x.shape}")
    interpret = kernel is True and jax.default_backend() != "gpu"
    q, qt, amax = choose(kernel, kernel_fits(x), lambda x, s: _kernel(x, s, dtype, interpret=interpret),
                         lambda x, s: xla_form(x, s, dtype), (
        f"x of shape {x.shape} and dtype {x.dtype} does not fit the kernel: sizes multiples of "
        f"({GEOMETRY.rows}, {GEOMETRY.cols}), bf16/f16/f32, not sharded in its type"))(x, scale)
    return q, qt, scaling.reduce_amax(amax, x)


def one_device_program() -> bool:
    """Whether the program being traced runs on one device with no mesh around it: one device
    in the process, and no abstract mesh set (`jax.set_mesh`, AOT lowering for a topology) and
    no `shard_map` (whose manual axes the Pallas call's outputs would not carry)."""
    mesh = jax.sharding.get_abstract_mesh()
    return jax.device_count() == 1 and (mesh.empty or (mesh.size == 1 and not mesh.manual_axes))


def kernel_fits(x) -> bool:
    """Whether the kernel takes x: 2-D, sizes multiples of GEOMETRY's tile, bf16/f16/f32, no typed
    sharding."""
    return (x.ndim == 2 and x.shape[0] % GEOMETRY.rows == 0 and x.shape[1] % GEOMETRY.cols == 0
            and x.shape[0] > 0
            and not typed_sharding(x) and x.dtype in (jnp.bfloat16, jnp.float16, jnp.float32))


def choose(kernel: bool | None, fits: bool, cuda, xla, refusal: str):
    """The quantise kernels' rule for `kernel=`: True the kernel (cuda; a ValueError `refusal`
    where the inputs do not fit it), False the XLA form, None the platform's choice between them
    at lowering where the inputs fit and the program runs on one device (else the XLA form)."""
    if kernel is None:
        if fits and one_device_program():
            return lambda *args: lax.platform_dependent(*args, cuda=cuda, default=xla)
        return xla
    if kernel and not fits:
        raise ValueError(refusal)
    return cuda if kernel else xla


def xla_form(x, scale, dtype):
    """`quantize_both`'s XLA form on this device: (q, q.T by `byte_transpose`, local amax)."""
    q = scaling.quantize(x, scale, dtype)
    return q, byte_transpose(q), scaling.local_amax(x)


def _kernel(x, scale, dtype, *, interpret: bool):
    from jax.experimental import pallas as pl

    M, K = x.shape

    def body(x_ref, s_ref, q_ref, qt_ref, amax_ref):
        write_tile(x_ref[...].astype(jnp.float32), s_ref[0], dtype, q_ref, qt_ref, amax_ref)

    R, C = GEOMETRY.rows, GEOMETRY.cols
    grid = (M // R, K // C)
    q, qt, tiles = pl.pallas_call(
        body, grid=grid,
        in_specs=[pl.BlockSpec((R, C), lambda i, j: (i, j)), pl.BlockSpec((1,), lambda i, j: (0,))],
        out_specs=output_specs(),
        out_shape=[jax.ShapeDtypeStruct((M, K), dtype), jax.ShapeDtypeStruct((K, M), dtype),
                   jax.ShapeDtypeStruct(grid, jnp.float32)],
        compiler_params=compiler_params(), interpret=interpret,
        name="fp8_quantize_both")(x, scale.reshape(1).astype(jnp.float32))
    return q, qt, jnp.max(tiles)


def write_tile(v, s, dtype, q_ref, qt_ref, amax_ref):
    """Inside a quantise kernel: the float32 tile v quantised with scale s into both layouts'
    refs, and its amax."""
    q_ref[...] = quantize_tile(v, s, dtype)
    qt_ref[...] = quantize_tile(v.T, s, dtype)
    amax_ref[...] = tile_amax(v)


def quantize_tile(v, s, dtype):
    """Inside a kernel: v * s clipped to the FP8 range, in dtype; NaN stays NaN (Triton's min and
    max clip it to a bound, -448 on the H200, 2026-12-02, where XLA's clip keeps it)."""
    top = float(jnp.finfo(dtype).max)
    scaled = v * s
    return jnp.where(jnp.isnan(scaled), scaled, jnp.clip(scaled, -top, top)).astype(dtype)


def tile_amax(v):
    """Inside a kernel: max |v| of a tile as [1, 1], a NaN made explicit (a kernel's max reduction
    may skip it, interpret mode's does, and the delayed-scaling history records the amax as XLA's
    max gives it)."""
    nan = jnp.max(jnp.where(jnp.isnan(v), 1.0, 0.0)) > 0.0
    return jnp.where(nan, jnp.nan, jnp.max(jnp.abs(v))).reshape(1, 1)
