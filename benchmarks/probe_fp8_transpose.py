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


def main():
    small = "--small" in sys.argv
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
