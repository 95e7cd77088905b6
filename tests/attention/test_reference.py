"""The reference backend against the brute-force NumPy oracle of `semantics.py`.

The reference is the ground truth of every other test, so it is checked here against an
independent implementation written from the documented semantics: masks (none, causal,
bottom-right with T < S and T > S, windows), segments from every descriptor constructor, bias
shapes, softmax types, soft cap, scale, GQA / MQA, Dqk != Dv, dropout, fully masked rows (exact
zeros, never NaN), and gradients (autodiff of the oracle's jnp port, and finite differences of
the NumPy oracle itself). Everything runs in float64 through `flashmesh.attention`.
"""

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashmesh
import semantics as sem
from flashmesh.attention import normalize
from flashmesh.attention.spec import EMPTY_ROW_LSE

F64 = dict(rtol=1e-11, atol=1e-12)


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _call(q, k, v, *, bias=None, sink=None, ct=None, jit=False, **opts):
    """Reference output, lse and (with a cotangent ct) gradients of sum(out * ct) with respect
    to q, k, v, bias, sink. Eager on purpose: op-by-op dispatch reuses compiled kernels across
    tests, while a jit per configuration costs a fresh XLA compile each time (jit=True for
    shapes no other test uses: one compile is then cheaper than many small ones)."""
    def fwd(q, k, v, bias, sink):
        return flashmesh.attention(q, k, v, bias=bias, sink=sink, implementation="reference",
                                   return_lse=True, **opts)

    if ct is None:
        out, lse = (sem.jit(fwd) if jit else fwd)(q, k, v, bias, sink)
        return np.asarray(out), np.asarray(lse), None

    def loss(q, k, v, bias, sink):
        out, lse = fwd(q, k, v, bias, sink)
        return jnp.sum(out.astype(ct.dtype) * ct), (out, lse)

    argnums = tuple(i for i, x in enumerate((q, k, v, bias, sink)) if x is not None)
    step = jax.value_and_grad(loss, argnums, has_aux=True)
    (_, (out, lse)), grads = (sem.jit(step) if jit else step)(q, k, v, bias, sink)
    named = dict(zip([("q", "k", "v", "bias", "sink")[i] for i in argnums], grads))
    return np.asarray(out), np.asarray(lse), {n: np.asarray(g) for n, g in named.items()}


def _oracle_grads(q, k, v, vis, ct, *, bias=None, sink=None, jit=False, **opts):
    """Gradients of sum(out * ct) by autodiff of the oracle's jnp port, in float64."""
    names = [n for n, x in (("q", q), ("k", k), ("v", v), ("bias", bias), ("sink", sink))
             if x is not None]
    args = [jnp.asarray(x, jnp.float64) for x in (q, k, v, bias, sink) if x is not None]

    def loss(*xs):
        kw = dict(zip(names, xs))
        out, _ = sem.attention_jnp(kw["q"], kw["k"], kw["v"], vis, bias=kw.get("bias"),
                                   sink=kw.get("sink"), **opts)
        return jnp.sum(out * ct)

    step = jax.grad(loss, tuple(range(len(args))))
    grads = (sem.jit(step) if jit else step)(*args)
    return dict(zip(names, (np.asarray(g) for g in grads)))


def _check(q, k, v, *, bias=None, sink=None, segments=None, grads=False, rng=None, jit=False,
           **opts):
    """Reference vs oracle: output and lse, and gradients when asked."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    bias = None if bias is None else np.asarray(bias, np.float64)
    sink = None if sink is None else np.asarray(sink, np.float64)
    desc = None if segments is None else segments.descriptor()
    ct = None
    if grads:
        B, T, N = q.shape[:3]
        ct = jnp.asarray((rng or np.random.default_rng(1)).standard_normal((B, T, N, v.shape[3])))
    out, lse, g = _call(q, k, v, bias=bias, sink=sink, segments=desc, ct=ct, jit=jit, **opts)
    want_out, want_lse = sem.attention(q, k, v, bias=bias, sink=sink, segments=segments, **opts)
    sem.assert_close("out", out, want_out, **F64)
    sem.assert_close("lse", lse, want_lse, **F64)
    if grads:
        B, T, S = q.shape[0], q.shape[1], k.shape[1]
        vis = sem.visible(B, T, S, mask=opts.get("mask", "causal"), window=opts.get("window"),
                          segments=segments)
        jnp_opts = {key: opts[key] for key in ("scale", "softmax", "logits_soft_cap") if key in opts}
        want = _oracle_grads(q, k, v, vis, ct, bias=bias, sink=sink, jit=jit, **jnp_opts)
        for name, grad in want.items():
            sem.assert_close(f"d{name}", g[name], grad, **F64)
    return out, lse, g


def _seed(*parts) -> int:
    """A stable seed from test parameters (str hashes change between processes)."""
    return zlib.crc32(repr(parts).encode())


def _qkv(seed, B=2, T=9, S=9, N=4, K=2, Dqk=8, Dv=8):
    return sem.random_qkv(np.random.default_rng(seed), B, T, S, N, K, Dqk, Dv, np.float64)


# -- masks and windows ---------------------------------------------------------------------------
@pytest.mark.parametrize("mask", ["none", "causal", "causal_bottom_right"])
@pytest.mark.parametrize("T,S", [(9, 9), (6, 11), (11, 6)])
def test_masks(mask, T, S):
    q, k, v = _qkv(T * 100 + S, T=T, S=S)
    _check(q, k, v, mask=mask)


@pytest.mark.parametrize("mask,window,T,S", [
    ("causal", (0, 0), 9, 9), ("causal", (2, 0), 9, 9), ("causal", (3, -1), 9, 9),
    ("causal", (1, 0), 6, 11), ("causal_bottom_right", (2, 0), 6, 11),
    ("causal_bottom_right", (3, 0), 11, 6), ("none", (2, 3), 9, 9), ("none", (-1, 2), 9, 9),
    ("none", (4, -1), 9, 9), ("none", (0, 0), 9, 9), ("none", (1, 2), 6, 11),
    ("none", (0, 1), 11, 6),
])
def test_windows(mask, window, T, S):
    q, k, v = _qkv(7, T=T, S=S)
    _check(q, k, v, mask=mask, window=window)


def test_bottom_right_diagonal_is_the_last_query_and_key():
    """T < S bottom-right: the last query sees every key; top-left: it sees T of them."""
    vis_br = sem.visible(1, 3, 7, mask="causal_bottom_right")
    vis_tl = sem.visible(1, 3, 7, mask="causal")
    assert vis_br[0].sum(-1).tolist() == [5, 6, 7]
    assert vis_tl[0].sum(-1).tolist() == [1, 2, 3]


# -- segments ------------------------------------------------------------------------------------
SEGMENT_MASKS = [("padding_causal", 9, 9), ("padding", 6, 11),
                 ("padding_causal_bottom_right", 11, 6)]


def _segment_params():
    """Each recipe with two of the three masks, in rotation: every (recipe, mask) pair but
    one in three, every mask with six recipes."""
    for r, recipe in enumerate(sorted(sem.SEGMENT_RECIPES)):
        for mask, T, S in (SEGMENT_MASKS[r % 3], SEGMENT_MASKS[(r + 1) % 3]):
            yield recipe, mask, T, S


@pytest.mark.parametrize("recipe,mask,T,S", list(_segment_params()))
def test_segments(recipe, mask, T, S):
    rng = np.random.default_rng(_seed(recipe, mask, T))
    seg = sem.SEGMENT_RECIPES[recipe](rng, 2, T, S)
    q, k, v = _qkv(3, T=T, S=S)
    _check(q, k, v, mask=mask, segments=seg)


@pytest.mark.parametrize("recipe", ["seqlens", "offsets", "ids", "ids_pos_shifted"])
@pytest.mark.parametrize("window", [(0, 0), (1, 2)])
def test_segments_with_windows(recipe, window):
    rng = np.random.default_rng(11)
    seg = sem.SEGMENT_RECIPES[recipe](rng, 2, 9, 9)
    q, k, v = _qkv(4)
    _check(q, k, v, mask="none" if window[1] > 0 else "padding_causal", window=window, segments=seg)


def test_offsets_descriptor_forms_agree():
    """[B, M] offsets and cuDNN's [B, M+1] form (padded with -1) are the same layout."""
    rng = np.random.default_rng(5)
    seg = sem.offsets_segments(rng, 2, 9, 9, cudnn_offsets=True)
    short = sem.Segments("offsets", (seg.q[0], seg.q[1][:, :-1]), (seg.kv[0], seg.kv[1][:, :-1]))
    q, k, v = _qkv(2)
    a = _check(q, k, v, mask="padding_causal", segments=seg)[0]
    b = _check(q, k, v, mask="padding_causal", segments=short)[0]
    np.testing.assert_array_equal(a, b)


def test_segment_ids_with_canonical_positions_equal_derived():
    rng = np.random.default_rng(9)
    seg = sem.ids_segments(rng, 2, 9, 9, positions="canonical")
    derived = sem.Segments("ids", (seg.q[0], None), (seg.kv[0], None))
    q, k, v = _qkv(2)
    a = _check(q, k, v, mask="causal", window=(2, 0), segments=seg)[0]
    b = _check(q, k, v, mask="causal", window=(2, 0), segments=derived)[0]
    np.testing.assert_array_equal(a, b)


# -- bias, softmax, soft cap, scale, heads ---------------------------------------------------------
@pytest.mark.parametrize("pattern", sem.BIAS_SHAPES)
def test_bias_shapes(pattern):
    rng = np.random.default_rng(3)
    q, k, v = _qkv(3, T=6, S=11)
    bias = sem.random_bias(rng, pattern, 2, 4, 6, 11, np.float64)
    _check(q, k, v, bias=bias, mask="causal", grads=True)


@pytest.mark.parametrize("softmax", ["vanilla", "off_by_one", "learnable"])
@pytest.mark.parametrize("mask", ["causal", "causal_bottom_right"])
def test_softmax_types(softmax, mask):
    rng = np.random.default_rng(4)
    q, k, v = _qkv(4, T=11, S=6)  # bottom-right with T > S: the first 5 rows are empty
    sink = sem.random_sink(rng, 4) if softmax == "learnable" else None
    _check(q, k, v, sink=sink, softmax=softmax, mask=mask, grads=True)


@pytest.mark.parametrize("cap,scale", [(2.0, None), (0.5, 2.5)])
def test_soft_cap_and_scale(cap, scale):
    rng = np.random.default_rng(6)
    q, k, v = _qkv(6)
    bias = sem.random_bias(rng, "1NTS", 2, 4, 9, 9, np.float64)
    _check(q, k, v, bias=bias, logits_soft_cap=cap, scale=scale, mask="causal", grads=True)


def test_default_scale_is_inverse_sqrt_dqk():
    q, k, v = _qkv(8, Dqk=16, Dv=4)
    a = _check(q, k, v, mask="none")[0]
    b = _check(q, k, v, mask="none", scale=1.0 / math.sqrt(16))[0]
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("N,K,Dqk,Dv", [(16, 2, 8, 8), (4, 1, 8, 8), (4, 4, 16, 8),
                                        (4, 2, 8, 24)])
def test_heads_and_dims(N, K, Dqk, Dv):
    """GQA 8:1, MQA, MHA with Dqk > Dv, and Dqk < Dv."""
    q, k, v = _qkv(N * 7 + K, T=6, S=11, N=N, K=K, Dqk=Dqk, Dv=Dv)
    out = _check(q, k, v, mask="causal", grads=True, jit=True)[0]
    assert out.shape == (2, 6, N, Dv)


# -- dropout -----------------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [0.2, 0.6])
def test_dropout_matches_oracle_with_the_same_keep_mask(rate):
    q, k, v = _qkv(12, T=6, S=11)
    key = jax.random.key(42)
    inputs, spec = normalize(q, k, v, dropout_rate=rate, dropout_rng=key)
    keep = sem.dropout_keep_mask(inputs.dropout_seed, rate, 2, 4, 6, 11)
    assert 0 < keep.mean() < 1
    out, lse, _ = _call(q, k, v, mask="causal", dropout_rate=rate, dropout_rng=key)
    want_out, want_lse = sem.attention(q, k, v, mask="causal", keep=keep, dropout_rate=rate)
    sem.assert_close("out", out, want_out, **F64)
    sem.assert_close("lse", lse, want_lse, **F64)  # lse is the undropped softmax's


def test_dropout_gradients():
    q, k, v = _qkv(13)
    rng = np.random.default_rng(0)
    key, rate = jax.random.key(3), 0.3
    inputs, _ = normalize(q, k, v, dropout_rate=rate, dropout_rng=key)
    keep = sem.dropout_keep_mask(inputs.dropout_seed, rate, 2, 4, 9, 9)
    ct = jnp.asarray(rng.standard_normal((2, 9, 4, 8)))
    _, _, g = _call(q, k, v, mask="causal", dropout_rate=rate, dropout_rng=key, ct=ct)
    vis = sem.visible(2, 9, 9, mask="causal")
    want = _oracle_grads(q, k, v, vis, ct, keep=keep, dropout_rate=rate)
    for name in "qkv":
        sem.assert_close(f"d{name}", g[name], want[name], **F64)


def test_deterministic_turns_dropout_off():
    q, k, v = _qkv(14)
    a = _call(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(0), deterministic=True)[0]
    b = _call(q, k, v)[0]
    np.testing.assert_array_equal(a, b)


# -- fully masked rows -------------------------------------------------------------------------
FULLY_MASKED = {  # name -> options and how the rows come out empty
    "bottom_right_T_gt_S": dict(T=11, S=6, mask="causal_bottom_right"),
    "seqlens_zero_row": dict(T=9, S=9, mask="padding", recipe="seqlens_empty_row"),
    "offsets_zero_row": dict(T=9, S=9, mask="padding_causal", recipe="offsets_empty_row"),
    "ids_zero_row": dict(T=9, S=9, mask="padding_causal", recipe="ids_empty_row"),
    "window_past_the_keys": dict(T=11, S=6, mask="none", window=(0, 0)),
}


def _fully_masked_params():
    for case in sorted(FULLY_MASKED):
        for softmax in ("vanilla", "off_by_one", "learnable"):
            yield case, softmax, "float64"
    for case in ("bottom_right_T_gt_S",):
        for softmax in ("vanilla", "learnable"):
            for dtype in ("float32", "bfloat16"):
                yield case, softmax, dtype


@pytest.mark.parametrize("case,softmax,dtype", list(_fully_masked_params()))
def test_fully_masked_rows_are_exactly_zero(case, softmax, dtype):
    cfg = dict(FULLY_MASKED[case])
    T, S = cfg.pop("T"), cfg.pop("S")
    rng = np.random.default_rng(20)
    seg = sem.SEGMENT_RECIPES[cfg.pop("recipe")](rng, 2, T, S) if "recipe" in cfg else None
    B, N, K, D = 2, 4, 2, 8
    vis = sem.visible(B, T, S, segments=seg, **cfg)
    empty = ~vis.any(-1)  # [B, T]
    assert empty.any() and not empty.all()
    q, k, v = sem.random_qkv(rng, B, T, S, N, K, D, D, np.float64)
    bias = sem.random_bias(rng, "BNTS", B, N, T, S, np.float64)
    sink = sem.random_sink(rng, N) if softmax == "learnable" else None
    dt = jnp.dtype(dtype)
    q, k, v, bias = (jnp.asarray(x, dt) for x in (q, k, v, bias))
    ct = jnp.asarray(rng.standard_normal((B, T, N, D)), jnp.float32)
    out, lse, g = _call(q, k, v, bias=bias, sink=None if sink is None else jnp.asarray(sink),
                        softmax=softmax, segments=None if seg is None else seg.descriptor(),
                        ct=ct, **cfg)
    assert out.dtype == dt and lse.dtype == (jnp.float64 if dtype == "float64" else jnp.float32)
    for name, x in [("out", out), ("lse", lse)] + [(f"d{n}", x) for n, x in g.items()]:
        assert np.isfinite(np.asarray(x, np.float64)).all(), f"{name} is not finite"
    assert (np.asarray(out, np.float64)[empty] == 0).all(), "an empty row's output is not 0"
    assert (g["q"][empty] == 0).all(), "an empty row's dq is not 0"
    assert (np.asarray(g["bias"], np.float64)[~vis[:, None].repeat(N, 1)] == 0).all(), \
        "dbias is not 0 at a hidden pair"
    unseen = ~vis.any(1)  # [B, S]: keys no query sees
    assert (g["k"][unseen] == 0).all() and (g["v"][unseen] == 0).all(), "dk/dv of an unseen key"
    want_lse = {"vanilla": np.full(N, EMPTY_ROW_LSE), "off_by_one": np.zeros(N),
                "learnable": None if sink is None else np.asarray(sink, np.float64)}[softmax]
    lse_rows = np.moveaxis(lse, 1, 2)[empty]  # [rows, N]
    if softmax == "vanilla":
        assert (lse_rows == lse.dtype.type(EMPTY_ROW_LSE)).all()
    else:
        np.testing.assert_allclose(lse_rows, np.broadcast_to(want_lse, lse_rows.shape), rtol=1e-6)


@pytest.mark.parametrize("softmax", ["vanilla", "off_by_one", "learnable"])
def test_all_rows_empty_give_zero_gradients_everywhere(softmax):
    """Every query hidden: out, dq, dk, dv, dbias and dsink are all exactly 0."""
    rng = np.random.default_rng(21)
    seg = sem.Segments("seqlens", np.zeros(2, np.int64), np.zeros(2, np.int64))
    q, k, v = _qkv(21)
    bias = sem.random_bias(rng, "11TS", 2, 4, 9, 9, np.float64)
    sink = jnp.asarray(sem.random_sink(rng, 4), jnp.float64) if softmax == "learnable" else None
    ct = jnp.asarray(rng.standard_normal((2, 9, 4, 8)))
    out, lse, g = _call(q, k, v, bias=bias, sink=sink, softmax=softmax, mask="padding",
                        segments=seg.descriptor(), ct=ct)
    assert (out == 0).all()
    for name, grad in g.items():
        assert (grad == 0).all(), f"d{name} is not exactly 0"


# -- gradients ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name,opts", [
    ("segments_window_bias", dict(recipe="offsets", mask="padding_causal", window=(3, 0), bias="B1TS")),
    ("cross_bottom_right", dict(T=6, S=11, mask="causal_bottom_right", bias="BNTS")),
    ("learnable_soft_cap", dict(softmax="learnable", logits_soft_cap=1.5, mask="none")),
    ("off_by_one_ids", dict(softmax="off_by_one", recipe="ids_pos_shifted", mask="padding_causal")),
    ("non_causal_window", dict(mask="none", window=(1, 2), bias="11TS", scale=0.9)),
])
def test_gradients_against_oracle(name, opts):
    opts = dict(opts)
    T, S = opts.pop("T", 9), opts.pop("S", 9)
    rng = np.random.default_rng(_seed(name))
    seg = sem.SEGMENT_RECIPES[opts.pop("recipe")](rng, 2, T, S) if "recipe" in opts else None
    q, k, v = _qkv(30, T=T, S=S)
    pattern = opts.pop("bias", None)
    bias = None if pattern is None else sem.random_bias(rng, pattern, 2, 4, T, S, np.float64)
    sink = sem.random_sink(rng, 4) if opts.get("softmax") == "learnable" else None
    _check(q, k, v, bias=bias, sink=sink, segments=seg, grads=True, rng=rng, **opts)


def test_jnp_port_matches_numpy_oracle():
    """The jnp port (used for oracle gradients and as the plain bf16 computation) computes the
    same as the loops."""
    rng = np.random.default_rng(31)
    seg = sem.SEGMENT_RECIPES["offsets_empty_row"](rng, 2, 9, 9)
    q, k, v = _qkv(31)
    bias = sem.random_bias(rng, "BNTS", 2, 4, 9, 9, np.float64)
    sink = sem.random_sink(rng, 4).astype(np.float64)
    keep = rng.random((2, 4, 9, 9)) > 0.3
    opts = dict(softmax="learnable", logits_soft_cap=2.0, scale=0.5, dropout_rate=0.3)
    vis = sem.visible(2, 9, 9, mask="padding_causal", window=(4, 0), segments=seg)
    out, lse = sem.attention_jnp(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), vis,
                                 bias=jnp.asarray(bias), sink=jnp.asarray(sink), keep=keep, **opts)
    want_out, want_lse = sem.attention(q, k, v, mask="padding_causal", window=(4, 0), segments=seg,
                                       bias=bias, sink=sink, keep=keep, **opts)
    sem.assert_close("out", out, want_out, **F64)
    sem.assert_close("lse", lse, want_lse, **F64)


def test_gradients_against_finite_differences():
    """Directional derivatives of the NumPy oracle (central differences) against the
    reference's gradients, with every differentiable input in play."""
    rng = np.random.default_rng(32)
    B, T, S, N, K, D = 2, 6, 11, 4, 2, 8
    seg = sem.SEGMENT_RECIPES["offsets"](rng, B, T, S)
    opts = dict(mask="padding", window=(2, 1), softmax="learnable", logits_soft_cap=2.0, scale=0.8)
    x = dict(zip("qkv", sem.random_qkv(rng, B, T, S, N, K, D, D, np.float64)))
    x["bias"] = sem.random_bias(rng, "1NTS", B, N, T, S, np.float64)
    x["sink"] = sem.random_sink(rng, N).astype(np.float64)
    ct = rng.standard_normal((B, T, N, D))
    _, _, g = _call(x["q"], x["k"], x["v"], bias=x["bias"], sink=x["sink"],
                    segments=seg.descriptor(), ct=jnp.asarray(ct), **opts)

    def f(xs):
        out, _ = sem.attention(xs["q"], xs["k"], xs["v"], bias=xs["bias"], sink=xs["sink"],
                               segments=seg, **opts)
        return float(np.sum(out * ct))

    h = 1e-5
    for trial in range(3):
        d = {n: rng.standard_normal(a.shape) for n, a in x.items()}
        fd = (f({n: x[n] + h * d[n] for n in x}) - f({n: x[n] - h * d[n] for n in x})) / (2 * h)
        ad = sum(float(np.sum(g[n] * d[n])) for n in x)
        assert abs(fd - ad) <= 1e-6 * max(1.0, abs(ad)), (trial, fd, ad)
    for n in x:  # and each input on its own
        d = rng.standard_normal(x[n].shape)
        xp, xm = dict(x), dict(x)
        xp[n], xm[n] = x[n] + h * d, x[n] - h * d
        fd = (f(xp) - f(xm)) / (2 * h)
        ad = float(np.sum(g[n] * d))
        assert abs(fd - ad) <= 1e-6 * max(1.0, abs(ad)), (n, fd, ad)


# -- dtypes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_output_and_lse_dtypes(dtype):
    q, k, v = (jnp.asarray(x, dtype) for x in _qkv(40))
    out, lse, _ = _call(q, k, v, jit=True)
    assert out.dtype == jnp.dtype(dtype) and lse.dtype == np.float32
    want_out, want_lse = sem.attention(*(np.asarray(x, np.float64) for x in (q, k, v)))
    tol = dict(float32=1e-5, bfloat16=1e-2, float16=2e-3)[dtype]
    sem.assert_close("out", out, want_out, rtol=tol, atol=tol)
    sem.assert_close("lse", lse, want_lse, rtol=1e-5, atol=1e-5)
