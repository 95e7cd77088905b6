"""The chunked backend inside `jax.shard_map` (check_vma on), forward and backward.

Under shard_map every value carries the mesh axes it varies along, and a loop's carry must keep
its type; the chunked loops start from constants, so they must be marked as varying like the
inputs. Each case of test_chunked.CASES runs on 2 fake CPU devices with its inputs stacked along
a sharded leading axis (everything varies), and must equal the reference on one device; other
tests mix replicated and sharded inputs, as data and context parallelism do.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import flashmesh
from flashmesh.attention import reference
from flashmesh.attention.sequence import SequenceDescriptor as SD

from test_chunked import CASES, _chunked, _close, _setup, _value_and_grads


def _mesh(n=2):
    return Mesh(np.array(jax.devices()[:n]), ("x",))


def _stacked(inputs, n=2):
    return jax.tree.map(lambda x: jnp.stack([x] * n), inputs)


@pytest.mark.parametrize("shape, options, blocks", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_chunked_case_under_shard_map(shape, options, blocks):
    with jax.enable_x64(True):
        inputs, spec = _setup(shape, options, jnp.float64)
        (want,) = _value_and_grads([reference.attention], inputs, spec)

        def per_shard(stacked):
            (got,) = _value_and_grads([_chunked(blocks)], jax.tree.map(lambda x: x[0], stacked), spec)
            return jax.tree.map(lambda x: x[None], got)

        f = jax.shard_map(per_shard, mesh=_mesh(), in_specs=P("x"), out_specs=P("x"))
        got = jax.jit(f)(_stacked(inputs))
        for name, expected in want.items():
            if expected is None:
                continue
            for shard in range(2):
                _close(f"{name}[{shard}]", got[name][shard], expected, 1e-11)


def test_replicated_q_with_sharded_seqlens():
    """The issue's reproducer: q replicated, seqlens sharded over the batch (mixed types)."""
    q, lens = jnp.ones((2, 8, 2, 4)), jnp.array([8, 5])

    def call(impl):
        return lambda q, l: flashmesh.attention(q, q, q, mask="padding", implementation=impl,
                                                segments=SD.from_seqlens(l))

    f = jax.shard_map(call("chunked"), mesh=_mesh(), in_specs=(P(), P("x")), out_specs=P("x"))
    got = jax.jit(f)(q[:1], lens)
    want = call("reference")(jnp.ones((2, 8, 2, 4)), lens)
    _close("out", got, want, 1e-6)


@pytest.mark.parametrize("mask, segments", [("none", None), ("padding_causal", "seqlens"),
                                            ("padding", "ids")])
def test_data_parallel_grad_under_shard_map(mask, segments):
    """Batch sharded over 2 devices, K/V replicated, several tiles (mask='none' and a
    descriptor): value and gradients of a loss equal the unsharded chunked call's."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((4, 40, 4, 8)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((1, 40, 2, 8)), jnp.float32)
    ids = jnp.asarray(np.repeat(np.array([[1, 2, 0, 0]]), 10, axis=1).repeat(4, 0))
    lens = jnp.array([40, 17, 3, 0])

    def loss(q, kv, ids, lens):
        seg = {None: None, "seqlens": SD.from_seqlens(lens), "ids": SD.from_segment_ids_and_pos(ids)}[segments]
        k = jnp.broadcast_to(kv, (q.shape[0],) + kv.shape[1:])
        out = flashmesh.attention(q, k, k, mask=mask, segments=seg, implementation="chunked")
        return jnp.sum(out ** 2)

    def per_shard(q, kv, ids, lens):
        value, grads = jax.value_and_grad(loss, (0, 1))(q, kv, ids, lens)
        # kv is replicated: its gradient is already summed over the shards (the transpose of
        # JAX's implicit cast of kv to varying), as for any replicated input under shard_map.
        return jax.lax.psum(value, "x"), grads[0], grads[1]

    f = jax.shard_map(per_shard, mesh=_mesh(), in_specs=(P("x"), P(), P("x"), P("x")),
                      out_specs=(P(), P("x"), P()))
    value, dq, dkv = jax.jit(f)(q, kv, ids, lens)
    want_value, (want_dq, want_dkv) = jax.value_and_grad(loss, (0, 1))(q, kv, ids, lens)
    _close("loss", value, want_value, 0.0, rtol=1e-5)
    _close("dq", dq, want_dq, 1e-5)
    _close("dkv", dkv, want_dkv, 1e-4)
