"""The registered `pallas_mosaic_gpu` implementation: what it refuses and why (everywhere), and
on a Hopper GPU the whole path through `flashmesh.attention` (custom VJP, lse cotangent)
against the float32 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashmesh
from flashmesh.attention import pallas_mosaic_gpu, registry
from flashmesh.attention.api import normalize


def _spec(**kw):
    q = jnp.zeros((1, 128, 4, kw.pop("D", 64)), kw.pop("dtype", jnp.bfloat16))
    return normalize(q, q, q, **kw)[1]


@pytest.mark.parametrize("kw, words", [
    (dict(dtype=jnp.float32), "dtype float32"),
    (dict(D=96), "Dqk=96"),
    (dict(D=256), "Dqk=256"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "dropout"),
    (dict(bias=jnp.zeros((1, 1, 128, 128), jnp.bfloat16)), "bias"),
])
def test_static_reasons(kw, words):
    assert words in pallas_mosaic_gpu.static_reason(_spec(**kw))


def test_band_masks_sinks_and_cap_are_accepted_statically():
    for kw in (dict(), dict(mask="none", window=(16, 8)), dict(mask="causal_bottom_right"),
               dict(logits_soft_cap=20.0), dict(softmax="off_by_one"), dict(D=128), dict(D=192)):
        assert pallas_mosaic_gpu.static_reason(_spec(**kw)) is None, kw


def test_refused_off_gpu_with_the_reason():
    assert "Hopper" in pallas_mosaic_gpu.unsupported_reason(_spec(), "cpu")
    if registry.current_platform() != "gpu":
        q = jnp.zeros((1, 128, 4, 64), jnp.bfloat16)
        with pytest.raises(NotImplementedError, match="pallas_mosaic_gpu"):
            flashmesh.attention(q, q, q, implementation="pallas_mosaic_gpu")


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [
    dict(mask="causal"),
    dict(mask="none", window=(100, 30), logits_soft_cap=15.0),
    dict(mask="causal_bottom_right", softmax="learnable"),
], ids=["causal", "window_cap", "bottom_right_sink"])
def test_gpu_gradients_with_lse_cotangent(kw):
    B, T, S, N, K, D = 2, 300, 333, 8, 2, 128
    keys = jax.random.split(jax.random.key(3), 6)
    q = jax.random.normal(keys[0], (B, T, N, D), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, S, K, D), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, S, K, D), jnp.float32).astype(jnp.bfloat16)
    g = jax.random.normal(keys[3], (B, T, N, D), jnp.float32)
    g_lse = jax.random.normal(keys[4], (B, N, T), jnp.float32)
    sink = jax.random.normal(keys[5], (N,), jnp.float32) if kw.get("softmax") == "learnable" else None

    def loss(impl, q, k, v, sink):
        out, lse = flashmesh.attention(q, k, v, sink=sink, return_lse=True, implementation=impl, **kw)
        return jnp.sum(out.astype(jnp.float32) * g) + jnp.sum(lse * g_lse), (out, lse)

    args = (q, k, v, sink)
    got = jax.jit(jax.grad(lambda *a: loss("pallas_mosaic_gpu", *a), argnums=(0, 1, 2, 3),
                           has_aux=True))(*args)
    f32 = [None if a is None else a.astype(jnp.float32) for a in args]
    want = jax.grad(lambda *a: loss("reference", *a), argnums=(0, 1, 2, 3), has_aux=True)(*f32)
    (grads, (out, lse)), (wgrads, (wout, wlse)) = got, want
    assert _rel(out, wout) < 1e-2 and _rel(lse, wlse) < 1e-3
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), grads, wgrads):
        if b is not None:
            assert bool(jnp.all(jnp.isfinite(a))), name
            assert _rel(a, b) < 2e-2, (name, _rel(a, b))
