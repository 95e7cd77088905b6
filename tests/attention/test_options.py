"""Options that mean the same thing give the same call: every descriptor form of one packing
aligns a bottom-right mask alike, a window longer than the sequence is no window, numpy
scalars are numbers, and dropout's indices are the call's own (so shards need their own key)."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import flashmesh
import semantics as sem
from flashmesh import SequenceDescriptor as SD
from flashmesh.attention import normalize

B, N, K, H = 2, 4, 2, 8


def _qkv(T, S, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, T, N, H)).astype(np.float32),
            rng.standard_normal((B, S, K, H)).astype(np.float32),
            rng.standard_normal((B, S, K, H)).astype(np.float32))


def _ref(q, k, v, **options):
    return np.asarray(flashmesh.attention(q, k, v, implementation="reference", **options))


def _tokens(lens, offs, L):
    """Segment ids (1-based) and canonical positions [B, L] of a packing given by slots."""
    ids, pos = np.zeros((B, L), np.int32), np.zeros((B, L), np.int32)
    for b in range(B):
        for m, (n, start) in enumerate(zip(lens[b], offs[b])):
            ids[b, start:start + n] = m + 1
            pos[b, start:start + n] = np.arange(n)
    return ids, pos


# -- bottom-right masks: one alignment whatever the descriptor form -------------------------------
# Row 0: query segments of 2 and 4 tokens against key segments of 5 and 3; row 1: one query
# segment of 3 (then padding) against 7 keys.
T, S = 7, 9
Q_LENS, KV_LENS = np.array([[2, 4], [3, 0]]), np.array([[5, 3], [7, 0]])
Q_OFFS, KV_OFFS = np.array([[0, 2], [0, 3]]), np.array([[0, 5], [0, 7]])


def _forms():
    (q_ids, q_pos), (kv_ids, kv_pos) = _tokens(Q_LENS, Q_OFFS, T), _tokens(KV_LENS, KV_OFFS, S)
    return {
        "offsets": SD.from_seqlens_and_offsets((Q_LENS, KV_LENS), (Q_OFFS, KV_OFFS)),
        "ids_and_pos": SD.from_segment_ids_and_pos((q_ids, kv_ids), (q_pos, kv_pos)),
        "ids": SD.from_segment_ids_and_pos((q_ids, kv_ids)),
    }


@pytest.mark.parametrize("window", [None, (1, 0)])
def test_bottom_right_is_one_alignment_for_every_descriptor_form(window):
    q, k, v = _qkv(T, S)
    mask = "padding_causal_bottom_right"
    outs = {name: _ref(q, k, v, mask=mask, window=window, segments=d)
            for name, d in _forms().items()}
    for name, out in outs.items():
        np.testing.assert_array_equal(out, outs["offsets"], err_msg=name)
    # The alignment, stated independently: top-left on positions shifted by (kv - q) length.
    (q_ids, q_pos), (kv_ids, kv_pos) = _tokens(Q_LENS, Q_OFFS, T), _tokens(KV_LENS, KV_OFFS, S)
    shift = np.concatenate([np.zeros((B, 1), int), KV_LENS - Q_LENS], axis=1)
    shifted = (q_pos + np.take_along_axis(shift, q_ids, axis=1)).astype(np.int32)
    want = _ref(q, k, v, mask="padding_causal", window=window,
                segments=SD.from_segment_ids_and_pos((q_ids, kv_ids), (shifted, kv_pos)))
    np.testing.assert_allclose(outs["ids_and_pos"], want, rtol=1e-6, atol=1e-6)
    top_left = _ref(q, k, v, mask="padding_causal", window=window, segments=_forms()["ids_and_pos"])
    assert not np.allclose(top_left, want)  # the shift is not a no-op on this packing


def test_bottom_right_padding_rows_agree_with_seqlens():
    """One segment per row (padding): seqlens, [B, 1] offsets and ids all align alike."""
    q, k, v = _qkv(T, S, seed=1)
    q_lens, kv_lens = np.array([3, 7]), np.array([9, 4])
    q_ids, _ = _tokens(q_lens[:, None], np.zeros((B, 1), int), T)
    kv_ids, _ = _tokens(kv_lens[:, None], np.zeros((B, 1), int), S)
    forms = [SD.from_seqlens((q_lens, kv_lens)),
             SD.from_seqlens_and_offsets((q_lens[:, None], kv_lens[:, None]),
                                         np.zeros((B, 1), np.int32)),
             SD.from_segment_ids_and_pos((q_ids, kv_ids))]
    outs = [_ref(q, k, v, mask="padding_causal_bottom_right", segments=d) for d in forms]
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_bottom_right_segment_ids_under_jit():
    """Derived positions need no concrete arrays: traced ids align as the offsets form does."""
    q, k, v = _qkv(T, S, seed=2)
    (q_ids, _), (kv_ids, _) = _tokens(Q_LENS, Q_OFFS, T), _tokens(KV_LENS, KV_OFFS, S)
    f = jax.jit(lambda q_ids, kv_ids: flashmesh.attention(
        q, k, v, mask="padding_causal_bottom_right", implementation="reference",
        segments=SD.from_segment_ids_and_pos((q_ids, kv_ids), max_segments=2)))
    want = _ref(q, k, v, mask="padding_causal_bottom_right", segments=_forms()["offsets"])
    np.testing.assert_array_equal(np.asarray(f(q_ids, kv_ids)), want)


# -- windows at least as long as the sequence are unbounded ---------------------------------------
CASES = [("causal", None, 5, 9), ("causal", None, 9, 5), ("causal_bottom_right", None, 5, 9),
         ("causal_bottom_right", None, 9, 5), ("none", None, 5, 9), ("none", None, 9, 5),
         ("padding_causal_bottom_right", "offsets", 5, 9),
         ("padding_causal_bottom_right", "offsets", 9, 5), ("padding", "seqlens", 9, 5)]


@pytest.mark.parametrize("mask,recipe,T,S", CASES)
def test_window_of_the_sequence_length_is_unbounded(mask, recipe, T, S):
    seg = None if recipe is None else sem.SEGMENT_RECIPES[recipe](np.random.default_rng(3), B, T, S)
    causal = "causal" in mask
    q, k, v = _qkv(T, S)
    segments = None if seg is None else seg.descriptor()
    unbounded = (-1, 0) if causal else (-1, -1)
    for side in (max(T, S), 2**31, 2**62):
        window = (side, 0) if causal else (side, side)
        # The brute-force mask with the window as given equals the one without a window ...
        np.testing.assert_array_equal(sem.visible(B, T, S, mask=mask, window=window, segments=seg),
                                      sem.visible(B, T, S, mask=mask, segments=seg))
        # ... so normalize drops it, and every backend sees one spec.
        spec = normalize(q, k, v, mask=mask, window=window, segments=segments)[1]
        assert spec.window == unbounded
    # Below max(T, S) a window is kept as given (whether or not it binds on this call).
    spec = normalize(q, k, v, mask=mask, window=(max(T, S) - 1, 0 if causal else 1),
                     segments=segments)[1]
    assert spec.window[0] == max(T, S) - 1


def test_huge_window_with_positions_the_user_chose():
    """Explicit positions can be far apart, so only int32's range bounds them: (2**31, 0) is
    unbounded, a window below it is kept and compared without overflow."""
    T = S = 6
    q, k, v = _qkv(T, S)
    ids = np.ones((B, T), np.int32)
    pos = np.broadcast_to(np.arange(T, dtype=np.int32) * 10**8, (B, T))
    segments = SD.from_segment_ids_and_pos(ids, pos)
    assert normalize(q, k, v, mask="padding_causal", window=(2**31, 0),
                     segments=segments)[1].window == (-1, 0)
    kept = normalize(q, k, v, mask="padding_causal", window=(10**8, 0), segments=segments)[1]
    assert kept.window == (10**8, 0)
    unbounded = _ref(q, k, v, mask="padding_causal", segments=segments)
    np.testing.assert_array_equal(
        _ref(q, k, v, mask="padding_causal", window=(2**31, 0), segments=segments), unbounded)
    self_and_previous = _ref(q, k, v, mask="padding_causal", window=(10**8, 0), segments=segments)
    assert not np.allclose(self_and_previous, unbounded)


# -- numbers and flags -----------------------------------------------------------------------------
def test_numpy_scalars_are_numbers_and_numpy_bools_are_bools():
    q, k, v = _qkv(6, 6)
    key = jax.random.key(0)
    np.testing.assert_array_equal(
        _ref(q, k, v, logits_soft_cap=np.float32(5.0), scale=np.float64(0.3)),
        _ref(q, k, v, logits_soft_cap=5.0, scale=0.3))
    rate = np.float32(0.1)
    np.testing.assert_array_equal(_ref(q, k, v, dropout_rate=rate, dropout_rng=key),
                                  _ref(q, k, v, dropout_rate=float(rate), dropout_rng=key))
    np.testing.assert_array_equal(
        _ref(q, k, v, dropout_rate=0.5, dropout_rng=key, deterministic=np.bool_(True)),
        _ref(q, k, v))
    out, lse = flashmesh.attention(q, k, v, return_lse=np.bool_(True), implementation="reference")
    assert lse.shape == (B, N, 6)
    spec = normalize(q, k, v, dropout_rate=np.float16(0.25), dropout_rng=np.int64(3))[1]
    assert spec.dropout_rate == 0.25


def test_window_accepts_numpy_ints():
    q, k, v = _qkv(6, 6)
    assert normalize(q, k, v, window=(np.int64(2), np.int32(0)))[1].window == (2, 0)


# -- dropout uses the call's own indices -----------------------------------------------------------
def _mesh():
    return jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest fakes 8 CPUs)")
def test_dropout_under_shard_map_needs_a_key_per_shard():
    """Four data-parallel shards of identical rows: one replicated key drops the same elements
    on every shard (indices are local); folding in the axis index gives each shard its own."""
    mesh = _mesh()
    q = jax.device_put(np.broadcast_to(_qkv(6, 6)[0][:1], (4, 6, N, H)),
                       jax.NamedSharding(mesh, P("data")))
    key = jax.random.key(7)

    def shards(per_shard: bool):
        def f(q):
            k = jax.random.fold_in(key, jax.lax.axis_index("data")) if per_shard else key
            return flashmesh.attention(q, q, q, dropout_rate=0.5, dropout_rng=k,
                                       implementation="reference")
        return np.asarray(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(q))

    same = shards(per_shard=False)
    for b in range(1, 4):
        np.testing.assert_array_equal(same[b], same[0])
    own = shards(per_shard=True)
    for b in range(4):  # shard b is one ordinary call with its folded key
        row = np.asarray(q)[b:b + 1]
        want = _ref(row, row, row, dropout_rate=0.5, dropout_rng=jax.random.fold_in(key, b))
        np.testing.assert_array_equal(own[b:b + 1], want)
    assert not np.array_equal(own[0], own[1])
