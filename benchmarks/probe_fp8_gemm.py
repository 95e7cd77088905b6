"""Diagnosis only (numbers are claimed from `flashmesh bench`): the FP8 weight-gradient GEMM of
the guide's layer, dw [K, N] = xT [K, M] . gT [N, M] (M tokens contracted, both contiguous along
M), with its result wanted in float32 (the parameters' dtype): `bf16+convert` (what
`quantization.dense` does: a bf16 GEMM output, then a convert), `f32` (float32 straight out of
the GEMM, the rescale in float32) — each timed back to back with its compiled GEMM kind
(cuBLASLt FP8 custom call, Triton fusion) and error against the float32 product.
`--shapes K,N,M;...` (default the FC1/FC2, QKV and out-projection shapes at M 8192)."""
import re
import sys

import jax
import jax.numpy as jnp
from jax import lax

from flashmesh.bench import timing
from flashmesh.quantization.dense import TN

SHAPES = [(4096, 16384, 8192), (16384, 4096, 8192), (4096, 12288, 8192), (4096, 4096, 8192)]


def back_to_back(f, *args, n=30):
    jax.block_until_ready(f(*args))  # compiled and warm
    return timing.back_to_back(f, args, n)


def bf16_then_convert(a, b, s):
    y = lax.dot_general(a, b, TN, precision=lax.Precision.DEFAULT, preferred_element_type=jnp.bfloat16)
    return (y * s.astype(jnp.bfloat16)).astype(jnp.float32)


def f32_out(a, b, s):
    y = lax.dot_general(a, b, TN, precision=lax.Precision.DEFAULT, preferred_element_type=jnp.float32)
    return y * s


def main():
    shapes = SHAPES
    if "--shapes" in sys.argv:
        shapes = [tuple(int(v) for v in s.split(",")) for s in sys.argv[sys.argv.index("--shapes") + 1].split(";")]
    for K, N, M in shapes:
        ka, kb = jax.random.split(jax.random.key(K + N))
        a = jax.random.normal(ka, (K, M), jnp.float32).astype(jnp.float8_e4m3fn)
        b = (jax.random.normal(kb, (N, M), jnp.float32) * 4).astype(jnp.float8_e5m2)
        s = jnp.float32(0.5)
        want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32).T, precision="highest") * s
        flops = 2 * K * N * M
        for name, f in (("bf16+convert", bf16_then_convert), ("f32", f32_out)):
            jf = jax.jit(f)
            text = jf.lower(a, b, s).compile().as_text()
            kinds = sorted(set(re.findall(r'custom_call_target="(__cublas[^"]*)"', text)))
            kinds += ["triton"] * len(re.findall(r"__triton_nested_gemm_fusion|__triton_gemm", text))
            err = float(jnp.linalg.norm(jf(a, b, s) - want) / jnp.linalg.norm(want))
            ms = back_to_back(jf, a, b, s)
            print(f"dw [{K}, {N}] over M {M} {name}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s), "
                  f"GEMM {kinds}, rel err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
