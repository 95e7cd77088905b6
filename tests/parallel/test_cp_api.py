"""The boundary of context_parallel_attention: bad input gets a one-line ValueError naming the
argument, and flashmesh.explain explains the call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flashmesh

MESH = Mesh(np.array(jax.devices()[:4]), ("cp",))
Q = jnp.ones((1, 32, 4, 8))
KV = jnp.ones((1, 32, 2, 8))


def _call(q=Q, k=KV, v=KV, **kw):
    return flashmesh.context_parallel_attention(q, k, v, mesh=kw.pop("mesh", MESH), implementation="chunked", **kw)


@pytest.mark.parametrize("kwargs, match", [
    (dict(q=jnp.ones((1, 30, 4, 8)), k=jnp.ones((1, 30, 2, 8)), v=jnp.ones((1, 30, 2, 8))), "multiple of cp_size"),
    (dict(order="dual_chunk", q=jnp.ones((1, 36, 4, 8)), k=jnp.ones((1, 36, 2, 8)), v=jnp.ones((1, 36, 2, 8))),
     "multiple of 2 \\* cp_size"),
    (dict(axis="sp"), "axis='sp' is not an axis"),
    (dict(batch_axis="dp"), "batch_axis='dp' is not an axis"),
    (dict(strategy="ulysses"), "strategy='ulysses'"),
    (dict(order="zigzag"), "order must be one of"),
    (dict(stripe_size=4), "stripe_size applies only to order='striped'"),
    (dict(order="striped", stripe_size=0), "stripe_size must be a positive integer"),
    (dict(order="striped", stripe_size=16), "multiple of stripe_size \\* cp_size"),
    (dict(strategy="all_to_all", q=jnp.ones((1, 32, 2, 8))), "num_heads per rank"),
    (dict(q=jax.device_put(Q, NamedSharding(MESH, P(None, None, "cp")))), "q is sharded as"),
])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _call(**kwargs)


def test_segment_ids_in_another_order_need_positions():
    ids = flashmesh.SequenceDescriptor.from_segment_ids_and_pos(jnp.ones((1, 32), jnp.int32))
    with pytest.raises(ValueError, match="need segment_pos"):
        _call(mask="padding_causal", segments=ids, order="dual_chunk")
    with pytest.raises(ValueError, match="need segment_pos"):  # explain raises what the call raises
        flashmesh.explain(Q, KV, KV, mesh=MESH, mask="padding_causal", segments=ids, order="dual_chunk")


def test_no_mesh_and_no_ambient_mesh():
    with pytest.raises(ValueError, match="mesh=None needs an ambient mesh"):
        flashmesh.context_parallel_attention(Q, KV, KV)


def test_flashmesh_explain_explains_the_context_parallel_call():
    choice = flashmesh.explain(Q, KV, KV, mesh=MESH, mask="causal", window=(3, 0))
    assert choice.strategy == "ring" and choice.hops == (0, 1), str(choice)
    assert "ring" in str(choice) and "received per rank" in str(choice)
