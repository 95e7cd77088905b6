"""context_parallel_attention on fake CPU devices equals flashmesh.attention on one device.

For cp in {2, 4, 8}, every strategy and order, and masks from causal to packed documents that
cross shards: output, lse and gradients of q, k, v (and bias, sink) match the single-device
reference in float64; padded rows are exactly zero. `CONFIGURATIONS` reaches every mask kind,
head split and option (dropout, both sinks, soft cap, bias) at least once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import flashmesh
from flashmesh.parallel import layouts
from flashmesh.parallel.context import context_parallel_attention, explain

SD = flashmesh.SequenceDescriptor


def _mesh(cp):
    return Mesh(np.array(jax.devices()[:cp]), ("cp",))


def _segments(kind, rng, B, T):
    """A descriptor in original order, or None: padding lengths, or packed documents whose
    boundaries fall anywhere (crossing shards), with padding at the end of each row."""
    if kind is None:
        return None
    if kind == "seqlens":
        return SD.from_seqlens(jnp.asarray(rng.integers(0, T + 1, B), jnp.int32))
    ids = np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T), 3, replace=False))
        ids[b] = np.searchsorted(cuts, np.arange(T), side="right") + 1
        ids[b, T - int(rng.integers(0, T // 4)):] = 0
    return ids  # turned into a descriptor after reordering


def _run(cp, strategy, order, options, *, B=2, T=32, N=4, K=2, D=8, seed=0, stripe=None, grads=True):
    rng = np.random.default_rng(seed)
    with jax.enable_x64(True):
        q = jnp.asarray(rng.standard_normal((B, T, N, D)))
        k = jnp.asarray(rng.standard_normal((B, T, K, D)))
        v = jnp.asarray(rng.standard_normal((B, T, K, D)))
        opts = dict(options)
        ids = opts.pop("ids", None)
        extra = {}
        if opts.get("softmax") == "learnable":
            extra["sink"] = jnp.asarray(rng.standard_normal(N))
        if opts.pop("bias", False):
            extra["bias"] = jnp.asarray(rng.standard_normal((B, 1, T, T)))
        if opts.get("dropout_rate"):
            opts["dropout_rng"] = jax.random.key(3)
        R = lambda x, d=1: layouts.reorder_for_context_parallel(x, order, cp, d, stripe)
        I = lambda x, d=1: layouts.inverse_reorder_for_context_parallel(x, order, cp, d, stripe)

        def segs(reordered):
            if ids is None:
                return {}
            if isinstance(ids, SD):
                return dict(segments=ids)
            pos = np.concatenate([np.zeros((B, 1), np.int32), np.cumsum(ids[:, 1:] == ids[:, :-1], 1)], 1)
            run = np.zeros_like(ids)  # offset from the document start
            for b in range(B):
                start = 0
                for t in range(T):
                    if t and ids[b, t] != ids[b, t - 1]:
                        start = t
                    run[b, t] = t - start
            i, p = jnp.asarray(ids), jnp.asarray(run)
            if reordered:
                i, p = R(i), R(p)
            del pos
            return dict(segments=SD.from_segment_ids_and_pos(i, p))

        def one(q, k, v, *e):
            e = dict(zip(extra, e))
            return flashmesh.attention(q, k, v, implementation="reference", return_lse=True, **segs(False), **e, **opts)

        def many(q, k, v, *e):
            e = dict(zip(extra, e))
            if "bias" in e:
                e["bias"] = R(R(e["bias"], 2), 3)
            out, lse = context_parallel_attention(
                R(q), R(k), R(v), mesh=_mesh(cp), strategy=strategy, order=order, stripe_size=stripe,
                implementation="chunked", return_lse=True, **segs(True), **e, **opts)
            return I(out), I(lse, 2)

        args = (q, k, v, *extra.values())
        ct = jnp.asarray(rng.standard_normal((B, T, N, D)))

        def loss(f):  # one call of f per evaluation: out and lse from the same call
            def value(*a):
                out, lse = f(*a)
                return jnp.sum(out * ct) + jnp.sum(jnp.sin(lse) * 1e-3)
            return value

        want, got = one(*args), jax.jit(many)(*args)
        for name, a, b in zip(("out", "lse"), got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-10, err_msg=name)
        if grads:
            argnums = tuple(range(len(args)))
            gw = jax.grad(loss(one), argnums)(*args)
            gg = jax.jit(jax.grad(loss(many), argnums))(*args)
            for name, a, b in zip(("dq", "dk", "dv", *extra), gg, gw):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-8, atol=1e-9, err_msg=name)
        return got


STRATEGIES = ("ring", "all_gather", "all_to_all")
ORDERS = ("contiguous", "dual_chunk", "striped")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("order", ORDERS)
def test_causal_gqa_cp4(strategy, order):
    _run(4, strategy, order, dict(mask="causal"))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_packed_documents_crossing_shards(strategy):
    rng = np.random.default_rng(1)
    _run(4, strategy, "dual_chunk", dict(mask="padding_causal", ids=_segments("ids", rng, 2, 32)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_padding_rows_are_exactly_zero(strategy):
    lens = jnp.array([32, 0])
    out, _ = _run(2, strategy, "contiguous", dict(mask="padding_causal", ids=SD.from_seqlens(lens)), grads=False)
    assert (np.asarray(out)[1] == 0).all()


# Every mask kind, head split and option at least once, across the mesh sizes, strategies and
# orders (hypothesis with a fixed seed drew the same four cases every run and never reached
# dropout, the sinks or the soft cap).
CONFIGURATIONS = [
    (4, "ring", "dual_chunk", "window_narrow", (8, 2), dict(dropout_rate=0.3)),
    (8, "all_gather", "striped", "causal_bottom_right", (8, 1), dict(softmax="off_by_one")),
    (2, "all_to_all", "contiguous", "window_wide", (8, 8), dict(logits_soft_cap=2.0)),
    (4, "ring", "striped", "none", (8, 1), dict(bias=True)),
    (8, "ring", "contiguous", "packed", (8, 2), dict(softmax="learnable")),
    (2, "all_gather", "contiguous", "seqlens", (8, 8), dict(dropout_rate=0.3)),
    (4, "all_to_all", "dual_chunk", "causal", (8, 2), dict(dropout_rate=0.3, softmax="off_by_one")),
    (8, "all_to_all", "striped", "window_narrow", (8, 8), dict(softmax="learnable", logits_soft_cap=2.0)),
]


@pytest.mark.parametrize("cp, strategy, order, mask, heads, extra", CONFIGURATIONS,
                         ids=lambda x: x if isinstance(x, (str, int)) else None)
def test_configurations(cp, strategy, order, mask, heads, extra):
    seed = cp * 31 + len(mask)
    rng = np.random.default_rng(seed)
    T = 32
    options = {"causal": dict(mask="causal"), "none": dict(mask="none"),
               "window_narrow": dict(mask="causal", window=(2, 0)),  # narrower than a shard
               "window_wide": dict(mask="none", window=(20, 3)),
               "packed": dict(mask="padding_causal", ids=_segments("ids", rng, 2, T)),
               "seqlens": dict(mask="padding", ids=_segments("seqlens", rng, 2, T)),
               "causal_bottom_right": dict(mask="causal_bottom_right")}[mask]
    N, K = heads
    _run(cp, strategy, order, {**options, **extra}, N=N, K=K, T=T, seed=seed)


def test_explain_says_the_choice():
    x = jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 4096, 1, 64), jnp.bfloat16)
    narrow = explain(x, kv, kv, mesh=_mesh(8), mask="causal", window=(128, 0))
    assert narrow.strategy == "ring" and narrow.hops == (0, 1), str(narrow)
    mha = explain(x, x, x, mesh=_mesh(8), mask="causal")
    assert mha.strategy == "all_to_all", str(mha)
    assert "received per rank" in str(mha)
    # what the call runs or raises: heads split by a tensor axis are not split again
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("cp", "tp"))
    split = explain(x, x, x, mesh=mesh, mask="causal", head_axis="tp")
    assert split.strategy != "all_to_all", str(split)
    few = jax.ShapeDtypeStruct((1, 4096, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="needs num_heads per rank"):
        explain(few, few, few, mesh=_mesh(4), strategy="all_to_all")
    with pytest.raises(NotImplementedError, match="heads are already split"):
        explain(x, x, x, mesh=mesh, strategy="all_to_all", head_axis="tp")
    with pytest.raises(ValueError, match="head_axis='hp' is not an axis"):
        explain(x, x, x, mesh=mesh, head_axis="hp")


def test_hop_kinds_leave_causal_steps_to_any_implementation():
    """A causal document over 4 contiguous ranks: the own block runs the plain causal mask, the
    blocks before it unmasked, the ones after it not at all; none needs positions (so cuDNN can
    run every step); a narrow window needs positions only on its partial hop."""
    from flashmesh.parallel import schedule
    from flashmesh.parallel.ring import hop_kinds

    sched = schedule.static_schedule(4, "contiguous", 64, window=(-1, 0))
    kinds = hop_kinds(sched.counts, sched.ring_hops, "contiguous", (-1, 0), 64, 64, segments=False)
    assert kinds[0] == ("local",) * 4
    for d in range(1, 4):
        assert kinds[d] == tuple("empty" if r < d else "full" for r in range(4))
    dual = schedule.static_schedule(4, "dual_chunk", 64, window=(-1, 0))
    kinds = hop_kinds(dual.counts, dual.ring_hops, "dual_chunk", (-1, 0), 64, 64, segments=False)
    assert kinds[0] == ("local",) * 4  # positions rise within a rank: the local causal mask
    narrow = schedule.static_schedule(4, "contiguous", 64, window=(5, 0))
    kinds = hop_kinds(narrow.counts, narrow.ring_hops, "contiguous", (5, 0), 64, 64, segments=False)
    assert kinds == (("local",) * 4, ("empty", "positions", "positions", "positions"))


def test_explicit_mesh_eager_and_under_set_mesh():
    """jax.make_mesh gives Explicit axes: inputs are resharded to the call's layout, reorders
    keep their sharding, and jit under jax.set_mesh needs no mesh argument."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 64, 4, 8)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((1, 64, 2, 8)), jnp.float32)
    mesh = jax.make_mesh((4,), ("cp",))
    want = flashmesh.attention(q, kv, kv, mask="causal", implementation="reference")
    R = lambda x: flashmesh.reorder_for_context_parallel(x, "dual_chunk", 4)  # noqa: E731
    eager = context_parallel_attention(R(q), R(kv), R(kv), mesh=mesh, order="dual_chunk", mask="causal")
    with jax.set_mesh(mesh):
        jitted = jax.jit(lambda q, k, v: context_parallel_attention(q, k, v, order="dual_chunk", mask="causal"))(
            R(q), R(kv), R(kv))
    for got in (eager, jitted):
        got = flashmesh.inverse_reorder_for_context_parallel(got, "dual_chunk", 4)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy, order, opts", [
    ("ring", "dual_chunk", dict(mask="causal", window=(9, 0))),
    ("all_gather", "striped", dict(mask="causal", softmax="learnable")),
    ("all_to_all", "contiguous", dict(mask="none", bias=True)),
    # packed documents given per rank (ids and positions) with padding rows, which are exactly 0
    ("ring", "dual_chunk", dict(mask="padding_causal", segments=True, dropout_rate=0.3)),
    ("all_to_all", "striped", dict(mask="padding_causal", segments=True, window=(5, 0),
                                   softmax="off_by_one")),
    ("all_gather", "contiguous", dict(mask="causal_bottom_right", logits_soft_cap=2.0, dropout_rate=0.2)),
])
def test_per_shard_form_inside_users_shard_map(strategy, order, opts):
    """context_parallel_shard inside a user's shard_map equals one device, output and grads
    (dropout: the same elements dropped, the hash seeing global token numbers)."""
    from jax.sharding import PartitionSpec as P
    from flashmesh.parallel.shard import context_parallel_shard

    rng = np.random.default_rng(2)
    cp, B, T, N, K, D = 4, 2, 32, 4, 2, 8
    q = jnp.asarray(rng.standard_normal((B, T, N, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, T, K, D)), jnp.float32) for _ in range(2))
    opts = dict(opts)
    extra, specs = {}, {}
    if opts.pop("bias", False):
        extra["bias"], specs["bias"] = jnp.asarray(rng.standard_normal((B, N, T, T)), jnp.float32), P(None, None, "cp")
    if opts.get("softmax") == "learnable":
        extra["sink"], specs["sink"] = jnp.asarray(rng.standard_normal(N), jnp.float32), P()
    if opts.get("dropout_rate"):
        opts["dropout_rng"] = jax.random.key(5)
    R = lambda x, d=1: flashmesh.reorder_for_context_parallel(x, order, cp, d)  # noqa: E731
    ids = pos = None
    if opts.pop("segments", False):  # documents of 11 and 13 tokens, then 8 padding tokens
        ids = np.broadcast_to(np.array([1] * 11 + [2] * 13 + [0] * 8, np.int32), (B, T))
        pos = np.broadcast_to(np.concatenate([np.arange(11), np.arange(13), np.zeros(8)]).astype(np.int32), (B, T))
        ids, pos = jnp.asarray(ids), jnp.asarray(pos)

    def one(q, k, v, extra):
        segs = None if ids is None else SD.from_segment_ids_and_pos(ids, pos)
        return flashmesh.attention(q, k, v, implementation="reference", segments=segs, **extra, **opts)

    def sharded(q, k, v, extra):
        e = dict(extra)
        if "bias" in e:
            e["bias"] = R(R(e["bias"], 2), 3)
        tables = () if ids is None else (R(ids), R(pos))

        def per_rank(q, k, v, e, *tables):
            segs = SD.from_segment_ids_and_pos(*tables) if tables else None
            return context_parallel_shard(q, k, v, axis="cp", strategy=strategy, order=order,
                                          implementation="chunked", segments=segs, **e, **opts)

        f = jax.shard_map(per_rank, mesh=_mesh(cp),
                          in_specs=(P(None, "cp"),) * 3 + ({n: specs[n] for n in e},) + (P(None, "cp"),) * len(tables),
                          out_specs=P(None, "cp"))
        return flashmesh.inverse_reorder_for_context_parallel(f(R(q), R(k), R(v), e, *tables), order, cp)

    got = np.asarray(jax.jit(sharded)(q, k, v, extra))
    np.testing.assert_allclose(got, np.asarray(one(q, k, v, extra)), rtol=1e-5, atol=1e-5)
    if ids is not None:  # padding rows: exactly zero
        assert (got[:, 24:] == 0).all()
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    want = jax.grad(loss(one), (0, 1, 2, 3))(q, k, v, extra)
    got = jax.jit(jax.grad(loss(sharded), (0, 1, 2, 3)))(q, k, v, extra)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_documents_aligned_with_shards(strategy):
    """Tutorial 003's layout at CPU size: a document per shard, padding at each one's end; every
    step's positions are canonical, the case whose steps cuDNN can run on a GPU."""
    ids = np.repeat(np.array([[1] * 6 + [0] * 2 + [2] * 6 + [0] * 2 + [3] * 6 + [0] * 2 + [4] * 6 + [0] * 2]), 2, 0)
    _run(4, strategy, "contiguous", dict(mask="padding_causal", window=(4, 0), ids=ids.astype(np.int32)))


def test_positions_canonical():
    from flashmesh.parallel.steps import Side, positions_canonical

    ids = jnp.array([[1, 1, 1, 2, 2, 0, 0]])
    good = Side(ids, jnp.array([[0, 1, 2, 0, 1, 9, 9]]), jnp.arange(7))
    cut = Side(ids, jnp.array([[4, 5, 6, 0, 1, 0, 0]]), jnp.arange(7))  # a document cut on the left
    assert bool(positions_canonical(good)) and not bool(positions_canonical(cut))
