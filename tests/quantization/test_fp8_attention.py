"""FP8 attention (flashmesh.quantization.attention).

CPU (unmarked): every refusal reason; the state; and the custom VJP's plumbing (quantise q, k,
v and dO with the stored scales, hand cuDNN the inverse scales, dequantise o and dq, dk, dv,
return the updated state as the state's cotangent) with the cuDNN calls replaced by an
emulation written here from cudnn-frontend's SDPA FP8 graphs: f32 attention on the
dequantised inputs, the kernels' amaxes, outputs quantised with their scales; optionally P and
dS quantised where cuDNN quantises them (the forward's P as its flash kernel does, unnormalised:
cudnn-frontend test/python/sdpa/fp8_ref.py). Expected values are computed independently here.
Also pinned on CPU: the fixed scale_s and the backward's operand order (XLA_BWD_KEYS), the two
causes of the H200 failure found by reading jax / XLA / cudnn-frontend; and that the emulation's
e4m3 round trips survive XLA:GPU (an optimization barrier each: without it the GPU references
lost their FP8 rounding, the cause of the last "failure", see CPU_ERRORS).

GPU (`@pytest.mark.gpu`, B=2 T=256 N=4 H=128, causal and not): real cuDNN FP8 against the
float32 attention of the unquantised inputs. Its relative error is held to at most 1.5x
(+0.002) that of the full emulation (the same quantisation points in plain JAX; on CPU 5.5-6 %
forward, 7 % for dq, dk, dv) and to 3x that of quantising the inputs alone (4-6 %); the
kernels' amaxes to the emulation's; the scales to their update rule over several steps; the
references themselves to their CPU errors (CPU_ERRORS). One test pins why HYBRID is refused.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax import lax

from flashmesh.attention import cudnn
from flashmesh.quantization import attention as fa8
from flashmesh.quantization.recipe import DelayedScaling, Float8CurrentScaling, Format
from flashmesh.quantization.state import update_fp8_metas

E4M3 = jnp.float8_e4m3fn
TOP = 448.0
RECIPE = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=4)
H200 = cudnn.Device(91900, (9, 0))


# --------------------------------------------------------------------------------------------
# An emulation of cuDNN's FP8 kernels (cudnn-frontend node/sdpa_fp8.h, sdpa_fp8_bwd.h)
# --------------------------------------------------------------------------------------------
# Every e4m3 value the emulation makes or reads passes an optimization barrier. XLA:GPU's
# SimplifyFPConversions (on by default: xla_allow_excess_precision) folds a float convert chain
# convert(convert(x, f8e4m3fn), f32) into x, so without it the emulation and the references
# below lose their FP8 rounding on a GPU (the H200 run of 2026-12-01 printed "inputs-only
# 0.0000") and cuDNN was held to a near-bf16 error. test_emulation_keeps_its_fp8_rounding pins it.
def quant(x, scale):
    return lax.optimization_barrier(jnp.clip(x.astype(jnp.float32) * scale, -TOP, TOP).astype(E4M3))


def dequant(x8, descale):
    return lax.optimization_barrier(x8).astype(jnp.float32) * descale


def qdq(x, scale):
    return dequant(quant(x, scale), 1.0 / scale)


def attention_math(q, k, v, scale, causal, p_scale=None):
    """(o [B,T,N,H], P [B,N,T,S], stats [B,N,T]) in float32.

    With p_scale, P v is computed as cuDNN's FP8 flash forward does (cudnn-frontend
    test/python/sdpa/fp8_ref.py compute_ref): the UNNORMALISED probabilities exp(logit - row
    max), in (0, 1] with max 1 in every row, are quantised with p_scale, and P v is divided by
    their (unquantised) row sum afterwards. So p_scale > fp8_max saturates them."""
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
    if causal:
        T, S = logits.shape[-2:]
        logits = jnp.where(jnp.tril(jnp.ones((T, S), bool)), logits, -1e30)
    stats = jax.nn.logsumexp(logits, axis=-1)
    p = jnp.exp(logits - stats[..., None])
    if p_scale is None:
        return jnp.einsum("bnts,bsnh->btnh", p, v), p, stats
    e = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    o = jnp.einsum("bnts,bsnh->btnh", qdq(e, p_scale), v)
    return o / jnp.sum(e, axis=-1).transpose(0, 2, 1)[..., None], p, stats


def grads_math(q, k, v, o, do, p, scale, p_scale=None, ds_scale=None):
    """(dq, dk, dv, dS) in float32, cuDNN's order: dS = P (dO v^T - rowsum(dO o)) scale."""
    dv = jnp.einsum("bnts,btnh->bsnh", p if p_scale is None else qdq(p, p_scale), do)
    dp = jnp.einsum("btnh,bsnh->bnts", do, v)
    d = jnp.einsum("btnh,btnh->bnt", do, o)
    ds = p * (dp - d[..., None]) * scale
    ds_used = ds if ds_scale is None else qdq(ds, ds_scale)
    return (jnp.einsum("bnts,bsnh->btnh", ds_used, k), jnp.einsum("bnts,btnh->bsnh", ds_used, q),
            dv, ds)


def _m(meta, name):
    return meta[name].reshape(())


def emul_forward(q8, k8, v8, meta, *, scale, causal, is_training, intermediates):
    q, k, v = (dequant(x, _m(meta, f"descale_{n}")) for x, n in ((q8, "q"), (k8, "k"), (v8, "v")))
    o, p, stats = attention_math(q, k, v, scale, causal,
                                 _m(meta, "scale_s") if intermediates else None)
    stats = stats if is_training else None
    return quant(o, _m(meta, "scale_o")), jnp.max(p), jnp.max(jnp.abs(o)), stats


def emul_backward(q8, k8, v8, o8, do8, stats, meta, *, scale, causal, intermediates):
    q, k, v = (dequant(x, _m(meta, f"descale_{n}")) for x, n in ((q8, "q"), (k8, "k"), (v8, "v")))
    o, do = dequant(o8, _m(meta, "descale_o")), dequant(do8, _m(meta, "descale_dO"))
    _, p, _ = attention_math(q, k, v, scale, causal)
    sc = (_m(meta, "scale_s"), _m(meta, "scale_dP")) if intermediates else (None, None)
    dq, dk, dv, ds = grads_math(q, k, v, o, do, p, scale, *sc)
    amax = lambda x: jnp.max(jnp.abs(x)).reshape(1, 1, 1, 1)  # noqa: E731
    return (quant(dq, _m(meta, "scale_dQ")), quant(dk, _m(meta, "scale_dK")),
            quant(dv, _m(meta, "scale_dV")), amax(dq), amax(dk), amax(dv), amax(ds))


def kernels(intermediates: bool) -> fa8.Fp8Kernels:
    return fa8.Fp8Kernels(functools.partial(emul_forward, intermediates=intermediates),
                          functools.partial(emul_backward, intermediates=intermediates))


OUTPUTS_ONLY, FULL = kernels(False), kernels(True)


def _inputs(shape, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return tuple(jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys)


@jax.jit
def _emulation_and_autodiff(q, k, v, g):
    o, vjp = jax.vjp(lambda q, k, v: attention_math(q, k, v, 0.3, True)[0], q, k, v)
    _, p, _ = attention_math(q, k, v, 0.3, True)
    return grads_math(q, k, v, o, g, p, 0.3)[:3], vjp(g)


def test_emulation_gradients_match_autodiff():
    got, want = _emulation_and_autodiff(*_inputs((1, 16, 2, 8), jnp.float32))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# The state and the custom VJP's plumbing (CPU)
# --------------------------------------------------------------------------------------------
def test_init_state():
    state = fa8.init_state(5)
    assert set(state) == set(fa8.TENSORS) and len(fa8.TENSORS) == 10
    for scale, history in state.values():
        assert scale.shape == (1,) and scale.dtype == jnp.float32 and float(scale[0]) == 1.0
        assert history.shape == (5,) and history.dtype == jnp.float32 and not history.any()
    with pytest.raises(ValueError, match="amax_history_len"):
        fa8.init_state(0)


@functools.partial(jax.jit, static_argnames=("causal", "recipe", "kern"))
def _call(q, k, v, state, g, *, causal, recipe=RECIPE, kern=OUTPUTS_ONLY):
    f = lambda q, k, v, s: fa8.fp8_attention(q, k, v, s, recipe, causal=causal, scale=0.25,  # noqa: E731
                                             kernels=kern)
    out, vjp = jax.vjp(f, q, k, v, state)
    return out, vjp(g)


def assert_same_fp8_values(got, want, name):
    """Equal, but for the rare element whose e4m3 rounding a last-bit difference of float32
    arithmetic (another fusion, another summation order) moves by one e4m3 step (<= 1/8)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    off = ~np.isclose(got, want, rtol=1e-6, atol=1e-9)
    assert off.mean() <= 0.01, f"{name}: {off.sum()} of {off.size} elements differ"
    np.testing.assert_allclose(got[off], want[off], rtol=0.13, err_msg=name)


@functools.partial(jax.jit, static_argnames="causal")
def _by_hand(q, k, v, g, causal):
    """Distinct scales far from 1 (200 / rough amax), and what fp8_attention must give."""
    o0, p0, _ = attention_math(q, k, v, 0.25, causal)
    dq0, dk0, dv0, ds0 = grads_math(q, k, v, o0, g, p0, 0.25)
    rough = dict(q=q, k=k, v=v, s=p0, o=o0, do=g, dp=ds0, dq=dq0, dk=dk0, dv=dv0)
    s = {t: 200.0 / jnp.max(jnp.abs(x)) for t, x in rough.items()}
    qd, kd, vd, gd = qdq(q, s["q"]), qdq(k, s["k"]), qdq(v, s["v"]), qdq(g, s["do"])
    o, p, _ = attention_math(qd, kd, vd, 0.25, causal)
    o_d = qdq(o, s["o"])
    dq, dk, dv, ds = grads_math(qd, kd, vd, o_d, gd, p, 0.25)
    grads = (qdq(dq, s["dq"]), qdq(dk, s["dk"]), qdq(dv, s["dv"]))
    amax = dict(q=q, k=k, v=v, s=p, o=o, do=g, dp=ds, dq=dq, dk=dk, dv=dv)
    return s, o_d, grads, {t: jnp.max(jnp.abs(x)) for t, x in amax.items()}


@pytest.mark.parametrize("causal", [False, True])
def test_plumbing_against_hand_computation(causal):
    """Scales far from 1 and all different: a scale/descale mix-up anywhere shows."""
    q, k, v, g = _inputs((1, 32, 2, 16), jnp.float32)
    scales, want_out, want_grads, amax = _by_hand(q, k, v, g, causal)
    state = {t: (s.reshape(1), jnp.zeros((4,), jnp.float32)) for t, s in scales.items()}
    out, (dq, dk, dv, new) = _call(q, k, v, state, g, causal=causal)
    for got, want, t in zip((out, dq, dk, dv), (want_out, *want_grads), ("o", "dq", "dk", "dv")):
        assert_same_fp8_values(got, want, t)
    for t, a in amax.items():
        a = float(a)
        np.testing.assert_allclose(new[t][1], [0.0, 0.0, 0.0, a], rtol=1e-6, err_msg=t)
        np.testing.assert_allclose(new[t][0], [TOP / a], rtol=1e-6, err_msg=t)
        assert new[t][0].dtype == jnp.float32 and new[t][1].dtype == jnp.float32


@jax.jit
def _reference(q, k, v, g):
    o, vjp = jax.vjp(lambda q, k, v: attention_math(q, k, v, 0.25, True)[0], q, k, v)
    return (o, *vjp(g))


def test_bfloat16_inputs_give_bfloat16_outputs_close_to_float32():
    q, k, v, g = _inputs((1, 32, 2, 16), jnp.bfloat16)
    # One step calibrates the scales (unit scales flush small gradients).
    state = _call(q, k, v, fa8.init_state(4), g, causal=True)[1][3]
    out, (dq, dk, dv, _) = _call(q, k, v, state, g, causal=True)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == jnp.bfloat16
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    for got, want in zip((out, dq, dk, dv), _reference(f32(q), f32(k), f32(v), f32(g))):
        err = float(jnp.linalg.norm(f32(got) - want) / jnp.linalg.norm(want))
        assert err < 0.1, err  # e4m3 keeps 3 mantissa bits: a few percent


@pytest.mark.parametrize("length, margin, algo, want", [
    (2, 0, "max", 2.0), (4, 0, "max", 4.0), (4, 1, "most_recent", 4.0)])
def test_scales_follow_the_history_over_steps(length, margin, algo, want):
    """Step inputs q * [4, 1, 2]: the third step's q scale is 448 / (want * max|q|)."""
    recipe = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=length, margin=margin,
                            amax_compute_algo=algo)
    q, k, v, g = _inputs((1, 32, 2, 16), jnp.float32)
    state = fa8.init_state(length)
    for c in (4.0, 1.0, 2.0):
        state = _call(q * c, k, v, state, g, causal=False, recipe=recipe)[1][3]
    a = float(jnp.max(jnp.abs(q)))
    np.testing.assert_allclose(state["q"][0], [TOP / (want * a)], rtol=1e-6)
    np.testing.assert_allclose(state["q"][1][-1], 2.0 * a, rtol=1e-6)
    assert float(state["q"][1][0]) == 0.0


def test_forward_only_call_matches_the_differentiated_one():
    q, k, v, g = _inputs((1, 32, 2, 16), jnp.float32)
    state = fa8.init_state(4)
    f = jax.jit(lambda q, k, v, s: fa8.fp8_attention(q, k, v, s, RECIPE, causal=True, scale=0.25,
                                                     kernels=OUTPUTS_ONLY))
    np.testing.assert_array_equal(f(q, k, v, state), _call(q, k, v, state, g, causal=True)[0])


def test_zero_cotangent_keeps_the_do_scale():
    q, k, v, g = _inputs((1, 32, 2, 16), jnp.float32)
    state = dict(fa8.init_state(4), do=(jnp.full((1,), 3.0), jnp.zeros((4,))))
    _, (_, _, _, new) = _call(q, k, v, state, jnp.zeros_like(g), causal=True)
    assert float(new["do"][0][0]) == 3.0
    assert float(new["q"][0][0]) != 1.0


def test_softmax_scale_is_fixed_at_fp8_max():
    """cuDNN quantises exp(logit - row max) <= 1: scale_s = 448 whatever state["s"] holds."""
    state = {t: (jnp.full((1,), 1000.0 + i), jnp.zeros((4,))) for i, t in enumerate(fa8.TENSORS)}
    meta = fa8._meta(fa8._scales(state), Format.E4M3)
    np.testing.assert_array_equal(meta["scale_s"], np.full((1, 1, 1, 1), TOP, np.float32))
    np.testing.assert_allclose(meta["descale_s"], np.full((1, 1, 1, 1), 1 / TOP), rtol=1e-7)
    for name, t in (("scale_o", "o"), ("scale_dP", "dp"), ("scale_dQ", "dq")):
        np.testing.assert_array_equal(meta[name].reshape(1), state[t][0])
    for name, t in (("descale_q", "q"), ("descale_o", "o"), ("descale_dO", "do"), ("descale_dP", "dp")):
        np.testing.assert_allclose(meta[name].reshape(1), 1 / state[t][0], rtol=1e-7)


@functools.partial(jax.jit, static_argnames="causal")
def _f32_attention(q, k, v, causal):
    return attention_math(q, k, v, 0.25, causal)[0]


def test_calibrated_softmax_scale_would_saturate_the_flash_kernel():
    """The H200's failure, emulated: after one calibrating step state["s"] holds 448 / amax_s
    (amax of the normalised softmax, about 0.3 here), which saturates the unnormalised P the
    flash kernel quantises (error about 0.5, as measured); fp8_attention passes 448 instead."""
    q, k, v, g = _inputs((1, 256, 2, 16), jnp.float32)
    want = _f32_attention(q, k, v, False)
    state = _call(q, k, v, fa8.init_state(4), g, causal=False, kern=FULL)[1][3]
    out = _call(q, k, v, state, g, causal=False, kern=FULL)[0]
    assert float(state["s"][0][0]) > 2 * TOP  # 448 / amax_s, amax_s < 0.5
    err = _rel(out, want)
    assert err < 0.1, err
    scales = fa8._scales(state)
    meta = dict(fa8._meta(scales, Format.E4M3), scale_s=scales["s"].reshape(1, 1, 1, 1),
                descale_s=(1 / scales["s"]).reshape(1, 1, 1, 1))
    q8, k8, v8 = (quant(x, scales[t][0]) for x, t in ((q, "q"), (k, "k"), (v, "v")))
    o8 = emul_forward(q8, k8, v8, meta, scale=0.25, causal=False, is_training=False,
                      intermediates=True)[0]
    saturated = _rel(dequant(o8, 1 / scales["o"][0]), want)
    assert saturated > 0.3, saturated


# XLA's cuDNN FP8 backward graph numbers its tensors in this order (cuda_dnn.cc,
# GetCudnnFlashAttentionBackwardF8OperationGraph: next_uid() for Q, K, V, O, dO, Stats, then
# the set_uid calls) and CudnnGraph::PackOperands binds the custom call's operands to those uids
# by position. Written out here independently of flashmesh's XLA_BWD_KEYS.
XLA_BWD_UIDS = ("q", "k", "v", "o", "dO", "stats", "descale_q", "descale_k", "descale_v",
                "descale_s", "descale_o", "descale_dO", "descale_dP", "scale_s", "scale_dP",
                "scale_dQ", "scale_dK", "scale_dV")


def test_backward_scales_reach_the_custom_call_in_xla_graph_order():
    """Lowers flashmesh's cuDNN backward for CUDA (no GPU needed) and reads the operand order
    of the __cudnn$fmhaSoftmaxBackwardF8 custom call."""
    import re
    from jax._src.cudnn import fused_attention_stablehlo as jfa
    assert tuple(jfa.fp8_params_keys_bwd) == fa8.JAX_BWD_KEYS  # the jax analysed
    x8 = jax.ShapeDtypeStruct((1, 128, 1, 128), E4M3)
    one = jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32)
    names = ("q", "k", "v", "o", "dO", "stats") + tuple(sorted(fa8.JAX_BWD_KEYS))

    def bwd(*args):
        arrays, meta = args[:6], dict(zip(names[6:], args[6:]))
        return fa8.CUDNN_KERNELS.backward(*arrays, meta, scale=0.1, causal=False)

    shapes = (x8,) * 5 + (jax.ShapeDtypeStruct((1, 1, 128), jnp.float32),) + (one,) * 12
    text = jax.jit(bwd).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    call = re.search(r"custom_call @__cudnn\$fmhaSoftmaxBackwardF8\(([^)]*)\)", text)
    assert call is not None, text
    order = tuple(names[int(a.strip()[len("%arg"):])] for a in call.group(1).split(","))
    assert order == XLA_BWD_UIDS, order


def test_operand_order_check():
    from jax._src.cudnn import fused_attention_stablehlo as jfa
    fa8._check_jax_operand_order(jfa)  # the installed jax is the one analysed

    class OtherJax:
        fp8_params_keys_fwd = list(fa8.JAX_FWD_KEYS)
        fp8_params_keys_bwd = list(fa8.XLA_BWD_KEYS)

    with pytest.raises(NotImplementedError, match="re-check"):
        fa8._check_jax_operand_order(OtherJax)


class _Attention(nn.Module):
    @nn.compact
    def __call__(self, q, k, v):
        state = fa8.declare_state(self, RECIPE)
        return fa8.fp8_attention(q, k, v, state, RECIPE, causal=True, scale=0.25, kernels=OUTPUTS_ONLY)


def test_flax_module_state_round_trip():
    """declare_state's fp8_metas variables, their cotangent, and update_fp8_metas."""
    q, k, v, g = _inputs((1, 32, 2, 16), jnp.float32)
    variables = jax.jit(_Attention().init)(jax.random.key(0), q, k, v)
    names = {f"{t}_{x}" for t in fa8.TENSORS for x in ("scale", "amax_history")}
    assert set(variables["fp8_metas"]) == names
    loss = lambda var: jnp.vdot(_Attention().apply(var, q, k, v), g)  # noqa: E731
    grads = jax.jit(jax.grad(loss))(variables)
    new = update_fp8_metas(variables, grads)["fp8_metas"]
    a = float(jnp.max(jnp.abs(q)))
    np.testing.assert_allclose(new["q_scale"], [TOP / a], rtol=1e-6)
    np.testing.assert_allclose(new["q_amax_history"], [0, 0, 0, a], rtol=1e-6)
    assert float(new["dq_scale"][0]) != 1.0


# --------------------------------------------------------------------------------------------
# Refusals (CPU)
# --------------------------------------------------------------------------------------------
def test_refusals():
    q, k, v, _ = _inputs((1, 32, 2, 16), jnp.float32)
    state = fa8.init_state(4)

    def call(state=state, recipe=RECIPE, causal=True, **kw):
        return fa8.fp8_attention(q, k, v, state, recipe, causal=causal, scale=0.25, **kw)

    with pytest.raises(NotImplementedError, match="one FP8 dtype"):
        call(recipe=DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4), kernels=OUTPUTS_ONLY)
    with pytest.raises(NotImplementedError, match="Float8CurrentScaling"):
        call(recipe=Float8CurrentScaling(fp8_format=Format.E4M3), kernels=OUTPUTS_ONLY)
    with pytest.raises(NotImplementedError, match="needs an NVIDIA GPU|head dim 16"):
        call()  # cuDNN: refused on CPU, and for this head dim on a GPU
    with pytest.raises(ValueError, match="keys"):
        call(state={t: state[t] for t in fa8.TENSORS[:-1]}, kernels=OUTPUTS_ONLY)
    with pytest.raises(ValueError, match=r"\(4,\)"):
        call(state=fa8.init_state(3), kernels=OUTPUTS_ONLY)
    with pytest.raises(ValueError, match="causal must be a bool"):
        call(causal=1, kernels=OUTPUTS_ONLY)


def _support(T=256, S=256, N=4, K=4, H=128, Dv=None, dtype=jnp.bfloat16, **kw):
    q = jax.ShapeDtypeStruct((2, T, N, H), dtype)
    k = jax.ShapeDtypeStruct((2, S, K, H), dtype)
    v = jax.ShapeDtypeStruct((2, S, K, Dv or H), dtype)
    kw.setdefault("device", H200)
    return fa8.fp8_attention_support(q, k, v, **kw)


STATIC = {
    "bias": (dict(bias=jnp.zeros((1, 4, 256, 256), jnp.bfloat16)), "takes no bias"),
    "window": (dict(window=(64, 0)), "sliding window"),
    "dropout": (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "dropout"),
    "segments": (dict(mask="padding", segments="seqlens"), "sequence lengths"),
    "off_by_one": (dict(softmax="off_by_one"), "vanilla softmax"),
    "soft_cap": (dict(logits_soft_cap=5.0), "soft cap"),
    "bottom_right": (dict(mask="causal_bottom_right", S=384), "top-left"),
    "gqa": (dict(K=2), "GQA"),
    "mla": (dict(Dv=64, is_training=False), "Dv=64"),
    "head_dim": (dict(H=64), "head dim 128 only"),
    "seq": (dict(T=200), "multiples of 128"),
    "inference_head_dim": (dict(H=72, is_training=False), "multiple of 16"),
    "lse": (dict(return_lse=True), "log-sum-exp"),
    "hybrid": (dict(recipe=DelayedScaling(fp8_format=Format.HYBRID)), "use Format.E4M3"),
    "ampere": (dict(device=cudnn.Device(91900, (8, 0))), "compute capability >= 9.0"),
    "sm120": (dict(device=cudnn.Device(91900, (12, 0))), "12.0"),
    "old_cudnn": (dict(device=cudnn.Device(90000, (9, 0))), "cuDNN >= 9.1.0, found 9.0.0"),
    "cudnn_9_10_0": (dict(device=cudnn.Device(91000, (9, 0))), "9.10.0 has a known"),
    "sm103": (dict(device=cudnn.Device(91002, (10, 3))), "10.3 needs cuDNN >= 9.11.0"),
    "blackwell_bwd": (dict(device=cudnn.Device(91800, (10, 0))), "needs cuDNN >= 9.19.0"),
    "cpu": (dict(device=None), "needs an NVIDIA GPU"),
    "cpu_and_soft_cap": (dict(device=None, logits_soft_cap=5.0), "and on one: logits_soft_cap"),
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_support_reasons(name):
    kw, want = STATIC[name]
    kw = dict(kw)
    if kw.get("segments") == "seqlens":
        from flashmesh.attention.sequence import SequenceDescriptor
        kw["segments"] = SequenceDescriptor.from_seqlens((jnp.full((2,), 200, jnp.int32),) * 2)
    if name.startswith("cpu") and jax.default_backend() == "gpu":
        pytest.skip("asks about this machine, which has a GPU")
    reason = _support(**kw)
    assert reason is not None and want in reason, reason


@pytest.mark.parametrize("kw", [dict(mask="causal"), dict(mask="none"), dict(mask=None, T=128, S=384),
                                dict(H=64, is_training=False, recipe=RECIPE),
                                dict(device=cudnn.Device(91900, (10, 0)))])
def test_supported(kw):
    assert _support(**kw) is None


# --------------------------------------------------------------------------------------------
# Real cuDNN FP8 (GPU)
# --------------------------------------------------------------------------------------------
GPU_SHAPE, GPU_SCALE = (2, 256, 4, 128), 128 ** -0.5


def _rel(got, want):
    got = got.astype(jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


@functools.partial(jax.jit, static_argnames=("causal", "kern"))
def _gpu_step(q, k, v, state, g, *, causal, kern=fa8.CUDNN_KERNELS):
    """(out, (dq, dk, dv, new state)); kern None is cuDNN. Arrays are arguments, not constants
    closed over, so XLA does not constant-fold the inputs' reductions."""
    f = lambda q, k, v, s: fa8.fp8_attention(q, k, v, s, RECIPE, causal=causal,  # noqa: E731
                                             scale=GPU_SCALE, kernels=kern)
    out, vjp = jax.vjp(f, q, k, v, state)
    return out, vjp(g)


@functools.partial(jax.jit, static_argnames="causal")
def _f32_and_inputs_only(q, k, v, g, causal):
    """float32 attention (out, dq, dk, dv) of the inputs, and of them quantised-dequantised
    (e4m3, scale 448 / amax): the error of FP8 inputs alone."""
    def grads(q, k, v, g):
        o, vjp = jax.vjp(lambda q, k, v: attention_math(q, k, v, GPU_SCALE, causal)[0], q, k, v)
        return (o, *vjp(g))
    x = [a.astype(jnp.float32) for a in (q, k, v, g)]
    return grads(*x), grads(*(qdq(a, TOP / jnp.max(jnp.abs(a))) for a in x))


def fp8_round_trips_xla_gpu_folds(hlo: str) -> list[str]:
    """The convert(convert(x, f8), T) chains in `hlo` (HLO text, calls followed to their root),
    which XLA:GPU's SimplifyFPConversions replaces by x, dropping the FP8 rounding."""
    defs, roots, computation = {}, {}, None
    for line in hlo.splitlines():
        if line.endswith("{") and " = " not in line:
            computation = line.split()[-2].lstrip("%")
            continue
        parts = line.split(" = ", 1)
        if len(parts) != 2:
            continue
        name = parts[0].split()[-1].lstrip("%")
        type_, _, rest = parts[1].partition(" ")
        op, _, args = rest.partition("(")
        callee = args.split("to_apply=")[-1].split(",")[0].strip() if op == "call" else None
        defs[name] = (type_, op, args.split(")")[0].split(",")[0].strip().lstrip("%"), callee)
        if parts[0].strip().startswith("ROOT"):
            roots[computation] = name

    def producer(name):  # follow a call to the instruction its computation returns
        while name in defs and defs[name][1] == "call" and defs[name][3] in roots:
            name = roots[defs[name][3]]
        return name

    chains = []
    for name, (type_, op, arg, _) in defs.items():
        src = defs.get(producer(arg))
        if op == "convert" and src is not None and src[1] == "convert" and src[0].startswith("f8"):
            chains.append(f"{name} = {type_} convert({producer(arg)} = {src[0]} convert(...))")
    return chains


def test_fp8_round_trip_detector():
    def chain(x):
        return x.astype(E4M3).astype(jnp.float32) * 2.0

    def barrier(x):
        return lax.optimization_barrier(x.astype(E4M3)).astype(jnp.float32) * 2.0

    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    hlo = lambda f: jax.jit(f).trace(x).lower().as_text(dialect="hlo")  # noqa: E731
    assert len(fp8_round_trips_xla_gpu_folds(hlo(chain))) == 1
    assert fp8_round_trips_xla_gpu_folds(hlo(barrier)) == []
    assert len(fp8_round_trips_xla_gpu_folds(hlo(lambda x: jax.jit(lambda y: y.astype(E4M3))(x)
                                                 .astype(jnp.float32)))) == 1


@pytest.mark.parametrize("kern", ["FULL", "OUTPUTS_ONLY", "references"])
def test_emulation_keeps_its_fp8_rounding(kern):
    """The emulated kernels, the plumbing around them and the inputs-only reference, as the GPU
    tests trace them: no f32 -> e4m3 -> f32 round trip that XLA:GPU would fold away."""
    q, k, v, g = (jax.ShapeDtypeStruct((1, 128, 1, 16), jnp.bfloat16),) * 4
    if kern == "references":
        lowered = _f32_and_inputs_only.trace(q, k, v, g, causal=True).lower()
    else:
        state = jax.eval_shape(lambda: fa8.init_state(4))
        lowered = _gpu_step.trace(q, k, v, state, g, causal=False, kern=globals()[kern]).lower()
    hlo = lowered.as_text(dialect="hlo")
    assert "f8e4m3fn" in hlo
    assert fp8_round_trips_xla_gpu_folds(hlo) == []


# Relative errors from float32 at GPU_SHAPE, seed 1, measured on CPU (2 cores, 5 s) with scales
# calibrated by one emulated step: (full emulation, inputs-only) per tensor. The H200's cuDNN
# FP8 (2026-12-01) gave out 0.0581 / 0.0522, dq 0.0709 / 0.0694, dk 0.0707 / 0.0696, dv 0.0604 /
# 0.0546 (unmasked / causal): the full emulation's numbers, to 3 digits.
CPU_ERRORS = {False: dict(out=(0.0581, 0.0461), dq=(0.0710, 0.0597), dk=(0.0707, 0.0597),
                          dv=(0.0604, 0.0468)),
              True: dict(out=(0.0522, 0.0407), dq=(0.0694, 0.0567), dk=(0.0696, 0.0569),
                         dv=(0.0547, 0.0406))}


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_references_keep_their_fp8_rounding(causal):
    """On the GPU the emulation and the inputs-only reference give their CPU errors: XLA:GPU
    has not folded their e4m3 round trips (it had on 2026-12-01: inputs-only 0.0000)."""
    q, k, v, g = _inputs(GPU_SHAPE, jnp.bfloat16, seed=1)
    want, inputs_only = _f32_and_inputs_only(q, k, v, g, causal)
    state = _gpu_step(q, k, v, fa8.init_state(4), g, causal=causal, kern=FULL)[1][3]
    e_out, e_grads = _gpu_step(q, k, v, state, g, causal=causal, kern=FULL)
    for name, emul, ref, base in zip(("out", "dq", "dk", "dv"), (e_out, *e_grads[:3]), want,
                                     inputs_only):
        got = (_rel(emul, ref), _rel(base, ref))
        np.testing.assert_allclose(got, CPU_ERRORS[causal][name], rtol=0.1, err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_cudnn_fp8_against_float32(causal):
    """cuDNN's error from float32 within 1.5x (+0.002) of the full emulation's and 3x of the
    inputs-only one (CPU_ERRORS); passed (as a strict-xfail XPASS) on the H200 on 2026-12-01."""
    q, k, v, g = _inputs(GPU_SHAPE, jnp.bfloat16, seed=1)
    want, inputs_only = _f32_and_inputs_only(q, k, v, g, causal)
    state = _gpu_step(q, k, v, fa8.init_state(4), g, causal=causal)[1][3]  # calibrate the scales
    out, grads = _gpu_step(q, k, v, state, g, causal=causal)
    e_out, e_grads = _gpu_step(q, k, v, state, g, causal=causal, kern=FULL)
    report, wrong = [], []
    for name, got, emul, ref, base in zip(("out", "dq", "dk", "dv"), (out, *grads[:3]),
                                          (e_out, *e_grads[:3]), want, inputs_only):
        err, err_emul, err_base = _rel(got, ref), _rel(emul, ref), _rel(base, ref)
        report.append(f"{name}: cuDNN FP8 {err:.4f}, full emulation {err_emul:.4f}, "
                      f"inputs-only {err_base:.4f}, cuDNN vs emulation "
                      f"{_rel(got, emul.astype(jnp.float32)):.4f}")
        ok = (got.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(got)))
              and err <= 1.5 * err_emul + 2e-3 and err <= 3.0 * err_base)
        wrong += [] if ok else [name]
    print(f"causal={causal}: " + "; ".join(report))  # every tensor's numbers, also when all pass
    assert not wrong, f"causal={causal}, wrong: {wrong}; " + "; ".join(report)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_scales_update_over_steps(causal):
    """Passed on the H200 (2026-12-01) once scale_s = fp8_max and the backward's scale operands
    follow XLA's order; the accuracy test above still fails."""
    q, k, v, g = _inputs(GPU_SHAPE, jnp.bfloat16, seed=2)
    states = [fa8.init_state(4)]
    for _ in range(3):
        states.append(_gpu_step(q, k, v, states[-1], g, causal=causal)[1][3])
    last, prev = states[-1], states[-2]
    # The last step emulated: the kernels' amaxes (pre-scale, real units) must agree with it.
    want = _gpu_step(q, k, v, prev, g, causal=causal, kern=FULL)[1][3]
    for t in fa8.TENSORS:
        scale, history = last[t]
        assert float(history[0]) == 0.0 and bool(jnp.all(history[1:] > 0)), (t, history)
        np.testing.assert_allclose(scale, TOP / jnp.max(history), rtol=1e-6, err_msg=t)
        np.testing.assert_allclose(history[-1], want[t][1][-1], rtol=0.05, err_msg=t)
    for t, x in (("q", q), ("k", k), ("v", v), ("do", g)):
        np.testing.assert_allclose(last[t][0], TOP / jnp.max(jnp.abs(x.astype(jnp.float32))),
                                   rtol=1e-6, err_msg=t)
    if causal:  # row 0 sees key 0 alone: P = 1 there
        np.testing.assert_allclose(last["s"][1][-1], 1.0, rtol=1e-3)


@pytest.mark.gpu
def test_gpu_support_here():
    q, k, v, _ = _inputs(GPU_SHAPE, jnp.bfloat16)
    assert fa8.fp8_attention_support(q, k, v, mask="causal", recipe=RECIPE) is None


@pytest.mark.gpu
def test_gpu_xla_refuses_an_e5m2_output_gradient():
    """Why HYBRID is refused: XLA's cuDNN FP8 backward takes dO in q's FP8 dtype only."""
    from jax._src.cudnn import fused_attention_stablehlo as jfa
    q, k, v, g = _inputs(GPU_SHAPE, jnp.bfloat16)
    one = jnp.ones((1, 1, 1, 1), jnp.float32)
    meta = {n: one for n in jfa.fp8_params_keys}

    def f(q, k, v, g):
        q8, k8, v8 = (x.astype(E4M3) for x in (q, k, v))
        o8, _, _, stats = fa8.CUDNN_KERNELS.forward(q8, k8, v8, meta, scale=GPU_SCALE, causal=False,
                                                    is_training=True)
        return fa8.CUDNN_KERNELS.backward(q8, k8, v8, o8, g.astype(jnp.float8_e5m2), stats, meta,
                                          scale=GPU_SCALE, causal=False)[0]

    with pytest.raises(Exception, match="do not match"):
        jax.jit(f)(q, k, v, g).block_until_ready()
