"""A GEMM's gradient quantised from its parts (`quantization.parts`, `dense_parts`): the kernel
and the XLA form give the bytes of the packed gradient's cast-transpose and its column sums, and
an FP8 projection split into parts (a fused QKV projection) gives the values and gradients of
the unsplit one, followed by the split."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashmesh.te as te
import flashmesh.te.flax as te_flax
from flashmesh.nn import dense as nn_dense
from flashmesh.quantization import layouts, parts
from flashmesh.te.recipe import DelayedScaling, Float8CurrentScaling

q_dense = importlib.import_module("flashmesh.quantization.dense")  # the package exports a function of that name


def _bytes(a):
    a = np.asarray(a)
    return np.where(np.isnan(a.astype(np.float32)), 0xFF, a.view(np.uint8))


def _parts(n, shape, dtype, seed):
    keys = jax.random.split(jax.random.key(seed), n)
    return [(jax.random.normal(k, shape, jnp.float32) * (2.0 + i)).astype(dtype) for i, k in enumerate(keys)]


@pytest.mark.parametrize("dtype,fp8", [(jnp.bfloat16, jnp.float8_e5m2), (jnp.float32, jnp.float8_e4m3fn)])
@pytest.mark.parametrize("n", [1, 3])
def test_kernel_and_xla_give_the_packed_bytes_and_sums(n, fp8, dtype):
    """Both forms equal `layouts.quantize_both` of the parts side by side, byte for byte, and
    sum each column in float32 (against a float64 sum)."""
    ps = _parts(n, (128, 192), dtype, n)
    s = jnp.full((1,), 5.0, jnp.float32)
    packed = jnp.concatenate(ps, axis=1)
    want = layouts.quantize_both(packed, s, fp8, kernel=False)
    exact = np.sum(np.asarray(packed, np.float64), axis=0)
    for kernel in (False, True):
        q, qt, amax, sums = parts.quantize_parts(ps, s, fp8, kernel=kernel)
        for a, b in zip((q, qt, amax), want):
            np.testing.assert_array_equal(_bytes(a) if a.dtype == fp8 else a, _bytes(b) if b.dtype == fp8 else b)
        assert sums.dtype == jnp.float32 and sums.shape == (n * 192,)
        np.testing.assert_allclose(sums, exact, rtol=1e-5, atol=1e-4)


def test_a_nan_reaches_the_amax_and_the_sum():
    ps = _parts(3, (64, 64), jnp.bfloat16, 0)
    ps[2] = ps[2].at[5, 7].set(jnp.nan)
    for kernel in (False, True):
        q, qt, amax, sums = parts.quantize_parts(ps, jnp.ones((1,)), jnp.float8_e4m3fn, kernel=kernel)
        assert np.isnan(amax[0]) and np.isnan(sums[128 + 7]) and np.isfinite(np.delete(np.asarray(sums), 135)).all()
        assert np.isnan(np.asarray(q[5, 135], np.float32)) and np.isnan(np.asarray(qt[135, 5], np.float32))


def test_refusals():
    a, b = jnp.ones((64, 64), jnp.bfloat16), jnp.ones((64, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"parts\[1\] must have parts\[0\]'s shape and dtype"):
        parts.quantize_parts([a, b], jnp.ones((1,)), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"parts\[0\] must be 2-D, got shape \(64,\)"):
        parts.quantize_parts([a[0]], jnp.ones((1,)), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="at least one array"):
        parts.quantize_parts([], jnp.ones((1,)), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="do not fit the kernel"):
        parts.quantize_parts([jnp.ones((64, 48), jnp.bfloat16)] * 2, jnp.ones((1,)), jnp.float8_e4m3fn, kernel=True)
    x, k = jnp.ones((64, 32), jnp.bfloat16), jnp.ones((32, 96), jnp.float32)
    with pytest.raises(ValueError, match="parts=5 must divide the kernel's 96 output columns"):
        q_dense.dense_parts(x, k, None, None, Float8CurrentScaling(), 5)
    with pytest.raises(ValueError, match=r"bias.shape=\(32,\) must be \(96,\)"):
        q_dense.dense_parts(x, k, jnp.ones((32,)), None, Float8CurrentScaling(), 3)
    with pytest.raises(ValueError, match=r"kernel's output shape \(96,\) must have two axes or more"):
        nn_dense.dense_general_parts(x, k, 1)
    with pytest.raises(ValueError, match="split_features needs two features axes"):
        te_flax.DenseGeneral(features=96, split_features=True).init(jax.random.key(0), x)


def _state():
    return {n: (jnp.full((1,), s, jnp.float32), jnp.zeros((4,), jnp.float32))
            for n, s in (("x", 1.0), ("kernel", 8.0), ("grad", 0.25))}


@pytest.mark.parametrize("kernel,recipe,bias", [
    (True, DelayedScaling(amax_history_len=4), True), (False, Float8CurrentScaling(), True),
    (False, DelayedScaling(amax_history_len=4), False), (True, Float8CurrentScaling(), False)],
    ids=["kernel-delayed-bias", "xla-current-bias", "xla-delayed", "kernel-current"])
def test_dense_parts_is_dense_then_split(kernel, recipe, bias, monkeypatch):
    """Outputs, dx, dkernel and the state's cotangent bit for bit those of `dense` + bias + the
    split; the bias gradient a float32 sum of the parts' gradients (JAX's transpose of the bf16
    bias add sums in bf16: within bf16's rounding of that)."""
    real = parts.quantize_parts
    monkeypatch.setattr(parts, "quantize_parts", lambda *a, **k: real(*a, **{**k, "kernel": kernel}))
    ks = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(ks[0], (128, 96), jnp.bfloat16)
    w = jax.random.normal(ks[1], (96, 3 * 64), jnp.float32) * 0.1
    b = jax.random.normal(ks[2], (3 * 64,), jnp.float32) if bias else None
    dys = jax.random.normal(ks[3], (3, 128, 64), jnp.float32)
    st = _state() if isinstance(recipe, DelayedScaling) else None

    def split_after(x, w, b, st):
        y = q_dense.dense(x, w, st, recipe)
        y = y if b is None else y + b.reshape(1, -1).astype(y.dtype)
        return jnp.split(y, 3, axis=1)

    def loss(f):
        return lambda *a: sum(jnp.vdot(y.astype(jnp.float32), dy) for y, dy in zip(f(*a), dys))

    got = jax.jit(jax.value_and_grad(loss(lambda *a: q_dense.dense_parts(*a[:3], a[3], recipe, 3)),
                                     argnums=(0, 1, 2, 3)))(x, w, b, st)
    want = jax.jit(jax.value_and_grad(loss(split_after), argnums=(0, 1, 2, 3)))(x, w, b, st)
    (lg, (dx, dw, db, dst)), (lw, (dx_w, dw_w, db_w, dst_w)) = got, want
    for a, c in zip(jax.tree.leaves((lg, dx, dw, dst)), jax.tree.leaves((lw, dx_w, dw_w, dst_w))):
        np.testing.assert_array_equal(a, c)
    if bias:
        g = np.asarray(dys.astype(jnp.bfloat16), np.float64)  # y is bf16: so is its cotangent
        exact = np.concatenate([gi.sum(axis=0) for gi in g])
        np.testing.assert_allclose(db, exact, rtol=1e-6, atol=1e-4)
        np.testing.assert_allclose(db, db_w, rtol=2e-2, atol=0.5)
    else:
        assert db is None and db_w is None


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_dense_parts_inside_shard_map(recipe):
    """Tokens split over 4 devices, kernel and bias replicated: dx, dkernel and the state's
    cotangent (amaxes taken over all devices) are those of dense + split; dbias is every
    device's sum, added up (against a float64 sum)."""
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,))
    ks = jax.random.split(jax.random.key(4), 4)
    x = jax.random.normal(ks[0], (256, 64), jnp.bfloat16)
    w = jax.random.normal(ks[1], (64, 2 * 64), jnp.float32) * 0.1
    b = jax.random.normal(ks[2], (2 * 64,), jnp.float32)
    dys = jax.random.normal(ks[3], (2, 256, 64), jnp.float32)
    st = _state() if isinstance(recipe, DelayedScaling) else None
    P = jax.P

    def run(f):
        def local(x, w, b, st, dys):
            return jax.grad(lambda x, w, b, st: sum(jnp.vdot(y.astype(jnp.float32), dy) for y, dy in zip(
                f(x, w, b, st), dys)), argnums=(0, 1, 2, 3))(x, w, b, st)
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P(), P(), P(None, "data")),
                                     out_specs=(P("data"), P(), P(), P())))(x, w, b, st, dys)

    def packed(x, w, b, st):
        y = q_dense.dense(x, w, st, recipe)
        return jnp.split(y + b.reshape(1, -1).astype(y.dtype), 2, axis=1)

    dx, dw, db, dst = run(lambda x, w, b, st: q_dense.dense_parts(x, w, b, st, recipe, 2))
    dx_w, dw_w, db_w, dst_w = run(packed)
    for a, c in zip(jax.tree.leaves((dx, dw, dst)), jax.tree.leaves((dx_w, dw_w, dst_w))):
        np.testing.assert_array_equal(a, c)
    g = np.asarray(dys.astype(jnp.bfloat16), np.float64)
    np.testing.assert_allclose(db, np.concatenate([gi.sum(axis=0) for gi in g]), rtol=1e-6, atol=1e-4)


def _module_step(module, x, recipe, outputs, n_inputs=1):
    """(loss, its gradients) of a random projection of the arrays outputs(module's result), x
    passed n_inputs times (self-attention)."""
    with te.autocast(enabled=True, recipe=recipe):
        variables = module.init(jax.random.key(0), *[x] * n_inputs)

        def loss(v, x):
            ys = outputs(module.apply(v, *[x] * n_inputs))
            dys = jax.random.normal(jax.random.key(7), (len(ys),) + ys[0].shape, jnp.float32)
            return sum(jnp.vdot(y.astype(jnp.float32), dy) for y, dy in zip(ys, dys))

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(variables, x)


def _old_parts(monkeypatch):
    """The split taken after the packed FP8 GEMM (what the modules did before dense_parts)."""
    def packed(x2, k2, bias, state, recipe, n, source=None):
        y = q_dense.dense(x2, k2, state, recipe, source)
        y = y if bias is None else y + bias.reshape(1, -1).astype(y.dtype)
        return tuple(jnp.split(y, n, axis=1))

    monkeypatch.setattr(nn_dense, "fp8_dense_parts", packed)


def _compare(split, packed, bias_paths):
    """Every leaf equal, but the bias gradients (float32 sums against bf16 ones)."""
    flat_s, flat_p = jax.tree_util.tree_leaves_with_path(split), jax.tree_util.tree_leaves_with_path(packed)
    assert [p for p, _ in flat_s] == [p for p, _ in flat_p]
    for (path, a), (_, b) in zip(flat_s, flat_p):
        name = jax.tree_util.keystr(path)
        if any(bias in name for bias in bias_paths):
            np.testing.assert_allclose(a, b, rtol=2e-2, atol=0.5, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_split_layernorm_dense_gives_the_parts(recipe):
    """LayerNormDenseGeneral with split_features gives the parts of the unsplit module; only
    the bias gradient differs (float32 sums against bf16 ones)."""
    x = jax.random.normal(jax.random.key(1), (2, 64, 64), jnp.bfloat16)
    split = _module_step(te_flax.LayerNormDenseGeneral(features=(3, 64), use_bias=True, split_features=True),
                         x, recipe, lambda out: out[0])
    whole = _module_step(te_flax.LayerNormDenseGeneral(features=(3, 64), use_bias=True), x, recipe,
                         lambda out: tuple(out[0][..., i, :] for i in range(3)))
    _compare(split, whole, ["'bias'"])


@pytest.mark.parametrize("groups", [None, 2], ids=["fused_qkv", "gqa_fused_kv"])
def test_attention_projections_take_the_split(groups, monkeypatch):
    """MultiHeadAttention's fused QKV (and GQA's fused KV) projection goes through dense_parts
    and gives what it gave when the split followed the packed GEMM, but the bias gradients."""
    x = jax.random.normal(jax.random.key(1), (2, 64, 64), jnp.bfloat16)
    recipe = DelayedScaling(amax_history_len=4)
    mha = te_flax.MultiHeadAttention(head_dim=16, num_attention_heads=4, num_gqa_groups=groups,
                                     input_layernorm=True, attn_mask_type="causal", use_bias=True,
                                     attention_dropout=0.0)
    calls, real = [], nn_dense.fp8_dense_parts
    monkeypatch.setattr(nn_dense, "fp8_dense_parts", lambda *a, **k: calls.append(a[5]) or real(*a, **k))
    split = _module_step(mha, x, recipe, lambda out: out[:1], 2)
    assert calls and set(calls) == {3 if groups is None else 2}, calls
    _old_parts(monkeypatch)
    packed = _module_step(mha, x, recipe, lambda out: out[:1], 2)
    _compare(split, packed, ["['qkv']['bias']", "['kv']['bias']"])


def test_kernel_lowers_to_triton_for_cuda(export_for_h200):
    """On a CPU the kernel lowers (not compiled) for CUDA with an H200's description."""
    part = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    text = export_for_h200(lambda ps, s: parts.quantize_parts(ps, s, jnp.float8_e5m2), [part] * 3,
                           jax.ShapeDtypeStruct((1,), jnp.float32))
    assert "__gpu$xla.gpu.triton" in text and "fp8_parts_quantize_both" in text


@pytest.mark.gpu
def test_gpu_kernel_matches_xla_and_takes_the_layer(fp8_layer_custom_calls):
    """On the GPU: the compiled kernel's bytes and sums against XLA's form, and the guide-shaped
    FP8 TransformerLayer quantises its QKV gradient by this kernel."""
    ps = _parts(3, (8192, 4096), jnp.bfloat16, 5)
    s = jnp.full((1,), 24.0, jnp.float32)
    f = jax.jit(lambda ps, s: parts.quantize_parts(ps, s, jnp.float8_e5m2, kernel=True))
    assert "fp8_parts_quantize_both" in f.lower(ps, s).compile().as_text()
    got, want = f(ps, s), parts.quantize_parts(ps, s, jnp.float8_e5m2, kernel=False)
    for a, b in zip(got[:2], want[:2]):
        np.testing.assert_array_equal(_bytes(a), _bytes(b))
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got[3]), np.asarray(want[3]), rtol=1e-4, atol=1e-2)
    assert fp8_layer_custom_calls("fp8_parts_quantize_both") == 1
