"""Diagnosis only: does the compiled dropout mask share one hash between the two keys of a pair?

`masks.dropout_keep` decides keys 2m and 2m + 1 from one 32-bit hash of m; the kernels compute
the mask elementwise over a WGMMA-layout tile and rely on the compiler to see that a thread's
two registers of a pair hash the same value (`pallas_mosaic_gpu_sm90_parts.dropout_keep`). This
script compiles the Mosaic forward and backward with dropout on a small causal call, with
Mosaic GPU's PTX dump on, and counts per kernel the multiplies by the hash's last mixing
constant (one per hash evaluated) against the `ex2` instructions (one per probability
computed): about 0.5 where each pair is hashed once, 1.0 where every element is hashed.

    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=DIR python benchmarks/probe_dropout_ptx.py
    python benchmarks/probe_dropout_ptx.py --count DIR      # count an existing dump
"""
import collections
import glob
import os
import re
import sys

# The second multiplier of masks.mix32 (0x846CA68B) as PTX prints it (a signed decimal), and
# the first (0x7FEB352D), and the key-pair multiplier (0x85EBCA77).
CONSTANTS = {"mix32 second multiply": -2073254261, "mix32 first multiply": 2146121005,
             "key-pair multiply": -2048144777}


def count(directory: str) -> str:
    files = sorted(glob.glob(os.path.join(directory, "**", "*.ptx"), recursive=True))
    if not files:
        return f"no .ptx files under {directory}"
    lines = []
    for path in files:
        text = open(path).read()
        counts = collections.Counter()
        for line in text.splitlines():
            if "ex2.approx" in line:
                counts["ex2"] += 1
            for name, value in CONSTANTS.items():
                if re.search(rf"(?<![\w-]){value}(?!\d)", line) or (value < 0 and re.search(
                        rf"\b{value + 2**32}\b", line)) or f"0x{value % 2**32:08X}" in line.upper():
                    counts[name] += 1
        ratio = (counts["mix32 second multiply"] / counts["ex2"]) if counts["ex2"] else float("nan")
        lines.append(f"{os.path.basename(path)}: ex2 {counts['ex2']}, "
                     + ", ".join(f"{name} {counts[name]}" for name in CONSTANTS)
                     + f"; hashes per probability {ratio:.2f}")
    return "\n".join(lines)


if "--count" in sys.argv:
    print(count(sys.argv[sys.argv.index("--count") + 1]))
    raise SystemExit(0)

directory = os.environ.get("MOSAIC_GPU_DUMP_TO")
if os.environ.get("MOSAIC_GPU_DUMP_PTX") != "1" or not directory:
    raise SystemExit("set MOSAIC_GPU_DUMP_PTX=1 and MOSAIC_GPU_DUMP_TO=<directory>")
os.makedirs(directory, exist_ok=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import flashmesh  # noqa: E402

B, T, N, D = 1, 1024, 4, 128
q, k, v = (jax.random.normal(jax.random.key(i), (B, T, N, D), jnp.bfloat16) for i in range(3))


def loss(q, k, v):
    out = flashmesh.attention(q, k, v, mask="causal", dropout_rate=0.1, dropout_rng=jax.random.key(7),
                              implementation="pallas_mosaic_gpu")
    return jnp.sum(out.astype(jnp.float32))


jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
print(count(directory))
