"""What attention must do: the one behaviour suite every backend runs against the reference.

Each backend has a capability set in `CAPABILITIES`. For every (backend, case, dtype):

* if every feature the case uses is in the backend's capabilities, the backend's output, lse
  and gradients of q, k, v, bias and sink are compared with the reference run in float64 on
  the same values: float32 inputs to a tight relative tolerance, bfloat16 inputs by
  FlashAttention's rule (at most twice the error of the plain bfloat16 computation plus
  rounding noise); fully masked rows must be exactly 0 with exactly 0 dq;
* otherwise the call must raise NotImplementedError with the reason. Nothing is skipped
  silently.

Inputs are rounded to bfloat16-representable values once, so the float32 and bfloat16 runs of
a case share one float64 answer. Backends run under jit, as users run them; the reference
(and the float64 answer) runs eagerly for shapes several cases share, where op-by-op dispatch
reuses compiled operations (see `run`). Cases use few distinct shapes for the same reason.

cuDNN cases are marked `gpu` (skipped on CPU by conftest). A new backend adds one entry to
`CAPABILITIES` (and `GPU_BACKENDS` if it needs a GPU).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import flashmesh
import semantics as sem
from flashmesh.attention import cudnn, normalize
from flashmesh.attention.spec import EMPTY_ROW_LSE

ALL_FEATURES = frozenset({
    "float32", "bfloat16", "return_lse",
    "single_pair", "t_ne_s", "odd_lengths", "gqa", "mqa", "dqk_ne_dv",
    "causal", "causal_bottom_right", "window", "window_non_causal",
    "padding", "packed", "positions", "fully_masked",
    "bias", "bias_per_batch", "off_by_one", "learnable", "soft_cap", "dropout",
})

CAPABILITIES: dict[str, frozenset[str]] = {
    "reference": ALL_FEATURES,
    "chunked": ALL_FEATURES,
    # JAX's cuDNN fused attention as cudnn.py exposes it (see its static_reason): bfloat16
    # only, top-left causal, left (sliding) windows with causal, padding and packed segments
    # with canonical positions, a bias shared over the batch; no sinks, soft cap, bottom-right
    # diagonal with T != S, right windows, flashmesh's dropout hash, or T = S = 1 (its graph
    # validation rejects s_q = s_kv = 1; seen on the H200). Keep this in step with
    # cudnn.static_reason: a mismatch fails in one direction or the other on the GPU.
    "cudnn": frozenset({
        "bfloat16", "return_lse", "t_ne_s", "odd_lengths", "gqa", "mqa", "dqk_ne_dv",
        "causal", "window", "padding", "packed", "fully_masked", "bias",
    }),
}
# Features a backend has one by one but not together.
UNSUPPORTED_TOGETHER: dict[str, tuple[frozenset[str], ...]] = {
    "cudnn": (frozenset({"packed", "bias"}), frozenset({"packed", "dqk_ne_dv"}),
              frozenset({"bias", "odd_lengths"})),
}
GPU_BACKENDS = {"cudnn"}


@dataclasses.dataclass(frozen=True)
class Case:
    B: int = 2
    T: int = 16
    S: int = 16
    N: int = 4
    K: int = 4
    Dqk: int = 16
    Dv: int = 16
    mask: str = "causal"
    window: tuple[int, int] | None = None
    segments: str | None = None  # a recipe of semantics.SEGMENT_RECIPES
    bias: str | None = None  # a pattern of semantics.BIAS_SHAPES
    softmax: str = "vanilla"
    soft_cap: float | None = None
    scale: float | None = None
    dropout: float = 0.0
    layout: str = "bshd"
    dtypes: tuple[str, ...] = ("float32",)


BOTH = ("float32", "bfloat16")
# Few distinct shapes on purpose: eager dispatch compiles each operation once per shape and
# dtype, so cases that share a shape cost little.
GQA = dict(N=16, K=2)  # 8 query heads per key/value head
MQA = dict(N=4, K=1)
MLA = dict(N=8, K=2, Dqk=16, Dv=8)
SHORT_Q = dict(T=7, S=19)  # odd lengths and T < S
LONG_Q = dict(T=19, S=7)  # odd lengths and T > S
CASES: dict[str, Case] = {
    "mha_causal": Case(dtypes=BOTH),
    "mha_none_scale": Case(mask="none", scale=0.5),
    "len_1": Case(T=1, S=1),
    "decode_one_query": Case(T=1, S=19, mask="none", dtypes=BOTH),
    "len_7": Case(T=7, S=7, mask="none"),
    "len_129_window_17": Case(T=129, S=129, N=2, K=1, Dqk=8, Dv=8, window=(17, 0)),
    "len_1000": Case(B=1, T=1000, S=1000, N=1, K=1, Dqk=8, Dv=8),
    "q_shorter_causal": Case(**SHORT_Q),
    "q_shorter_bottom_right": Case(**SHORT_Q, mask="causal_bottom_right"),
    "q_longer_bottom_right": Case(**LONG_Q, mask="causal_bottom_right"),
    "gqa_8to1": Case(**GQA, dtypes=BOTH),
    "mqa": Case(**MQA),
    "dqk_gt_dv": Case(**MLA, dtypes=BOTH),
    "dqk_lt_dv": Case(Dqk=8, Dv=24),
    "window_0": Case(window=(0, 0)),
    "window_3": Case(window=(3, 0)),
    "window_left_right": Case(mask="none", window=(4, 2)),
    "window_left_only": Case(mask="none", window=(5, -1)),
    "window_bottom_right": Case(**SHORT_Q, mask="causal_bottom_right", window=(4, 0)),
    "padding": Case(mask="padding_causal", segments="seqlens", dtypes=BOTH),
    "padding_cross": Case(**SHORT_Q, mask="padding", segments="seqlens"),
    "padding_empty_row": Case(mask="padding", segments="seqlens_empty_row"),
    "packed_offsets": Case(mask="padding_causal", segments="offsets", dtypes=BOTH),
    "packed_offsets_window": Case(mask="padding_causal", segments="offsets", window=(3, 0)),
    "packed_empty_row": Case(mask="padding_causal", segments="offsets_empty_row"),
    "packed_ids_positions": Case(mask="padding_causal", segments="ids_pos_shifted", window=(2, 0)),
    "packed_cross_bottom_right": Case(**SHORT_Q, mask="padding_causal_bottom_right",
                                      segments="offsets"),
    "bias_BNTS": Case(bias="BNTS"),
    "bias_11TS": Case(bias="11TS", mask="none"),
    "bias_1NTS": Case(bias="1NTS", window=(6, 0)),
    "off_by_one": Case(softmax="off_by_one", mask="padding", segments="ids_empty_row"),
    "learnable": Case(softmax="learnable", dtypes=BOTH),
    "learnable_empty_rows": Case(**LONG_Q, softmax="learnable", mask="causal_bottom_right"),
    "soft_cap": Case(soft_cap=5.0, bias="BNTS", dtypes=BOTH),
    "dropout": Case(dropout=0.3, dtypes=BOTH),
    "fully_masked_window": Case(**LONG_Q, mask="none", window=(0, 0)),
    "layout_sbhd": Case(layout="sbhd"),
    "layout_bs3hd": Case(layout="bs3hd"),
    "layout_bshd_bs2hd": Case(**MQA, layout="bshd_bs2hd"),
    "layout_t3hd": Case(layout="t3hd", mask="padding_causal", segments="ids"),
    "layout_thd_t2hd": Case(**GQA, layout="thd_t2hd", mask="padding_causal", segments="offsets"),
    "layout_thd_thd_thd": Case(layout="thd_thd_thd", mask="padding_causal", segments="ids_pos"),
    "kitchen_sink": Case(**MLA, mask="padding_causal", segments="offsets", window=(5, 0),
                         bias="B1TS", softmax="learnable", soft_cap=4.0, dropout=0.2,
                         dtypes=BOTH),
}


_SHAPES_IN_USE = collections.Counter((c.B, c.T, c.S, c.N, c.K, c.Dqk, c.Dv) for c in CASES.values())


# ---------------------------------------------------------------------------------------------
# Inputs and features of a case
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Inputs:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    bias: np.ndarray | None
    sink: np.ndarray | None
    ct: np.ndarray  # the output cotangent: gradients are of sum(out * ct)
    segments: sem.Segments | None
    visible: np.ndarray  # [B, T, S] from the oracle
    rng: jax.Array | None  # the dropout key


def _bf16_exact(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16, stored as float32: the same values in every dtype we test."""
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def make_inputs(c: Case, seed: int) -> Inputs:
    """Random inputs for case c (never zeros), rounded to bfloat16-representable values."""
    rng = np.random.default_rng(seed)
    q, k, v = (_bf16_exact(x) for x in sem.random_qkv(rng, c.B, c.T, c.S, c.N, c.K, c.Dqk, c.Dv))
    bias = None if c.bias is None else _bf16_exact(sem.random_bias(rng, c.bias, c.B, c.N, c.T, c.S))
    sink = _bf16_exact(sem.random_sink(rng, c.N)) if c.softmax == "learnable" else None
    ct = rng.standard_normal((c.B, c.T, c.N, c.Dv)).astype(np.float32)
    seg = None if c.segments is None else sem.SEGMENT_RECIPES[c.segments](rng, c.B, c.T, c.S)
    vis = sem.visible(c.B, c.T, c.S, mask=c.mask, window=c.window, segments=seg)
    key = jax.random.key(int(rng.integers(2**31))) if c.dropout else None
    return Inputs(q, k, v, bias, sink, ct, seg, vis, key)


@functools.lru_cache(maxsize=None)
def inputs_of(name: str) -> Inputs:
    return make_inputs(CASES[name], zlib.crc32(name.encode()))


def case_features(c: Case, x: Inputs, dtype: str) -> frozenset[str]:
    """The features case c uses in `dtype`, derived from its configuration."""
    f = {dtype, "return_lse"}
    if c.T == c.S == 1:
        f.add("single_pair")
    if c.T != c.S:
        f.add("t_ne_s")
    if c.T % 2 or c.S % 2:
        f.add("odd_lengths")
    if c.K < c.N:
        f.add("mqa" if c.K == 1 else "gqa")
    if c.Dqk != c.Dv:
        f.add("dqk_ne_dv")
    if c.mask.endswith("bottom_right"):
        f.add("causal_bottom_right")
    elif "causal" in c.mask:
        f.add("causal")
    # normalized_window folds a causal mask in as right = 0, so (-1, 0) is the causal mask
    # itself, not a window: only a bounded left side, or a right side that is not 0, is one.
    left, right = sem.normalized_window(c.mask, c.window)
    if left >= 0 and right == 0:
        f.add("window")
    elif left >= 0 or right > 0:
        f.add("window_non_causal")
    if c.segments is not None:
        f.add("padding" if c.segments.startswith("seqlens") else "packed")
        if c.segments == "ids_pos_shifted":
            f.add("positions")
    if not x.visible.any(-1).all():
        f.add("fully_masked")
    if c.bias is not None:
        f.add("bias")
        if c.bias[0] == "B" and c.B > 1:
            f.add("bias_per_batch")
    if c.softmax != "vanilla":
        f.add(c.softmax)
    if c.soft_cap is not None:
        f.add("soft_cap")
    if c.dropout:
        f.add("dropout")
    return frozenset(f)


def features(name: str, dtype: str) -> frozenset[str]:
    return case_features(CASES[name], inputs_of(name), dtype)


def options_of(c: Case, x: Inputs) -> dict:
    return dict(mask=c.mask, window=c.window, scale=c.scale, softmax=c.softmax,
                logits_soft_cap=c.soft_cap, dropout_rate=c.dropout, dropout_rng=x.rng,
                segments=None if x.segments is None else x.segments.descriptor())


# ---------------------------------------------------------------------------------------------
# Running a backend
# ---------------------------------------------------------------------------------------------
def run(c: Case, x: Inputs, implementation: str, dtype: str, layout: str | None = None,
        jit: bool | None = None):
    """Output [B,T,N,Dv], lse [B,N,T] and gradients {q, k, v, bias, sink} of one call, with
    q/k/v/bias in `dtype` (the sink stays float32, float64 for float64).

    Backends run under jit, as users run them. The reference runs eagerly when other cases
    share its shape (op-by-op dispatch then reuses compiled operations, which is faster than a
    compile per case), else under jit (jit=None); jit=True/False forces it."""
    layout = c.layout if layout is None else layout
    dt = jnp.dtype(dtype)
    wide = jnp.float64 if dtype == "float64" else jnp.float32
    q, k, v = (jnp.asarray(a, dt) for a in (x.q, x.k, x.v))
    packed = sem.pack(layout, q, k, v)
    slots = [i for i, a in enumerate(packed) if a is not None]
    extra = {}
    if x.bias is not None:
        extra["bias"] = jnp.asarray(x.bias, dt)
    if x.sink is not None:
        extra["sink"] = jnp.asarray(x.sink, wide)
    ct = jnp.asarray(x.ct, wide)
    opts = options_of(c, x)

    def loss(arrays, extra):
        args = [None, None, None]
        for i, a in zip(slots, arrays):
            args[i] = a
        out, lse = flashmesh.attention(*args, **extra, **opts, layout=layout,
                                       implementation=implementation, return_lse=True)
        out = sem.unpack_out(layout, out)
        return jnp.sum(out.astype(wide) * ct), (out, lse)

    step = jax.value_and_grad(loss, (0, 1), has_aux=True)
    if jit is None:
        jit = implementation != "reference" or not _shared_shape(c)
    if jit:
        step = sem.jit(step)
    (_, (out, lse)), (g_arrays, g_extra) = step([packed[i] for i in slots], extra)
    full = [None, None, None]
    for i, g in zip(slots, g_arrays):
        full[i] = g
    dq, dk, dv = sem.unpack_grads(layout, full)
    grads = dict(q=dq, k=dk, v=dv, **g_extra)
    return out, lse, grads


def _shared_shape(c: Case) -> bool:
    return _SHAPES_IN_USE.get((c.B, c.T, c.S, c.N, c.K, c.Dqk, c.Dv), 0) >= 3


def expected_of(c: Case, x: Inputs, jit: bool | None = None):
    """The reference in float64 on the case's values (layout-free: plain bshd), on the CPU (a
    TPU has no float64)."""
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        out, lse, grads = run(c, x, "reference", "float64", layout="bshd", jit=jit)
        return (np.asarray(out), np.asarray(lse), {n: np.asarray(g) for n, g in grads.items()})


def plain_of(c: Case, x: Inputs, dtype: str = "bfloat16"):
    """The plain computation in `dtype` (semantics.attention_jnp throughout in it)."""
    bf = jnp.dtype(dtype)
    args = dict(q=jnp.asarray(x.q, bf), k=jnp.asarray(x.k, bf), v=jnp.asarray(x.v, bf))
    if x.bias is not None:
        args["bias"] = jnp.asarray(x.bias, bf)
    if x.sink is not None:
        args["sink"] = jnp.asarray(x.sink, jnp.float32)
    keep = None
    if c.dropout:
        inputs, _ = normalize(x.q, x.k, x.v, sink=x.sink, **options_of(c, x))
        keep = sem.dropout_keep_mask(inputs.dropout_seed, c.dropout, c.B, c.N, c.T, c.S)
    ct = jnp.asarray(x.ct)

    def loss(args):
        out, lse = sem.attention_jnp(args["q"], args["k"], args["v"], x.visible,
                                     bias=args.get("bias"), sink=args.get("sink"), scale=c.scale,
                                     softmax=c.softmax, logits_soft_cap=c.soft_cap, keep=keep,
                                     dropout_rate=c.dropout)
        return jnp.sum(out.astype(jnp.float32) * ct), (out, lse)

    (_, (out, lse)), grads = sem.jit(jax.value_and_grad(loss, has_aux=True))(args)
    return np.asarray(out), np.asarray(lse), grads


@functools.lru_cache(maxsize=None)
def expected(name: str):
    return expected_of(CASES[name], inputs_of(name))


@functools.lru_cache(maxsize=None)
def plain(name: str, dtype: str = "bfloat16"):
    return plain_of(CASES[name], inputs_of(name), dtype)


def float32_by_rule() -> bool:
    """Whether float32 results are judged as bfloat16's are, against the plain float32
    computation on the same device, rather than by F32_TOL: on a TPU, whose transcendental
    functions are not IEEE-exact (the reference itself misses F32_TOL there by up to ~7e-5
    relative, benchmarks/results/2026-12-08-tpu-v5e-tests)."""
    return jax.default_backend() == "tpu"


def float32_precision(dtype: str):
    """The matmul precision float32 cases run under: on a TPU JAX's default multiplies float32
    in bfloat16 passes, so a user who wants float32 accuracy there asks for "highest" (README),
    and so do these cases; elsewhere JAX's default is float32 already."""
    if dtype == "float32" and float32_by_rule():
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------
F32_TOL = dict(rtol=2e-5, atol=1e-5)  # inputs are O(1): so are outputs and gradients


def compare_results(label: str, c: Case, x: Inputs, dtype: str, got, want, plain=None):
    """got/want/plain: (out, lse, grads) of the backend, the float64 reference and the plain
    computation in dtype (bfloat16, and float32 where `float32_by_rule`; None: F32_TOL)."""
    out, lse, grads = got
    want_out, want_lse, want_grads = want
    assert out.shape == (c.B, c.T, c.N, c.Dv) and out.dtype == jnp.dtype(dtype)
    assert lse.shape == (c.B, c.N, c.T) and lse.dtype == jnp.float32
    assert set(grads) == set(want_grads)
    lse = np.asarray(lse)

    # Empty rows (vanilla softmax): lse is exactly EMPTY_ROW_LSE; the others are compared.
    empty_lse = want_lse == EMPTY_ROW_LSE
    assert (lse[empty_lse] == np.float32(EMPTY_ROW_LSE)).all(), f"{label}: lse of an empty row"
    lse_cmp, want_lse_cmp = np.where(empty_lse, 0.0, lse), np.where(empty_lse, 0.0, want_lse)

    pairs = [("out", out, want_out), ("lse", lse_cmp, want_lse_cmp)]
    pairs += [(f"d{n}", grads[n], want_grads[n]) for n in want_grads]
    if plain is None:
        for what, a, b in pairs:
            sem.assert_close(f"{label} {what}", a, b, **F32_TOL)
    else:
        p_out, p_lse, p_grads = plain
        ref = {"out": p_out, "lse": np.where(empty_lse, 0.0, p_lse)}
        ref.update({f"d{n}": g for n, g in p_grads.items()})
        # float32: F32_TOL's absolute part besides (a gradient that is 0 exactly, e.g. of a row
        # that sees one key, may come out as float32 rounding noise)
        rule = dict(noise=2.0**-8) if dtype == "bfloat16" else dict(noise=2.0**-20, atol=F32_TOL["atol"])
        for what, a, b in pairs:
            sem.assert_fa_rule(f"{label} {what}", a, b, ref[what], **rule)

    empty = ~x.visible.any(-1)  # [B, T]
    if empty.any():
        assert (np.asarray(out, np.float64)[empty] == 0).all(), f"{label}: an empty row's output is not 0"
        assert (np.asarray(grads["q"], np.float64)[empty] == 0).all(), f"{label}: an empty row's dq is not 0"


def compare(name: str, implementation: str, dtype: str):
    c, x = CASES[name], inputs_of(name)
    got = run(c, x, implementation, dtype)
    by_rule = dtype == "bfloat16" or (dtype == "float32" and float32_by_rule())
    plain_ = plain(name, dtype) if by_rule else None
    compare_results(f"{name}/{implementation}/{dtype}", c, x, dtype, got, expected(name), plain_)


def supports(backend: str, used: frozenset[str]) -> bool:
    return used <= CAPABILITIES[backend] and not any(
        combo <= used for combo in UNSUPPORTED_TOGETHER.get(backend, ()))


def _params():
    for backend in CAPABILITIES:
        marks = [pytest.mark.gpu] if backend in GPU_BACKENDS else []
        for name, case in CASES.items():
            # A backend without float32 runs every case in bfloat16 (float32 must raise).
            extra = () if "float32" in CAPABILITIES[backend] else ("bfloat16",)
            for dtype in dict.fromkeys(case.dtypes + extra):
                yield pytest.param(backend, name, dtype, id=f"{backend}-{name}-{dtype}", marks=marks)


@pytest.mark.parametrize("backend,name,dtype", list(_params()))
def test_behaviour(backend, name, dtype):
    if not supports(backend, features(name, dtype)):
        with pytest.raises(NotImplementedError, match=r"\w.{8,}"):  # with its reason
            run(CASES[name], inputs_of(name), backend, dtype)
        return
    with float32_precision(dtype):
        compare(name, backend, dtype)


def test_features_cover_every_capability():
    """Every feature is exercised by some case (so a capability cannot go untested)."""
    used = set()
    for name, case in CASES.items():
        for dtype in case.dtypes:
            used |= features(name, dtype)
    assert used == ALL_FEATURES, sorted(ALL_FEATURES - used)


def spec_of(c: Case, x: Inputs, dtype: str):
    """The AttentionSpec of case c's call in `dtype` (as `run` makes it), from shapes alone."""
    dt = jnp.dtype(dtype)
    opts = options_of(c, x)
    extra = {} if x.bias is None else {"bias": jax.ShapeDtypeStruct(x.bias.shape, dt)}
    if x.sink is not None:
        extra["sink"] = jax.ShapeDtypeStruct(x.sink.shape, jnp.float32)
    box = []

    def trace(q, k, v, extra):
        box.append(normalize(*sem.pack(c.layout, q, k, v), **extra, **opts, layout=c.layout)[1])
        return 0

    jax.eval_shape(trace, *(jax.ShapeDtypeStruct(a.shape, dt) for a in (x.q, x.k, x.v)), extra)
    return box[0]


def test_cudnn_capabilities_match_its_reasons():
    """On CPU too: CAPABILITIES["cudnn"] (with UNSUPPORTED_TOGETHER) supports a case exactly
    when cudnn's own checks accept it on a Hopper GPU with a recent cuDNN. The gpu-marked cases
    expect output or NotImplementedError from this table; a table out of step with the backend
    would otherwise show only on a GPU, as every case failing in one direction."""
    hopper = cudnn.Device(91200, (9, 0))
    wrong = []
    for name, c in CASES.items():
        for dtype in dict.fromkeys(c.dtypes + ("bfloat16",)):
            spec = spec_of(c, inputs_of(name), dtype)
            reason = cudnn.static_reason(spec) or cudnn.device_reason(spec, hopper)
            table = supports("cudnn", features(name, dtype))
            if table != (reason is None):
                wrong.append(f"{name}/{dtype}: the table says supported={table}, cudnn says "
                             f"{reason or 'supported'}")
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------------------------------------
# Dropout: reproducible from its rng, off when deterministic, the same elements everywhere
# ---------------------------------------------------------------------------------------------
def _backend_params():
    for backend in CAPABILITIES:
        marks = [pytest.mark.gpu] if backend in GPU_BACKENDS else []
        yield pytest.param(backend, id=backend, marks=marks)


def _dropout_call(backend, rng, *, rate=0.4, deterministic=False, v=None, dtype=jnp.bfloat16):
    x = inputs_of("mha_none_scale")
    q, k = jnp.asarray(x.q, dtype), jnp.asarray(x.k, dtype)
    v = jnp.asarray(x.v if v is None else v, dtype)
    with float32_precision(jnp.dtype(dtype).name):
        return flashmesh.attention(q, k, v, mask="none", dropout_rate=rate, dropout_rng=rng,
                                   deterministic=deterministic, implementation=backend)


def _dropout_dtype(backend):
    return jnp.float32 if "float32" in CAPABILITIES[backend] else jnp.bfloat16


@pytest.mark.parametrize("backend", list(_backend_params()))
def test_dropout_reproducible(backend):
    dt = _dropout_dtype(backend)
    if "dropout" not in CAPABILITIES[backend]:
        with pytest.raises(NotImplementedError):
            _dropout_call(backend, jax.random.key(0), dtype=dt)
        return
    a = _dropout_call(backend, jax.random.key(0), dtype=dt)
    b = _dropout_call(backend, jax.random.key(0), dtype=dt)
    c = _dropout_call(backend, jax.random.key(1), dtype=dt)
    raw = _dropout_call(backend, jax.random.key_data(jax.random.key(0)), dtype=dt)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, raw)  # raw uint32 key data is the same key
    assert np.mean(np.asarray(a) != np.asarray(c)) > 0.5, "a different rng drops the same"
    off = _dropout_call(backend, jax.random.key(0), deterministic=True, dtype=dt)
    none = _dropout_call(backend, None, rate=0.0, dtype=dt)
    np.testing.assert_array_equal(off, none)
    assert not np.array_equal(off, a)


@pytest.mark.parametrize("backend", list(_backend_params()))
def test_dropout_drops_the_reference_elements(backend):
    """v = one-hot of the key index makes out[b, i, n, j] = dropped p_ij: the zeros show
    exactly which elements a backend dropped, and they must be the reference's."""
    dt = _dropout_dtype(backend)
    x = inputs_of("mha_none_scale")
    c = CASES["mha_none_scale"]
    eye = np.broadcast_to(np.eye(c.S, dtype=np.float32)[None, :, None, :], (c.B, c.S, c.K, c.S))
    if "dropout" not in CAPABILITIES[backend]:
        with pytest.raises(NotImplementedError):
            _dropout_call(backend, jax.random.key(7), v=eye, dtype=dt)
        return
    got = np.asarray(_dropout_call(backend, jax.random.key(7), v=eye, dtype=dt), np.float64)
    want = np.asarray(_dropout_call("reference", jax.random.key(7), v=eye, dtype=dt), np.float64)
    inputs, _ = normalize(x.q, x.k, x.v, mask="none", dropout_rate=0.4, dropout_rng=jax.random.key(7))
    keep = sem.dropout_keep_mask(inputs.dropout_seed, 0.4, c.B, c.N, c.T, c.S)  # [B, N, T, S]
    keep = np.moveaxis(keep, 1, 2)  # [B, T, N, S], like out with Dv = S
    np.testing.assert_array_equal(want != 0, keep)
    np.testing.assert_array_equal(got != 0, keep)
    sem.assert_close("dropped probabilities", got, want, rtol=1e-2 if dt == jnp.bfloat16 else 1e-5)


# ---------------------------------------------------------------------------------------------
# The public call's small promises
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", list(_backend_params()))
def test_return_lse_false_returns_the_output_alone(backend):
    x = inputs_of("mha_causal")
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (x.q, x.k, x.v))
    out = flashmesh.attention(q, k, v, implementation=backend)
    out2, _ = flashmesh.attention(q, k, v, implementation=backend, return_lse=True)
    assert isinstance(out, jax.Array)
    np.testing.assert_array_equal(out, out2)


@pytest.mark.parametrize("backend", list(_backend_params()))
def test_jit_matches_eager(backend):
    """Under jit (segments traced, not concrete) the answer is the same."""
    name = "packed_offsets"
    dt = jnp.bfloat16
    x = inputs_of(name)
    q, k, v = (jnp.asarray(a, dt) for a in (x.q, x.k, x.v))
    seg = x.segments

    @jax.jit
    def f(q, k, v, lens, offs):
        desc = flashmesh.SequenceDescriptor.from_seqlens_and_offsets(lens, offs)
        return flashmesh.attention(q, k, v, mask="padding_causal", segments=desc,
                                   implementation=backend)

    eager = flashmesh.attention(q, k, v, mask="padding_causal", segments=seg.descriptor(),
                                implementation=backend)
    jitted = f(q, k, v, jnp.asarray(seg.q[0], jnp.int32), jnp.asarray(seg.q[1], jnp.int32))
    sem.assert_close("jit vs eager", jitted, eager, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("backend", list(_backend_params()))
def test_vmap_matches_a_loop(backend):
    """vmap over a leading axis (two input sets, GQA, causal, with lse): outputs and gradients
    equal the calls one by one."""
    x = inputs_of("gqa_8to1")
    stack = lambda a: jnp.asarray(np.stack([a, a[::-1] * 0.5]), jnp.bfloat16)  # noqa: E731
    q, k, v = stack(x.q), stack(x.k), stack(x.v)

    def loss(q, k, v):
        out, lse = flashmesh.attention(q, k, v, mask="causal", return_lse=True, implementation=backend)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(lse), (out, lse)

    step = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, got), grads = jax.jit(jax.vmap(step))(q, k, v)
    for i in range(2):
        (_, want), want_grads = jax.jit(step)(q[i], k[i], v[i])
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (*got, *grads), (*want, *want_grads)):
            sem.assert_close(f"vmap {name}", np.asarray(a[i], np.float64), np.asarray(b, np.float64),
                             rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------
# Padding never reaches valid tokens, whatever it holds
# ---------------------------------------------------------------------------------------------
def _poisoned(c: Case, x: Inputs) -> Inputs:
    """x with NaN in padded queries and values, inf in padded keys, NaN in the bias rows and
    columns of padding (segment id 0)."""
    q_ids, kv_ids, _, _ = x.segments.tokens(c.T, c.S, c.mask.endswith("bottom_right"))
    q_pad, kv_pad = q_ids == 0, kv_ids == 0
    q, k, v = x.q.copy(), x.k.copy(), x.v.copy()
    q[q_pad], k[kv_pad], v[kv_pad] = np.nan, np.inf, np.nan
    bias = None
    if x.bias is not None:
        bias = np.array(np.broadcast_to(x.bias, (c.B,) + x.bias.shape[1:]))
        bias[(q_pad[:, :, None] | kv_pad[:, None, :])[:, None].repeat(bias.shape[1], 1)] = np.nan
    return dataclasses.replace(x, q=q, k=k, v=v, bias=bias)


def _padding_params():
    for backend in CAPABILITIES:
        marks = [pytest.mark.gpu] if backend in GPU_BACKENDS else []
        for name in ("padding", "packed_offsets", "packed_cross_bottom_right", "kitchen_sink"):
            c = CASES[name]
            dtype = "float32" if "float32" in CAPABILITIES[backend] else "bfloat16"
            if c.bias is not None and c.bias[0] != "B":
                continue  # the poisoned bias is per batch row
            if supports(backend, features(name, dtype)):
                yield pytest.param(backend, name, dtype, id=f"{backend}-{name}", marks=marks)


@pytest.mark.parametrize("backend, name, dtype", list(_padding_params()))
def test_padding_contents_never_reach_valid_tokens(backend, name, dtype):
    """Output and gradients with NaN/inf in every padded token equal those with random padding,
    exactly; padded rows are 0 and padded tokens get exactly zero gradient."""
    c, x = CASES[name], inputs_of(name)
    out, lse, grads = run(c, x, backend, dtype, jit=True)
    bad_out, bad_lse, bad_grads = run(c, _poisoned(c, x), backend, dtype, jit=True)
    np.testing.assert_array_equal(np.asarray(bad_out), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(bad_lse), np.asarray(lse))
    q_ids, kv_ids, _, _ = x.segments.tokens(c.T, c.S, c.mask.endswith("bottom_right"))
    for n in ("q", "k", "v", "bias"):
        if grads.get(n) is None:
            continue
        got, want = np.asarray(bad_grads[n], np.float32), np.asarray(grads[n], np.float32)
        if n == "bias":  # hidden pairs get zero gradient; compare where either is visible
            got, want = np.where(x.visible[:, None], got, 0), np.where(x.visible[:, None], want, 0)
        np.testing.assert_array_equal(got, want, err_msg=f"d{n}")
        if n != "bias":
            pad = (q_ids if n == "q" else kv_ids) == 0
            assert (got[pad] == 0).all(), f"d{n} of padding tokens is not zero"
    assert (np.asarray(bad_out)[q_ids == 0] == 0).all()
