"""The registered `pallas_mosaic_gpu` implementation: what it refuses and why (everywhere), and
on a Hopper GPU the whole path through `flashmesh.attention` (custom VJP, lse cotangent)
against the float32 reference."""

import dataclasses
import functools

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
    (dict(D=72), "Dqk=72"),
    (dict(D=320), "Dqk=320"),
])
def test_static_reasons(kw, words):
    assert words in pallas_mosaic_gpu.static_reason(_spec(**kw))


def test_band_masks_sinks_and_cap_are_accepted_statically():
    for kw in (dict(), dict(mask="none", window=(16, 8)), dict(mask="causal_bottom_right"),
               dict(logits_soft_cap=20.0), dict(softmax="off_by_one"), dict(D=128),
               dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
               dict(bias=jnp.zeros((1, 4, 128, 128), jnp.bfloat16)), dict(D=96), dict(D=80), dict(D=192), dict(D=256)):
        assert pallas_mosaic_gpu.static_reason(_spec(**kw)) is None, kw


def test_refused_off_gpu_with_the_reason():
    assert "Hopper" in pallas_mosaic_gpu.unsupported_reason(_spec(), "cpu")
    if registry.current_platform() != "gpu":
        q = jnp.zeros((1, 128, 4, 64), jnp.bfloat16)
        with pytest.raises(NotImplementedError, match="pallas_mosaic_gpu"):
            flashmesh.attention(q, q, q, implementation="pallas_mosaic_gpu")


@pytest.mark.parametrize("kw", [
    dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), dict(mask="causal", window=(64, 0)),
    dict(mask="none", window=(32, 32))])
def test_automatic_choice_keeps_dropout_and_narrow_windows(kw):
    # Dropout (cuDNN cannot draw flashmesh's mask) and windows the window kernel takes (measured
    # faster): never passed to cuDNN.
    assert pallas_mosaic_gpu.automatic_reason(_spec(**kw), "gpu", "NVIDIA H200") is None


def test_automatic_choice_takes_head_dim_64_with_the_fused_backward():
    # causal_8k_h32_d64, codelab_small, codelab_te_2048: faster than cuDNN fwd and fwd+bwd on
    # the H200 (benchmarks/results/2026-12-02-nvidia-h200-anchors-2); d128 stays with cuDNN
    # (test_gpu_automatic_choice).
    for mask in ("causal", "none"):
        assert pallas_mosaic_gpu.config(_spec(mask=mask), "NVIDIA H200")[1].fused_dq
        assert pallas_mosaic_gpu.automatic_reason(_spec(mask=mask), "gpu", "NVIDIA H200") is None
        assert not pallas_mosaic_gpu.config(_spec(mask=mask, D=128), "NVIDIA H200")[1].fused_dq


def test_automatic_choice_takes_packed_documents_in_self_attention():
    # packed_16docs_64k (16 causal documents of 4096 tokens, GQA 32:8, d128): 0.96x / 0.89x of
    # cuDNN's time fwd / fwd+bwd and a ninth of its memory on the H200
    # (benchmarks/results/2026-12-02-nvidia-h200-anchors-3).
    from flashmesh import SequenceDescriptor

    q = jnp.zeros((2, 128, 4, 128), jnp.bfloat16)
    ids = jnp.asarray([[1] * 50 + [2] * 60 + [0] * 18, [1] * 128], jnp.int32)
    packed = normalize(q, q, q, mask="causal",
                       segments=SequenceDescriptor.from_segment_ids_and_pos(ids, max_segments=2))[1]
    assert packed.segments == "packed"
    assert pallas_mosaic_gpu.automatic_reason(packed, "gpu", "NVIDIA H200") is None


def test_automatic_choice_leaves_cross_attention_and_unpacked_d128_to_cudnn(monkeypatch):
    # where cuDNN would run the call (patched: off a GPU it refuses everything), packed ids on
    # cross-attention and plain causal d128 stay with it
    from flashmesh import SequenceDescriptor
    from flashmesh.attention import cudnn

    monkeypatch.setattr(cudnn, "unsupported_reason", lambda *a, **k: None)
    q, kv = jnp.zeros((1, 128, 4, 128), jnp.bfloat16), jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
    ids = jnp.asarray([[1] * 60 + [2] * 68], jnp.int32)
    kv_ids = jnp.asarray([[1] * 100 + [2] * 156], jnp.int32)
    cross = normalize(q, kv, kv, segments=SequenceDescriptor.from_segment_ids_and_pos(
        (ids, kv_ids), max_segments=2))[1]
    assert cross.segments == "packed" and cross.q_len != cross.kv_len
    assert "cuDNN runs this call" in pallas_mosaic_gpu.automatic_reason(cross, "gpu", "NVIDIA H200")
    causal = _spec(mask="causal", D=128)
    assert "cuDNN runs this call" in pallas_mosaic_gpu.automatic_reason(causal, "gpu", "NVIDIA H200")
    # d64 with a window wider than the window kernel's band (none was measured): cuDNN
    long = jnp.zeros((1, 1024, 4, 64), jnp.bfloat16)
    wide = normalize(long, long, long, mask="causal", window=(256, 0))[1]
    assert wide.window == (256, 0)
    assert "cuDNN runs this call" in pallas_mosaic_gpu.automatic_reason(wide, "gpu", "NVIDIA H200")


def test_automatic_choice_takes_the_measured_window_shape():
    # seed000_gqa_swa (B2 T4096 128:8 d128, window (128, 0)): measured 1.43x cuDNN fwd+bwd on the
    # H200 (benchmarks/results/2026-12-01-nvidia-h200-anchors) with the window kernel.
    from flashmesh.attention.pallas_mosaic_gpu_common import WindowBlockSizes

    spec = dataclasses.replace(_spec(mask="causal", D=128), batch=2, q_len=4096, kv_len=4096,
                               num_heads=128, num_kv_heads=8, window=(128, 0))
    assert isinstance(pallas_mosaic_gpu.config(spec, "NVIDIA H200")[0], WindowBlockSizes)
    assert pallas_mosaic_gpu.automatic_reason(spec, "gpu", "NVIDIA H200") is None


def test_automatic_choice_passes_over_what_no_gpu_has_checked():
    from flashmesh.parallel.steps import step_spec

    step = step_spec(_spec(mask="causal"), 128, 256, None)
    assert "context-parallel" in pallas_mosaic_gpu.automatic_reason(step, "gpu", "NVIDIA H200")
    huge = dataclasses.replace(_spec(mask="causal", D=128), batch=2, q_len=65536, kv_len=65536,
                               num_heads=128, num_kv_heads=8, window=(8192, 0))  # q: 2^31 elements
    assert "2^30" in pallas_mosaic_gpu.automatic_reason(huge, "gpu", "NVIDIA H200")


def test_context_parallel_dropout_steps_are_refused_statically():
    # A context-parallel step numbers its keys by kv_index; the kernels cannot, so the automatic
    # choice passes over them before the call (it would raise at call time otherwise).
    from flashmesh.parallel.steps import step_spec

    spec = step_spec(_spec(dropout_rate=0.1, dropout_rng=jax.random.key(0)), 128, 256, None)
    assert spec.context_step
    assert "global key numbers" in pallas_mosaic_gpu.static_reason(spec)
    assert "global key numbers" in registry.explain_spec(spec, "gpu").reason("pallas_mosaic_gpu")
    assert pallas_mosaic_gpu.static_reason(step_spec(_spec(), 128, 256, None)) is None


@pytest.mark.gpu
def test_gpu_automatic_choice():
    """cuDNN keeps d128 causal attention, wide windows and MLA dims (which it runs on a Hopper
    GPU); the kernels take d64, dropout and narrow windows, and the automatic call equals the
    named one."""
    q = jax.random.normal(jax.random.key(1), (2, 256, 4, 128), jnp.bfloat16)
    assert flashmesh.explain(q, q, q, mask="causal").chosen == "cudnn"
    rows = {row.name: row for row in flashmesh.explain(q, q, q, mask="causal").rows}
    assert "measured faster" in rows["pallas_mosaic_gpu"].declines
    d64 = q[..., :64]
    assert flashmesh.explain(d64, d64, d64, mask="causal").chosen == "pallas_mosaic_gpu"
    key = jax.random.key(2)
    for kw in (dict(mask="causal", dropout_rate=0.1, dropout_rng=key), dict(mask="causal", window=(64, 0)),
               dict(mask="none", window=(32, 32))):
        assert flashmesh.explain(d64, d64, d64, **kw).chosen == "pallas_mosaic_gpu", kw
        np.testing.assert_array_equal(flashmesh.attention(d64, d64, d64, **kw), flashmesh.attention(
            d64, d64, d64, implementation="pallas_mosaic_gpu", **kw))
    v = d64[..., :32]
    assert flashmesh.explain(d64, d64, v, mask="causal").chosen == "cudnn"
    # a window wider than the window kernel's band (a wider one than T would be plain causal)
    long = jax.random.normal(jax.random.key(3), (1, 1024, 4, 64), jnp.bfloat16)
    assert flashmesh.explain(long, long, long, mask="causal", window=(256, 0)).chosen == "cudnn"
    # packed documents (d128 here): the kernels, equal to the named call
    ids = jnp.asarray([[1] * 100 + [2] * 120 + [0] * 36, [1] * 30 + [2] * 226], jnp.int32)
    segments = flashmesh.SequenceDescriptor.from_segment_ids_and_pos(ids, max_segments=2)
    assert flashmesh.explain(q, q, q, mask="causal", segments=segments).chosen == "pallas_mosaic_gpu"
    np.testing.assert_array_equal(
        flashmesh.attention(q, q, q, mask="causal", segments=segments),
        flashmesh.attention(q, q, q, mask="causal", segments=segments, implementation="pallas_mosaic_gpu"))


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
    for name, a, b in zip(("dq", "dk", "dv"), grads, wgrads):
        assert bool(jnp.all(jnp.isfinite(a))), name
        assert _rel(a, b) < 2e-2, (name, _rel(a, b))
    if sink is not None:  # a sum of signed terms: measured against the sum of their sizes
        assert grads[3].dtype == sink.dtype
        delta = jnp.einsum("btnd,btnd->bnt", wout, g) - g_lse
        size = jnp.sum(jnp.abs(jnp.exp(sink[None, :, None] - wlse) * delta), axis=(0, 2))
        np.testing.assert_array_less(np.abs(np.asarray(grads[3] - wgrads[3])), 1e-2 * np.asarray(size))


def test_custom_vjp_with_lse_cotangent_in_the_interpreter():
    """The registered path's custom VJP on a CPU (Mosaic GPU's interpreter): GQA, Dqk != Dv,
    tails on both axes, a bottom-right window, and a loss that uses out and lse."""
    from flashmesh.attention import pallas_mosaic_gpu_sm90_bwd as bwd
    from flashmesh.attention import reference
    from flashmesh.attention.pallas_mosaic_gpu_common import BlockSizes

    B, T, S, N, K = 1, 72, 136, 2, 1
    keys = jax.random.split(jax.random.key(5), 5)
    q = jax.random.normal(keys[0], (B, T, N, 128), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, S, K, 128), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, S, K, 64), jnp.float32).astype(jnp.bfloat16)
    g = jax.random.normal(keys[3], (B, T, N, 64), jnp.float32)
    g_lse = jax.random.normal(keys[4], (B, N, T), jnp.float32)
    inputs, spec = normalize(q, k, v, mask="causal_bottom_right", window=(40, 0), return_lse=True)
    fwd = BlockSizes(block_q=64, block_kv=64, num_stages=2, num_compute_wgs=1)
    back = bwd.BackwardBlockSizes(block_q=64, block_kv=64, block_q_dq=64, block_kv_dq=64, num_stages=2,
                                  num_compute_wgs=1)

    def loss(attend, q, k, v):
        out, lse = attend(dataclasses.replace(inputs, q=q, k=k, v=v))
        return jnp.sum(out.astype(jnp.float32) * g) + jnp.sum(lse * g_lse)

    mine = lambda i: pallas_mosaic_gpu.attention_with(i, spec, fwd, back, interpret=True)
    theirs = lambda i: reference.attention(i, spec)
    got = jax.grad(functools.partial(loss, mine), argnums=(0, 1, 2))(q, k, v)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    want = jax.grad(functools.partial(loss, theirs), argnums=(0, 1, 2))(*f32)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert bool(jnp.all(jnp.isfinite(a))) and _rel(a, b) < 1e-2, (name, _rel(a, b))
    # the lse cotangent matters (a kernel that dropped it would fail the check above): without
    # it the reference's dq differs
    no_lse = jax.grad(lambda q: jnp.sum(theirs(dataclasses.replace(inputs, q=q, k=f32[1], v=f32[2]))[0]
                                        .astype(jnp.float32) * g))(f32[0])
    assert _rel(no_lse, want[0]) > 0.05


def test_describe_names_the_tiles_and_their_source():
    text = pallas_mosaic_gpu.describe(_spec(D=128, mask="causal"), "NVIDIA H200")
    assert "forward tiles 128x" in text and "backward dK/dV 64x128" in text
    assert "table entry" in text or "heuristic" in text
    assert "compile time not measured" in text or "compiled in" in text
    assert "from the backward table entry causal_8k_h32_d128" in text
    fused = pallas_mosaic_gpu.describe(_spec(mask="causal"), "NVIDIA H200")
    assert "one fused kernel 128x128" in fused and "not bit-reproducible" in fused
    fixed = pallas_mosaic_gpu.describe(_spec(mask="causal", reproducible=True), "NVIDIA H200")
    assert "does not fit this call under reproducible=True" in fixed and "dQ 128x64" in fixed
    assert "backward rule (no table entry)" in pallas_mosaic_gpu.describe(
        _spec(mask="causal", window=(32, 0)), "NVIDIA H200")
    # the window anchor's entry (group 16, window 128): persistent dQ, per-warpgroup tiles
    q, kv = jnp.zeros((1, 512, 16, 128), jnp.bfloat16), jnp.zeros((1, 512, 1, 128), jnp.bfloat16)
    window = pallas_mosaic_gpu.describe(normalize(q, kv, kv, mask="causal", window=(128, 0))[1],
                                        "NVIDIA H200")
    assert "dQ 128x64 persistent" in window and "each warpgroup over its own band tiles" in window
    assert "backward table entry seed000_gqa_swa" in window
    with pytest.raises(NotImplementedError, match="Hopper"):
        pallas_mosaic_gpu.describe(_spec(), "NVIDIA A100-SXM4-80GB")


def test_grad_of_grad_says_first_order_only():
    """Traced only (nothing runs): the backward kernels have no derivative, and say so."""
    from flashmesh.attention import pallas_mosaic_gpu_sm90_bwd as bwd
    from flashmesh.attention.pallas_mosaic_gpu_common import BlockSizes

    q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
    inputs, spec = normalize(q, q, q, mask="causal")
    fwd = BlockSizes(block_q=64, block_kv=64, num_stages=2, num_compute_wgs=1)
    back = bwd.BackwardBlockSizes(block_q=64, block_kv=64, block_q_dq=64, block_kv_dq=64, num_stages=2,
                                  num_compute_wgs=1)

    def loss(q):
        out, _ = pallas_mosaic_gpu.attention_with(dataclasses.replace(inputs, q=q), spec, fwd, back,
                                                  interpret=True)
        return jnp.sum(out.astype(jnp.float32))

    jax.eval_shape(jax.grad(loss), q)  # first order traces
    with pytest.raises(NotImplementedError, match="first derivatives only"):
        jax.eval_shape(jax.grad(lambda q: jnp.sum(jax.grad(loss)(q).astype(jnp.float32))), q)


def test_reproducible_takes_fixed_order_reductions_only():
    # reproducible=True: the two-kernel backward (not the fused one's TMA reduce-adds), and on
    # a GPU neither cuDNN nor chunked (XLA's attention kernels and scatters); off a GPU chunked.
    spec = _spec(mask="causal", reproducible=True)
    assert spec.reproducible and not _spec(mask="causal").reproducible
    assert not pallas_mosaic_gpu.config(spec, "NVIDIA H200")[1].fused_dq
    assert pallas_mosaic_gpu.config(_spec(mask="causal"), "NVIDIA H200")[1].fused_dq
    rows = registry.explain_spec(spec, "gpu")
    for name in ("cudnn", "chunked"):
        assert "reproducible=True" in rows.reason(name), name
    assert registry.explain_spec(spec, "cpu").reason("chunked") is None
    assert registry.explain_spec(_spec(mask="causal"), "gpu").reason("chunked") is None


@pytest.mark.gpu
def test_gpu_reproducible_gradients_are_bit_identical():
    """Head dim 64 (the fused backward by default): reproducible=True runs the two-kernel
    backward, whose gradients are bit-identical run to run and equal the fused ones closely."""
    B, T, N, K, D = 2, 1000, 8, 2, 64
    keys = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(keys[0], (B, T, N, D), jnp.bfloat16)
    k, v = (jax.random.normal(key, (B, T, K, D), jnp.bfloat16) for key in keys[1:3])
    g = jax.random.normal(keys[3], (B, T, N, D), jnp.float32)

    def grads(reproducible):
        def loss(q, k, v):
            out = flashmesh.attention(q, k, v, mask="causal", reproducible=reproducible)
            return jnp.vdot(out.astype(jnp.float32), g)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    assert flashmesh.explain(q, k, v, mask="causal", reproducible=True).chosen == "pallas_mosaic_gpu"
    first, second, fused = grads(True), grads(True), grads(False)
    for a, b, c in zip(first, second, fused):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        assert _rel(c, a) < 1e-2
