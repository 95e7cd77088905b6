"""The fused FP8 MLP: the activation + quantisation kernels (interpret mode here, compiled in the
GPU suite) against their XLA form and autodiff, `fp8_mlp` against two `dense` calls, and
LayerNormMLP's choice of it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import flashmesh.te as te
from flashmesh.nn import LayerNormMLP
from flashmesh.nn import mlp as nn_mlp
from flashmesh.nn.activations import (ACTIVATIONS, ActivationParams, ClampedSwigluParams,
                                      activation_functions)
from flashmesh.quantization import activation, dense, layouts, update_fp8_metas
from flashmesh.quantization.mlp import fp8_mlp
from flashmesh.quantization.recipe import DelayedScaling, Float8CurrentScaling, Format

R = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
ACTS = {"gelu": (ACTIVATIONS["gelu"],), "relu": (ACTIVATIONS["relu"],),
        "swiglu": (ACTIVATIONS["silu"], ACTIVATIONS["linear"]),
        "geglu": (ACTIVATIONS["gelu"], ACTIVATIONS["linear"]),
        # GPT-OSS's, with a limit the inputs (x 3) cross
        "clamped_swiglu": activation_functions(("clamped_silu", "clamped_linear"), ActivationParams(
            ClampedSwigluParams(limit=2.0, alpha=1.5)))}


def _inputs(n, M=128, F=192, dtype=jnp.bfloat16, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    h = (jax.random.normal(k[0], (M, n * F), jnp.float32) * 3).astype(dtype)
    bias = jax.random.normal(k[1], (n * F,), jnp.float32)
    g = jax.random.normal(k[2], (M, F), jnp.float32).astype(dtype)
    return h, bias, g


def _plain(h, bias, acts, g):
    """a and dh of the composition in float32, by autodiff."""
    n, F = len(acts), g.shape[1]

    def act(h):
        v = h.astype(jnp.float32) + (0.0 if bias is None else bias.reshape(1, -1))
        return activation._activate(acts, [v[:, k * F:(k + 1) * F] for k in range(n)])

    a, pullback = jax.vjp(act, h.astype(jnp.float32))
    return a, pullback(g.astype(jnp.float32))[0]


@pytest.mark.parametrize("name", sorted(ACTS))
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("kernel", [False, True], ids=["xla", "kernel"])
def test_unquantised_forms_equal_autodiff(name, with_bias, kernel):
    """With a float32 'FP8' dtype nothing is rounded: a, dh, amax and dbias equal the float32
    composition and its autodiff, both in the XLA form and the kernel (interpret mode)."""
    acts = ACTS[name]
    h, bias, g = _inputs(len(acts), dtype=jnp.float32)
    bias = bias if with_bias else None
    a, dh = _plain(h, bias, acts, g)
    s = jnp.ones((1,), jnp.float32)
    q, qt, amax = activation.act_quantize_both(h, bias, acts, s, jnp.float32, kernel=kernel)
    np.testing.assert_allclose(q, a, rtol=1e-5, atol=1e-4)  # GELU's cancellation far left
    np.testing.assert_array_equal(qt, q.T)
    np.testing.assert_allclose(amax, [jnp.max(jnp.abs(a))], rtol=1e-6)
    q, qt, amax, dbias = activation.dact_quantize_both(g, h, bias, acts, s, jnp.float32, kernel=kernel)
    np.testing.assert_allclose(q, dh, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(qt, q.T)
    np.testing.assert_allclose(amax, [jnp.max(jnp.abs(dh))], rtol=1e-6)
    if with_bias:
        np.testing.assert_allclose(dbias, jnp.sum(dh, axis=0), rtol=1e-4, atol=1e-3)
    else:
        assert dbias is None


@pytest.mark.parametrize("name", ["gelu", "swiglu"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_kernel_equals_xla_in_fp8(name, dtype):
    """In FP8 the kernel's bytes are the XLA form's but for rare one-step roundings (the two
    order and fuse their float32 operations differently: 0.13% of GELU's bf16 case on XLA's CPU),
    in both layouts; the amaxes agree."""
    acts = ACTS[name]
    h, bias, g = _inputs(len(acts), dtype=dtype, seed=1)
    s = jnp.full((1,), 5.0, jnp.float32)
    for fn, args, fp8 in [(activation.act_quantize_both, (h, bias), jnp.float8_e4m3fn),
                          (activation.dact_quantize_both, (g, h, bias), jnp.float8_e5m2)]:
        want = fn(*args, acts, s, fp8, kernel=False)
        got = fn(*args, acts, s, fp8, kernel=True)
        for a, b in zip(got[:2], want[:2]):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert a.shape == b.shape
            assert np.mean(a != b) < 1e-2
            np.testing.assert_allclose(a, b, rtol=0.26, atol=2.0 ** -9)  # one step (subnormals included)
        np.testing.assert_allclose(got[2], want[2], rtol=1e-5)


@pytest.mark.parametrize("geometry", [layouts.Geometry(128, 64, 8), layouts.Geometry(64, 32)], ids=str)
def test_kernel_geometries_equal_the_default(geometry, monkeypatch):
    """Another program shape (benchmarks/probe_fp8_transpose.py --geometries) gives the default
    geometry's bytes, amax and dbias exactly: a program's elements are computed alike."""
    acts = ACTS["swiglu"]
    h, bias, g = _inputs(len(acts), M=256, F=192, seed=3)
    s = jnp.full((1,), 5.0, jnp.float32)
    for fn, args, fp8 in [(activation.act_quantize_both, (h, bias), jnp.float8_e4m3fn),
                          (activation.dact_quantize_both, (g, h, bias), jnp.float8_e5m2)]:
        want = fn(*args, acts, s, fp8, kernel=True)
        with monkeypatch.context() as m:
            m.setattr(layouts, "GEOMETRY", geometry)
            got = fn(*args, acts, s, fp8, kernel=True)
        for a, b in zip(got[:3], want[:3]):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        if len(got) == 4:  # dbias: the column sums in another grouping of rows
            np.testing.assert_allclose(got[3], want[3], rtol=1e-5, atol=1e-4)


def test_nan_reaches_the_amax_and_infinities_clip():
    """The kernel's amax is NaN where a NaN is (the delayed-scaling history then keeps the old
    scale); the XLA form's is not finite where an infinity is left (XLA's CPU max reduction skips
    NaN, as `scaling.amax` does there). An infinite activation clips to the FP8 maximum."""
    acts = ACTS["gelu"]
    h, bias, g = _inputs(1, dtype=jnp.float32)
    h = h.at[3, 5].set(jnp.nan).at[7, 9].set(jnp.inf)
    s = jnp.ones((1,), jnp.float32)
    for kernel in (False, True):
        expected = np.isnan if kernel else (lambda a: not np.isfinite(a))
        q, _, amax = activation.act_quantize_both(h, None, acts, s, jnp.float8_e4m3fn, kernel=kernel)
        assert expected(amax[0])
        assert float(q[7, 9].astype(jnp.float32)) == 448.0
        _, _, amax, _ = activation.dact_quantize_both(g, h, None, acts, s, jnp.float8_e5m2, kernel=kernel)
        assert np.isnan(amax[0]) or not kernel  # dh is NaN at both (GELU' of inf is NaN): XLA's CPU skips


def test_bad_shapes_are_refused():
    acts = ACTS["swiglu"]
    h, bias, g = _inputs(2)
    s = jnp.ones((1,), jnp.float32)
    with pytest.raises(ValueError, match="h must be"):
        activation.act_quantize_both(h[:, :-1], None, acts, s, jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="h must be"):
        activation.dact_quantize_both(g[:, :64], h, None, acts, s, jnp.float8_e5m2)
    with pytest.raises(ValueError, match="does not fit the kernel"):
        activation.act_quantize_both(h[:100], None, acts, s, jnp.float8_e4m3fn, kernel=True)
    assert activation.fits(h, 2) and not activation.fits(h[:, :200], 2)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS) + ["clamped_swiglu"])
def test_every_table_activation_lowers_to_triton_for_cuda(name, export_for_h200):
    """On a CPU the kernels are lowered (not compiled) for CUDA with an H200's description: every
    activation of the table lowers to Triton, forward and backward, gated or not, and GPT-OSS's
    clamped SwiGLU pair."""
    S = jax.ShapeDtypeStruct
    pairs = ([activation_functions(("clamped_silu", "clamped_linear"))] if name == "clamped_swiglu"
             else [(ACTIVATIONS[name],), (ACTIVATIONS[name], ACTIVATIONS["linear"])])
    for acts in pairs:
        n = len(acts)
        fwd = lambda h, b, s: activation.act_quantize_both(h, b, acts, s, jnp.float8_e4m3fn)  # noqa: E731
        bwd = lambda g, h, b, s: activation.dact_quantize_both(g, h, b, acts, s, jnp.float8_e5m2)  # noqa: E731
        h, b, s = S((128, n * 128), jnp.bfloat16), S((n * 128,), jnp.float32), S((1,), jnp.float32)
        for f, args, label in [(fwd, (h, b, s), "fp8_act_quantize_both"),
                               (bwd, (S((128, 128), jnp.bfloat16), h, b, s), "fp8_dact_quantize_both")]:
            text = export_for_h200(f, *args)
            assert "__gpu$xla.gpu.triton" in text and label in text


def _states(key):
    def one(k):
        k1, k2, k3 = jax.random.split(k, 3)
        return {n: (jax.random.uniform(kk, (1,), minval=0.5, maxval=4.0), jnp.zeros((4,), jnp.float32))
                for n, kk in zip(("x", "kernel", "grad"), (k1, k2, k3))}
    k0, k1 = jax.random.split(key)
    return one(k0), one(k1)


@pytest.mark.parametrize("name", ["gelu", "swiglu"])
def test_fp8_mlp_equals_two_dense_calls(name):
    """Output, every gradient and both new states against dense -> act -> dense (the unfused
    composition), which rounds h + bias and a to bf16 where fp8_mlp stays in float32."""
    acts = ACTS[name]
    n, M, H, F = len(acts), 128, 64, 192
    k = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(k[0], (M, H), jnp.float32).astype(jnp.bfloat16)
    wi = jax.random.normal(k[1], (H, n * F), jnp.float32) * 0.1
    bi = jax.random.normal(k[2], (n * F,), jnp.float32) * 0.1
    wo = jax.random.normal(k[3], (F, H), jnp.float32) * 0.1
    dy = jax.random.normal(k[4], (M, H), jnp.float32).astype(jnp.bfloat16)
    s0, s1 = _states(jax.random.key(4))

    def unfused(x, wi, bi, wo, s0, s1):
        h = dense(x, wi, s0, R) + bi.astype(jnp.bfloat16).reshape(1, -1)
        hf = h.astype(jnp.float32)
        a = activation._activate(acts, [hf[:, j * F:(j + 1) * F] for j in range(n)]).astype(jnp.bfloat16)
        return dense(a, wo, s1, R)

    def fused(x, wi, bi, wo, s0, s1):
        return fp8_mlp(x, wi, bi, wo, s0, s1, R, acts)

    outs = []
    for f in (unfused, fused):
        y, vjp = jax.vjp(jax.jit(f), x, wi, bi, wo, s0, s1)
        outs.append((y, vjp(dy)))
    (y0, g0), (y1, g1) = outs
    rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))  # noqa: E731
    assert rel(y1, y0) < 0.03
    for a, b in zip(g1[:4], g0[:4]):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel(a, b) < 0.06
    for new_f, new_u in [(g1[4], g0[4]), (g1[5], g0[5])]:
        for q in ("x", "kernel", "grad"):
            np.testing.assert_allclose(new_f[q][0], new_u[q][0], rtol=0.03)
            np.testing.assert_allclose(new_f[q][1], new_u[q][1], rtol=0.03)


def test_fp8_mlp_refuses_current_scaling():
    acts = ACTS["gelu"]
    x = jnp.ones((64, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="DelayedScaling"):
        fp8_mlp(x, jnp.ones((64, 64)), None, jnp.ones((64, 64)), None, None, Float8CurrentScaling(), acts)


def _steps(module, x, dy, fused: bool, monkeypatch, steps=2):
    monkeypatch.setattr(nn_mlp.LayerNormMLP, "_fused", lambda self, *a: fused and _FUSED(self, *a))
    with te.autocast(enabled=True, recipe=R):
        variables = nn.unbox(module.init(jax.random.key(1), x, deterministic=True))

        def loss(v, x):
            y = module.apply(v, x, deterministic=True)[0].astype(jnp.float32)
            return jnp.sum(y * dy), y

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        for _ in range(steps):
            (_, out), (grads, dx) = step(variables, x)
            variables = update_fp8_metas(variables, grads)
    return out, grads, dx, variables


_FUSED = nn_mlp.LayerNormMLP._fused


@pytest.mark.parametrize("activations", [("gelu",), ("silu", "linear"), ("clamped_silu", "clamped_linear")])
def test_layernorm_mlp_fused_equals_unfused(activations, monkeypatch):
    """Two FP8 training steps of LayerNormMLP through fp8_mlp and through the two DenseGeneral
    GEMMs: the same loss, gradients and FP8 state (within FP8's rounding). The clamped SwiGLU's
    limit is low enough to clamp."""
    x = jax.random.normal(jax.random.key(0), (2, 32, 64), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(5), (2, 32, 64), jnp.float32)
    params = {"limit": 0.5, "alpha": 1.2} if activations[0] == "clamped_silu" else None
    module = LayerNormMLP(intermediate_dim=128, activations=activations, use_bias=True, dtype=jnp.float32,
                          activation_params=params)
    a = _steps(module, x, dy, True, monkeypatch)
    b = _steps(module, x, dy, False, monkeypatch)
    # the last step's output (its loss, a sum of y dy, cancels too much for a relative check)
    assert float(jnp.linalg.norm(a[0] - b[0]) / jnp.linalg.norm(b[0])) < 0.05
    flat_a, flat_b = jax.tree.leaves_with_path(a[1]["params"]), jax.tree.leaves(b[1]["params"])
    for (path, ga), gb in zip(flat_a, flat_b):
        err = float(jnp.linalg.norm(ga - gb) / jnp.maximum(jnp.linalg.norm(gb), 1e-6))
        assert err < 0.08, (path, err)
    for ma, mb in zip(jax.tree.leaves(a[3]["fp8_metas"]), jax.tree.leaves(b[3]["fp8_metas"])):
        np.testing.assert_allclose(ma, mb, rtol=0.05)
    assert jax.tree.structure(a[3]) == jax.tree.structure(b[3])


def test_layernorm_mlp_takes_the_fused_path_only_where_it_applies(monkeypatch):
    """DelayedScaling with a table activation and no LoRA or active dropout calls fp8_mlp;
    current scaling, LoRA, active intermediate dropout and flax-only activations do not."""
    calls = []
    real = nn_mlp.fp8_mlp
    monkeypatch.setattr(nn_mlp, "fp8_mlp", lambda *a: calls.append(1) or real(*a))
    x = jnp.ones((2, 8, 64), jnp.bfloat16)

    def used(recipe=R, deterministic=True, **fields):
        calls.clear()
        module = LayerNormMLP(intermediate_dim=64, **fields)
        with te.autocast(enabled=True, recipe=recipe):
            v = module.init(jax.random.key(0), x, deterministic=True)
            calls.clear()
            module.apply(v, x, deterministic=deterministic, rngs={"dropout": jax.random.key(1)})
        return bool(calls)

    assert used()
    assert used(intermediate_dropout_rate=0.1)  # deterministic
    assert not used(intermediate_dropout_rate=0.1, deterministic=False)
    assert not used(recipe=Float8CurrentScaling())
    assert not used(enable_low_rank_adaptation=True, low_rank_adaptation_dim=4)
    assert not used(activations=("elu",))


@pytest.mark.gpu
def test_gpu_fused_kernels_compile_and_equal_xla():
    """On the GPU both kernels compile to Triton custom calls and agree with the XLA form."""
    for name in ("gelu", "swiglu", "clamped_swiglu"):
        acts = ACTS[name]
        h, bias, g = _inputs(len(acts), M=2048, F=1024, seed=2)
        s = jnp.full((1,), 3.0, jnp.float32)
        fwd = jax.jit(lambda h, b, s: activation.act_quantize_both(h, b, acts, s, jnp.float8_e4m3fn, kernel=True))
        bwd = jax.jit(lambda g, h, b, s: activation.dact_quantize_both(g, h, b, acts, s, jnp.float8_e5m2,
                                                                       kernel=True))
        assert "triton" in fwd.lower(h, bias, s).compile().as_text()
        assert "triton" in bwd.lower(g, h, bias, s).compile().as_text()
        for got, want in [(fwd(h, bias, s), activation.act_quantize_both(h, bias, acts, s, jnp.float8_e4m3fn,
                                                                         kernel=False)),
                          (bwd(g, h, bias, s), activation.dact_quantize_both(g, h, bias, acts, s,
                                                                             jnp.float8_e5m2, kernel=False))]:
            for a, b in zip(got[:2], want[:2]):
                a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
                # the kernel's GELU uses tanh.approx.f32: 0.47% of bytes one step off with
                # libdevice's tanh (2026-12-02)
                assert np.mean(a != b) < 1e-2
                np.testing.assert_allclose(a, b, rtol=0.26, atol=2.0 ** -9)
            np.testing.assert_allclose(got[2], want[2], rtol=1e-5)
            if len(got) == 4:
                np.testing.assert_allclose(got[3], want[3], rtol=1e-3, atol=1e-2)
