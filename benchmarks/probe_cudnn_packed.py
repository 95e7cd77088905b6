"""Probe: cuDNN against chunked on tutorial 003's packed workload at several sizes, per batch row
(dq, dk, dv, out), to find where cuDNN's packed fwd+bwd goes wrong (seen on the H200: dq of row 1
at B=2, T=65536, N=128)."""
import sys, time
import jax, jax.numpy as jnp, numpy as np
import flashmesh

def case(B, T, N, K, D=128, slots=4, valid_frac=0.75, window=(8192, 0)):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, N, D)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, T, K, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, T, K, D)), jnp.bfloat16)
    L = T // slots
    ids = np.zeros((B, T), np.int32)
    for s in range(slots):
        ids[:, s * L: s * L + int(L * valid_frac)] = s + 1
    seg = flashmesh.SequenceDescriptor.from_segment_ids_and_pos(jnp.asarray(ids))
    ct = jnp.asarray(rng.standard_normal((B, T, N, D)), jnp.bfloat16)
    def grads(impl):
        def f(q, k, v):
            return jnp.sum(flashmesh.attention(q, k, v, mask="padding_causal", window=window, segments=seg,
                                               implementation=impl).astype(jnp.float32) * ct.astype(jnp.float32))
        out = jax.jit(lambda q, k, v: flashmesh.attention(q, k, v, mask="padding_causal", window=window,
                                                          segments=seg, implementation=impl))(q, k, v)
        return (out,) + jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v)
    t0 = time.time()
    a, b = grads("cudnn"), grads("chunked")
    row = []
    for name, x, y in zip(("out", "dq", "dk", "dv"), a, b):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        per_b = [float(np.abs(x[i] - y[i]).max() / (np.abs(y[i]).max() + 1e-9)) for i in range(B)]
        row.append(f"{name} " + " ".join(f"{e:.1e}" for e in per_b))
    print(f"B={B} T={T} N={N} K={K} q elements 2^{np.log2(B*T*N*D):.2f}: " + " | ".join(row), f"({time.time()-t0:.0f}s)", flush=True)

for args in [(2, 65536, 128, 8), (2, 65536, 64, 8), (1, 65536, 128, 8), (4, 32768, 128, 8), (2, 32768, 128, 8)]:
    try:
        case(*args)
    except Exception as e:
        print(args, "error", type(e).__name__, str(e)[:200], flush=True)
