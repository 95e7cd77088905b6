"""flashmesh.te: TransformerEngine's attention names map onto flashmesh.attention, exactly.

Every comparison is against the native call or an independent float64 numpy oracle, in
float32 on CPU with small shapes.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

import flashmesh
import flashmesh.te as te
from flashmesh.attention import layouts
from flashmesh.attention.api import MASKS
from flashmesh.attention.spec import SOFTMAX_TYPES
from flashmesh.te.attention import (AttnBiasType, AttnMaskType, AttnSoftmaxType, CPStrategy,
                                    QKVFormat, QKVLayout, ReorderStrategy, SequenceDescriptor,
                                    canonicalize, canonicalize_attn_mask_type, fused_attn,
                                    is_fused_attn_kernel_available)
from flashmesh.te.flax import DotProductAttention

B, T, N, K, D = 2, 12, 4, 2, 8
SCALE = D ** -0.5
VANILLA = AttnSoftmaxType.VANILLA_SOFTMAX
SEPARATE = QKVLayout.BSHD_BSHD_BSHD


def _normal(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def _qkv(t=T, s=T, n=N, k=K, dqk=D, dv=D, seed=0):
    return _normal(seed, (B, t, n, dqk)), _normal(seed + 1, (B, s, k, dqk)), _normal(seed + 2, (B, s, k, dv))


def _fused(qkv, mask=AttnMaskType.CAUSAL_MASK, layout=SEPARATE, *, bias=None, desc=None,
           seed=None, bias_type=AttnBiasType.NO_BIAS, softmax=VANILLA, scale=SCALE,
           dropout=0.0, training=True, **kwargs):
    return fused_attn(qkv, bias, desc, seed, bias_type, mask, layout, softmax, scale, dropout,
                      training, **kwargs)


def _pack(layout, q, k, v):
    """The `qkv` tuple of `layout` from separate arrays."""
    if layout.is_qkvpacked():
        return (jnp.stack([q, k, v], axis=2),)
    if layout.is_kvpacked():
        return (q, jnp.stack([k, v], axis=2))
    return (q, k, v)


def _numpy_attention(q, k, v, logits_fn=lambda s: SCALE * s, visible=None):
    """float64 oracle: softmax(logits_fn(q k^T), masked by visible [B, T, S]) v; rows that see
    no key give 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    s = logits_fn(np.einsum("btnh,bsnh->bnts", q, k))
    if visible is not None:
        s = np.where(visible[:, None], s, -np.inf)
    top = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(top), top, 0.0))
    denom = p.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", p / np.where(denom == 0, 1.0, denom), v)


def _close(got, want, atol=1e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=atol, rtol=1e-5)


# -- enums ------------------------------------------------------------------------------------

def test_every_enum_member_maps_to_a_native_option():
    masks = {AttnMaskType.NO_MASK: "none", AttnMaskType.PADDING_MASK: "padding",
             AttnMaskType.CAUSAL_MASK: "causal", AttnMaskType.PADDING_CAUSAL_MASK: "padding_causal",
             AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK: "causal_bottom_right",
             AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK: "padding_causal_bottom_right"}
    layouts_ = {QKVLayout.BS3HD: "bs3hd", QKVLayout.BSHD_BS2HD: "bshd_bs2hd",
                QKVLayout.BSHD_BSHD_BSHD: "bshd_bshd_bshd", QKVLayout.T3HD: "t3hd",
                QKVLayout.THD_T2HD: "thd_t2hd", QKVLayout.THD_THD_THD: "thd_thd_thd"}
    softmaxes = {AttnSoftmaxType.VANILLA_SOFTMAX: "vanilla",
                 AttnSoftmaxType.OFF_BY_ONE_SOFTMAX: "off_by_one",
                 AttnSoftmaxType.LEARNABLE_SOFTMAX: "learnable"}
    for table, enum_type, native in ((masks, AttnMaskType, MASKS),
                                     (layouts_, QKVLayout, layouts.LAYOUTS),
                                     (softmaxes, AttnSoftmaxType, SOFTMAX_TYPES)):
        assert set(table) == set(enum_type), enum_type
        for member, value in table.items():
            assert member.value == value and value in native
    assert [m.name for m in AttnBiasType] == ["NO_BIAS", "PRE_SCALE_BIAS", "POST_SCALE_BIAS"]
    assert [m.name for m in CPStrategy] == ["DEFAULT", "ALL_GATHER", "RING"]
    assert [m.name for m in ReorderStrategy] == ["DualChunkSwap", "Striped"]


def test_enum_helpers_and_strings():
    assert AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK.is_padding()
    assert AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK.is_bottom_right()
    assert AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK.is_causal()
    assert not AttnMaskType.PADDING_MASK.is_causal() and not AttnMaskType.NO_MASK.is_padding()
    assert QKVLayout.T3HD.is_qkvpacked() and QKVLayout.THD_T2HD.is_kvpacked()
    assert QKVLayout.THD_THD_THD.is_separate() and QKVLayout.THD_T2HD.is_thd()
    assert QKVLayout.BS3HD.to_separate() == QKVLayout.BSHD_BSHD_BSHD
    assert QKVLayout.THD_THD_THD.to_qkvpacked() == QKVLayout.T3HD
    assert QKVLayout.BSHD_BSHD_BSHD.to_kvpacked() == QKVLayout.BSHD_BS2HD
    assert QKVLayout.T3HD.get_qkv_format() == QKVFormat.THD
    assert canonicalize_attn_mask_type("causal_padding") == AttnMaskType.PADDING_CAUSAL_MASK
    assert canonicalize_attn_mask_type("bottom_right_causal") == AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK
    assert canonicalize_attn_mask_type("no_mask") == AttnMaskType.NO_MASK
    assert AttnSoftmaxType.from_str("off-by-one") == AttnSoftmaxType.OFF_BY_ONE_SOFTMAX
    assert canonicalize(AttnBiasType, "post_scale_bias", "b") == AttnBiasType.POST_SCALE_BIAS
    assert canonicalize(QKVLayout, "BS3HD", "l") == QKVLayout.BS3HD
    with pytest.raises(ValueError, match="attn_mask_type='sliding'"):
        canonicalize_attn_mask_type("sliding")
    with pytest.raises(ValueError, match="softmax_type='soft'"):
        AttnSoftmaxType.from_str("soft")
    with pytest.raises(ValueError, match="qkv_layout='bhsd'"):
        canonicalize(QKVLayout, "bhsd", "qkv_layout")


def test_sequence_descriptor_is_flashmesh_s():
    assert te.attention.SequenceDescriptor is flashmesh.SequenceDescriptor
    for ctor in ("from_seqlens", "from_seqlens_and_offsets", "from_segment_ids_and_pos"):
        assert hasattr(SequenceDescriptor, ctor)
    # TE's keyword names
    lens, offs = jnp.asarray([[3, 2]]), jnp.asarray([[0, 3, 5]])
    packed = SequenceDescriptor.from_seqlens_and_offsets(seqlens=lens, seq_offsets=offs)
    assert packed.kind == "seqlens_offsets" and packed.q_offsets.shape == (1, 2)
    ids = jnp.asarray([[1, 1, 1, 2, 2]])
    assert SequenceDescriptor.from_segment_ids_and_pos(
        segment_ids=ids, segment_pos=jnp.asarray([[0, 1, 2, 0, 1]])).kind == "segment_ids"


# -- layouts ----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [QKVLayout.BS3HD, QKVLayout.BSHD_BS2HD, QKVLayout.BSHD_BSHD_BSHD])
def test_bshd_layouts_match_native(layout):
    heads = N if layout == QKVLayout.BS3HD else K  # a packed qkv has one head count
    q, k, v = _qkv(k=heads)
    got = _fused(_pack(layout, q, k, v), layout=layout, window_size=(3, 0))
    want = flashmesh.attention(q, k, v, mask="causal", window=(3, 0), implementation="reference")
    _close(got, want)


def _packed_rows():
    """Two rows packing segments [5, 4, pad 3] and [7, pad 2, 3]; ids 1-based, 0 = padding."""
    ids = np.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 7 + [0] * 2 + [2] * 3], np.int32)
    pos = np.array([list(range(5)) + list(range(4)) + [0] * 3,
                    list(range(7)) + [0] * 2 + list(range(3))], np.int32)
    return ids, pos


@pytest.mark.parametrize("layout", [QKVLayout.T3HD, QKVLayout.THD_T2HD, QKVLayout.THD_THD_THD])
@pytest.mark.parametrize("form", ["segment_ids", "seqlens_offsets"])
def test_thd_layouts_attend_within_segments(layout, form):
    ids, pos = _packed_rows()
    heads = N if layout == QKVLayout.T3HD else K
    q, k, v = _qkv(k=heads, seed=3)
    if form == "segment_ids":
        desc = SequenceDescriptor.from_segment_ids_and_pos(jnp.asarray(ids), jnp.asarray(pos))
    else:  # TransformerEngine's convention: lengths and offsets padded with -1
        lens = jnp.asarray([[5, 4, -1], [7, 3, -1]], jnp.int32)
        offsets = jnp.asarray([[0, 5, 9, -1], [0, 9, 12, -1]], jnp.int32)
        desc = SequenceDescriptor.from_seqlens_and_offsets(lens, offsets)
    got = _fused(_pack(layout, q, k, v), AttnMaskType.PADDING_CAUSAL_MASK, layout, desc=desc,
                 max_segments_per_seq=3)
    # Each segment attends causally to itself only; padding tokens give exactly 0.
    visible = ((ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] > 0)
               & (pos[:, :, None] >= pos[:, None, :]))
    _close(got, _numpy_attention(q, k, v, visible=visible))
    assert not np.asarray(got)[1, 7:9].any()


def test_thd_under_jit_takes_max_segments_per_seq():
    ids, pos = _packed_rows()
    q, k, v = _qkv(seed=5)

    def f(q, k, v, ids, pos):  # under jit the segment ids are traced: their count is unknown
        desc = SequenceDescriptor.from_segment_ids_and_pos(ids, pos)
        assert desc.max_segments == (None if isinstance(ids, jax.core.Tracer) else 2)
        return _fused((q, k, v), AttnMaskType.PADDING_CAUSAL_MASK, QKVLayout.THD_THD_THD,
                      desc=desc, max_segments_per_seq=2)

    _close(jax.jit(f)(q, k, v, ids, pos), f(q, k, v, jnp.asarray(ids), jnp.asarray(pos)))


def test_thd_needs_a_padding_mask():
    ids, pos = _packed_rows()
    desc = SequenceDescriptor.from_segment_ids_and_pos(jnp.asarray(ids), jnp.asarray(pos))
    with pytest.raises(ValueError, match="needs a PADDING_\\* attn_mask_type, got CAUSAL_MASK"):
        _fused(_qkv(), AttnMaskType.CAUSAL_MASK, QKVLayout.THD_THD_THD, desc=desc)


# -- masks ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mask", list(AttnMaskType))
def test_mask_types_match_native_strings(mask):
    q, k, v = _qkv(t=8, s=T, seed=7)
    lens = (jnp.asarray([8, 3], jnp.int32), jnp.asarray([T, 6], jnp.int32))
    desc = SequenceDescriptor.from_seqlens(lens) if mask.is_padding() else None
    got = _fused((q, k, v), mask, desc=desc)
    native = {"NO_MASK": "none", "PADDING_MASK": "padding", "CAUSAL_MASK": "causal",
              "PADDING_CAUSAL_MASK": "padding_causal",
              "CAUSAL_BOTTOM_RIGHT_MASK": "causal_bottom_right",
              "PADDING_CAUSAL_BOTTOM_RIGHT_MASK": "padding_causal_bottom_right"}[mask.name]
    want = flashmesh.attention(q, k, v, mask=native, segments=desc, implementation="reference")
    _close(got, want)
    if mask == AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK:  # last query sees every key
        full = flashmesh.attention(q, k, v, mask="none")
        _close(got[:, -1], full[:, -1])


def test_non_padding_mask_ignores_the_descriptor_like_transformer_engine():
    q, k, v = _qkv(seed=9)
    padded = SequenceDescriptor.from_seqlens(jnp.asarray([7, 4], jnp.int32))
    _close(_fused((q, k, v), desc=padded), _fused((q, k, v)))


def test_window_none_and_minus_one_mean_no_window():
    qkv = _qkv(seed=11)
    _close(_fused(qkv, window_size=(-1, -1)), _fused(qkv, window_size=None))
    want = flashmesh.attention(*qkv, mask="none", window=(2, 1))
    _close(_fused(qkv, AttnMaskType.NO_MASK, window_size=(2, 1)), want)
    for bad in (5, (1, 2, 3)):
        with pytest.raises(ValueError, match="window_size must be a \\(left, right\\) pair or None"):
            _fused(qkv, window_size=bad)


# -- bias and softmax -------------------------------------------------------------------------

@pytest.mark.parametrize("bias_type", [AttnBiasType.PRE_SCALE_BIAS, AttnBiasType.POST_SCALE_BIAS])
def test_bias_types_against_numpy(bias_type):
    q, k, v = _qkv(seed=13)
    bias = _normal(16, (1, N, T, T))
    b = np.asarray(bias, np.float64)
    if bias_type == AttnBiasType.PRE_SCALE_BIAS:
        want = _numpy_attention(q, k, v, lambda s: SCALE * (s + b))
    else:
        want = _numpy_attention(q, k, v, lambda s: SCALE * s + b)
    got = _fused((q, k, v), AttnMaskType.NO_MASK, bias=bias, bias_type=bias_type)
    _close(got, want)


def test_pre_scale_bias_gradient_is_scaled():
    q, k, v = _qkv(seed=17)
    bias = _normal(18, (1, N, T, T))

    def loss(bias, bias_type):
        return jnp.sum(_fused((q, k, v), AttnMaskType.NO_MASK, bias=bias, bias_type=bias_type) ** 2)

    pre = jax.grad(loss)(bias, AttnBiasType.PRE_SCALE_BIAS)
    post = jax.grad(loss)(bias * SCALE, AttnBiasType.POST_SCALE_BIAS)
    _close(pre, SCALE * post)


def test_learnable_softmax_offset_maps_to_sink_with_gradient():
    q, k, v = _qkv(seed=19)
    offset = _normal(20, (1, N, 1, 1))

    def te_loss(offset):
        return jnp.sum(_fused((q, k, v), softmax=AttnSoftmaxType.LEARNABLE_SOFTMAX,
                              softmax_offset=offset) ** 2)

    def native_loss(sink):
        return jnp.sum(flashmesh.attention(q, k, v, softmax="learnable", sink=sink) ** 2)

    grad = jax.grad(te_loss)(offset)
    assert grad.shape == (1, N, 1, 1) and np.abs(np.asarray(grad)).min() > 0
    _close(grad.reshape(N), jax.grad(native_loss)(offset.reshape(N)))
    off_by_one = _fused((q, k, v), softmax=AttnSoftmaxType.OFF_BY_ONE_SOFTMAX)
    _close(off_by_one, flashmesh.attention(q, k, v, softmax="off_by_one"))


# -- dropout ----------------------------------------------------------------------------------

def test_dropout_seed_forms_and_training_switch():
    qkv = _qkv(seed=21)
    key = jax.random.PRNGKey(3)  # raw uint32 [2]
    want = flashmesh.attention(*qkv, dropout_rate=0.3, dropout_rng=key)
    for seed in (key, jax.random.wrap_key_data(key), jnp.stack([key, key + 1]),
                 jax.random.wrap_key_data(jnp.stack([key, key + 1]))):
        _close(_fused(qkv, seed=seed, dropout=0.3), want)
    other = _fused(qkv, seed=jax.random.PRNGKey(4), dropout=0.3)
    assert not np.allclose(np.asarray(other), np.asarray(want))
    _close(_fused(qkv, seed=key, dropout=0.3, training=False), _fused(qkv))
    with pytest.raises(ValueError, match="needs a seed"):
        _fused(qkv, dropout=0.3)


def _dp_tp_mesh():
    return jax.make_mesh((4, 2), ("dp", "tp"), devices=jax.devices()[:8])


def _shard_map(f, mesh, spec, check_vma=True):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=check_vma))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest fakes 8 CPUs)")
@pytest.mark.parametrize("check_vma", [True, False])
def test_dropout_seed_is_per_shard_inside_shard_map(check_vma):
    """TransformerEngine seeds every device; flashmesh's hash sees local indices, so inside
    shard_map the key folds in the shard's index over the axes the data is sharded on."""
    mesh, key = _dp_tp_mesh(), jax.random.PRNGKey(5)  # a raw key, as TransformerEngine's
    q = np.broadcast_to(np.asarray(_normal(40, (1, T, 1, D))), (4, T, 2, D))  # identical shards
    spec = P("dp", None, "tp")
    x = jax.device_put(q, jax.NamedSharding(mesh, spec))
    got = np.asarray(_shard_map(lambda x: _fused((x, x, x), seed=key, dropout=0.5), mesh, spec,
                                check_vma)(x))
    for b in range(4):
        for h in range(2):
            local = q[b:b + 1, :, h:h + 1]
            shard_key = jax.random.fold_in(jax.random.wrap_key_data(key), 2 * b + h)
            want = flashmesh.attention(local, local, local, dropout_rate=0.5, dropout_rng=shard_key)
            _close(got[b:b + 1, :, h:h + 1], want)
    assert not np.allclose(got[0], got[1])


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest fakes 8 CPUs)")
def test_dropout_replicas_keep_one_seed_and_jit_uses_global_indices():
    """Data replicated over "tp" keeps one mask there (shard_map's check_vma would refuse the
    replicated out_specs otherwise); under plain jit the call is global and needs no fold."""
    mesh, key = _dp_tp_mesh(), jax.random.key(6)
    q = np.asarray(_normal(41, (4, T, N, D)))
    spec = P("dp")
    x = jax.device_put(q, jax.NamedSharding(mesh, spec))
    got = np.asarray(_shard_map(lambda x: _fused((x, x, x), seed=key, dropout=0.5), mesh, spec)(x))
    for b in range(4):
        local = q[b:b + 1]
        _close(got[b:b + 1], flashmesh.attention(local, local, local, dropout_rate=0.5,
                                                 dropout_rng=jax.random.fold_in(key, b)))
    global_ = jax.jit(lambda x: _fused((x, x, x), seed=key, dropout=0.5))(x)
    _close(global_, flashmesh.attention(q, q, q, dropout_rate=0.5, dropout_rng=key))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest fakes 8 CPUs)")
def test_module_dropout_differs_between_data_parallel_shards():
    mesh = _dp_tp_mesh()
    q = np.broadcast_to(np.asarray(_normal(42, (1, T, N, D))), (4, T, N, D))
    spec = P("dp")
    x = jax.device_put(q, jax.NamedSharding(mesh, spec))
    module = _module(num_gqa_groups=N, attention_dropout=0.5)

    def apply(x):
        return module.apply({}, x, x, x, rngs={"dropout": jax.random.key(1)})

    got = np.asarray(_shard_map(apply, mesh, spec)(x))
    assert not np.allclose(got[0], got[1])  # identical rows, one key: only the fold tells apart


# -- what is not mapped raises ----------------------------------------------------------------

def test_score_mod_raises():
    with pytest.raises(NotImplementedError, match="score_mod"):
        _fused(_qkv(), score_mod=lambda graph, score, tensors: score)


def test_bad_arguments_raise_value_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="qkv must be a tuple of 1 array\\(s\\) for qkv_layout=BS3HD, got a 3-tuple"):
        _fused((q, k, v), layout=QKVLayout.BS3HD)
    with pytest.raises(ValueError, match="bias must be None when attn_bias_type is NO_BIAS"):
        _fused((q, k, v), bias=jnp.zeros((1, N, T, T)))
    with pytest.raises(ValueError, match="POST_SCALE_BIAS needs a bias"):
        _fused((q, k, v), bias_type=AttnBiasType.POST_SCALE_BIAS)
    with pytest.raises(ValueError, match="softmax_offset shape \\(4,\\s?1\\)"):
        _fused((q, k, v), softmax=AttnSoftmaxType.LEARNABLE_SOFTMAX, softmax_offset=jnp.zeros((N, 1)))
    with pytest.raises(ValueError, match="softmax_offset is only used with LEARNABLE_SOFTMAX"):
        _fused((q, k, v), softmax_offset=jnp.zeros((1, N, 1, 1)))
    with pytest.raises(ValueError, match="sequence_descriptor must be a SequenceDescriptor"):
        _fused((q, k, v), AttnMaskType.PADDING_MASK, desc=jnp.zeros((B, 1, T, T), bool))
    with pytest.warns(UserWarning, match="max_segments_per_seq=2 only applies to THD layouts"):
        _fused((q, k, v), max_segments_per_seq=2)


# -- kernel availability ----------------------------------------------------------------------

TUTORIAL_CONFIG = (True, jnp.bfloat16, jnp.bfloat16, QKVLayout.BSHD_BSHD_BSHD, AttnBiasType.NO_BIAS,
                   AttnMaskType.CAUSAL_MASK, VANILLA, 0.0, 128, 8, 4096, 4096, 128, 128, (128, 0))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="answers for CPU")
def test_no_fused_kernel_on_cpu():
    assert is_fused_attn_kernel_available(*TUTORIAL_CONFIG) is False
    thd = (True, jnp.bfloat16, jnp.bfloat16, QKVLayout.THD_THD_THD, AttnBiasType.NO_BIAS,
           AttnMaskType.PADDING_CAUSAL_MASK, VANILLA, 0.0, 128, 8, 65536, 65536, 128, 128, (8192, 0))
    explanation = te.attention.fused_attn_explanation(*thd)
    assert explanation.reason("cudnn") is not None and explanation.chosen is not None


@pytest.mark.gpu
def test_fused_kernel_for_the_tutorial_shape_on_gpu():
    assert is_fused_attn_kernel_available(*TUTORIAL_CONFIG) is True
    # A sliding window: flashmesh's own kernel, measured faster than cuDNN there, is chosen.
    assert te.attention.fused_attn_explanation(*TUTORIAL_CONFIG).chosen == "pallas_mosaic_gpu"
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(t=256, s=256, n=8, k=2, dqk=64, dv=64))
    got = _fused((q, k, v), window_size=(32, 0), scale=64 ** -0.5)
    want = flashmesh.attention(q, k, v, window=(32, 0), implementation="reference")
    _close(got.astype(jnp.float32), want.astype(jnp.float32), atol=2e-2)


# -- flax DotProductAttention -----------------------------------------------------------------

def _module(**fields):
    return DotProductAttention(**{"head_dim": D, "num_attention_heads": N, "num_gqa_groups": K,
                                  **fields})


def test_module_gqa_window_matches_fused_attn():
    q, k, v = _qkv(seed=23)
    module = _module(window_size=(3, 0))
    variables = module.init(jax.random.key(0), q, k, v)
    assert variables == {}
    _close(module.apply(variables, q, k, v), _fused((q, k, v), window_size=(3, 0)))


def test_module_mla_head_dims():
    q, k, v = _qkv(dqk=D, dv=D // 2, seed=25)
    out = _module(attn_mask_type="no_mask").apply({}, q, k, v)
    assert out.shape == (B, T, N, D // 2)
    _close(out, flashmesh.attention(q, k, v, mask="none"))


def test_module_transpose_batch_sequence_and_packed_layouts():
    q, k, v = _qkv(k=N, seed=27)
    want = _module(num_gqa_groups=N).apply({}, q, k, v)
    sbhd = _module(num_gqa_groups=N, transpose_batch_sequence=True)
    got = sbhd.apply({}, *(jnp.swapaxes(x, 0, 1) for x in (q, k, v)))
    _close(jnp.swapaxes(got, 0, 1), want)
    packed = jnp.stack([q, k, v], axis=2)
    _close(_module(num_gqa_groups=N, qkv_layout="bs3hd").apply({}, packed, None, None), want)
    seq_packed = _module(num_gqa_groups=N, qkv_layout="bs3hd", transpose_batch_sequence=True)
    _close(jnp.swapaxes(seq_packed.apply({}, jnp.swapaxes(packed, 0, 1)), 0, 1), want)
    kv = jnp.stack([k, v], axis=2)
    _close(_module(num_gqa_groups=N, qkv_layout="bshd_bs2hd").apply({}, q, kv, None), want)


def test_module_bias_defaults_to_post_scale():
    q, k, v = _qkv(seed=29)
    bias = _normal(30, (1, N, T, T))
    got = _module(attn_mask_type="no_mask").apply({}, q, k, v, None, bias)
    _close(got, flashmesh.attention(q, k, v, mask="none", bias=bias))
    pre = _module(attn_mask_type="no_mask", attn_bias_type="pre_scale_bias").apply({}, q, k, v, None, bias)
    _close(pre, flashmesh.attention(q, k, v, mask="none", bias=bias * SCALE))


def test_module_learnable_softmax_param_gets_gradient():
    q, k, v = _qkv(seed=31)
    module = _module(softmax_type="learnable")
    boxed = module.init(jax.random.key(0), q, k, v)["params"]
    assert boxed["softmax_offset"].names == (None, "nvte_head", None, None)  # TE's logical axes
    params = nn.unbox(boxed)
    assert params["softmax_offset"].shape == (1, N, 1, 1)
    assert params["softmax_offset"].dtype == jnp.float32

    def loss(params):
        return jnp.sum(module.apply({"params": params}, q, k, v) ** 2)

    grad = jax.grad(loss)(params)["softmax_offset"]
    assert np.abs(np.asarray(grad)).min() > 0


def test_module_dropout_rng_stream():
    q, k, v = _qkv(seed=33)
    module = _module(attention_dropout=0.4)

    def run(key, **kw):
        return np.asarray(module.apply({}, q, k, v, rngs={"dropout": key}, **kw))

    a, b = run(jax.random.key(1)), run(jax.random.key(1))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, run(jax.random.key(2)))
    _close(run(jax.random.key(1), deterministic=True), _module().apply({}, q, k, v))
    named = _module(attention_dropout=0.4, dropout_rng_name="attn")
    np.testing.assert_array_equal(np.asarray(named.apply({}, q, k, v, rngs={"attn": jax.random.key(1)})), a)


def test_module_field_checks():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="query has 4 heads but num_attention_heads=8"):
        _module(num_attention_heads=8).apply({}, q, k, v)
    with pytest.raises(ValueError, match="key/value have 2 heads but num_gqa_groups=1"):
        _module(num_gqa_groups=1).apply({}, q, k, v)
    with pytest.raises(ValueError, match="head_dim=16"):
        _module(head_dim=16).apply({}, q, k, v)
    with pytest.raises(ValueError, match="dtype=bfloat16"):
        _module(dtype=jnp.bfloat16).apply({}, q, k, v)
    with pytest.raises(ValueError, match="context_parallel_strategy='diagonal'"):
        _module(context_parallel_strategy="diagonal").apply({}, q, k, v)


def test_padding_mask_without_descriptor_speaks_transformer_engine():
    """A padding mask type without a descriptor is refused in TransformerEngine's argument
    names, not in the native `mask=` / `segments=` it maps onto."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^attn_mask_type='padding' needs sequence_descriptor="):
        _module(attn_mask_type="padding").apply({}, q, k, v)
    with pytest.raises(ValueError, match=r"^attn_mask_type=AttnMaskType.PADDING_CAUSAL_MASK needs "
                                         r"sequence_descriptor="):
        _fused((q, k, v), AttnMaskType.PADDING_CAUSAL_MASK)
    with pytest.raises(ValueError, match=r"^attn_mask_type=AttnMaskType.PADDING_MASK needs "
                                         r"sequence_descriptor="):
        _fused((q, k, v), AttnMaskType.PADDING_MASK, QKVLayout.THD_THD_THD)


def test_module_padding_mask_with_descriptor_and_deprecated_mask_name():
    q, k, v = _qkv(seed=35)
    desc = SequenceDescriptor.from_seqlens(jnp.asarray([9, 5], jnp.int32))
    module = _module(attn_mask_type="padding_causal")
    want = flashmesh.attention(q, k, v, mask="padding_causal", segments=desc)
    _close(module.apply({}, q, k, v, desc), want)
    _close(module.apply({}, q, k, v, mask=desc), want)


def test_te_dot_product_attention_passes_reproducible(monkeypatch):
    """te.flax.DotProductAttention(reproducible=True), a flashmesh field: the call gets it."""
    import flashmesh.te.flax as te_flax
    from flashmesh.te import attention as te_attention

    seen, attention = [], te_attention.api.attention

    def recording(*args, **options):
        seen.append(options.get("reproducible"))
        return attention(*args, **options)

    monkeypatch.setattr(te_attention.api, "attention", recording)
    q = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16, 4, 8)), jnp.float32)
    for flag in (True, False):
        module = te_flax.DotProductAttention(head_dim=8, num_attention_heads=4, reproducible=flag)
        module.apply({}, q, q, q, deterministic=True)
    assert seen == [True, False]


def test_te_module_paths_and_fp8_availability():
    """TE's import paths for the Flax modules, and `is_fp8_available` as TE's examples call it."""
    from flashmesh.te.flax import module, transformer
    from flashmesh.te.quantize import ScalingMode, is_fp8_available

    assert transformer.TransformerLayer is te.flax.TransformerLayer
    assert transformer.MultiHeadAttention is te.flax.MultiHeadAttention
    assert module.LayerNormMLP is te.flax.LayerNormMLP
    assert is_fp8_available() == (True, "")  # per-tensor FP8: every platform (emulated on CPU)
    assert is_fp8_available(ScalingMode.CURRENT_TENSOR_SCALING)[0]
    for mode in (ScalingMode.MXFP8_1D_SCALING, ScalingMode.NVFP4_2D_SCALING):
        available, reason = is_fp8_available(mode)
        assert not available and "Blackwell" in reason
    with pytest.raises(ValueError, match="scaling_mode"):
        is_fp8_available("delayed")


def test_recipes_answer_te_predicates():
    from flashmesh.te.recipe import (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling,
                                     NVFP4BlockScaling, Recipe)

    delayed, current = DelayedScaling(), Float8CurrentScaling()
    assert isinstance(delayed, Recipe) and delayed.delayed() and not delayed.float8_current_scaling()
    assert current.float8_current_scaling() and current.float8_per_tensor_scaling()
    assert not current.delayed() and not current.mxfp8()
    assert MXFP8BlockScaling().mxfp8() and NVFP4BlockScaling().nvfp4()
    assert not any(r.float8_block_scaling() or r.custom() for r in (delayed, current))
