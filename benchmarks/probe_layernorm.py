"""Diagnosis only (numbers are claimed from `flashmesh bench`): LayerNorm / RMSNorm forward +
backward at the guide's layer size ([8192, 4096] bf16 by default, `--rows R --hidden H`) in
two forms, timed back to back (30 calls, one synchronisation): `autodiff` (the formula left to
jax.grad, what `nn.layernorm` was before 2026-12-03, and RMSNorm's form still) and `kernel`
(`layernorm_vjp.normalize`'s Pallas backward kernel, LayerNorm's GPU default; for LayerNorm
also each of `--configs ROWS:WARPS,...`, default 32:8,16:8,16:4,64:8), each with its error
against float32 autodiff."""
import sys

import jax
import jax.numpy as jnp

from flashmesh.bench import timing
from flashmesh.nn import layernorm_vjp


def _option(name, default):
    return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def autodiff(x, gamma, bias, rms, eps=1e-6):
    xf = x.astype(jnp.float32)
    mean = 0.0 if rms else jnp.mean(xf, axis=-1, keepdims=True)
    c = xf - mean
    y = c * jax.lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + eps) * gamma[None, :]
    return (y if bias is None else y + bias[None, :]).astype(x.dtype)


def back_to_back(f, *args, n=30):
    jax.block_until_ready(f(*args))  # compiled and warm
    return timing.back_to_back(f, args, n)


def main():
    R, H = _option("--rows", 8192), _option("--hidden", 4096)
    kx, kg, kb, kd = jax.random.split(jax.random.key(0), 4)
    x = (jax.random.normal(kx, (R, H), jnp.float32) * 2 + 0.5).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (R, H), jnp.bfloat16)
    gamma = 1 + 0.1 * jax.random.normal(kg, (H,), jnp.float32)
    bias = 0.1 * jax.random.normal(kb, (H,), jnp.float32)
    for rms in (False, True):
        b = None if rms else bias
        want = jax.vjp(lambda x, g, b: autodiff(x, g, b, rms), x.astype(jnp.float32), gamma, b)[1](
            dy.astype(jnp.float32))
        forms = {"autodiff": (lambda x, g, b: autodiff(x, g, b, rms), None)}
        configs = [] if rms else [tuple(int(v) for v in c.split(":")) for c in _option("--configs", "32:8,16:8,16:4,64:8").split(",")]
        for rows, warps in configs:
            forms[f"kernel {rows} rows {warps} warps"] = (
                lambda x, g, b: layernorm_vjp.normalize(x, g, b, rms=rms, epsilon=1e-6), (rows, warps))
        for name, (f, config) in forms.items():
            if config:
                layernorm_vjp.ROWS_PER_PROGRAM, layernorm_vjp.NUM_WARPS = config
            step = jax.jit(lambda x, g, b, dy, f=f: jax.vjp(f, x, g, b)[1](dy))
            got = step(x, gamma, b, dy)
            errs = [float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w))
                    for g, w in zip(got, want) if w is not None]
            fwd = jax.jit(f)
            print(f"{'rmsnorm' if rms else 'layernorm'} [{R}, {H}] {name}: fwd+bwd {back_to_back(step, x, gamma, b, dy):.3f} ms, "
                  f"fwd {back_to_back(fwd, x, gamma, b):.3f} ms; rel err dx/dgamma/dbias "
                  + " / ".join(f"{e:.1e}" for e in errs), flush=True)


if __name__ == "__main__":
    main()
