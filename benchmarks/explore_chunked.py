"""Diagnosis, not a result: times variants of the chunked backend (tile sizes, unrolling) and
flashmesh's automatic dispatch against raw cuDNN, interleaved, on a few anchor shapes; `memory`
prints XLA's memory plan of tutorial 003's packed 64k workload per backend and segment kind.
Speed claims come from `flashmesh bench` only; this script tells which settings to pick."""

import statistics
import sys
import time

import jax
import jax.numpy as jnp

import flashmesh
from flashmesh.attention import chunked, chunked_tiles, normalize


def median_ms(f, args, iters=15):
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def make(B, T, N, K, D, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, N, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, K, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, K, D), jnp.bfloat16)
    do = jax.random.normal(ks[3], (B, T, N, D), jnp.bfloat16)
    return q, k, v, do


def fwd_bwd(attn):
    def f(q, k, v, do):
        o, vjp = jax.vjp(attn, q, k, v)
        return vjp(do)
    return jax.jit(f)


def chunked_variants(name, B, T, N, K, D, mask, window):
    q, k, v, do = make(B, T, N, K, D)
    for block in (512, 1024, 2048):
        for unroll in (2, 64):
            chunked_tiles.UNROLL_STEPS = unroll
            bs = chunked.BlockSizes(block, block)

            def attn(q, k, v):
                inputs, spec = normalize(q, k, v, mask=mask, window=window)
                return chunked.attention(inputs, spec, block_sizes=bs)[0]
            try:
                f = median_ms(jax.jit(attn), (q, k, v))
                fb = median_ms(fwd_bwd(attn), (q, k, v, do))
                print(f"chunked {name:18s} block={block:5d} unroll={unroll:3d} fwd {f:7.3f} ms  fwdbwd {fb:7.3f} ms", flush=True)
            except Exception as e:  # noqa: BLE001 - diagnosis script, report and go on
                print(f"chunked {name} block={block} unroll={unroll} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    chunked_tiles.UNROLL_STEPS = 2


def dispatch_ab(name, B, T, N, K, D, causal):
    q, k, v, do = make(B, T, N, K, D)
    fm = lambda q, k, v: flashmesh.attention(q, k, v, mask="causal" if causal else "none")
    raw = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    for mode in ("fwd", "fwdbwd"):
        fs = {n: (jax.jit(f) if mode == "fwd" else fwd_bwd(f)) for n, f in (("flashmesh", fm), ("cudnn", raw))}
        args = (q, k, v) if mode == "fwd" else (q, k, v, do)
        res = {n: [] for n in fs}
        for _ in range(5):  # interleaved rounds: drift hits both alike
            for n, f in fs.items():
                res[n].append(median_ms(f, args, iters=20))
        a, b = statistics.median(res["flashmesh"]), statistics.median(res["cudnn"])
        print(f"dispatch {name:18s} {mode:6s} flashmesh {a:7.3f} ms cudnn {b:7.3f} ms ratio {a / b:5.3f}", flush=True)


def memory_plans():
    """XLA's plan (arguments, outputs, temporaries) of fwd+bwd at B=2, T=64k, N=128, K=8, D=128,
    causal window 8192: packed segments vs padding vs none, cudnn and chunked. Compiles only."""
    from flashmesh.bench.shapes import WORKLOAD_SHAPES, segment_ids_and_positions

    s = WORKLOAD_SHAPES[0]
    ids, _ = segment_ids_and_positions(s)
    seg = jnp.broadcast_to(jnp.asarray(ids)[None], (s.B, s.T))
    bf = jnp.bfloat16
    q, do = (jax.ShapeDtypeStruct((s.B, s.T, s.N, s.Dqk), bf) for _ in range(2))
    kv = jax.ShapeDtypeStruct((s.B, s.T, s.K, s.Dqk), bf)
    segments = {
        "packed": lambda: flashmesh.SequenceDescriptor.from_segment_ids_and_pos(seg, max_segments=4),
        "padding": lambda: flashmesh.SequenceDescriptor.from_seqlens(jnp.full((s.B,), s.T - 4096, jnp.int32)),
        "none": lambda: None,
    }
    for impl in ("cudnn", "chunked"):
        for kind, make_segments in segments.items():
            mask = "causal" if kind == "none" else "padding_causal"
            attn = lambda q, k, v: flashmesh.attention(q, k, v, mask=mask, window=s.window,  # noqa: E731
                                                       segments=make_segments(), implementation=impl)
            for mode, f, args in (("fwd", jax.jit(attn), (q, kv, kv)), ("fwdbwd", fwd_bwd(attn), (q, kv, kv, do))):
                try:
                    m = f.lower(*args).compile().memory_analysis()
                    gib = lambda x: f"{x / 2**30:6.2f}"  # noqa: E731
                    print(f"memory {impl:8s} {kind:8s} {mode:6s} args {gib(m.argument_size_in_bytes)} out "
                          f"{gib(m.output_size_in_bytes)} temp {gib(m.temp_size_in_bytes)} GiB", flush=True)
                except Exception as e:  # a diagnosis prints what failed and goes on
                    print(f"memory {impl:8s} {kind:8s} {mode:6s} {type(e).__name__}: {str(e)[:120]}", flush=True)


if __name__ == "__main__":
    what = sys.argv[1:] or ["chunked", "dispatch"]
    if "memory" in what:
        memory_plans()
    if "dispatch" in what:
        dispatch_ab("full_4k_h16_d128", 4, 4096, 16, 16, 128, False)
        dispatch_ab("causal_8k_h32_d128", 1, 8192, 32, 32, 128, True)
    if "chunked" in what:
        chunked_variants("full_4k_h16_d128", 4, 4096, 16, 16, 128, "none", None)
        chunked_variants("causal_8k_h32_d128", 1, 8192, 32, 32, 128, "causal", None)
