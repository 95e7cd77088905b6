"""Property test of the chunked schedule: over random lengths, diagonals, windows, tile sizes
and lane caps, the static tables run exactly the non-empty tiles, each once, every step has
work and distinct query blocks, no table has more lanes than the cap; and a whole call traces
(`jax.eval_shape`) for random shapes whose default tiles cap the lanes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashmesh
from flashmesh.attention import chunked, chunked_tiles, masks
from flashmesh.attention.spec import AttentionInputs, AttentionSpec

NO_INPUTS = AttentionInputs(q=None, k=None, v=None)


@st.composite
def tilings(draw):
    T, S = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    left, right = draw(st.sampled_from([-1, 0, 1, 5, 40, 299])), draw(st.sampled_from([-1, 0, 3, 64]))
    bq, bk = draw(st.integers(1, 64)), draw(st.integers(1, 64))
    lanes = draw(st.sampled_from([None, 1, 2, 3, 7]))
    spec = AttentionSpec(batch=1, q_len=T, kv_len=S, num_heads=1, num_kv_heads=1, qk_dim=4, v_dim=4,
                         dtype="float32", scale=1.0, window=(left, right), bottom_right=draw(st.booleans()))
    return spec, min(bq, T), min(bk, S), lanes


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tilings())
def test_static_tables_cover_exactly_the_nonempty_tiles(tiling):
    spec, bq, bk, lanes = tiling
    classes = masks.block_map(spec, NO_INPUTS, bq, bk)
    nq, nk = classes.shape[1:]
    seen = np.zeros((nq, nk), int)
    for table in chunked_tiles.static_schedule(classes, lanes):
        assert lanes is None or table.q.shape[1] <= lanes
        kind = masks.PARTIAL if table.masked else masks.FULL
        for t in range(table.num_steps):
            step = table.static_step(t, nq)  # must not fail for any step
            real = table.q[t] < nq
            assert real.any(), f"step {t} of a table has no work"
            assert len(set(table.q[t][real])) == real.sum(), "a step holds one query block twice"
            assert (classes[0][table.q[t][real], table.kv[t][real]] == kind).all()
            assert step.masked == table.masked
            np.add.at(seen, (table.q[t][real], table.kv[t][real]), 1)
    assert (seen == (classes[0] != masks.EMPTY)).all()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(40000, 70000), st.sampled_from([(-1, 0), (200, 0), (1000, 0), (64, 64), (-1, -1)]),
       st.sampled_from([64, 128]), st.sampled_from(["cpu", "gpu"]))
def test_large_calls_trace(T, window, N, platform):
    """Shapes whose default blocks mostly cap the lanes per step (> STEP_LOGITS_BYTES of logits)."""
    N = 128 if platform == "cpu" else N  # CPU tiles are smaller: more heads before lanes cap
    x = jax.ShapeDtypeStruct((1, T, N, 64), jnp.bfloat16)
    spec = AttentionSpec(batch=1, q_len=T, kv_len=T, num_heads=N, num_kv_heads=N, qk_dim=64, v_dim=64,
                         dtype="bfloat16", scale=0.125, window=window)
    blocks = chunked.BlockSizes.default_for(spec, platform)
    f = lambda q: flashmesh.attention(q, q, q, mask="none", window=window, implementation="chunked")
    if platform == "gpu":  # the GPU's tiles, traced on this machine
        f = lambda q: chunked.attention(AttentionInputs(q=q, k=q, v=q), spec, block_sizes=blocks)[0]
    assert jax.eval_shape(f, x).shape == x.shape


def test_issue_reproducer_traces():
    x = jax.ShapeDtypeStruct((1, 65728, 64, 64), jnp.bfloat16)
    spec = AttentionSpec(batch=1, q_len=65728, kv_len=65728, num_heads=64, num_kv_heads=64, qk_dim=64,
                         v_dim=64, dtype="bfloat16", scale=0.125, window=(200, 0))
    assert chunked.BlockSizes.default_for(spec, "cpu").lanes is not None  # the case that failed
    for impl in ("chunked", None):
        out = jax.eval_shape(lambda q: flashmesh.attention(q, q, q, mask="causal", window=(200, 0),
                                                           implementation=impl), x)
        assert out.shape == x.shape
