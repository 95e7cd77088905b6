"""flashmesh.te's context-parallel names map onto flashmesh.context_parallel_attention, exactly.

On 4 fake CPU devices, float32, small shapes. Each TransformerEngine name is checked against
the native call it maps to (the same arrays and options give the same bits) and against one
device (`flashmesh.attention`, implementation "reference"); the reorders against numpy
transcriptions of TransformerEngine's own definitions.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flashmesh
import flashmesh.te as te
import flashmesh.te.attention as te_attention
from flashmesh.parallel.context import context_parallel_attention
from flashmesh.te.attention import (AttnBiasType, AttnMaskType, AttnSoftmaxType, CPStrategy,
                                    QKVLayout, ReorderStrategy, SequenceDescriptor, fused_attn,
                                    inverse_reorder_causal_load_balancing,
                                    reorder_causal_load_balancing)
from flashmesh.te.context_parallel import ORDERS, STRATEGIES
from flashmesh.te.flax import DotProductAttention
from flashmesh.te.sharding import MeshResource, global_mesh_resource, global_shard_guard

CP = 4
B, T, N, K, D = 2, 32, 4, 2, 8
SCALE = D ** -0.5
SEQ = P(None, "cp", None, None)

pytestmark = pytest.mark.skipif(jax.device_count() < CP, reason="needs 4 devices (conftest fakes 8 CPUs)")


def _mesh(shape=(CP,), names=("cp",)):
    n = int(np.prod(shape))
    return Mesh(np.asarray(jax.devices()[:n]).reshape(shape), names)


def _qkv(seed=0, t=T, k=K):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (B, t, N, D)), jax.random.normal(keys[1], (B, t, k, D)),
            jax.random.normal(keys[2], (B, t, k, D)))


def _put(mesh, x, spec=SEQ):
    return jax.device_put(x, NamedSharding(mesh, P(*tuple(spec)[:x.ndim])))


def _fused(qkv, desc=None, mask=AttnMaskType.CAUSAL_MASK, layout=QKVLayout.BSHD_BSHD_BSHD,
           window=None, **cp):
    return fused_attn(qkv, None, desc, None, AttnBiasType.NO_BIAS, mask, layout,
                      AttnSoftmaxType.VANILLA_SOFTMAX, SCALE, 0.0, True,
                      max_segments_per_seq=4 if layout.is_thd() else 1, window_size=window, **cp)


def _close(got, want, atol=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    err = np.abs(got - want)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol,
                               err_msg=f"worst at {np.unravel_index(np.argmax(err), err.shape)}")


@pytest.fixture
def native_calls(monkeypatch):
    """The options of every native context-parallel call fused_attn / the module makes."""
    calls = []

    def spy(*arrays, **options):
        calls.append(options)
        return native(*arrays, **options)

    native = te_attention.context_parallel_attention
    monkeypatch.setattr(te_attention, "context_parallel_attention", spy)
    return calls


def _cp_keys(call):
    return {k: call[k] for k in ("axis", "strategy", "order", "stripe_size", "batch_axis", "head_axis")}


# -- the tables --------------------------------------------------------------------------------

def test_every_strategy_and_reorder_has_a_native_name():
    assert [m.name for m in CPStrategy] == ["DEFAULT", "ALL_GATHER", "RING"]
    assert STRATEGIES == {CPStrategy.DEFAULT: "auto", CPStrategy.ALL_GATHER: "all_gather",
                          CPStrategy.RING: "ring"}
    assert ORDERS == {ReorderStrategy.DualChunkSwap: "dual_chunk", ReorderStrategy.Striped: "striped"}
    assert te.attention.CPStrategy is CPStrategy and te.attention.ReorderStrategy is ReorderStrategy


def test_mesh_resource_has_transformer_engines_fields():
    names = [f.name for f in dataclasses.fields(MeshResource)]
    assert names == ["dp_resource", "tp_resource", "tpsp_resource", "fsdp_resource",
                     "pp_resource", "cp_resource", "ep_resource"]
    assert MeshResource() == MeshResource(*[None] * 7) and te.MeshResource is MeshResource
    assert MeshResource("dp", "tp").tp_resource == "tp"
    with pytest.raises(ValueError, match="cp_resource must be a mesh axis name"):
        MeshResource(cp_resource=4)


def test_autocast_installs_the_mesh_resource_and_restores_it():
    outer, inner = MeshResource(cp_resource="cp"), MeshResource(dp_resource="dp")
    with pytest.raises(RuntimeError, match="no MeshResource is set"):
        global_mesh_resource()
    with te.autocast(mesh_resource=outer):
        assert global_mesh_resource() is outer
        with te.autocast(enabled=False, recipe=None, mesh_resource=inner):
            assert global_mesh_resource() is inner
        with global_shard_guard(None):
            with pytest.raises(RuntimeError):
                global_mesh_resource()
        assert global_mesh_resource() is outer
    with pytest.raises(RuntimeError):
        global_mesh_resource()
    with pytest.raises(ValueError, match="mesh_resource must be a MeshResource"):
        with te.autocast(mesh_resource="cp"):
            pass


def test_autocast_sets_fp8_and_mesh_resource_together():
    from flashmesh.quantization import active_recipe
    from flashmesh.te.recipe import DelayedScaling, MXFP8BlockScaling
    from flashmesh.te.sharding import current_mesh_resource
    resource = MeshResource(cp_resource="cp")
    with te.autocast(enabled=True, mesh_resource=resource):
        assert active_recipe() == DelayedScaling()  # recipe=None means DelayedScaling, as in TE
        assert current_mesh_resource() is resource
    assert active_recipe() is None and current_mesh_resource() is None
    with pytest.raises(NotImplementedError, match="Blackwell"):
        with te.autocast(enabled=True, recipe=MXFP8BlockScaling()):
            pass


# -- reorders equal TransformerEngine's definitions ----------------------------------------------

def _te_dual_chunk_swap(x, cp, seq_dim, to_contiguous):
    """TransformerEngine's reorder_causal_dual_chunk_swap, transcribed to numpy."""
    if cp == 1:
        return x
    shape = x.shape
    x = x.reshape(*shape[:seq_dim], 2 * cp, shape[seq_dim] // (2 * cp), *shape[seq_dim + 1:])
    if not to_contiguous:
        parts = [np.take(x, [r, 2 * cp - r - 1], axis=seq_dim) for r in range(cp)]
    else:
        parts = [np.take(x, [4 * r, 4 * r + 2], axis=seq_dim) for r in range(cp // 2)]
        parts += [np.take(x, [2 * cp - 1 - 4 * r, 2 * cp - 3 - 4 * r], axis=seq_dim)
                  for r in range(cp // 2)]
    return np.stack(parts, axis=seq_dim).reshape(shape)


def _te_striped(x, cp, seq_dim, is_inverse, stripe_size=1):
    """TransformerEngine's reorder_causal_striped, transcribed to numpy."""
    shape, n = x.shape, x.shape[seq_dim] // (cp * stripe_size)
    mid = (cp, n, stripe_size) if is_inverse else (n, cp, stripe_size)
    y = x.reshape(*shape[:seq_dim], *mid, *shape[seq_dim + 1:])
    return np.swapaxes(y, seq_dim, seq_dim + 1).reshape(shape)


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize("shape,seq_dim", [((3, 32, 8, 4), 1), ((32, 3, 2), 0), ((1, 16, 1, 1), 1),
                                           ((2, 32), 1)])
def test_reorders_equal_transformer_engines(cp, shape, seq_dim):
    x = np.random.default_rng(cp).standard_normal(shape).astype(np.float32)
    ids = np.arange(np.prod(shape), dtype=np.int32).reshape(shape)  # ids/positions too
    cases = [(ReorderStrategy.DualChunkSwap, None, lambda a, inv: _te_dual_chunk_swap(a, cp, seq_dim, inv))]
    for ss in (None, 1, 2, 4):
        if shape[seq_dim] % (cp * (ss or 1)) == 0:
            cases.append((ReorderStrategy.Striped, ss,
                          lambda a, inv, ss=ss: _te_striped(a, cp, seq_dim, inv, ss or 1)))
    for strategy, ss, te_def in cases:
        if strategy == ReorderStrategy.DualChunkSwap and cp > 1 and shape[seq_dim] % (2 * cp):
            continue
        for a in (x, ids):  # numpy arrays (the same code as jax arrays, without a compile each)
            got = reorder_causal_load_balancing(a, strategy, cp, seq_dim, stripe_size=ss)
            np.testing.assert_array_equal(np.asarray(got), te_def(a, False))
            assert got.dtype == a.dtype
            back = inverse_reorder_causal_load_balancing(got, strategy, cp, seq_dim, stripe_size=ss)
            np.testing.assert_array_equal(np.asarray(back), a)
            np.testing.assert_array_equal(np.asarray(back), te_def(te_def(a, False), True))


def test_reorder_examples_and_errors():
    x = jnp.arange(16)[None]
    for strategy, ss in ((ReorderStrategy.DualChunkSwap, None), (ReorderStrategy.Striped, 2)):
        y = reorder_causal_load_balancing(x, strategy, 4, 1, stripe_size=ss)
        assert isinstance(y, jax.Array) and y.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(y), reorder_causal_load_balancing(
            np.asarray(x), strategy, 4, 1, stripe_size=ss))
    dual = reorder_causal_load_balancing(x, ReorderStrategy.DualChunkSwap, 4, 1)
    np.testing.assert_array_equal(np.asarray(dual).reshape(4, 4)[:2], [[0, 1, 14, 15], [2, 3, 12, 13]])
    striped = reorder_causal_load_balancing(x, ReorderStrategy.Striped, 4, 1)
    np.testing.assert_array_equal(np.asarray(striped).reshape(4, 4)[0], [0, 4, 8, 12])
    with pytest.raises(ValueError, match="dual chunk reordering stripe_size=2"):
        reorder_causal_load_balancing(x, ReorderStrategy.DualChunkSwap, 4, 1, stripe_size=2)
    with pytest.raises(ValueError, match="stripe_size must be a positive int"):
        inverse_reorder_causal_load_balancing(x, ReorderStrategy.Striped, 4, 1, stripe_size=0)
    with pytest.raises(ValueError, match="must be a ReorderStrategy"):
        reorder_causal_load_balancing(x, "striped", 4, 1)
    with pytest.raises(ValueError, match="must be a multiple of stripe_size"):
        reorder_causal_load_balancing(x, ReorderStrategy.Striped, 4, 1, stripe_size=8)


# -- fused_attn's arguments select the native call ------------------------------------------------

@pytest.mark.parametrize("strategy", list(CPStrategy))
def test_strategies_on_dual_chunk_bshd(strategy, native_calls):
    """load balanced + no stripe_size = DualChunkSwap = order "dual_chunk"; every CPStrategy
    gives the native call with its strategy, and one device's result."""
    mesh, qkv = _mesh(), _qkv(1)
    stored = tuple(_put(mesh, reorder_causal_load_balancing(x, ReorderStrategy.DualChunkSwap, CP, 1))
                   for x in qkv)
    cp = dict(context_parallel_strategy=strategy, context_parallel_causal_load_balanced=True,
              context_parallel_axis="cp")
    with jax.set_mesh(mesh):
        got = jax.jit(lambda qkv: _fused(qkv, **cp))(stored)
        want = jax.jit(lambda qkv: context_parallel_attention(
            *qkv, axis="cp", strategy=STRATEGIES[strategy], order="dual_chunk", mask="causal",
            scale=SCALE))(stored)
    assert [_cp_keys(c) for c in native_calls] == [dict(
        axis="cp", strategy=STRATEGIES[strategy], order="dual_chunk", stripe_size=None,
        batch_axis=None, head_axis=None)]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding.spec == SEQ
    one = flashmesh.attention(*qkv, mask="causal", implementation="reference")
    _close(inverse_reorder_causal_load_balancing(got, ReorderStrategy.DualChunkSwap, CP, 1), one)


def _packed(t=T):
    """Segment ids/positions as TransformerEngine's tutorial packs them: 4 slots per row of
    3/4 valid tokens then padding, positions counting on through the padding."""
    slot = t // 4
    ids = np.concatenate([np.r_[np.full(3 * slot // 4, s + 1), np.zeros(slot // 4)] for s in range(4)])
    pos = np.tile(np.arange(slot), 4)
    return (jnp.asarray(np.tile(ids[None], (B, 1)), jnp.int32),
            jnp.asarray(np.tile(pos[None], (B, 1)), jnp.int32))


@pytest.mark.parametrize("strategy,stripe", [(CPStrategy.RING, 1), (CPStrategy.ALL_GATHER, 2)])
def test_striped_thd_forward_and_gradients(strategy, stripe, native_calls):
    """The tutorial's configuration, small: THD, GQA, padded segments, causal window, Striped."""
    mesh, qkv, (ids, pos) = _mesh(), _qkv(2), _packed()
    ro = lambda x: reorder_causal_load_balancing(x, ReorderStrategy.Striped, CP, 1, stripe_size=stripe)
    inv = lambda x: inverse_reorder_causal_load_balancing(x, ReorderStrategy.Striped, CP, 1, stripe_size=stripe)
    stored = tuple(_put(mesh, ro(x)) for x in qkv)
    desc = jax.tree.map(lambda x: _put(mesh, x), SequenceDescriptor.from_segment_ids_and_pos(ro(ids), ro(pos)))
    dout = _put(mesh, ro(jax.random.normal(jax.random.key(9), qkv[0].shape)))
    cp = dict(context_parallel_strategy=strategy, context_parallel_causal_load_balanced=True,
              context_parallel_axis="cp", stripe_size=stripe)
    options = dict(mask=AttnMaskType.PADDING_CAUSAL_MASK, layout=QKVLayout.THD_THD_THD, window=(5, 0))

    def loss(qkv, desc, dout, f):
        return jnp.vdot(f(qkv, desc), dout)

    with jax.set_mesh(mesh):
        got, got_grads = jax.jit(jax.value_and_grad(loss), static_argnums=3)(
            stored, desc, dout, lambda qkv, d: _fused(qkv, d, **options, **cp))
        out = jax.jit(lambda qkv, d: _fused(qkv, d, **options, **cp))(stored, desc)
    assert _cp_keys(native_calls[0]) == dict(axis="cp", strategy=STRATEGIES[strategy], order="striped",
                                             stripe_size=stripe, batch_axis=None, head_axis=None)
    with jax.set_mesh(mesh):
        native = jax.jit(lambda qkv, d: context_parallel_attention(
            *qkv, **{k: native_calls[0][k] for k in ("axis", "strategy", "order", "stripe_size")},
            mask="padding_causal", window=(5, 0), segments=dataclasses.replace(d, max_segments=4),
            scale=SCALE, layout="thd_thd_thd"))(stored, desc)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(native))

    one_desc = SequenceDescriptor.from_segment_ids_and_pos(ids, pos)
    one = lambda *qkv: flashmesh.attention(*qkv, mask="padding_causal", window=(5, 0), segments=one_desc,
                                           layout="thd_thd_thd", implementation="reference")
    want, vjp = jax.vjp(one, *qkv)
    _close(inv(out), want)
    assert not np.asarray(inv(out))[np.asarray(ids) == 0].any()  # padded rows are exactly 0
    _close(got, jnp.vdot(want, inv(dout)), atol=1e-4)
    for g, w in zip(got_grads, vjp(inv(dout))):
        _close(inv(g), w)


def test_unbalanced_is_contiguous(native_calls):
    mesh, qkv = _mesh(), _qkv(3)
    stored = tuple(_put(mesh, x) for x in qkv)
    with jax.set_mesh(mesh):
        got = jax.jit(lambda qkv: _fused(qkv, context_parallel_axis="cp",
                                         context_parallel_strategy=CPStrategy.RING))(stored)
    assert _cp_keys(native_calls[0])["order"] == "contiguous"
    _close(got, flashmesh.attention(*qkv, mask="causal", implementation="reference"))


def test_options_transformer_engine_refuses_under_cp_are_computed():
    """TransformerEngine's CP refuses bias, dropout, sinks and packed QKV; the native call
    keeps them, with one device's meaning (dropout: the same mask for the same key)."""
    mesh, (q, _, _) = _mesh(), _qkv(11, k=N)
    bias = jax.random.normal(jax.random.key(12), (1, N, T, T))
    offset, key = jnp.linspace(-1.0, 1.0, N).reshape(1, N, 1, 1), jax.random.key(13)
    stored = _put(mesh, jnp.stack([q, q, q], axis=2), P(None, "cp"))

    def f(qkv, bias):
        return fused_attn((qkv,), bias, None, key, AttnBiasType.POST_SCALE_BIAS,
                          AttnMaskType.CAUSAL_MASK, QKVLayout.BS3HD, AttnSoftmaxType.LEARNABLE_SOFTMAX,
                          SCALE, 0.25, True, context_parallel_axis="cp", softmax_offset=offset)

    with jax.set_mesh(mesh):
        got = jax.jit(f)(stored, _put(mesh, bias, P(None, None, "cp")))
    want = flashmesh.attention(q, q, q, mask="causal", bias=bias, softmax="learnable",
                               sink=offset.reshape(N), dropout_rate=0.25, dropout_rng=key,
                               implementation="reference")
    _close(got, want)


# -- MeshResource and te.autocast ---------------------------------------------------------------

def test_cp_resource_of_autocast_is_the_axis_when_none_is_given(native_calls):
    mesh, qkv = _mesh(), _qkv(4)
    stored = tuple(_put(mesh, x) for x in qkv)
    with jax.set_mesh(mesh):
        single = jax.jit(lambda qkv: _fused(qkv))(stored)  # no axis, no MeshResource: one device
        assert native_calls == []
        with te.autocast(mesh_resource=MeshResource(cp_resource="cp")):
            got = jax.jit(lambda qkv: _fused(qkv))(stored)
    assert [c["axis"] for c in native_calls] == ["cp"]
    want = flashmesh.attention(*qkv, mask="causal", implementation="reference")
    _close(got, want)
    _close(single, want)


@pytest.mark.parametrize("shape,names,resource,axes", [
    ((2, 2), ("dp", "cp"), MeshResource(dp_resource="dp", cp_resource="cp"), ("dp", None)),
    ((1, 2, 2), ("dp", "fsdp", "cp"), MeshResource(dp_resource="dp", fsdp_resource="fsdp",
                                                   cp_resource="cp"), ("fsdp", None)),
    ((2, 2), ("cp", "tp"), MeshResource(tp_resource="tp", cp_resource="cp"), (None, "tp")),
    ((2, 1, 2), ("cp", "tp", "tpsp"), MeshResource(tp_resource="tp", tpsp_resource="tpsp",
                                                   cp_resource="cp"), (None, "tpsp")),
])
def test_batch_and_head_axes_come_from_the_mesh_resource(shape, names, resource, axes, native_calls):
    """fsdp if active else dp shards the batch, tpsp if active else tp the heads (TE's rules;
    "active": of size > 1)."""
    mesh, (batch, head), qkv = _mesh(shape, names), axes, _qkv(5)
    spec = P(batch, "cp", head, None)
    cp = mesh.shape["cp"]
    stored = tuple(_put(mesh, reorder_causal_load_balancing(x, ReorderStrategy.DualChunkSwap, cp, 1), spec)
                   for x in qkv)
    with jax.set_mesh(mesh), te.autocast(mesh_resource=resource):
        got = jax.jit(lambda qkv: _fused(qkv, context_parallel_causal_load_balanced=True))(stored)
    assert _cp_keys(native_calls[0]) == dict(axis="cp", strategy="auto", order="dual_chunk",
                                             stripe_size=None, batch_axis=batch, head_axis=head)
    _close(inverse_reorder_causal_load_balancing(got, ReorderStrategy.DualChunkSwap, cp, 1),
           flashmesh.attention(*qkv, mask="causal", implementation="reference"))


def test_one_device_when_the_axis_is_absent_or_of_size_one(native_calls):
    qkv = _qkv(6)
    want = flashmesh.attention(*qkv, mask="causal", implementation="reference")
    _close(_fused(qkv, context_parallel_axis="cp", context_parallel_causal_load_balanced=True,
                  context_parallel_strategy=CPStrategy.RING, stripe_size=1), want)  # no mesh
    with jax.set_mesh(_mesh((1, 4), ("cp", "dp"))):
        _close(jax.jit(lambda qkv: _fused(qkv, context_parallel_axis="cp",
                                          context_parallel_causal_load_balanced=True))(qkv), want)
    assert native_calls == []


# -- DotProductAttention's fields -----------------------------------------------------------------

@pytest.mark.parametrize("transpose", [False, True])
def test_dot_product_attention_fields(transpose, native_calls):
    mesh, qkv = _mesh(), _qkv(7)
    ro = lambda x: reorder_causal_load_balancing(x, ReorderStrategy.DualChunkSwap, CP, 1)
    module = DotProductAttention(head_dim=D, num_attention_heads=N, num_gqa_groups=K,
                                 attn_mask_type="causal", window_size=(6, 0),
                                 transpose_batch_sequence=transpose,
                                 context_parallel_strategy="allgather",
                                 context_parallel_causal_load_balanced=True,
                                 context_parallel_axis="cp")
    swap = (lambda x: jnp.swapaxes(x, 0, 1)) if transpose else (lambda x: x)
    spec = P("cp", None, None, None) if transpose else SEQ
    stored = tuple(_put(mesh, swap(ro(x)), spec) for x in qkv)
    with jax.set_mesh(mesh):
        got = jax.jit(lambda qkv: module.apply({}, *qkv))(stored)
    assert _cp_keys(native_calls[0]) == dict(axis="cp", strategy="all_gather", order="dual_chunk",
                                             stripe_size=None, batch_axis=None, head_axis=None)
    want = flashmesh.attention(*qkv, mask="causal", window=(6, 0), implementation="reference")
    _close(inverse_reorder_causal_load_balancing(swap(got), ReorderStrategy.DualChunkSwap, CP, 1), want)


# -- what cannot be mapped, and mistakes ---------------------------------------------------------

def test_inside_shard_map_the_cp_axis_is_not_mapped():
    mesh, qkv = _mesh(), _qkv(8)
    f = jax.shard_map(lambda q, k, v: _fused((q, k, v), context_parallel_axis="cp"), mesh=mesh,
                      in_specs=SEQ, out_specs=SEQ)
    with pytest.raises(NotImplementedError, match="inside shard_map"):
        jax.jit(f)(*qkv)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest fakes 8 CPUs)")
def test_batch_over_both_dp_and_fsdp_is_not_mapped():
    resource, qkv = MeshResource(dp_resource="dp", fsdp_resource="fsdp", cp_resource="cp"), _qkv(9)
    with jax.set_mesh(_mesh((2, 2, 2), ("dp", "fsdp", "cp"))), te.autocast(mesh_resource=resource):
        with pytest.raises(NotImplementedError, match="both dp_resource='dp' and fsdp_resource='fsdp'"):
            _fused(qkv)


def test_mistakes_raise_value_errors():
    qkv = _qkv(10)
    with jax.set_mesh(_mesh()):
        with pytest.raises(ValueError, match="context_parallel_axis='seq' is not an axis of the mesh"):
            _fused(qkv, context_parallel_axis="seq")
        with te.autocast(mesh_resource=MeshResource(cp_resource="context")):
            with pytest.raises(ValueError, match="MeshResource.cp_resource='context' is not an axis"):
                _fused(qkv)
        with te.autocast(mesh_resource=MeshResource(dp_resource="data", cp_resource="cp")):
            with pytest.raises(ValueError, match="MeshResource.dp_resource='data' is not an axis"):
                _fused(qkv)
        with pytest.raises(ValueError, match="qkv_layout=THD_THD_THD needs the stripe_size"):
            ids, pos = _packed()
            _fused(qkv, SequenceDescriptor.from_segment_ids_and_pos(ids, pos),
                   mask=AttnMaskType.PADDING_CAUSAL_MASK, layout=QKVLayout.THD_THD_THD,
                   context_parallel_axis="cp", context_parallel_causal_load_balanced=True)
        with pytest.raises(ValueError, match="THD_THD_THD needs the stripe_size"):
            DotProductAttention(head_dim=D, num_attention_heads=N, qkv_layout="thd_thd_thd",
                                attn_mask_type="padding_causal", context_parallel_axis="cp",
                                context_parallel_causal_load_balanced=True).apply(
                {}, *qkv, sequence_descriptor=SequenceDescriptor.from_segment_ids_and_pos(*_packed()))
    with pytest.raises(ValueError, match="context_parallel_strategy='zigzag'"):
        _fused(qkv, context_parallel_strategy="zigzag")
    with pytest.raises(ValueError, match="context_parallel_causal_load_balanced must be a bool"):
        _fused(qkv, context_parallel_causal_load_balanced="yes")
    with pytest.raises(ValueError, match="stripe_size must be a positive int"):
        _fused(qkv, stripe_size=0)
    with pytest.raises(ValueError, match="context_parallel_axis must be a mesh axis name"):
        _fused(qkv, context_parallel_axis=None)
    if jax.device_count() >= 8:
        resource = MeshResource(tp_resource="tp", tpsp_resource="tpsp", cp_resource="cp")
        with jax.set_mesh(_mesh((2, 2, 2), ("tp", "tpsp", "cp"))), te.autocast(mesh_resource=resource):
            with pytest.raises(ValueError, match="cannot both be active"):
                _fused(qkv)
        with jax.set_mesh(_mesh((2, 2), ("dp", "cp"))), te.autocast(
                mesh_resource=MeshResource(dp_resource="cp", cp_resource="cp")):
            with pytest.raises(ValueError, match="batch axis 'cp' of the MeshResource is also"):
                _fused(qkv)
