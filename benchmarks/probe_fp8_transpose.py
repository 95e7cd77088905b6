"""Diagnosis only: ways to make an FP8 tensor's two layouts (q [M, K] and q^T [K, M]) and its
amax from a bf16 (or float32) tensor, each timed back to back (50 calls, one synchronisation)
and checked byte for byte against the plain XLA form.

2026-12-02: the FP8 TransformerLayer step spent ~1.5 ms in XLA's `wrapped_transpose` of FP8
arrays (about 0.6 TB/s, benchmarks/results/2026-12-02-nvidia-h200-layer/profile/); the wgrad
GEMMs need both operands contiguous along the token axis, so every activation and gradient is
needed in both layouts. Variants:
  xla      quantize(x), its transpose, amax (what `quantization.dense` does today)
  bytes    the transpose moved as 4x4 byte blocks in uint32 words (`layouts.byte_transpose`)
  barrier  quantize(x^T) with the bf16 transpose behind an optimization barrier
  triton   one Pallas Triton kernel writing both layouts and per-tile amaxes
           (`layouts.quantize_both(kernel=True)`; interpret mode off a GPU)

`--geometries 64x64+64x128:8+...`: instead, the three quantise kernels (`quantize_both`, and
`activation.act_quantize_both` / `dact_quantize_both` with GELU, the FP8 layer's FFN) per program
shape `layouts.Geometry` (rows x cols, :num_warps), on the guide layer's FFN activations
[8192, 16384] bf16 and a float32 weight [4096, 16384], each checked byte for byte against the
first geometry named.
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashmesh.quantization import layouts, scaling

SHAPES = [((8192, 4096), jnp.bfloat16), ((8192, 16384), jnp.bfloat16),
          ((8192, 12288), jnp.bfloat16), ((4096, 16384), jnp.float32)]
DTYPE = jnp.float8_e4m3fn


def xla(x, s):
    q = scaling.quantize(x, s, DTYPE)
    return q, q.T, scaling.amax(x)


def bytes_(x, s):
    q = scaling.quantize(x, s, DTYPE)
    return q, layouts.byte_transpose(q), scaling.amax(x)


def barrier(x, s):
    q = scaling.quantize(x, s, DTYPE)
    return q, scaling.quantize(lax.optimization_barrier(x.T), s, DTYPE), scaling.amax(x)


def triton(x, s):
    return layouts.quantize_both(x, s, DTYPE, kernel=True)


VARIANTS = {"xla": xla, "bytes": bytes_, "barrier": barrier, "triton": triton}


def timed(f, *args, n=50):
    jax.block_until_ready(f(*args))
    for _ in range(3):
        jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(n):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) * 1e3 / n


def geometries(spec: str, small: bool):
    """`--geometries`: each kernel per layouts.Geometry, against the first geometry's bytes."""
    from flashmesh.quantization import activation

    acts = (activation.gelu_tanh,)
    found = []
    for item in spec.split("+"):
        shape, _, warps = item.partition(":")
        rows, cols = (int(v) for v in shape.split("x"))
        found.append(layouts.Geometry(rows, cols, int(warps) if warps else None))
    d = 64 if small else 1
    h = (jax.random.normal(jax.random.key(1), (8192 // d, 16384 // d), jnp.float32) * 3).astype(jnp.bfloat16)
    g = jax.random.normal(jax.random.key(2), h.shape, jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(3), (4096 // d, 16384 // d), jnp.float32)
    s = jnp.full((1,), 20.0, jnp.float32)
    kernels = {  # name: (function, arguments, GB read and written)
        "quantize_both bf16": (lambda x, s: layouts.quantize_both(x, s, DTYPE, kernel=True), (h, s), h.size * 4),
        "quantize_both f32": (lambda x, s: layouts.quantize_both(x, s, DTYPE, kernel=True), (w, s), w.size * 6),
        "act_quantize_both": (lambda h, s: activation.act_quantize_both(h, None, acts, s, DTYPE, kernel=True),
                              (h, s), h.size * 4),
        "dact_quantize_both": (lambda g, h, s: activation.dact_quantize_both(g, h, None, acts, s, jnp.float8_e5m2,
                                                                            kernel=True), (g, h, s), h.size * 6),
    }
    first = {}
    for geometry in found:
        layouts.GEOMETRY = geometry
        for name, (fn, args, nbytes) in kernels.items():
            try:
                # a new function per geometry (jit caches traces by function: the geometry is
                # read when tracing)
                f = jax.jit(lambda *a, fn=fn: fn(*a))
                out = jax.block_until_ready(f(*args))
                got = [np.asarray(o).view(np.uint8) if o.dtype.itemsize == 1 else np.asarray(o)
                       for o in out if o is not None]
                same = all(np.array_equal(a, b) for a, b in zip(got, first.setdefault(name, got)))
                ms = timed(f, *args)
                print(f"{tuple(geometry)} {name:20s} {ms:7.3f} ms  {nbytes / 1e9 / ms:6.2f} TB/s  "
                      f"{'same bytes' if same else 'DIFFERENT'}", flush=True)
            except Exception as e:  # a geometry that fails is a line, not the end of the probe
                print(f"{tuple(geometry)} {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


def main():
    small = "--small" in sys.argv
    if "--geometries" in sys.argv:
        return geometries(sys.argv[sys.argv.index("--geometries") + 1], small)
    for (M, K), dt in SHAPES:
        if small:
            M, K = M // 64, K // 64
        x = (jax.random.normal(jax.random.key(0), (M, K), jnp.float32) * 3).astype(dt)
        s = jnp.full((1,), 20.0, jnp.float32)
        want = None
        gb = M * K * (jnp.dtype(dt).itemsize + 2) / 1e9
        for name, fn in VARIANTS.items():
            try:
                f = jax.jit(fn)
                out = jax.block_until_ready(f(x, s))
                got = [np.asarray(o).view(np.uint8) if o.dtype == DTYPE else np.asarray(o) for o in out]
                if want is None:
                    want = got
                same = all(np.array_equal(a, b) for a, b in zip(got, want))
                for _ in range(3):
                    jax.block_until_ready(f(x, s))
                n = 50
                t0 = time.perf_counter()
                for _ in range(n):
                    out = f(x, s)
                jax.block_until_ready(out)
                ms = (time.perf_counter() - t0) * 1e3 / n
                print(f"{M}x{K} {jnp.dtype(dt).name:8s} {name:8s} {ms:7.3f} ms  {gb / ms:6.2f} TB/s "
                      f"(x read, both layouts written)  {'same bytes' if same else 'DIFFERENT'}", flush=True)
            except Exception as e:  # a variant that fails is a line, not the end of the probe
                print(f"{M}x{K} {name:8s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
