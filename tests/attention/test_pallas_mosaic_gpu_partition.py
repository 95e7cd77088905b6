"""The Mosaic GPU kernels in a program over several (fake CPU) devices, in the interpreter: the
call splits over batch and heads (custom_partitioning on an Auto mesh, shard_map on an Explicit
one) and equals the one-device call, forward and gradients, with GQA, a learnable sink, a
broadcast bias, dropout and packed segments."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from flashmesh.attention import pallas_mosaic_gpu
from flashmesh.attention import pallas_mosaic_gpu_partition as partition
from flashmesh.attention import pallas_mosaic_gpu_sm90_bwd as bwd
from flashmesh.attention.api import normalize
from flashmesh.attention.pallas_mosaic_gpu_common import BlockSizes
from flashmesh.attention.sequence import SequenceDescriptor

B, T, N, K, D = 4, 64, 4, 2, 64
FWD = BlockSizes(block_q=64, block_kv=64, num_stages=2, num_compute_wgs=1)
BACK = bwd.BackwardBlockSizes(block_q=64, block_kv=64, block_q_dq=64, block_kv_dq=64, num_stages=2,
                              num_compute_wgs=1)


def _mesh(kind):
    return jax.make_mesh((2, 2), ("data", "model"), axis_types=(getattr(AxisType, kind),) * 2)


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-6))


def test_splits_follow_q_and_keep_gqa_groups_whole():
    mesh = _mesh("Auto")
    spec = normalize(*(jnp.zeros((B, T, n, D), jnp.bfloat16) for n in (N, K, K)))[1]
    assert partition.splits(spec, mesh, P("data", None, "model")) == (("data",), ("model",))
    mqa = dataclasses.replace(spec, num_kv_heads=1)
    assert partition.splits(mqa, mesh, P("data", None, "model")) == (("data",), ())
    odd = dataclasses.replace(spec, batch=3)
    assert partition.splits(odd, mesh, P(("data", "model"))) == ((), ())
    assert partition._spec("bias", (1, N, T, T), ("data",), ("model",)) == P(None, "model", None, None)
    assert partition._rule(("q", "kv", "bias"), ("q", "rows"),
                           [jax.ShapeDtypeStruct(s, jnp.float32) for s in
                            ((B, T, N, D), (B, T, K, D), (1, N, T, T))],
                           [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((B, T, N, D), (B, N, T))]) \
        == "b u0 h u1, b u2 k u3, u4 h u5 u6 -> b u7 h u8, b h u9"


def _reference_calls():
    """Stand-ins for the kernel calls with the same operands, roles and results: the reference's
    forward (out, lse) and its VJP (dq, dk, dv, dsink, dbias), on the spec they are given (the
    Mosaic GPU interpreter cannot run on several devices at once)."""
    from flashmesh.attention import reference
    from flashmesh.attention.spec import AttentionInputs

    def inputs(q, k, v, sink, bias, tables):
        return AttentionInputs(q=q, k=k, v=v, sink=sink, bias=bias, q_segment_ids=tables[0],
                               kv_segment_ids=tables[1], q_positions=tables[2], kv_positions=tables[3])

    def forward(local, q, k, v, sink, bias, hash_, *tables):
        return reference.attention(inputs(q, k, v, sink, bias, tables), local)

    def backward(local, q, k, v, out, lse, d_out, sink, d_lse, hash_, bias, *tables):
        f = lambda q, k, v, sink, bias: reference.attention(inputs(q, k, v, sink, bias, tables), local)
        _, pull = jax.vjp(f, q, k, v, sink, bias)
        return pull((d_out, d_lse))

    return forward, backward


FWD_ROLES = ("q", "kv", "kv", "heads", "bias", "rows") + ("tokens",) * 4
BWD_ROLES = ("q", "kv", "kv", "q", "rows", "q", "heads", "rows", "rows", "bias") + ("tokens",) * 4


@pytest.mark.parametrize("kind", ["Auto", "Explicit"])
def test_split_calls_equal_one_device(kind):
    """`partition.run` as the kernels' calls use it, on a (data, model) mesh: the forward and the
    backward (the sink's gradient and a bias broadcast over the batch summed over the shards)
    equal the unsplit calls; GQA, a learnable sink, packed segments with positions."""
    keys = jax.random.split(jax.random.key(0), 8)
    normal = lambda i, shape: jax.random.normal(keys[i], shape, jnp.float32)
    q, k, v = normal(0, (B, T, N, D)), normal(1, (B, T, K, D)), normal(2, (B, T, K, D))
    bias, sink = normal(3, (1, N, T, T)), normal(4, (N,))
    segments = jnp.asarray([[1] * 40 + [2] * 24, [1] * 64, [1] * 10 + [2] * 30 + [0] * 24,
                            [3] * 64], jnp.int32)
    positions = jnp.tile(jnp.arange(T, dtype=jnp.int32)[None], (B, 1))
    tables = (segments, segments, positions, positions)
    inputs, spec = normalize(q, k, v, bias=bias, mask="causal", softmax="learnable", sink=sink,
                             segments=SequenceDescriptor.from_segment_ids_and_pos(segments, positions))
    forward, backward = _reference_calls()
    out, lse = forward(spec, q, k, v, sink, bias, None, *tables)
    d_out, d_lse = normal(5, out.shape), normal(6, lse.shape)
    bwd_args = (q, k, v, out, lse, d_out, sink, d_lse, None, bias, *tables)
    want = (out, lse) + tuple(backward(spec, *bwd_args))

    seen = set()  # (batch, heads, q's shape) of each traced call

    def traced(fn):
        def call(local, q, *rest):
            seen.add((local.batch, local.num_heads, q.shape))
            return fn(local, q, *rest)
        return call

    def both(*args):
        fwd = partition.run(traced(forward), spec, (*args[:5], None, *args[5:]), FWD_ROLES, ("q", "rows"))
        q, k, v, sink, bias, *tabs = args
        grads = partition.run(traced(backward), spec, (q, k, v, *fwd, d_out, sink, d_lse, None, bias, *tabs),
                              BWD_ROLES, ("q", "kv", "kv", "heads", "bias"))
        return (*fwd, *grads)

    mesh = _mesh(kind)
    specs = (P("data", None, "model"),) * 3 + (P("model"), P(None, "model")) + (P("data"),) * 4
    with jax.set_mesh(mesh):
        placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in
                  zip((q, k, v, sink, bias, *tables), specs)]
        got = jax.jit(both)(*placed)
        hlo = jax.jit(both).lower(*placed).compile().as_text()
    assert "all-gather" not in hlo  # each device ran its own batch rows and heads
    assert (B // 2, N // 2, (B // 2, T, N // 2, D)) in seen, seen
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsink", "dbias"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5, err_msg=name)
    if kind == "Explicit":
        assert tuple(jax.typeof(got[0]).sharding.spec)[:3] == ("data", None, "model")
        assert jax.typeof(got[5]).sharding.spec == P("model")  # summed over the batch shards


def test_one_device_calls_run_directly():
    assert partition.multi_device() is None  # no mesh set, though the suite fakes 8 devices
    calls = []
    assert partition.run(lambda spec, x: calls.append(spec) or (x,), "spec", (jnp.ones(2),), ("q",), ("q",))
    assert calls == ["spec"]


def test_automatic_choice_waits_for_a_gpu_check_on_several_devices():
    q = jnp.zeros((B, T, N, D), jnp.bfloat16)
    spec = normalize(q, q, q, dropout_rate=0.1, dropout_rng=jax.random.key(0))[1]
    assert pallas_mosaic_gpu.automatic_reason(spec, "gpu", "NVIDIA H200") is None  # no mesh set
    for kind in ("Auto", "Explicit"):
        with jax.set_mesh(_mesh(kind)):
            reason = pallas_mosaic_gpu.automatic_reason(spec, "gpu", "NVIDIA H200")
        assert "several devices" in reason and "not yet run on GPUs" in reason


def test_no_mesh_set_runs_the_call_whole():
    """Several devices and inputs sharded, but no mesh set: the call runs whole (the traced call
    sees the whole batch and every head), as one device's program on that host does."""
    keys = jax.random.split(jax.random.key(3), 4)
    q, k, v = (jax.random.normal(keys[i], (B, T, n, D), jnp.float32) for i, n in enumerate((N, K, K)))
    sink = jax.random.normal(keys[3], (N,), jnp.float32)
    spec = normalize(q, k, v, mask="causal", softmax="learnable", sink=sink)[1]
    reference_forward, _ = _reference_calls()
    shapes = []

    def forward(local, q, *rest):
        shapes.append((local.batch, local.num_heads, q.shape))
        return reference_forward(local, q, *rest)

    def f(q, k, v, sink):
        return partition.run(forward, spec, (q, k, v, sink) + (None,) * 6, FWD_ROLES, ("q", "rows"))

    want = f(q, k, v, sink)
    mesh = _mesh("Auto")
    placed = [jax.device_put(a, NamedSharding(mesh, P("data", None, "model"))) for a in (q, k, v)]
    shapes.clear()
    got = jax.jit(f)(*placed, sink)
    assert shapes == [(B, N, (B, T, N, D))], shapes
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["Auto", "Explicit"])
def test_gpu_kernels_split_over_two_devices(kind):
    """On two Hopper GPUs (the H200 x2 kind): the registered path under a (data, model) mesh,
    dropout and GQA, equals one device's call, forward and gradients, with no all-gather."""
    if jax.device_count() < 2:
        pytest.skip("needs two GPUs")
    import flashmesh

    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (4, 512, 8, 128), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (4, 512, 2, 128), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (4, 512, 2, 128), jnp.float32).astype(jnp.bfloat16)
    g = jax.random.normal(keys[3], q.shape, jnp.float32)

    def loss(q, k, v):
        out = flashmesh.attention(q, k, v, mask="causal", dropout_rate=0.1, dropout_rng=jax.random.key(2),
                                  implementation="pallas_mosaic_gpu")
        return jnp.sum(out.astype(jnp.float32) * g), out

    (_, out_one), grads_one = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    mesh = jax.make_mesh((2, 1), ("data", "model"), axis_types=(getattr(AxisType, kind),) * 2,
                         devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        placed = [jax.device_put(a, NamedSharding(mesh, P("data", None, "model"))) for a in (q, k, v)]
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        (_, out), grads = step(*placed)
        assert "all-gather" not in step.lower(*placed).compile().as_text()
    assert _rel(out, out_one) < 1e-2
    for a, b in zip(grads, grads_one):
        assert _rel(a, b) < 1e-2


@pytest.mark.parametrize("kind", ["Auto", "Explicit"])
def test_vmap_of_split_calls(kind):
    """vmap over a leading axis under a mesh of Auto or Explicit axes: equal to the calls one
    by one, and still split: a traced call sees one
    shard's rows and heads (custom_partitioning has no batching rule: the mapped axis folds
    into the batch). With a sink whose gradient is per mapped element the backward runs whole,
    and equals the loop too."""
    keys = jax.random.split(jax.random.key(4), 5)
    q, k, v = (jax.random.normal(key, (2, B, T, n, D), jnp.float32) for key, n in zip(keys, (N, K, K)))
    sink, d_out = jax.random.normal(keys[3], (N,), jnp.float32), jax.random.normal(keys[4], q.shape, jnp.float32)
    spec = normalize(q[0], k[0], v[0], mask="causal", softmax="learnable", sink=sink)[1]
    forward, backward = _reference_calls()
    seen = set()

    def traced(local, q, *rest):
        seen.add((local.batch, local.num_heads, q.shape))
        return forward(local, q, *rest)

    def f(q, k, v, d_out):
        out, lse = partition.run(traced, spec, (q, k, v, sink) + (None,) * 6, FWD_ROLES, ("q", "rows"))
        no_bias = lambda *a: backward(*a)[:4]  # noqa: E731  (dq, dk, dv, dsink: no bias here)
        grads = partition.run(no_bias, spec, (q, k, v, out, lse, d_out, sink, jnp.zeros_like(lse), None, None)
                              + (None,) * 4, BWD_ROLES, ("q", "kv", "kv", "heads"))
        return (out, lse, *grads)

    want = [f(q[i], k[i], v[i], d_out[i]) for i in range(2)]
    mesh = _mesh(kind)
    with jax.set_mesh(mesh):
        placed = [jax.device_put(a, NamedSharding(mesh, P(None, "data", None, "model"))) for a in (q, k, v, d_out)]
        seen.clear()
        got = jax.jit(jax.vmap(f))(*placed)
    assert (B, N // 2, (B, T, N // 2, D)) in seen or (B // 2, N // 2, (B // 2, T, N // 2, D)) in seen, seen
    for i in range(2):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsink"), got, want[i]):
            np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b), rtol=2e-5, atol=2e-5, err_msg=name)


def test_interpreted_kernels_run_whole():
    """split=False (the kernels in the interpreter, one device's) runs fn itself, on the arrays
    given, even under a mesh (split=True there traces it inside custom_partitioning)."""
    for split, direct in ((False, True), (True, False)):
        calls = []
        with jax.set_mesh(_mesh("Auto")):
            partition.run(lambda spec, x: calls.append(not isinstance(x, jax.core.Tracer)) or (x,), "spec",
                          (jnp.ones((B, T, N, D)),), ("q",), ("q",), split=split)
        assert calls and all(c == direct for c in calls), (split, calls)
