"""What the compiled context-parallel programs contain: the collectives each strategy issues
(from the optimised HLO) and the per-device memory (XLA's memory analysis), on 8 fake CPU
devices."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import flashmesh
from flashmesh.parallel.context import context_parallel_attention

T = 1024
Q = jax.ShapeDtypeStruct((1, T, 4, 16), jnp.float32)
KV = jax.ShapeDtypeStruct((1, T, 2, 16), jnp.float32)
COLLECTIVE = re.compile(r"= (\S+) (collective-permute|all-gather|all-reduce|reduce-scatter|all-to-all)(?:-start)?\(")


def _mesh(cp):
    return Mesh(np.array(jax.devices()[:cp]), ("cp",))


def _compiled(strategy, cp=8, grad=False, shapes=(Q, KV), **opts):
    def f(q, k, v):
        return context_parallel_attention(q, k, v, mesh=_mesh(cp), strategy=strategy, implementation="chunked", **opts)
    if grad:
        f = jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v)), (0, 1, 2))
    q, kv = shapes
    return jax.jit(f).lower(q, kv, kv).compile()


def _collectives(compiled):
    """[(result type, op)] of every collective in the optimised HLO."""
    return COLLECTIVE.findall(compiled.as_text())


def test_ring_permutes_and_never_gathers():
    ops = [op for _, op in _collectives(_compiled("ring", mask="causal"))]
    assert ops and set(ops) == {"collective-permute"}
    grad_ops = {op for _, op in _collectives(_compiled("ring", mask="causal", grad=True))}
    assert grad_ops == {"collective-permute"}


def test_narrow_window_sends_only_the_halo():
    """Shards of 128 tokens, a causal window of 50: one hop (the left neighbour's block: k, v
    and its positions), not seven."""
    def kv_permutes(**opts):  # the K and V blocks sent, [B, T / cp, K, H] each
        return [t for t, op in _collectives(_compiled("ring", **opts))
                if op == "collective-permute" and t.startswith("f32[1,128,2,16]")]
    assert len(kv_permutes(mask="causal")) == 7 * 2
    assert len(kv_permutes(mask="causal", window=(50, 0))) == 1 * 2


def test_all_gather_gathers_kv_once_and_never_q():
    found = _collectives(_compiled("all_gather", mask="causal"))
    assert {op for _, op in found} == {"all-gather"}
    shapes = [t for t, _ in found]
    assert sum(t.startswith("f32[1,1024,2,16]") for t in shapes) == 2  # K and V, once each
    assert not any(t.startswith("f32[1,1024,4,16]") for t in shapes)  # Q never moves
    grad = {op for _, op in _collectives(_compiled("all_gather", mask="causal", grad=True))}
    assert "reduce-scatter" in grad  # dK, dV go home summed


@pytest.mark.parametrize("strategy", ["ring", "all_to_all"])
def test_memory_per_device_falls_with_cp(strategy):
    """fwd+bwd temporaries per device at cp=8 are at most a quarter of one device's."""
    x = jax.ShapeDtypeStruct((1, T, 8, 16), jnp.float32)
    one = jax.jit(jax.grad(lambda q, k, v: jnp.sum(flashmesh.attention(q, k, v, mask="causal",
                                                                       implementation="chunked")), (0, 1, 2)))
    single = one.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes
    eight = _compiled(strategy, mask="causal", grad=True, shapes=(x, x)).memory_analysis().temp_size_in_bytes
    assert eight <= single / 4, (eight, single)
