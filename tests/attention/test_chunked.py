"""The chunked backend against the reference: forward, lse and gradients of q, k, v, bias and
sink in float64, over odd lengths, GQA/MQA, MLA head dims, windows, both diagonals, packed
segments with padding, every softmax, soft cap, dropout and fully masked rows; bf16 against a
float32 reference; and a 32k-token sequence in linear memory.

Tiles are small (a few rows) so that every case runs several tiles, ragged tails and both the
static schedule (unrolled and scanned tables) and the dynamic one (segments).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashmesh.attention import api, chunked, chunked_tiles, masks, reference, varying
from flashmesh.attention.sequence import SequenceDescriptor as SD
from flashmesh.attention.spec import EMPTY_ROW_LSE, AttentionInputs, compute_dtype

PACKED_IDS = np.array([[1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 0, 0, 0],
                       [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 0]])


# Segment layouts, built lazily (inside x64 mode when the test runs in float64).
def packed_ids():
    return SD.from_segment_ids_and_pos(jnp.asarray(PACKED_IDS))


def packed_positions():  # explicit, non-canonical positions inside each segment
    return SD.from_segment_ids_and_pos(jnp.asarray(PACKED_IDS), jnp.asarray((PACKED_IDS > 0) * (np.arange(13) % 5)))


def packed_offsets():  # T=12, S=16; slots padded with -1
    return SD.from_seqlens_and_offsets((jnp.array([[3, 5], [6, 0]]), jnp.array([[5, 6], [9, 0]])),
                                       (jnp.array([[0, 4], [1, -1]]), jnp.array([[0, 6], [2, -1]])))


def seqlens(*lengths):
    return lambda: SD.from_seqlens(jnp.array(lengths))


def _close(name, actual, expected, atol, rtol=0.0):
    """assert_allclose that names the worst element's coordinates."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    assert np.isfinite(actual).all(), f"{name}: non-finite values at {np.argwhere(~np.isfinite(actual))[:5]}"
    err = np.abs(actual - expected) - rtol * np.abs(expected)
    worst = np.unravel_index(np.argmax(err), err.shape) if err.size else ()
    assert err.size == 0 or err[worst] <= atol, (
        f"{name}: |actual - expected| = {np.abs(actual - expected)[worst]:.3g} at {worst} "
        f"(actual {actual[worst]:.6g}, expected {expected[worst]:.6g}, atol {atol:.3g}, rtol {rtol:.3g})")


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _setup(shape, options, dtype, seed=0):
    """(inputs, spec) from api.normalize with random q, k, v (and bias, sink, dropout rng)."""
    B, T, S, N, K, D, Dv = (shape.get(x, d) for x, d in
                            (("B", 2), ("T", 13), ("S", 13), ("N", 2), ("K", 1), ("D", 8), ("Dv", 8)))
    rng = np.random.default_rng(seed)
    q, k, v = (_normal(rng, s, dtype) for s in ((B, T, N, D), (B, S, K, D), (B, S, K, Dv)))
    options = dict(options)
    if "bias" in options:  # given as the broadcast shape, with letters for full axes
        sizes = {"B": B, "N": N, "T": T, "S": S}
        options["bias"] = _normal(rng, tuple(sizes.get(a, a) for a in options["bias"]), dtype)
    if options.get("softmax") == "learnable":
        options["sink"] = _normal(rng, (N,), dtype)
    if callable(options.get("segments")):
        options["segments"] = options["segments"]()
    if "dropout_rate" in options:
        options["dropout_rng"] = jax.random.key(7)
    return api.normalize(q, k, v, **options)


def _value_and_grads(impls, inputs, spec, seed=1):
    """For each implementation: out, lse and the vjp of random cotangents of both, w.r.t. q, k,
    v, bias and sink, as a dict. All implementations run in one jitted function (one compile)."""
    rng = np.random.default_rng(seed)
    # bf16-representable values, so a bf16 run and its float32 reference get the same ones.
    g_out = _normal(rng, (spec.batch, spec.q_len, spec.num_heads, spec.v_dim), jnp.bfloat16).astype(inputs.q.dtype)
    g_lse = _normal(rng, (spec.batch, spec.num_heads, spec.q_len), jnp.bfloat16).astype(
        compute_dtype(inputs.q.dtype))
    # Under shard_map (test_chunked_shard_map) the cotangents vary like the outputs.
    g_out, g_lse = varying.like((g_out, g_lse), varying.varying_axes(inputs))

    def one(impl, inputs):
        def f(q, k, v, bias, sink):
            out, lse = impl(dataclasses.replace(inputs, q=q, k=k, v=v, bias=bias, sink=sink), spec)
            return out, (jnp.zeros_like(g_lse) if lse is None else lse.astype(g_lse.dtype))
        (out, lse), vjp = jax.vjp(f, inputs.q, inputs.k, inputs.v, inputs.bias, inputs.sink)
        grads = vjp((g_out, g_lse))
        return dict(out=out, lse=lse, **dict(zip(("dq", "dk", "dv", "dbias", "dsink"), grads)))

    return jax.jit(lambda inputs: [one(impl, inputs) for impl in impls])(inputs)


def _chunked(blocks):
    return lambda inputs, spec: chunked.attention(inputs, spec, block_sizes=chunked.BlockSizes(*blocks))


# id, shape (defaults B=2 T=S=13 N=2 K=1 D=Dv=8), options for api.normalize, (block_q, block_kv[,
# lanes]): lanes caps the query blocks per step (the last group then has EMPTY padding lanes).
# bias is given as its broadcast shape; learnable softmax gets a random sink.
CASES = [
    ("causal_mha_dropout", dict(N=2, K=2), dict(mask="causal", dropout_rate=0.3), (4, 4)),
    ("none_mqa_one_query", dict(T=1, S=7, N=4, K=1), dict(mask="none"), (4, 4)),
    ("one_key_off_by_one", dict(T=5, S=1), dict(mask="causal_bottom_right", softmax="off_by_one"), (2, 2)),
    ("gqa8to1_mla_dims_window", dict(T=9, S=21, N=16, K=2, D=8, Dv=5),
     dict(mask="none", window=(5, 3)), (4, 8)),
    ("causal_window_rect_tiles_learnable_bias_softcap", dict(T=33, S=33, N=4, K=2),
     dict(mask="causal", window=(6, 0), softmax="learnable", bias=(1, "N", "T", "S"), logits_soft_cap=2.0), (8, 4)),
    ("bottom_right_short_q_bias_batch", dict(T=7, S=19),
     dict(mask="causal_bottom_right", bias=("B", 1, "T", "S")), (4, 4)),
    ("bottom_right_long_q_empty_rows", dict(T=19, S=7), dict(mask="causal_bottom_right"), (4, 4)),
    ("top_left_long_q_window_off_by_one", dict(T=19, S=7),
     dict(mask="none", window=(2, 1), softmax="off_by_one"), (4, 2)),
    ("bottom_right_window", dict(T=10, S=25), dict(mask="causal_bottom_right", window=(4, 0)), (4, 8)),
    ("padding_empty_batch_row_bias", dict(),
     dict(mask="padding_causal", bias=("B", "N", "T", "S"), segments=seqlens(9, 0)), (4, 4)),
    ("padding_all_full_dropout", dict(T=16, S=16),
     dict(mask="padding", dropout_rate=0.2, segments=seqlens(16, 16)), (4, 4)),
    ("packed_ids_window_learnable", dict(N=4, K=2),
     dict(mask="padding_causal", window=(3, 0), softmax="learnable", segments=packed_ids), (4, 4)),
    ("packed_positions_bias", dict(), dict(mask="padding", bias=(1, 1, "T", "S"), segments=packed_positions), (4, 8)),
    ("packed_offsets_bottom_right_softcap_dropout", dict(T=12, S=16),
     dict(mask="padding_causal_bottom_right", logits_soft_cap=3.0, dropout_rate=0.25, segments=packed_offsets), (4, 4)),
    ("long_tails", dict(B=1, T=129, S=1000, N=2, K=1, D=4, Dv=4), dict(mask="causal_bottom_right"), (32, 128)),
    ("lanes_full_shared_key_block", dict(T=16, S=16), dict(mask="none"), (4, 4, 3)),
    ("lanes_causal_window_bias", dict(T=33, S=33, N=4, K=2),
     dict(mask="causal", window=(6, 0), bias=(1, "N", "T", "S")), (4, 4, 3)),
    ("lanes_packed_bias_dropout", dict(N=4, K=2),
     dict(mask="padding_causal", bias=("B", 1, "T", "S"), dropout_rate=0.2, segments=packed_ids), (4, 4, 3)),
    ("lanes_one_padding_empty_rows", dict(T=19, S=7),
     dict(mask="padding", softmax="off_by_one", segments=seqlens(6, 0)), (4, 4, 1)),
]


@pytest.mark.parametrize("shape, options, blocks", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_matches_reference_float64(shape, options, blocks):
    with jax.enable_x64(True):
        inputs, spec = _setup(shape, options, jnp.float64)
        want, got = _value_and_grads([reference.attention, _chunked(blocks)], inputs, spec)
        for name, expected in want.items():
            if expected is None:
                assert got[name] is None, name
                continue
            assert got[name].shape == expected.shape and got[name].dtype == expected.dtype, name
            _close(name, got[name], expected, 1e-12 if name in ("out", "lse") else 1e-11)


def test_fully_masked_rows_are_zero():
    # Batch row 1 is all padding; in row 0 queries past 9 are padding, and with a bottom-right
    # diagonal and T > S the first queries see no key either.
    segments = SD.from_seqlens((jnp.array([9, 0]), jnp.array([5, 4])))
    inputs, spec = _setup(dict(T=13, S=7, N=2, K=1), dict(mask="padding_causal_bottom_right", segments=segments),
                          jnp.float32)
    (got,) = _value_and_grads([_chunked((4, 4))], inputs, spec)
    out, lse = got["out"], got["lse"]
    visible = np.asarray(masks.element_mask(spec, inputs, np.arange(13), np.arange(7)))  # [B, T, S]
    empty = ~visible.any(-1)
    assert empty[1].all() and empty[0, 9:].all() and empty[0, :5].any() and not empty.all()
    assert (np.asarray(out)[empty] == 0).all()
    assert (np.asarray(lse).transpose(0, 2, 1)[empty] == EMPTY_ROW_LSE).all()
    assert (np.asarray(got["dq"])[empty] == 0).all()
    for name in ("dq", "dk", "dv"):
        assert np.isfinite(np.asarray(got[name])).all(), name
    assert (np.asarray(got["dk"])[1] == 0).all() and (np.asarray(got["dv"])[1] == 0).all()


def test_dropout_is_the_references_and_drops():
    with jax.enable_x64(True):
        inputs, spec = _setup(dict(T=16, S=16), dict(mask="causal", dropout_rate=0.5), jnp.float64)
        no_dropout = dataclasses.replace(spec, dropout_rate=0.0)
        run = jax.jit(lambda inputs: (_chunked((4, 4))(inputs, spec)[0], reference.attention(inputs, spec)[0],
                                      _chunked((4, 4))(inputs, no_dropout)[0]))
        out, want, undropped = run(inputs)
        _close("out", out, want, 1e-12)
        assert np.abs(np.asarray(out - undropped)).max() > 0.1


def _naive_low_precision(inputs, spec):
    """The plain computation entirely in the input dtype (FlashAttention's yardstick)."""
    B, T, N, _ = inputs.q.shape
    S, K = inputs.k.shape[1], inputs.k.shape[2]
    q = inputs.q.reshape(B, T, K, N // K, -1)
    s = jnp.einsum("btkgh,bskh->bkgts", q, inputs.k).reshape(B, N, T, S) * spec.scale
    visible = masks.element_mask(spec, inputs, np.arange(T), np.arange(S))
    if visible is not None:
        s = jnp.where(visible[:, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).reshape(B, K, N // K, T, S)
    return jnp.einsum("bkgts,bskh->btkgh", p, inputs.v).reshape(B, T, N, -1), None


def test_bf16_within_twice_the_plain_bf16_error():
    """bf16 inputs, float32 reference on the same (rounded) values: the chunked error is at most
    twice the plain bf16 computation's (capped at 1/64 of the largest value, since the plain
    bf16 softmax backward is very loose), plus one bf16 rounding of the result."""
    shape = dict(B=2, T=67, S=67, N=4, K=2, D=32, Dv=32)
    inputs, spec = _setup(shape, dict(mask="causal", window=(40, 0)), jnp.bfloat16)
    upcast = dataclasses.replace(inputs, q=inputs.q.astype(jnp.float32), k=inputs.k.astype(jnp.float32),
                                 v=inputs.v.astype(jnp.float32))
    spec32 = dataclasses.replace(spec, dtype="float32")
    got, plain = _value_and_grads([_chunked((16, 16)), _naive_low_precision], inputs, spec)
    (want,) = _value_and_grads([reference.attention], upcast, spec32)
    assert got["out"].dtype == jnp.bfloat16 and got["dq"].dtype == jnp.bfloat16
    for name in ("out", "dq", "dk", "dv"):
        a, b, c = (np.asarray(x[name], np.float32) for x in (got, want, plain))
        scale = np.abs(b).max()
        _close(name, a, b, atol=min(2 * np.abs(c - b).max(), scale / 64) + scale / 256)


def test_gradients_hold_with_an_inexact_log(inexact_jnp):
    """A log off by 3e-5 relative (a TPU's float32 log misses by about that): the backward's
    p = e^(s - lse) still sums to 1 over each row, so the float32 gradients stay at float32
    rounding (without the forward's correction of lse they were off by ~1e-4 on the TPU)."""
    inexact_jnp(chunked, "log", 3e-5)
    rng = np.random.default_rng(3)
    q, kv = _normal(rng, (1, 40, 4, 16), jnp.float32), _normal(rng, (1, 40, 2, 16), jnp.float32)

    def loss(implementation):
        return lambda q, k, v: jnp.sum(api.attention(q, k, v, mask="causal", implementation=implementation) ** 2)

    got = jax.grad(loss("chunked"), (0, 1, 2))(q, kv, kv)
    want = jax.grad(loss("reference"), (0, 1, 2))(q, kv, kv)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        _close(name, a, b, 1e-5)


def test_api_dispatch_and_jit():
    rng = np.random.default_rng(0)
    q, kv = _normal(rng, (1, 70, 4, 16), jnp.float32), _normal(rng, (1, 70, 2, 16), jnp.float32)

    def loss(implementation):
        return lambda q, k, v: jnp.sum(api.attention(q, k, v, mask="causal", window=(20, 0),
                                                     implementation=implementation) ** 2)

    run = jax.jit(lambda *a: [jax.value_and_grad(loss(i), (0, 1, 2))(*a) for i in ("chunked", "reference")])
    (value, grads), (want_value, want_grads) = run(q, kv, kv)
    _close("loss", value, want_value, 0.0, rtol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv"), grads, want_grads):
        _close(name, a, b, 1e-5)


def _spec(**kw):
    inputs, spec = _setup(kw.pop("shape"), kw, jnp.float32)
    return spec


def test_unsupported_reason_is_none_everywhere():
    for spec in (_spec(shape=dict(), mask="causal"), _spec(shape=dict(), mask="none", softmax="learnable",
                                                           logits_soft_cap=1.0, dropout_rate=0.1)):
        for platform in ("cpu", "gpu", "tpu"):
            assert chunked.unsupported_reason(spec, platform) is None
            assert chunked.unsupported_reason(spec, platform, automatic=True) is None


def test_default_block_sizes():
    causal = _spec(shape=dict(B=1, T=8192, S=8192, N=1, D=4, Dv=4), mask="causal")
    window = _spec(shape=dict(B=1, T=4096, S=4096, N=1, D=4, Dv=4), mask="causal", window=(128, 0))
    tiny = _spec(shape=dict(B=1, T=7, S=300, N=1, D=4, Dv=4), mask="none")
    assert chunked.BlockSizes.default_for(causal, "gpu") == chunked.BlockSizes(2048, 2048)
    wide = _spec(shape=dict(B=1, T=16384, S=16384, N=64, D=4, Dv=4), mask="causal")
    assert chunked.BlockSizes.default_for(wide, "gpu") == chunked.BlockSizes(1024, 1024)
    assert chunked.BlockSizes.default_for(causal, "cpu") == chunked.BlockSizes(256, 256)
    assert chunked.BlockSizes.default_for(window, "gpu") == chunked.BlockSizes(128, 128)
    assert chunked.BlockSizes.default_for(tiny, "gpu") == chunked.BlockSizes(7, 300)
    # A long sequence is never one tile; a short one is (codelab_te_2048 and codelab_small).
    te_2048 = _spec(shape=dict(B=4, T=2048, S=2048, N=8, D=4, Dv=4), mask="causal")
    assert chunked.BlockSizes.default_for(te_2048, "gpu") == chunked.BlockSizes(1024, 1024)
    odd = _spec(shape=dict(B=1, T=1000, S=1000, N=1, D=4, Dv=4), mask="none")
    assert chunked.BlockSizes.default_for(odd, "gpu") == chunked.BlockSizes(512, 512)
    small = _spec(shape=dict(B=4, T=128, S=128, N=8, D=4, Dv=4), mask="none")
    assert chunked.BlockSizes.default_for(small, "gpu") == chunked.BlockSizes(128, 128)
    # Tutorial 003's 64k workload: 512-wide tiles would still hold 32 GiB of logits for all 128
    # query blocks, so a step takes 16 of them (4 GiB).
    huge = _spec(shape=dict(B=2, T=65536, S=65536, N=128, D=4, Dv=4), mask="causal")
    assert chunked.BlockSizes.default_for(huge, "gpu") == chunked.BlockSizes(512, 512, 16)
    with pytest.raises(ValueError, match="block_q"):
        chunked.BlockSizes(0, 16)
    with pytest.raises(ValueError, match="lanes"):
        chunked.BlockSizes(16, 16, 0)


def _tiles_of(tables, nq, nk):
    seen = np.zeros((nq, nk), int)
    for table in tables:
        for q_row, kv_row in zip(table.q, table.kv):
            real = q_row < nq
            assert len(set(q_row[real])) == real.sum(), "a step holds one query block twice"
            np.add.at(seen, (q_row[real], kv_row[real]), 1)
    return seen


def test_static_schedule_runs_exactly_the_nonempty_tiles():
    for options, bound in ((dict(mask="causal"), None), (dict(mask="causal", window=(128, 0)), 2),
                           (dict(mask="none", window=(64, 64)), 3)):
        spec = _spec(shape=dict(B=1, T=4096, S=4096, N=1, D=4, Dv=4), **options)
        cls = masks.block_map(spec, AttentionInputs(q=None, k=None, v=None), 128, 128)
        tables = chunked_tiles.static_schedule(cls)
        assert (_tiles_of(tables, 32, 32) == (cls[0] != masks.EMPTY)).all()
        partial = [t for t in tables if t.masked]
        assert all((cls[0][t.q[t.q < 32], t.kv[t.q < 32]] == masks.PARTIAL).all() for t in partial)
        if bound is not None:  # a window: a few steps however long the sequence
            assert sum(t.num_steps for t in tables) <= bound
        capped = chunked_tiles.static_schedule(cls, max_lanes=5)
        assert all(t.q.shape[1] <= 5 for t in capped)
        assert (_tiles_of(capped, 32, 32) == (cls[0] != masks.EMPTY)).all()


def test_32k_tokens_forward_backward_in_linear_memory():
    """B=1, T=S=32768: fwd+bwd runs on CPU, and XLA's own accounting of temporary memory is far
    below one [T, S] float32 matrix (4 GiB) for a causal mask and for a sliding window."""
    T, N, D = 32768, 2, 32
    x = jax.ShapeDtypeStruct((1, T, N, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, T, 1, D), jnp.float32)

    def fwd_bwd(window):
        def loss(q, k, v):
            inputs, spec = api.normalize(q, k, v, mask="causal", window=window)
            return jnp.sum(chunked.attention(inputs, spec)[0] ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    full_matrix = T * T * 4
    causal = fwd_bwd(None).lower(x, kv, kv).compile().memory_analysis().temp_size_in_bytes
    assert causal < full_matrix / 8, f"causal temp {causal / 2**20:.0f} MiB"
    compiled = fwd_bwd((512, 0)).lower(x, kv, kv).compile()
    window = compiled.memory_analysis().temp_size_in_bytes
    assert window < full_matrix / 8, f"window temp {window / 2**20:.0f} MiB"
    q = jax.random.normal(jax.random.key(0), (1, T, N, D), jnp.float32)
    k = jax.random.normal(jax.random.key(1), (1, T, 1, D), jnp.float32)
    value, grads = compiled(q, k, k)
    assert np.isfinite(float(value)) and all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_64k_packed_workload_plan_is_bounded_with_gpu_blocks():
    """Tutorial 003's workload on one device (B=2, T=64k, N=128, K=8, D=128, 4 documents per row,
    causal window 8192) with the GPU's default tiles: XLA's plan of fwd+bwd stays near the
    size of the linear state (q, out, dq and float32 accumulators, ~20 GiB) plus a few steps of
    4 GiB. Before steps were capped in lanes, 512-wide tiles of every query block held 32 GiB of
    logits per step and the plan was 113 GiB. Compiled on CPU, never run."""
    B, T, N, K, D = 2, 65536, 128, 8, 128
    q = jax.ShapeDtypeStruct((B, T, N, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, K, D), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def loss(q, k, v, seg):
        inputs, spec = api.normalize(q, k, v, mask="padding_causal", window=(8192, 0),
                                     segments=SD.from_segment_ids_and_pos(seg, max_segments=8))
        blocks = chunked.BlockSizes.default_for(spec, "gpu")
        assert blocks == chunked.BlockSizes(512, 512, 16)
        return jnp.sum(chunked.attention(inputs, spec, block_sizes=blocks)[0].astype(jnp.float32))

    plan = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile().memory_analysis()
    assert plan.temp_size_in_bytes < 40 * 2**30, f"temp {plan.temp_size_in_bytes / 2**30:.1f} GiB"


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_codelab_te_2048_plan_below_naive_with_gpu_blocks(mode):
    """The anchor codelab_te_2048 (B=4, T=2048, N=8, D=64, causal) with the GPU's default tiles:
    XLA's plan (arguments, outputs, temporaries) of chunked is below the naive float32
    baseline's. On the H200 one 2048 tile planned 1.61 GiB for fwd+bwd against naive's 1.56
    (benchmarks/results/2026-11-30-nvidia-h200-anchors-3). Compiled on CPU, never run."""
    from flashmesh.bench import implementations, runner
    from flashmesh.bench.shapes import Shape

    shape = Shape("codelab_te_2048", B=4, T=2048, N=8, K=8, Dqk=64, mask="causal")
    x = jax.ShapeDtypeStruct((4, 2048, 8, 64), jnp.bfloat16)
    args = (x, x, x, None) if mode == "fwd" else (x, x, x, None, x)

    def planned(fn):
        m = runner._step(fn, mode).lower(*args).compile().memory_analysis()
        return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes

    def chunked_gpu_tiles(q, k, v, segment_ids=None):
        inputs, spec = api.normalize(q, k, v, mask="causal")
        return chunked.attention(inputs, spec, block_sizes=chunked.BlockSizes.default_for(spec, "gpu"))[0]

    naive = implementations.get("naive").build(shape, "bf16", "cpu")
    assert planned(chunked_gpu_tiles) < 0.75 * planned(naive)


# -- GPU (skipped elsewhere): the anchor shapes, with the default GPU block sizes ------------------

# name, B, T, N, K, Dqk, Dv, mask, window (the shapes of shared/anchors/RESULTS.md)
ANCHORS = [
    ("seed000_gqa_swa", 2, 4096, 128, 8, 128, 128, "causal", (128, 0)),
    ("seed000_mla", 2, 4096, 128, 8, 128, 64, "causal", None),
    ("full_4k_h16_d128", 4, 4096, 16, 16, 128, 128, "none", None),
    ("causal_8k_h32_d128", 1, 8192, 32, 32, 128, 128, "causal", None),
    ("causal_8k_h32_d64", 1, 8192, 32, 32, 64, 64, "causal", None),
    ("gqa_causal_16k", 1, 16384, 64, 8, 128, 128, "causal", None),
    ("codelab_small", 4, 128, 8, 8, 64, 64, "none", None),
    ("codelab_te_2048", 4, 2048, 8, 8, 64, 64, "causal", None),
]


def _naive_float32(q, k, v, causal, window):
    """The baseline of the GPU acceptance: full float32 logits through XLA (shared/anchors)."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * q.shape[-1] ** -0.5
    qp, kp = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    visible = (kp <= qp) if causal else jnp.ones((q.shape[1], k.shape[1]), bool)
    if window is not None:
        visible &= kp >= qp - window[0]
    p = jax.nn.softmax(jnp.where(visible, s, jnp.finfo(jnp.float32).min), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)).astype(q.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("anchor", ANCHORS, ids=[a[0] for a in ANCHORS])
def test_gpu_anchor_fwd_bwd_memory_below_naive(anchor):
    """XLA's accounting of temporary memory for fwd+bwd: chunked below the naive baseline (or the
    naive one does not even compile), and chunked fits the device."""
    _, B, T, N, K, Dqk, Dv, mask, window = anchor
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((B, T, N, Dqk), (B, T, K, Dqk), (B, T, K, Dv))]

    def fwd_bwd(attn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))

    ours = fwd_bwd(lambda q, k, v: api.attention(q, k, v, mask=mask, window=window, implementation="chunked"))
    ours = ours.lower(*shapes).compile().memory_analysis().temp_size_in_bytes
    assert ours < 0.5 * jax.devices()[0].memory_stats()["bytes_limit"]
    try:
        naive = fwd_bwd(lambda q, k, v: _naive_float32(q, k, v, mask == "causal", window))
        naive = naive.lower(*shapes).compile().memory_analysis().temp_size_in_bytes
    except jax.errors.JaxRuntimeError as e:  # the naive baseline cannot even be compiled at this size
        if "RESOURCE_EXHAUSTED" not in str(e) and "memory" not in str(e).lower():
            raise
        return
    # A sequence of at most MIN_SPLIT_BLOCK is one tile: chunked then is the naive computation
    # plus its per-row float32 statistics, lse and delta, and a little (codelab_small on the
    # H200: 6,324,496 bytes against naive's 6,291,456). Longer ones must be strictly below.
    slack = 8 * B * N * T + 1024 if T <= chunked.MIN_SPLIT_BLOCK else 0
    assert ours < naive + slack, f"chunked temp {ours / 2**30:.4f} GiB >= naive {naive / 2**30:.4f} GiB"


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(mask="causal", window=(128, 0)), dict(mask="causal"), dict(mask="none")],
                         ids=["window", "causal", "full"])
def test_gpu_bf16_default_blocks_match_reference(options):
    shape = dict(B=1, T=1500, S=1500, N=16, K=2, D=128, Dv=64)
    inputs, spec = _setup(shape, options, jnp.bfloat16)
    upcast = dataclasses.replace(inputs, q=inputs.q.astype(jnp.float32), k=inputs.k.astype(jnp.float32),
                                 v=inputs.v.astype(jnp.float32))
    (got,) = _value_and_grads([chunked.attention], inputs, spec)
    (want,) = _value_and_grads([reference.attention], upcast, dataclasses.replace(spec, dtype="float32"))
    for name in ("out", "lse", "dq", "dk", "dv"):
        a, b = (np.asarray(x[name], np.float32) for x in (got, want))
        _close(name, a, b, atol=np.abs(b).max() / 64)


@pytest.mark.parametrize("segments", [None, "ids"])
def test_grad_of_grad_matches_reference(segments):
    """Reverse mode of any order, static and dynamic schedules (the dynamic loop has a static
    bound, so its backward pass can itself be differentiated)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(5)
        q, k, v = (_normal(rng, (2, 13, 2, 4), jnp.float64) for _ in range(3))
        seg = None if segments is None else SD.from_segment_ids_and_pos(jnp.asarray(PACKED_IDS))
        mask = "causal" if segments is None else "padding_causal"

        def grad_norm(impl, blocks=None):
            def loss(q, k, v):
                inputs, spec = api.normalize(q, k, v, mask=mask, segments=seg)
                fn = reference.attention if impl == "reference" else _chunked(blocks)
                return jnp.sum(jnp.sin(fn(inputs, spec)[0]))
            return lambda q, k, v: jnp.sum(jax.grad(loss, (0, 1, 2))(q, k, v)[1] ** 2)

        want = jax.grad(grad_norm("reference"), (0, 1, 2))(q, k, v)
        got = jax.jit(jax.grad(grad_norm("chunked", (4, 4)), (0, 1, 2)))(q, k, v)
        for name, a, b in zip(("ddq", "ddk", "ddv"), got, want):
            _close(name, a, b, 1e-10)


def test_forward_mode_raises_and_explain_says_so():
    q = jnp.ones((1, 8, 2, 4))
    f = lambda q: api.attention(q, q, q, implementation="chunked")
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(f, (q,), (q,))
    assert "jax.jvp" in str(api.explain(q, q, q))
    jax.jvp(lambda q: api.attention(q, q, q, implementation="reference"), (q,), (q,))
