"""flashmesh.nn.DotProductAttention: the native Flax module is flashmesh.attention plus a sink
parameter and a dropout rng stream, nothing else."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import flashmesh
from flashmesh.nn import DotProductAttention

B, T, N, K, D = 2, 12, 4, 2, 8


def _qkv(seed=0, dv=D, k_heads=K):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (B, T, N, D)), jax.random.normal(keys[1], (B, T, k_heads, D)),
            jax.random.normal(keys[2], (B, T, k_heads, dv)))


def _close(got, want, atol=1e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=atol, rtol=1e-5)


def test_module_is_the_native_call():
    q, k, v = _qkv()
    module = DotProductAttention(mask="causal", window=(3, 0), logits_soft_cap=5.0, scale=0.3)
    variables = module.init(jax.random.key(0), q, k, v)
    assert variables == {}  # vanilla softmax: no parameters
    want = flashmesh.attention(q, k, v, mask="causal", window=(3, 0), logits_soft_cap=5.0, scale=0.3)
    _close(module.apply(variables, q, k, v), want)


def test_reproducible_reaches_the_call():
    q, k, v = _qkv()
    module = DotProductAttention(mask="causal", reproducible=True)
    _close(module.apply({}, q, k, v), flashmesh.attention(q, k, v, mask="causal", reproducible=True))
    half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    with pytest.raises(NotImplementedError, match="reproducible=True"):  # cuDNN refuses it
        DotProductAttention(mask="causal", reproducible=True, implementation="cudnn").apply({}, *half)


def test_segments_bias_and_mla():
    q, k, v = _qkv(seed=1, dv=D // 2)
    segments = flashmesh.SequenceDescriptor.from_seqlens(jnp.asarray([9, 5], jnp.int32))
    bias = jax.random.normal(jax.random.key(2), (1, N, T, T))
    module = DotProductAttention(mask="padding_causal")
    out = module.apply({}, q, k, v, segments=segments, bias=bias)
    assert out.shape == (B, T, N, D // 2)
    _close(out, flashmesh.attention(q, k, v, mask="padding_causal", segments=segments, bias=bias))


def test_learnable_sink_is_a_parameter_with_gradient():
    q, k, v = _qkv(seed=3)
    module = DotProductAttention(softmax="learnable", sink_init=jax.nn.initializers.constant(0.5))
    boxed = module.init(jax.random.key(0), q, k, v)["params"]
    assert boxed["sink"].names == ("nvte_head",)  # boxed with its logical axis, as every parameter
    params = nn.unbox(boxed)
    assert params["sink"].shape == (N,) and params["sink"].dtype == jnp.float32
    _close(params["sink"], np.full(N, 0.5))

    def loss(params):
        return jnp.sum(module.apply({"params": params}, q, k, v) ** 2)

    grad = jax.grad(loss)(params)["sink"]
    assert np.abs(np.asarray(grad)).min() > 0
    want = jax.grad(lambda s: jnp.sum(flashmesh.attention(q, k, v, softmax="learnable", sink=s) ** 2))
    _close(grad, want(params["sink"]))


def test_dropout_draws_from_its_rng_stream():
    q, k, v = _qkv(seed=4)
    module = DotProductAttention(dropout_rate=0.4)

    def run(key, deterministic=False):
        return np.asarray(module.apply({}, q, k, v, rngs={"dropout": key}, deterministic=deterministic))

    a = run(jax.random.key(1))
    np.testing.assert_array_equal(a, run(jax.random.key(1)))
    assert not np.allclose(a, run(jax.random.key(2)))
    _close(run(jax.random.key(1), deterministic=True), flashmesh.attention(q, k, v))
    eval_module = DotProductAttention(dropout_rate=0.4, deterministic=True)
    _close(eval_module.apply({}, q, k, v), flashmesh.attention(q, k, v))
    with pytest.raises(ValueError, match="deterministic"):
        module.apply({}, q, k, v, rngs={"dropout": jax.random.key(1)})


def test_layouts_dtype_and_implementation():
    q, k, v = _qkv(seed=5, k_heads=N)
    want = flashmesh.attention(q, k, v)
    sbhd = DotProductAttention(layout="sbhd").apply({}, *(jnp.swapaxes(x, 0, 1) for x in (q, k, v)))
    _close(jnp.swapaxes(sbhd, 0, 1), want)
    _close(DotProductAttention(layout="bs3hd").apply({}, jnp.stack([q, k, v], axis=2)), want)
    low = DotProductAttention(dtype=jnp.bfloat16).apply({}, q, k, v)
    assert low.dtype == jnp.bfloat16
    _close(low.astype(jnp.float32), want, atol=5e-2)
    _close(DotProductAttention(implementation="reference").apply({}, q, k, v), want)
    if jax.default_backend() != "gpu":
        with pytest.raises(NotImplementedError, match="implementation='cudnn'"):
            DotProductAttention(implementation="cudnn").apply({}, q, k, v)
