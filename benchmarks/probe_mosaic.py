"""Diagnosis only (numbers are claimed from `flashmesh bench`): the Mosaic GPU forward
(`attention/pallas_mosaic_gpu_sm90.py`, not registered) against cuDNN on a few anchor shapes:
error against cuDNN and the time per call of 20 calls back to back, each block size listed."""
import sys
import time
import traceback

import jax
import jax.numpy as jnp

import flashmesh
from flashmesh.attention import pallas_mosaic_gpu_sm90 as sm90
from flashmesh.attention.pallas_mosaic_gpu_common import BlockSizes

SHAPES = [  # name, B, T, N, K, D, window
    ("causal_8k_h32_d128", 1, 8192, 32, 32, 128, (-1, 0)),
    ("full_4k_h16_d128", 4, 4096, 16, 16, 128, (-1, -1)),
    ("seed000_gqa_swa", 2, 4096, 128, 8, 128, (128, 0)),
    ("causal_8k_h32_d64", 1, 8192, 32, 32, 64, (-1, 0)),
]
CONFIGS = [dict(), dict(num_stages=3), dict(block_q=192, num_compute_wgs=3), dict(block_kv=64)]


def back_to_back(f, *args, n=20):
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    outs = [f(*args) for _ in range(n)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t0) * 1e3 / n


def main():
    only = sys.argv[1:] or None
    for name, B, T, N, K, D, window in SHAPES:
        if only and name not in only:
            continue
        kq, kk, kv = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(kq, (B, T, N, D), jnp.bfloat16)
        k = jax.random.normal(kk, (B, T, K, D), jnp.bfloat16)
        v = jax.random.normal(kv, (B, T, K, D), jnp.bfloat16)
        causal = window[1] == 0
        ref = jax.jit(lambda q, k, v: flashmesh.attention(
            q, k, v, mask="causal" if causal else "none",
            window=None if window[0] < 0 else window, implementation="cudnn"))
        out_ref = ref(q, k, v)
        t_ref = back_to_back(ref, q, k, v)
        print(f"{name}: cudnn {t_ref:.3f} ms", flush=True)
        for cfg in CONFIGS:
            try:
                bs = BlockSizes(**cfg) if cfg else None
                f = jax.jit(lambda q, k, v: sm90.forward(q, k, v, scale=D ** -0.5, window=window,
                                                         block_sizes=bs)[0])
                t0 = time.perf_counter()
                out = jax.block_until_ready(f(q, k, v))
                compile_s = time.perf_counter() - t0
                err = float(jnp.linalg.norm((out - out_ref).astype(jnp.float32))
                            / jnp.linalg.norm(out_ref.astype(jnp.float32)))
                t = back_to_back(f, q, k, v)
                print(f"  mosaic {cfg or 'default'}: {t:.3f} ms ({t / t_ref:.2f}x cudnn), "
                      f"rel err vs cudnn {err:.1e}, first call {compile_s:.1f} s", flush=True)
            except Exception as e:  # a probe: report and go on
                print(f"  mosaic {cfg or 'default'}: FAILED {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:400] if str(e) else ''}", flush=True)
                traceback.print_exc(limit=3)


if __name__ == "__main__":
    main()
