"""A LayerNorm's output quantised from its input (`quantization.normalized`): the kernel and the
XLA form give the bytes of the unfused LayerNorm + cast-transpose, and the modules that put a
LayerNorm in front of an FP8 GEMM give the same outputs and gradients through it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashmesh.te as te
import flashmesh.te.flax as te_flax
from flashmesh.nn import dense as nn_dense
from flashmesh.nn import mlp as nn_mlp
from flashmesh.nn.layernorm import layernorm, normalization
from flashmesh.quantization import layouts, normalized
from flashmesh.te.recipe import DelayedScaling, Float8CurrentScaling


def _bytes(a):
    a = np.asarray(a)
    return np.where(np.isnan(a.astype(np.float32)), 0xFF, a.view(np.uint8))


def _inputs(shape, dtype, seed, rms):
    k = jax.random.split(jax.random.key(seed), 3)
    x = (jax.random.normal(k[0], shape, jnp.float32) * 3.0 + 1.5).astype(dtype)
    scale = 1.0 + 0.5 * jax.random.normal(k[1], shape[-1:], jnp.float32)
    bias = None if rms else 0.3 * jax.random.normal(k[2], shape[-1:], jnp.float32)
    return x, scale, bias


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_kernel_and_xla_give_the_unfused_bytes(kind, fp8, dtype):
    """XLA's form quantises the y the LayerNorm returns; the kernel, which never reads y,
    computes it from x (zero-centred gamma included) in its own fused arithmetic (a multiply-add
    may be contracted: y within an ulp, so a byte may round the other way), in both layouts,
    with y's amax."""
    x, scale, bias = _inputs((128, 192), dtype, 1, kind == "rmsnorm")
    args = dict(layernorm_type=kind, epsilon=1e-5, zero_centered_gamma=True)
    y = layernorm(x, scale, bias, **args)
    n = normalization(x, scale, bias, **args)
    assert (n.mean is None) == (kind == "rmsnorm") and (n.beta is None) == (kind == "rmsnorm")
    s = jnp.full((1,), 9.0, jnp.float32)
    want = layouts.quantize_both(y, s, fp8, kernel=False)
    got = normalized.quantize_both(n, y, s, fp8, kernel=False)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(_bytes(a), _bytes(b))
    got = normalized.quantize_both(n, jnp.full_like(y, jnp.nan), s, fp8, kernel=True)
    for a, b in zip(got[:2], want[:2]):
        assert np.mean(_bytes(a) != _bytes(b)) <= 1e-3
    np.testing.assert_allclose(got[2], want[2], rtol=1e-6)
    assert got[2].shape == (1,)


def test_refusals():
    x = jnp.ones((64, 64), jnp.bfloat16)
    ones = jnp.ones((64, 1), jnp.float32)
    with pytest.raises(ValueError, match="Normalization.x must be 2-D"):
        normalized.Normalization(x[None], None, ones, jnp.ones(64), None).check()
    with pytest.raises(ValueError, match=r"Normalization.rstd must have shape \(64, 1\)"):
        normalized.Normalization(x, None, ones[:32], jnp.ones(64), None).check()
    with pytest.raises(ValueError, match=r"Normalization.gamma must have shape \(64,\)"):
        normalized.Normalization(x, ones, ones, jnp.ones(32), None).check()
    with pytest.raises(ValueError, match="does not fit the kernel"):
        normalized.quantize_both(normalized.Normalization(x[:, :48], None, ones, jnp.ones(48), None),
                                 x[:, :48], jnp.ones(1), jnp.float8_e4m3fn, kernel=True)
    with pytest.raises(ValueError, match=r"y must have x's shape and dtype \(64, 64\) bfloat16"):
        normalized.quantize_both(normalized.Normalization(x, None, ones, jnp.ones(64), None),
                                 x.astype(jnp.float32), jnp.ones(1), jnp.float8_e4m3fn)


@pytest.fixture
def one_device(monkeypatch):
    """The program counts as one device's (the suite runs on 8 CPU devices), where the modules
    hand their GEMM the LayerNorm's source; the calls that quantise from a source are counted."""
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    calls = []
    real = normalized.quantize_both

    def counted(n, *args, **kwargs):
        calls.append(n.x.shape)
        return real(n, *args, **kwargs)

    monkeypatch.setattr(normalized, "quantize_both", counted)
    return calls


@pytest.fixture
def kernel_without_y(monkeypatch, one_device):
    """The modules' source path with the kernel forced (interpret mode) and the LayerNorm's
    output poisoned with NaN outside its gradient: a finite loss shows the GEMM never read y."""
    import importlib

    nn_layernorm = importlib.import_module("flashmesh.nn.layernorm")  # the package exports a function of that name
    real_norm, real_both = nn_layernorm.layernorm, normalized.quantize_both
    monkeypatch.setattr(nn_layernorm, "layernorm", lambda *a, **k: real_norm(*a, **k) + jax.lax.stop_gradient(
        jnp.full(a[0].shape, jnp.nan, a[0].dtype)))
    monkeypatch.setattr(normalized, "quantize_both", lambda *a, **k: real_both(*a, **{**k, "kernel": True}))
    return one_device


def _step(module, x, recipe, call):
    with te.autocast(enabled=True, recipe=recipe):
        variables = module.init(jax.random.key(0), x, **call)

        def loss(v, x):
            y = module.apply(v, x, **call)[0]
            dy = jax.random.normal(jax.random.key(7), y.shape, jnp.float32)
            return jnp.vdot(y.astype(jnp.float32), dy)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(variables, x)


MODULES = {
    "ln_dense": (lambda: te_flax.LayerNormDenseGeneral(features=96, use_bias=True), {}),
    "ln_dense_rms": (lambda: te_flax.LayerNormDenseGeneral(features=96, layernorm_type="rmsnorm",
                                                           zero_centered_gamma=True), {}),
    "ln_mlp": (lambda: te_flax.LayerNormMLP(intermediate_dim=128, use_bias=True), {"deterministic": True}),
    "ln_mlp_gated": (lambda: te_flax.LayerNormMLP(intermediate_dim=64, activations=("silu", "linear")),
                     {"deterministic": True}),
    "ln_dense_zero_centred_out": (lambda: te_flax.LayerNormDenseGeneral(
        features=(3, 32), zero_centered_gamma=True, return_layernorm_output=True), {}),
    "ln_mlp_lora": (lambda: te_flax.LayerNormMLP(intermediate_dim=64, enable_low_rank_adaptation=True,
                                                 low_rank_adaptation_dim=4), {"deterministic": True}),
}


# Every module with delayed scaling; current scaling (whose amax comes from y before the
# quantisation) on the RMSNorm projection and the gated MLP.
@pytest.mark.parametrize("which,recipe", [(w, DelayedScaling(amax_history_len=4)) for w in sorted(MODULES)]
                         + [(w, Float8CurrentScaling()) for w in ("ln_dense_rms", "ln_mlp_gated")],
                         ids=[f"{w}-delayed" for w in sorted(MODULES)] + ["ln_dense_rms-current", "ln_mlp_gated-current"])
def test_modules_quantise_the_layernorm_from_its_input(which, recipe, one_device, monkeypatch):
    """On one device the GEMM after the LayerNorm quantises from the LayerNorm's input; the loss,
    the gradients (x, gamma, beta, weights) and the FP8 state's new value equal the path that
    quantises the LayerNorm's output (both XLA forms here)."""
    build, call = MODULES[which]
    x = jax.random.normal(jax.random.key(1), (2, 32, 64), jnp.bfloat16) * 2.0 + 0.5
    fused = _step(build(), x, recipe, call)
    assert one_device and set(one_device) == {(64, 64)}, one_device  # init and the step
    one_device.clear()
    for module in (nn_dense, nn_mlp):
        monkeypatch.setattr(module, "fp8_source", lambda *args: None)
    plain = _step(build(), x, recipe, call)
    assert not one_device
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("which", ["ln_dense", "ln_mlp"])
def test_the_kernel_path_never_reads_the_layernorm_output(which, kernel_without_y):
    build, call = MODULES[which]
    x = jax.random.normal(jax.random.key(1), (2, 32, 64), jnp.bfloat16)
    loss, grads = _step(build(), x, DelayedScaling(amax_history_len=4), call)
    assert kernel_without_y and np.isfinite(float(loss))
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in jax.tree.leaves(grads))


def test_a_moved_contraction_axis_takes_no_source(one_device, monkeypatch):
    """axis=-2 on a square input: the moved input has the source's shape but not its layout;
    the GEMM quantises the LayerNorm's output and the result equals the path without sources."""
    x = jax.random.normal(jax.random.key(1), (2, 64, 64), jnp.bfloat16)
    recipe = DelayedScaling(amax_history_len=4)
    moved = _step(te_flax.LayerNormDenseGeneral(features=32, axis=-2), x, recipe, {})
    assert not one_device
    for module in (nn_dense, nn_mlp):
        monkeypatch.setattr(module, "fp8_source", lambda *args: None)
    plain = _step(te_flax.LayerNormDenseGeneral(features=32, axis=-2), x, recipe, {})
    for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(a, b)


def test_no_source_under_a_mesh_or_for_other_axes(one_device):
    """A mesh of several devices or a contraction over other axes than the normalised one: the
    GEMM quantises the LayerNorm's output. With LoRA beside the GEMM (whose adapters read y) the
    GEMM still quantises from the source."""
    x = jax.random.normal(jax.random.key(1), (2, 32, 64), jnp.bfloat16)
    recipe = DelayedScaling(amax_history_len=4)
    _step(te_flax.LayerNormDenseGeneral(features=32, axis=(-2, -1)), x, recipe, {})
    assert not one_device
    _step(te_flax.LayerNormDenseGeneral(features=32), x, recipe, {})
    assert one_device
    one_device.clear()
    _step(te_flax.LayerNormDenseGeneral(features=32, enable_low_rank_adaptation=True,
                                        low_rank_adaptation_dim=4), x, recipe, {})
    assert one_device  # LoRA reads y too: the GEMM's input still comes from the source
    n = normalization(x, jnp.ones(64), None, layernorm_type="rmsnorm", epsilon=1e-6,
                      zero_centered_gamma=False)
    x2 = x.reshape(-1, 64)
    assert nn_dense.fp8_source(n, x2, 1) is n and nn_dense.fp8_source(n, x2, 2) is None
    assert nn_dense.fp8_source(n, x2[:32], 1) is None and nn_dense.fp8_source(None, x2, 1) is None
    with jax.set_mesh(jax.make_mesh((2,), ("d",), devices=jax.devices()[:2],
                                    axis_types=(jax.sharding.AxisType.Auto,))):
        assert nn_dense.fp8_source(n, x2, 1) is None


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_kernel_lowers_to_triton_for_cuda(kind, export_for_h200):
    """On a CPU the kernel lowers (not compiled) for CUDA with an H200's description, with and
    without the mean and beta."""
    S = jax.ShapeDtypeStruct
    M, K = 256, 512
    rms = kind == "rmsnorm"

    def f(x, mean, rstd, gamma, beta, y, s):
        n = normalized.Normalization(x, None if rms else mean, rstd, gamma, None if rms else beta)
        return normalized.quantize_both(n, y, s, jnp.float8_e4m3fn)

    x, stat, row = S((M, K), jnp.bfloat16), S((M, 1), jnp.float32), S((K,), jnp.float32)
    text = export_for_h200(f, x, stat, stat, row, row, x, S((1,), jnp.float32))
    assert "__gpu$xla.gpu.triton" in text and "fp8_layernorm_quantize_both" in text


@pytest.mark.gpu
def test_gpu_kernel_matches_xla_and_takes_the_layer(fp8_layer_custom_calls):
    """On the GPU: the compiled kernel's bytes against XLA's form (a rounding of y may differ
    where XLA and Triton contract a multiply-add differently: at most 0.1% of the bytes), and
    the guide-shaped FP8 TransformerLayer quantises both LayerNorms' outputs by this kernel."""
    x, scale, bias = _inputs((8192, 4096), jnp.bfloat16, 3, False)
    n = normalization(x, scale, bias, layernorm_type="layernorm", epsilon=1e-5, zero_centered_gamma=False)
    s = jnp.full((1,), 24.0, jnp.float32)
    y = layernorm(x, scale, bias, layernorm_type="layernorm", epsilon=1e-5, zero_centered_gamma=False)
    f = jax.jit(lambda n, y, s: normalized.quantize_both(n, y, s, jnp.float8_e4m3fn, kernel=True))
    assert "fp8_layernorm_quantize_both" in f.lower(n, y, s).compile().as_text()
    got, want = f(n, y, s), normalized.quantize_both(n, y, s, jnp.float8_e4m3fn, kernel=False)
    for a, b in zip(got[:2], want[:2]):
        assert np.mean(_bytes(a) != _bytes(b)) <= 1e-3
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-2)
    assert fp8_layer_custom_calls("fp8_layernorm_quantize_both") == 2
