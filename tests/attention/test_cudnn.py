"""The `cudnn` backend.

CPU (unmarked): the spec -> cuDNN mapping. Every refusal reason; the window and mask-type
mapping; the in-graph segment ids -> (seqlens, offsets) conversion against a NumPy version;
and the whole backend (masking of rows cuDNN never computes, lse gathering, the custom VJP with
its lse-cotangent correction) against the reference, with the two cuDNN calls replaced by a
stand-in that follows cuDNN's documented semantics, including JAX's decoding of the ragged
offsets, and leaves NaN wherever real cuDNN leaves stale memory.

GPU (`@pytest.mark.gpu`): real cuDNN in bfloat16 against the float32-upcast reference, held to
FlashAttention's rule (at most 2x the error of the plain bfloat16 computation plus rounding
noise), and the compiled graph against raw `jax.nn.dot_product_attention(implementation="cudnn")`.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashmesh
import semantics as sem
from flashmesh.attention import cudnn, cudnn_sequences, masks, normalize, reference
from flashmesh.attention.spec import EMPTY_ROW_LSE

H200 = cudnn.Device(91200, (9, 0))
A100 = cudnn.Device(91200, (8, 0))


def _spec(B=2, T=16, S=16, N=4, K=4, Dqk=64, Dv=64, dtype=jnp.bfloat16, **opts):
    q = jax.ShapeDtypeStruct((B, T, N, Dqk), dtype)
    k = jax.ShapeDtypeStruct((B, S, K, Dqk), dtype)
    v = jax.ShapeDtypeStruct((B, S, K, Dv), dtype)
    box = []
    jax.eval_shape(lambda q, k, v: box.append(normalize(q, k, v, **opts)[1]) or 0, q, k, v)
    return box[0]


# --------------------------------------------------------------------------------------------
# Reasons
# --------------------------------------------------------------------------------------------
def _ids(T, runs):
    """Segment ids [1, T] from (start, length, id) runs."""
    ids = np.zeros((1, T), np.int32)
    for start, n, s in runs:
        ids[0, start:start + n] = s
    return ids


SD = flashmesh.SequenceDescriptor
STATIC_CASES = {
    "float32": (dict(dtype=jnp.float32), "bfloat16 or float16 inputs, got float32"),
    "off_by_one": (dict(softmax="off_by_one"), "softmax='off_by_one'"),
    "learnable": (dict(softmax="learnable", sink=jnp.zeros(4)), "softmax='learnable'"),
    "soft_cap": (dict(logits_soft_cap=30.0), "no logit soft cap"),
    "dropout": (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "dropout: cuDNN draws"),
    "window_right": (dict(mask="none", window=(4, 2)), "looks left only"),
    "window_not_causal": (dict(mask="none", window=(4, -1)), "causal only"),
    "bottom_right_T_ne_S": (dict(T=8, S=16, mask="causal_bottom_right"), "T=8 != S=16"),
    "bottom_right_segments": (dict(mask="padding_causal_bottom_right",
                                   segments=SD.from_seqlens(jnp.array([3, 16]))),
                              "bottom-right causal alignment with segments"),
    "custom_positions": (dict(B=1, segments=SD.from_segment_ids_and_pos(
        _ids(16, [(0, 8, 1), (8, 8, 2)]), _ids(16, [(0, 16, 1)]) * np.arange(16))),
                         "custom positions"),
    "head_dim_not_8": (dict(Dqk=60, Dv=60), "multiples of 8"),
    "head_dim_too_big": (dict(Dqk=264, Dv=264), "at most 256"),
    "packed_mla": (dict(B=1, Dv=32, segments=SD.from_segment_ids_and_pos(
        _ids(16, [(0, 8, 1), (8, 8, 2)]))), "packed segments with Dqk=64 != Dv=32"),
    "packed_bias": (dict(B=1, bias=jnp.zeros((1, 4, 16, 16)), segments=SD.from_segment_ids_and_pos(
        _ids(16, [(0, 8, 1), (8, 8, 2)]))), "bias with packed segments"),
    "bias_per_batch": (dict(bias=jnp.zeros((2, 4, 16, 16))), "bias shared over the batch"),
    "bias_odd_length": (dict(T=15, S=15, bias=jnp.zeros((1, 4, 15, 15))), "odd T=15"),
}


@pytest.mark.parametrize("name", sorted(STATIC_CASES))
def test_static_reasons(name):
    opts, expected = STATIC_CASES[name]
    reason = cudnn.static_reason(_spec(**opts))
    assert reason is not None and expected in reason, reason
    assert "\n" not in reason


def test_packed_needs_static_max_segments():
    spec = dataclasses.replace(_spec(B=1, segments=SD.from_segment_ids_and_pos(
        _ids(16, [(0, 8, 1)]))), max_segments=None)
    assert "static max_segments" in cudnn.static_reason(spec)


DEVICE_CASES = {
    "turing": (dict(), cudnn.Device(91200, (7, 5)), "compute capability >= 8.0"),
    "old_cudnn": (dict(), cudnn.Device(80906, (9, 0)), "needs cuDNN >= 9.0.0, found 8.9.6"),
    "sm103": (dict(), cudnn.Device(91000, (10, 3)), "compute capability 10.3 needs cuDNN >= 9.11"),
    "head_dim_ampere": (dict(Dqk=192, Dv=192), A100, "at most 128 on compute capability 8.0"),
    "mla_ampere": (dict(Dv=32), A100, "Dqk=64 != Dv=32 needs cuDNN >= 9.10.0"),
    "mla_old_cudnn": (dict(Dv=32), cudnn.Device(90800, (9, 0)), "found cuDNN 9.8.0"),
    "packed_ampere": (dict(B=1, segments=SD.from_segment_ids_and_pos(_ids(16, [(0, 8, 1)]))),
                      A100, "packed segments need cuDNN >= 9.6.0"),
    "window_old_cudnn": (dict(window=(4, 0)), cudnn.Device(90100, (9, 0)), "needs cuDNN >= 9.2.0"),
}


@pytest.mark.parametrize("name", sorted(DEVICE_CASES))
def test_device_reasons(name):
    opts, device, expected = DEVICE_CASES[name]
    spec = _spec(**opts)
    assert cudnn.static_reason(spec) is None
    reason = cudnn.device_reason(spec, device)
    assert reason is not None and expected in reason, reason


@pytest.mark.parametrize("opts", [
    dict(), dict(mask="none"), dict(T=8, S=24), dict(T=24, S=8, window=(3, 0)),
    dict(N=8, K=1), dict(Dqk=128, Dv=64), dict(Dqk=256, Dv=256), dict(dtype=jnp.float16),
    dict(bias=jnp.zeros((1, 1, 16, 16))), dict(mask="causal_bottom_right"),
    dict(mask="padding_causal", segments=SD.from_seqlens(jnp.array([3, 0]))),
    dict(B=1, segments=SD.from_segment_ids_and_pos(_ids(16, [(0, 8, 1), (9, 7, 2)]))),
], ids=lambda o: ",".join(sorted(o)) or "plain")
def test_supported_on_hopper(opts):
    spec = _spec(**opts)
    assert cudnn.static_reason(spec) is None
    assert cudnn.device_reason(spec, H200) is None


def test_automatic_choice_declines_huge_packed_statistics(monkeypatch):
    monkeypatch.setattr(cudnn, "local_device", lambda: H200)
    seg = SD.from_segment_ids_and_pos(jnp.ones((4, 64), jnp.int32), max_segments=4096)
    spec = dataclasses.replace(_spec(B=4, T=64, S=64, segments=seg), q_len=2**14, kv_len=2**14)
    assert cudnn.unsupported_reason(spec, "gpu") is None
    assert "packed statistics" in cudnn.unsupported_reason(spec, "gpu", automatic=True)


def test_reasons_off_gpu():
    reason = cudnn.unsupported_reason(_spec(), "cpu")
    assert reason == "needs an NVIDIA GPU with CUDA (platform is 'cpu')"
    reason = cudnn.unsupported_reason(_spec(logits_soft_cap=5.0), "cpu")
    assert reason.endswith("; and on one: logits_soft_cap: JAX's cuDNN attention has no "
                           "logit soft cap")
    if jax.default_backend() == "cpu":
        assert cudnn.unsupported_reason(_spec(), "gpu") == "no GPU is visible to JAX"
        q = jax.ShapeDtypeStruct((2, 16, 4, 64), jnp.bfloat16)
        assert "needs an NVIDIA GPU" in flashmesh.explain(q, q, q).reason("cudnn")


# --------------------------------------------------------------------------------------------
# Mask type, window and segment mapping
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opts, mask, sliding", [
    (dict(mask="none"), "NO_MASK", None),
    (dict(), "CAUSAL", None),
    (dict(window=(0, 0)), "CAUSAL", 1),  # cuDNN's (pos - 1, pos]: only the diagonal
    (dict(window=(5, 0)), "CAUSAL", 6),
    (dict(mask="causal_bottom_right"), "CAUSAL", None),  # T == S: same diagonal
    (dict(T=24, S=8, window=(16, 0)), "CAUSAL", 17),  # every query sees a key
    (dict(T=24, S=8, window=(3, 0)), "PADDING_CAUSAL", 4),  # queries >= 11 see none: cut
    (dict(mask="padding", segments=SD.from_seqlens(jnp.array([3, 9]))), "PADDING", None),
    (dict(mask="padding_causal", window=(2, 0), segments=SD.from_seqlens(jnp.array([3, 9]))),
     "PADDING_CAUSAL", 3),
    (dict(B=1, segments=SD.from_segment_ids_and_pos(_ids(16, [(0, 8, 1), (8, 8, 2)]))),
     "CAUSAL", None),
    (dict(B=1, mask="none", segments=SD.from_segment_ids_and_pos(_ids(16, [(0, 8, 1)]))),
     "NO_MASK", None),
])
def test_plan(opts, mask, sliding):
    B, T, S = opts.get("B", 2), opts.get("T", 16), opts.get("S", 16)
    x = lambda L: jnp.zeros((B, L, 4, 64), jnp.bfloat16)  # noqa: E731
    inputs, spec = normalize(x(T), x(S), x(S), **{k: v for k, v in opts.items() if k not in "BTS"})
    cfg, seqs = cudnn.plan(spec, inputs)
    assert (cfg.mask_type, cfg.sliding_window_length) == (mask, sliding)
    if mask == "PADDING_CAUSAL" and spec.segments is None:
        assert np.asarray(seqs.q_seqlen).tolist() == [S + spec.window[0]] * B
    if spec.segments is None and mask != "PADDING_CAUSAL":
        assert all(x is None for x in jax.tree.leaves(seqs, is_leaf=lambda x: x is None))


def _np_runs(ids):
    """[(start, length, id)] of runs of equal nonzero ids."""
    runs, t = [], 0
    while t < len(ids):
        if ids[t] == 0:
            t += 1
            continue
        e = t
        while e < len(ids) and ids[e] == ids[t]:
            e += 1
        runs.append((t, e - t, int(ids[t])))
        t = e
    return runs


def _np_packed(q_ids, kv_ids, M, left):
    """The cuDNN arguments, written plainly: slot m = the m-th query run, keys of its id."""
    B, T = q_ids.shape
    S = kv_ids.shape[1]
    Me = max(M, 2)
    q_len, kv_len = -np.ones((B, Me), int), -np.ones((B, Me), int)
    q_off, kv_off = -np.ones((B, Me + 1), int), -np.ones((B, Me + 1), int)
    q_valid, kv_valid = np.zeros((B, T), bool), np.zeros((B, S), bool)
    index = np.zeros((B, T), int)
    j = 0
    for b in range(B):
        for m, (start, n, s) in enumerate(_np_runs(q_ids[b])[:M]):
            keys = np.flatnonzero(kv_ids[b] == s)
            if len(keys) == 0:
                continue
            n_eff = n if left is None else min(n, len(keys) + left)
            q_len[b, m], q_off[b, m] = n_eff, start
            kv_len[b, m], kv_off[b, m] = len(keys), keys[0]
            q_valid[b, start:start + n_eff] = True
            kv_valid[b, keys] = True
            index[b, start:start + n_eff] = j * T + np.arange(n_eff)
            j += 1
    return dict(q_seqlen=q_len, kv_seqlen=kv_len, q_offsets=q_off, kv_offsets=kv_off,
                q_valid=q_valid, kv_valid=kv_valid, stats_index=index)


def _random_packed_ids(rng, B, T, S, M, kv_order="random"):
    """Rows of up to M segments with gaps; for T != S the keys list a random subset of the
    query ids (in random order, or in the queries' order) and an id the queries lack."""
    q_ids, kv_ids = np.zeros((B, T), np.int32), np.zeros((B, S), np.int32)
    for b in range(B):
        m = int(rng.integers(0, M + 1))
        ids = rng.permutation(np.arange(1, 2 * M + 1))[:m] if T != S else np.arange(1, m + 1)
        for (start, n), s in zip(sem.random_partition(rng, T, m), ids):
            q_ids[b, start:start + n] = s
        if T == S:
            kv_ids[b] = q_ids[b]
            continue
        kv = [s for s in (rng.permutation(ids) if kv_order == "random" else ids)
              if rng.random() < 0.8] + [2 * M + 1]
        for (start, n), s in zip(sem.random_partition(rng, S, len(kv)), kv):
            kv_ids[b, start:start + n] = s
    return q_ids, kv_ids


@pytest.mark.parametrize("T, S, M, left", [(24, 24, 3, None), (24, 24, 4, 2), (17, 30, 3, None),
                                            (30, 11, 1, 0), (5, 40, 4, 3)])
def test_packed_sequences_match_numpy(T, S, M, left):
    rng = np.random.default_rng(T * 100 + S)
    fn = jax.jit(lambda a, b: cudnn.packed_sequences(a, b, M, left))
    for trial in range(4):
        q_ids, kv_ids = _random_packed_ids(rng, 4, T, S, M)
        seqs = fn(jnp.asarray(q_ids), jnp.asarray(kv_ids))
        _assert_packed_equal(seqs, _np_packed(q_ids, kv_ids, M, left), f"{trial=}")
        assert not np.asarray(seqs.q_bad).any()  # traced: nothing poisoned for valid layouts


def test_packed_sequences_concrete():
    """Concrete ids take the checked path: same arrays, validated, nothing to poison."""
    q_ids, kv_ids = _random_packed_ids(np.random.default_rng(5), 3, 12, 20, 3)
    seqs = cudnn.packed_sequences(jnp.asarray(q_ids), jnp.asarray(kv_ids), 3, 1)
    _assert_packed_equal(seqs, _np_packed(q_ids, kv_ids, 3, 1), "eager")
    assert seqs.q_bad is None


def _assert_packed_equal(seqs, expected, where):
    for name, want in expected.items():
        got = np.asarray(getattr(seqs, name))
        if name == "stats_index":
            got = np.where(expected["q_valid"], got, 0)
        np.testing.assert_array_equal(got, want, err_msg=f"{name} {where}")


def test_padding_sequences_match_numpy():
    rng = np.random.default_rng(1)
    T, S = 12, 9
    q_len = np.array([0, 5, 12, 12, 3, 7])
    kv_len = np.array([4, 0, 9, 2, 9, 1])
    q_ids = (np.arange(T) < q_len[:, None]).astype(np.int32)
    kv_ids = (np.arange(S) < kv_len[:, None]).astype(np.int32)
    for left in (None, 0, 3):
        seqs = cudnn.padding_sequences(jnp.asarray(q_ids), jnp.asarray(kv_ids), left)
        want_q = np.minimum(q_len, kv_len + (left if left is not None else T))
        want_q = np.where(kv_len > 0, want_q, 0)
        want_kv = np.where(want_q > 0, kv_len, 0)
        np.testing.assert_array_equal(seqs.q_seqlen, want_q)
        np.testing.assert_array_equal(seqs.kv_seqlen, want_kv)
        np.testing.assert_array_equal(seqs.q_valid, np.arange(T) < want_q[:, None])
        np.testing.assert_array_equal(seqs.kv_valid, np.arange(S) < want_kv[:, None])
    del rng


@pytest.mark.parametrize("q_runs, kv_runs, M, error, message", [
    ([(0, 4, 1), (4, 4, 2)], [(0, 3, 1), (3, 2, 2), (5, 3, 1)], 2, NotImplementedError,
     "segment id 1 of row 0"),  # the keys of id 1 are two runs
    ([(0, 3, 1), (3, 2, 2), (5, 3, 1)], [(0, 4, 1), (4, 4, 2)], 3, NotImplementedError,
     "segment id 1 of row 0"),  # id 1 twice among the queries: key gradients would collide
    ([(0, 2, 1), (2, 2, 2), (4, 2, 3)], [(0, 8, 1)], 2, ValueError, "max_segments=2"),
])
def test_packed_layouts_cudnn_cannot_express(q_runs, kv_runs, M, error, message):
    q_ids, kv_ids = jnp.asarray(_ids(8, q_runs)), jnp.asarray(_ids(8, kv_runs))
    with pytest.raises(error, match=message):
        cudnn.packed_sequences(q_ids, kv_ids, M, None)
    # Traced, nothing can raise: the affected queries are poisoned with NaN, never wrong.
    seqs = jax.jit(lambda a, b: cudnn.packed_sequences(a, b, M, None))(q_ids, kv_ids)
    assert np.asarray(seqs.q_bad).any()


def test_malformed_offsets_are_caught():
    q_ids = jnp.asarray(_ids(8, [(0, 4, 1), (4, 4, 2)]))
    seqs = cudnn.packed_sequences(q_ids, q_ids, 2, None)
    broken = dataclasses.replace(seqs, q_offsets=seqs.q_offsets.at[0, -1].set(8))
    with pytest.raises(RuntimeError, match="malformed cuDNN q"):
        cudnn_sequences._validate(broken, jnp.zeros((1, 8), bool), jnp.zeros((1, 2), bool),
                        jnp.zeros((1, 2), jnp.int32), 2, 8, 8)


# --------------------------------------------------------------------------------------------
# A stand-in for the two cuDNN calls (CPU), following cuDNN's semantics
# --------------------------------------------------------------------------------------------
def _shift_left(x, fill):
    """JAX's _fix_seqlen_offsets: non-negative entries of the flattened x, in order, first."""
    flat = x.reshape(-1)
    keep = flat >= 0
    moved = flat[jnp.argsort(~keep, stable=True)]
    return jnp.where(jnp.arange(flat.size) < jnp.sum(keep), moved, fill)


def _token_maps(cfg, seqs, B, T, S):
    """Per flat query token b*T + t: (cuDNN sequence, position in it); -1 = never computed."""
    def one(lens, offs, L):
        u = jnp.arange(B * L)
        if offs is not None:  # ragged: decode exactly as JAX hands the arrays to cuDNN
            lens = _shift_left(lens, 0)
            offs = jnp.where(offs >= 0, offs + jnp.arange(B)[:, None] * L, offs)
            starts = _shift_left(offs, B * L)[:lens.size]
            inside = (u[:, None] >= starts[None]) & (u[:, None] < (starts + lens)[None])
            seq = jnp.where(inside.any(1), jnp.argmax(inside, 1), -1)
            return seq, u - starts[jnp.maximum(seq, 0)]
        seq, pos = u // L, u % L
        if cfg.mask_type.startswith("PADDING"):
            seq = jnp.where(pos < lens[seq], seq, -1)
        return seq, pos
    return one(seqs.q_seqlen, seqs.q_offsets, T) + one(seqs.kv_seqlen, seqs.kv_offsets, S)


def _fake_scores(cfg, q, k, bias, seqs):
    B, T, N, D = q.shape
    S, K = k.shape[1], k.shape[2]
    q_seq, q_pos, kv_seq, kv_pos = _token_maps(cfg, seqs, B, T, S)
    qf = q.astype(jnp.float32).reshape(B * T, N, D)
    kf = jnp.repeat(k.astype(jnp.float32), N // K, axis=2).reshape(B * S, N, D)
    s = jnp.einsum("und,wnd->nuw", qf, kf) * cfg.scale
    if bias is not None:
        s = s + bias[0].astype(jnp.float32)[:, jnp.arange(B * T) % T][:, :, jnp.arange(B * S) % S]
    vis = (q_seq[:, None] == kv_seq[None]) & (q_seq >= 0)[:, None]
    if cfg.mask_type.endswith("CAUSAL"):
        vis &= kv_pos[None] <= q_pos[:, None]
    if cfg.sliding_window_length is not None:
        vis &= q_pos[:, None] - kv_pos[None] < cfg.sliding_window_length
    return s, vis, q_seq, q_pos, kv_seq


CALLS = {"fwd": 0, "bwd": 0}


def fake_forward(cfg, q, k, v, bias, seqs):
    CALLS["fwd"] += 1
    B, T, N, _ = q.shape
    S, K, Dv = v.shape[1], v.shape[2], v.shape[3]
    s, vis, q_seq, q_pos, _ = _fake_scores(cfg, q, k, bias, seqs)
    s = jnp.where(vis[None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)  # -inf for a row without keys: NaN, as stale memory
    lse = (m + jnp.log(jnp.sum(jnp.exp(s - m), axis=-1, keepdims=True)))[..., 0]  # [N, B*T]
    p = jnp.exp(s - lse[..., None])
    vf = jnp.repeat(v.astype(jnp.float32), N // K, axis=2).reshape(B * S, N, Dv)
    out = jnp.einsum("nuw,wnd->und", p, vf)
    out = jnp.where((q_seq >= 0)[:, None, None], out, jnp.nan).reshape(B, T, N, Dv)
    lse = jnp.where((q_seq >= 0)[None], lse, jnp.nan)
    if seqs.q_offsets is None:
        stats = jnp.transpose(lse.reshape(N, B, T), (1, 0, 2))
    else:  # one statistics row per cuDNN sequence: [B * M, N, T]
        J = seqs.q_seqlen.size
        rows = jnp.where(q_seq >= 0, q_seq, J)  # out of bounds: dropped
        stats = jnp.full((J, N, T), jnp.nan).at[rows, :, q_pos].set(lse.T, mode="drop")
    return out.astype(q.dtype), stats


def fake_backward(cfg, q, k, v, bias, seqs, stats, out, d_out):
    """cuDNN's backward formulas: p from the statistics, D_i = d_out_i . out_i, NaN in the
    rows and pairs it never writes."""
    CALLS["bwd"] += 1
    B, T, N, D = q.shape
    S, K, Dv = v.shape[1], v.shape[2], v.shape[3]
    s, vis, q_seq, q_pos, kv_seq = _fake_scores(cfg, q, k, bias, seqs)
    if seqs.q_offsets is None:
        lse = jnp.transpose(stats, (1, 0, 2)).reshape(N, B * T)
    else:
        lse = stats[jnp.maximum(q_seq, 0), :, q_pos].T
    p = jnp.where(vis[None], jnp.exp(s - lse[..., None]), 0.0)

    def f32(x, H):  # keys / values per query head, flat tokens
        return jnp.repeat(x.astype(jnp.float32), N // K, axis=2).reshape(B * S, N, H)

    qf, kf, vf = q.astype(jnp.float32).reshape(B * T, N, D), f32(k, D), f32(v, Dv)
    do = d_out.astype(jnp.float32).reshape(B * T, N, Dv)
    delta = jnp.sum(do * out.astype(jnp.float32).reshape(B * T, N, Dv), -1).T  # [N, B*T]
    ds = jnp.where(vis[None], p * (jnp.einsum("und,wnd->nuw", do, vf) - delta[..., None]), 0.0)
    group = lambda x: x.reshape(B, S, K, N // K, -1).sum(3)  # noqa: E731
    dq = (cfg.scale * jnp.einsum("nuw,wnd->und", ds, kf)).reshape(B, T, N, D)
    dk = group(cfg.scale * jnp.einsum("nuw,und->wnd", ds, qf))
    dv = group(jnp.einsum("nuw,und->wnd", p, do))
    dq = jnp.where((q_seq >= 0).reshape(B, T, 1, 1), dq, jnp.nan)
    dk, dv = (jnp.where((kv_seq >= 0).reshape(B, S, 1, 1), x, jnp.nan) for x in (dk, dv))
    dbias = None
    if bias is not None:
        rows = jnp.arange(B)
        dbias = ds.reshape(N, B, T, B, S)[:, rows, :, rows, :].sum(0)[None]
        seen = vis.reshape(B, T, B, S)[rows, :, rows, :].any(0)
        dbias = jnp.where(seen[None, None], dbias, jnp.nan).astype(bias.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias


@pytest.fixture
def fake_cudnn(monkeypatch):
    monkeypatch.setattr(cudnn, "_cudnn_forward", fake_forward)
    monkeypatch.setattr(cudnn, "_cudnn_backward", fake_backward)
    CALLS.update(fwd=0, bwd=0)
    with jax.default_matmul_precision("float32"):  # on a GPU too: no TF32 in tight comparisons
        yield CALLS


# --------------------------------------------------------------------------------------------
# The backend against the reference
# --------------------------------------------------------------------------------------------
def _segments(kind, rng, B, T, S):
    if kind is None:
        return None
    if kind == "padding":
        q = rng.integers(1, T + 1, B)
        kv = rng.integers(1, S + 1, B)
        q[0], kv[-1] = 0, 0  # a row with no queries and one with no keys
        return SD.from_seqlens((jnp.asarray(q), jnp.asarray(kv)))
    order = "same" if kind == "packed_ordered" else "random"
    q_ids, kv_ids = _random_packed_ids(rng, B, T, S, 3, order)
    return SD.from_segment_ids_and_pos((jnp.asarray(q_ids), jnp.asarray(kv_ids)))


def _problem(rng, dtype, *, B=2, T=16, S=16, N=4, K=2, Dqk=16, Dv=16, segments=None,
             bias=None, **opts):
    q, k, v = sem.random_qkv(rng, B, T, S, N, K, Dqk, Dv)
    if bias is not None:
        opts["bias"] = jnp.asarray(sem.random_bias(rng, bias, B, N, T, S), dtype)
    opts["segments"] = _segments(segments, rng, B, T, S)
    ct = jnp.asarray(rng.standard_normal((B, T, N, Dv)), jnp.float32)
    ct_lse = jnp.asarray(rng.standard_normal((B, N, T)), jnp.float32)
    return [jnp.asarray(x, dtype) for x in (q, k, v)], opts, ct, ct_lse


def _run(fn, arrays, opts, ct, ct_lse, with_lse=True):
    """(out, lse, grads of sum(out * ct) [+ sum(lse * ct_lse)] w.r.t. q, k, v (, bias)), jitted
    (cotangents are arguments, not constants XLA would fold)."""
    names = ["q", "k", "v"] + (["bias"] if "bias" in opts else [])
    args = list(arrays) + ([opts["bias"]] if "bias" in opts else [])
    rest = {k: v for k, v in opts.items() if k != "bias"}

    def loss(*args):
        *args, ct, ct_lse = args
        inputs, spec = normalize(*args[:3], bias=args[3] if len(args) > 3 else None, **rest)
        out, lse = fn(inputs, spec)
        total = jnp.sum(out.astype(jnp.float32) * ct)
        if with_lse:
            total = total + jnp.sum(jnp.where(lse > EMPTY_ROW_LSE / 2, lse, 0.0) * ct_lse)
        return total, (out, lse)

    grad = jax.value_and_grad(loss, tuple(range(len(args))), has_aux=True)
    (_, (out, lse)), grads = jax.jit(grad)(*args, ct, ct_lse)
    return out, lse, dict(zip(names, grads))


def _empty_rows(arrays, opts):
    inputs, spec = normalize(*arrays, **opts)
    vis = masks.element_mask(spec, inputs, np.arange(spec.q_len), np.arange(spec.kv_len))
    if vis is None:
        return np.zeros((spec.batch, spec.q_len), bool)
    return ~np.broadcast_to(np.asarray(vis), (spec.batch, spec.q_len, spec.kv_len)).any(-1)


CASES = {  # features combined, to keep the CPU suite short
    "none_mqa": dict(mask="none", N=4, K=1),
    "causal_gqa": dict(N=8, K=2),
    "causal_T>S": dict(T=24, S=8),
    "causal_T<S_mla": dict(T=8, S=24, Dqk=24, Dv=8),
    "window_empty_rows": dict(T=24, S=8, window=(2, 0)),
    "padding": dict(mask="padding", segments="padding", T=12, S=10),
    "padding_causal_window_bias": dict(bias="1NTS", mask="padding_causal", window=(3, 0),
                                       segments="padding", T=12, S=14),
    "bias_shared_heads_window": dict(bias="11TS", N=4, K=1, window=(5, 0)),
    "packed_self_no_mask": dict(segments="packed", mask="none", B=3, T=18, S=18),
    "packed_cross_window": dict(segments="packed", B=3, T=20, S=28, window=(4, 0)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference_with_stand_in(fake_cudnn, name):
    rng = np.random.default_rng(sorted(CASES).index(name))
    arrays, opts, ct, ct_lse = _problem(rng, jnp.float32, **CASES[name])
    out, lse, grads = _run(cudnn._attention, arrays, opts, ct, ct_lse)
    r_out, r_lse, r_grads = _run(reference.attention, arrays, opts, ct, ct_lse)
    tol = dict(rtol=2e-5, atol=2e-5)
    sem.assert_close("out", out, r_out, **tol)
    sem.assert_close("lse", lse, r_lse, **tol)
    for key in r_grads:
        sem.assert_close(f"d{key}", grads[key], r_grads[key], **tol)
    empty = _empty_rows(arrays, opts)
    assert (np.asarray(out)[empty] == 0).all() and (np.asarray(grads["q"])[empty] == 0).all()
    assert (np.asarray(lse).transpose(0, 2, 1)[empty] == EMPTY_ROW_LSE).all()
    assert fake_cudnn["bwd"] == 2  # the lse cotangent took one more cuDNN backward


def test_lse_correction_only_when_lse_is_differentiated(fake_cudnn):
    rng = np.random.default_rng(7)
    arrays, opts, ct, ct_lse = _problem(rng, jnp.float32, window=(4, 0))
    out, _, grads = _run(cudnn._attention, arrays, opts, ct, ct_lse, with_lse=False)
    assert fake_cudnn == {"fwd": 1, "bwd": 1}
    _, _, r_grads = _run(reference.attention, arrays, opts, ct, ct_lse, with_lse=False)
    for key in r_grads:
        sem.assert_close(f"d{key}", grads[key], r_grads[key], rtol=2e-5, atol=2e-5)


def test_common_path_is_the_cudnn_call_alone(fake_cudnn):
    x = jnp.zeros((2, 16, 4, 64), jnp.bfloat16)
    for opts in (dict(), dict(mask="none"), dict(window=(4, 0))):
        inputs, spec = normalize(x, x, x, **opts)
        jaxpr = jax.make_jaxpr(lambda i: cudnn._attention(i, spec))(inputs)
        assert [e.primitive.name for e in jaxpr.eqns] == ["custom_vjp_call"], jaxpr


# --------------------------------------------------------------------------------------------
# GPU: real cuDNN, bfloat16
# --------------------------------------------------------------------------------------------
def _plain_bf16(arrays, opts, ct, ct_lse, with_lse):
    """The plain bfloat16 computation (semantics.attention_jnp) and its gradients."""
    inputs, spec = normalize(*arrays, **opts)
    vis = masks.element_mask(spec, inputs, np.arange(spec.q_len), np.arange(spec.kv_len))
    vis = np.ones((spec.batch, spec.q_len, spec.kv_len), bool) if vis is None else np.broadcast_to(
        np.asarray(vis), (spec.batch, spec.q_len, spec.kv_len))
    has_bias = "bias" in opts

    def loss(q, k, v, *bias_and_cts):
        *bias, ct, ct_lse = bias_and_cts
        out, lse = sem.attention_jnp(q, k, v, vis, bias=bias[0] if bias else None, scale=spec.scale)
        lse = lse.astype(jnp.float32)
        total = jnp.sum(out.astype(jnp.float32) * ct)
        if with_lse:
            total = total + jnp.sum(jnp.where(lse > EMPTY_ROW_LSE / 2, lse, 0.0) * ct_lse)
        return total, (out, lse)

    args = list(arrays) + ([opts["bias"]] if has_bias else [])
    grad = jax.value_and_grad(loss, tuple(range(len(args))), has_aux=True)
    (_, (out, lse)), grads = jax.jit(grad)(*args, ct, ct_lse)
    return out, lse, dict(zip(["q", "k", "v", "bias"], grads))


def _check_gpu(name, arrays, opts, ct, ct_lse, with_lse=True):
    inputs, spec = normalize(*arrays, **opts)
    reason = cudnn.unsupported_reason(spec, "gpu")
    if reason is not None and name == "mla":
        pytest.skip(f"MLA head dims: {reason}")
    assert reason is None, reason

    rest = {key: value for key, value in opts.items() if key != "bias"}

    def via_api(inputs, spec):  # through the public call and its dispatch, as users reach it
        return flashmesh.attention(inputs.q, inputs.k, inputs.v, bias=inputs.bias,
                                   implementation="cudnn", return_lse=True, **rest)

    out, lse, grads = _run(via_api, arrays, opts, ct, ct_lse, with_lse)
    f32 = [x.astype(jnp.float32) for x in arrays]
    f32_opts = dict(opts, **({"bias": opts["bias"].astype(jnp.float32)} if "bias" in opts else {}))
    with jax.default_matmul_precision("float32"):  # no TF32 in the ground truth
        r_out, r_lse, r_grads = _run(reference.attention, f32, f32_opts, ct, ct_lse, with_lse)
    p_out, p_lse, p_grads = _plain_bf16(arrays, opts, ct, ct_lse, with_lse)
    sem.assert_fa_rule("out", out, r_out, p_out)
    empty = _empty_rows(arrays, opts)
    valid = ~np.repeat(empty[:, None, :], spec.num_heads, axis=1)  # [B, N, T]
    sem.assert_fa_rule("lse", np.where(valid, lse, 0), np.where(valid, r_lse, 0),
                       np.where(valid, p_lse, 0))
    for key in r_grads:
        sem.assert_fa_rule(f"d{key}", grads[key], r_grads[key], p_grads[key])
    assert (np.asarray(out)[empty] == 0).all(), "fully masked rows must be exactly 0"
    assert (np.asarray(grads["q"])[empty] == 0).all(), "fully masked rows get zero gradient"
    assert (np.asarray(lse).transpose(0, 2, 1)[empty] == EMPTY_ROW_LSE).all()


GPU_CASES = {
    "plain": dict(mask="none"),
    "causal": dict(),
    "causal_T<S": dict(T=128, S=384),
    "causal_T>S": dict(T=384, S=128),
    "gqa": dict(N=8, K=2),
    "mqa": dict(N=8, K=1),
    "mla": dict(Dqk=128, Dv=64),
    "window": dict(window=(64, 0)),
    "window_empty_rows": dict(T=512, S=128, window=(32, 0)),
    "padding": dict(mask="padding", segments="padding"),
    "padding_causal_window": dict(mask="padding_causal", window=(48, 0), segments="padding"),
    "packed": dict(segments="packed", B=3),
    "packed_cross_window": dict(segments="packed", B=3, T=320, S=448, window=(40, 0)),
    # Key segments in the queries' order: if only the case above fails, cuDNN wants monotone
    # key offsets and packed_sequences must refuse other orders.
    "packed_cross_ordered": dict(segments="packed_ordered", B=3, T=320, S=448),
    "bias": dict(bias="1NTS"),
    "bias_shared_heads": dict(bias="11TS", window=(100, 0)),
    "bias_padding": dict(bias="1NTS", mask="padding_causal", segments="padding"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_matches_reference(name):
    shape = dict(B=2, T=256, S=256, N=4, K=2, Dqk=64, Dv=64)
    shape.update(GPU_CASES[name])
    rng = np.random.default_rng(sorted(GPU_CASES).index(name))
    arrays, opts, ct, ct_lse = _problem(rng, jnp.bfloat16, **shape)
    _check_gpu(name, arrays, opts, ct, ct_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "padding", "packed", "bias"])
def test_gpu_gradients_without_lse(name):
    """The out-gradients alone (cuDNN's own backward, no lse correction): if these pass and
    test_gpu_matches_reference fails in its gradients, the lse correction is at fault."""
    shape = dict(B=2, T=256, S=256, N=4, K=2, Dqk=64, Dv=64)
    shape.update(GPU_CASES[name])
    rng = np.random.default_rng(sorted(GPU_CASES).index(name))
    arrays, opts, ct, ct_lse = _problem(rng, jnp.bfloat16, **shape)
    _check_gpu(name, arrays, opts, ct, ct_lse, with_lse=False)


@pytest.mark.gpu
def test_gpu_is_chosen_automatically():
    q = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16)
    assert flashmesh.explain(q, q, q).chosen == "cudnn"


def _compiled(fn, *args):
    text = jax.jit(fn).lower(*args).compile().as_text()
    targets = sorted(re.findall(r'custom_call_target="([^"]*cudnn[^"]*)"', text))
    moves = len(re.findall(r"\b(?:transpose|copy)\(", text))
    return targets, moves


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_graph_equals_raw_cudnn(causal):
    """Dispatch adds no work: the same cuDNN calls and no extra transposes or copies as
    jax.nn.dot_product_attention(implementation='cudnn'), forward + backward."""
    q = jnp.ones((2, 1024, 8, 128), jnp.bfloat16)
    mask = "causal" if causal else "none"

    def ours(q, k, v):
        return jnp.sum(flashmesh.attention(q, k, v, mask=mask).astype(jnp.float32))

    def raw(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32))

    mine, theirs = (_compiled(jax.grad(f, (0, 1, 2)), q, q, q) for f in (ours, raw))
    assert mine[0] == theirs[0]
    assert mine[1] <= theirs[1], (mine, theirs)


def test_forward_only_without_lse_runs_the_inference_kernel(fake_cudnn, monkeypatch):
    """A forward-only call that does not ask for the lse asks cuDNN for no statistics (its
    inference kernel, as jax.nn runs it); the differentiated path and return_lse still do."""
    asked = []

    def recording_forward(cfg, *args):
        asked.append(cfg.statistics)
        out, stats = fake_forward(cfg, *args)
        return (out, stats) if cfg.statistics else (out, None)

    monkeypatch.setattr(cudnn, "_cudnn_forward", recording_forward)
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 16, 4, 8)), jnp.bfloat16) for _ in range(3))

    def run(return_lse):
        inputs, spec = normalize(q, k, v, mask="causal", return_lse=return_lse)
        return inputs, spec, cudnn._attention(inputs, spec)

    inputs, spec, (out, _) = run(False)
    assert asked == [False]
    want, _ = reference.attention(inputs, spec)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=2e-2)
    run(True)
    assert asked == [False, True]
    inputs, spec = normalize(q, k, v, mask="causal", return_lse=False)
    jax.grad(lambda q: cudnn._attention(dataclasses.replace(inputs, q=q), spec)[0].astype(jnp.float32).sum())(q)
    assert asked[-1] is True


def _cudnn_call_types(fn, *args):
    """The result types of every cuDNN custom call in the compiled graph: a forward that
    computes softmax statistics (training mode) has one more result than inference mode."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return sorted(m.group(1).strip() for m in re.finditer(
        r"=\s*(.*?)\s*custom-call\(.*custom_call_target=\"[^\"]*cudnn[^\"]*\"", text))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_forward_only_graph_equals_raw_cudnn(causal):
    """Forward only, no lse asked: the same cuDNN call (inference mode) as jax.nn runs."""
    q = jnp.ones((2, 1024, 8, 128), jnp.bfloat16)
    ours = lambda q, k, v: flashmesh.attention(q, k, v, mask="causal" if causal else "none")  # noqa: E731
    raw = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,  # noqa: E731
                                                       implementation="cudnn")
    mine, theirs = (_cudnn_call_types(f, q, q, q) for f in (ours, raw))
    assert mine and mine == theirs, (mine, theirs)


def test_refuses_q_of_two_to_the_thirty_elements():
    """cuDNN's dq was wrong past batch row 0 at 2^31 q elements on the H200 (MAX_Q_ELEMENTS)."""
    def spec(B, T, N, D):
        specs = []
        jax.eval_shape(lambda q, kv: specs.append(normalize(q, kv, kv, mask="causal")[1]) or 0,
                       jax.ShapeDtypeStruct((B, T, N, D), jnp.bfloat16), jax.ShapeDtypeStruct((B, T, 8, D), jnp.bfloat16))
        return specs[0]
    big, small = spec(2, 65536, 128, 128), spec(1, 32768, 128, 128)
    assert "2^30" in cudnn.static_reason(big)
    assert cudnn.static_reason(small) is None
