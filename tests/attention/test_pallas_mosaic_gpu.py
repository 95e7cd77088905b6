"""The Hopper forward kernel (pallas_mosaic_gpu_sm90) against the reference backend in float32.

On CPU it runs in Mosaic GPU's interpreter (`interpret=True`, tiny shapes); the `gpu`-marked
copy runs the same cases compiled on a real Hopper GPU. Cases: no mask, causal, windows in both
alignments, GQA and MQA, Dqk != Dv, f16, several query and key tiles (so tiles are skipped and
both the masked and unmasked loops run), rows that see no key (exactly 0 output,
lse = EMPTY_ROW_LSE, or the sink logit with a sink), sequence tails (T, S not block multiples),
the logit soft cap and the off-by-one / learnable sink softmax, plus the errors of what the
kernel does not do yet.

Tolerance: FlashAttention's rule (semantics.assert_fa_rule): the output's error against the
float32 reference is at most twice that of a plain computation in the input dtype, plus noise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashmesh
from flashmesh.attention import pallas_mosaic_gpu_sm90 as sm90
from flashmesh.attention.pallas_mosaic_gpu_common import BlockSizes
from flashmesh.attention.spec import EMPTY_ROW_LSE
from mosaic_testing import interpreter, kernel_lengths  # noqa: F401  (interpreter: a fixture)
from semantics import assert_close, assert_fa_rule


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    T: int = 128
    S: int = 128
    N: int = 2
    K: int = 2
    Dqk: int = 64
    Dv: int = 64
    window: tuple[int, int] = (-1, -1)
    bottom_right: bool = False
    dtype: str = "bfloat16"
    cap: float | None = None
    softmax: str = "vanilla"
    blocks: BlockSizes = BlockSizes(block_q=128, block_kv=64, num_stages=2, num_compute_wgs=2)


ONE_WG = BlockSizes(block_q=64, block_kv=64, num_stages=2, num_compute_wgs=1)
CASES = [
    # KV splits (flash-decoding): a short query against 11 key tiles in 3 parts, the sink
    # joining at the merge; and 4 splits of a single key tile (3 empty parts) where query
    # tile 0 sees nothing (bottom-right T > S).
    Case("kv_splits_decode_learnable", T=64, S=700, N=2, K=1, window=(-1, 0), bottom_right=True,
         softmax="learnable", blocks=dataclasses.replace(ONE_WG, num_splits=3)),
    # Head dims off the 128-byte swizzle: 96 (64-byte rows), 80 / 32 (32-byte rows).
    Case("d96_causal_gqa_64b_swizzle", T=128, S=192, N=2, K=1, Dqk=96, Dv=96, window=(-1, 0),
         blocks=ONE_WG),
    Case("mla_f16_single_stage", Dqk=128, Dv=64, window=(-1, 0), dtype="float16",
         blocks=BlockSizes(block_q=64, block_kv=64, num_stages=1, num_compute_wgs=1)),
    # Persistent: 3 CTAs over 2 query tiles x 2 heads (CTA 0 runs two, the K/V ring and
    # ping-pong turns running on across them), tails; O in its own buffer, so the next tile's
    # Q loads under the last P·V and the O store completes under the next tile.
    Case("persistent_tails_prefetch_q", T=200, S=136, N=2, K=1,
         blocks=BlockSizes(block_q=128, block_kv=64, num_stages=3, reuse_q_for_o=False,
                           persistent=True)),
    # Persistent with O staged in Q; bottom-right T > S: tile 0 of each head sees no key (an
    # empty tile inside a CTA's loop).
    Case("persistent_empty_tiles_o_in_q", T=256, S=64, N=2, K=2, window=(-1, 0),
         bottom_right=True, blocks=dataclasses.replace(ONE_WG, persistent=True)),
    # KV splits with Q in place (T = 72 of a 128-row tile), each split's O merged over T rows
    Case("kv_splits_tma_tails_query_tail", T=72, S=300, N=2, K=1, window=(-1, 0),
         bottom_right=True, blocks=dataclasses.replace(ONE_WG, num_splits=3, tma_tails=True)),
    # tma_tails: Q, K, V read in place (T, S multiples of 8, not of the tiles): the second query
    # tile's second warpgroup reads rows 192..255 of 200, the last key tile 8 of 64 keys, and
    # TMA fills the rest with zeros and drops O's rows past T; persistent, O in its own buffer
    Case("tma_tails_persistent_causal", T=200, S=136, N=2, K=1, window=(-1, 0),
         bottom_right=True, blocks=BlockSizes(block_q=128, block_kv=64, num_stages=3,
                                              reuse_q_for_o=False, persistent=True, tma_tails=True)),
    # named_release: the K/V slots released through named barriers (the interpreter's form:
    # the whole memory warpgroup syncs); persistent causal in snake rounds, GQA, tails
    Case("named_release_persistent_causal_gqa_tails", T=300, S=264, N=2, K=1, window=(-1, 0),
         blocks=BlockSizes(block_q=128, block_kv=64, num_stages=3, reuse_q_for_o=False,
                           persistent=True, named_release=True)),
]

# GPU only (too large for the interpreter): the probe's tiles at full size.
GPU_CASES = [
    # run in the interpreter before the H200 passed them (2026-12-01); GPU only for CI time
    Case("causal_gqa_overlap", T=256, S=256, N=2, K=1, window=(-1, 0),
         blocks=BlockSizes(intra_wg_overlap=True)),
    Case("learnable_cap_window_tails", T=72, S=200, K=1, window=(30, 10), cap=2.0,
         softmax="learnable", blocks=ONE_WG),
    # The first kernel's schedule: no ping-pong, no intra-warpgroup overlap, O in its own
    # buffer, query tiles in order (the default elsewhere: ping-pong with 2 or more
    # warpgroups, no overlap, O staged in Q's buffer when Dqk == Dv, tiles last to first).
    Case("window_both_sides_mqa_first_schedule", N=2, K=1, window=(30, 20),
         blocks=BlockSizes(block_q=128, block_kv=64, num_stages=3, num_compute_wgs=2,
                           pingpong=False, intra_wg_overlap=False, reuse_q_for_o=False,
                           lpt_order=False)),
    # Tails: 2 query tiles (the second with 72 real rows, its second warpgroup all padding) and
    # 3 key tiles (the last with 8 real keys).
    Case("tails_full_pingpong_no_overlap", T=200, S=136, N=1, K=1,
         blocks=BlockSizes(block_q=128, block_kv=64, num_stages=2, num_compute_wgs=2,
                           intra_wg_overlap=False)),
    # Three warpgroups take turns in a ring. Bottom-right T > S: query tile 0 sees no key
    # (the empty branch), tile 1 has rows with no key and 2 masked key tiles.
    Case("three_wg_ring_empty_tile", T=384, S=128, N=1, K=1, window=(-1, 0), bottom_right=True,
         blocks=BlockSizes(block_q=192, block_kv=64, num_stages=3, num_compute_wgs=3,
                           intra_wg_overlap=True)),
    Case("d80_dv32_32b_swizzle", N=1, K=1, Dqk=80, Dv=32, blocks=ONE_WG),
    Case("kv_splits_empty_parts_off_by_one", T=128, S=64, N=1, K=1, window=(-1, 0),
         bottom_right=True, softmax="off_by_one", blocks=dataclasses.replace(ONE_WG, num_splits=4)),
    # band-mask cases the interpreter cases already cover in combination (CI time)
    # T > S bottom-right: query tile 0 sees nothing (lo == hi), tile 1 has rows with no key.
    Case("empty_rows", T=256, S=64, window=(-1, 0), bottom_right=True),
    Case("window_left", T=256, S=256, window=(40, 0), blocks=ONE_WG),  # tiles below lo skipped
    Case("full"),
    Case("causal_bottom_right", T=128, S=256, window=(-1, 0), bottom_right=True),
    Case("window_top_left_long_q", T=256, S=128, window=(16, 0), blocks=ONE_WG),  # rows past S+16 empty
    Case("tails_causal_soft_cap", T=200, S=136, N=1, K=1, window=(-1, 0), cap=1.5,
         blocks=ONE_WG),
    # Bottom-right T > S: query tile 0 sees no key (lo == hi), so out = 0 and lse = 0 there.
    Case("off_by_one_empty_rows", T=128, S=64, N=1, K=1, window=(-1, 0), bottom_right=True,
         softmax="off_by_one", blocks=ONE_WG),
    Case("d128_causal_three_stages", T=1024, S=1024, Dqk=128, Dv=128, window=(-1, 0),
         blocks=BlockSizes(num_stages=3)),
    Case("d128_full_kv192_240_regs", T=1024, S=960, Dqk=128, Dv=128,
         blocks=BlockSizes(block_kv=192, compute_registers=240, memory_registers=24)),
    Case("d128_window_pingpong_no_overlap", T=1024, S=1024, Dqk=128, Dv=128,
         window=(128, 0), blocks=BlockSizes(block_kv=64, intra_wg_overlap=False)),
    Case("d64_three_wg_causal_tails", T=1000, S=1000, Dqk=64, Dv=64, window=(-1, 0),
         blocks=BlockSizes(block_q=192, num_compute_wgs=3, num_stages=4)),
    # Persistent on the GPU: 8 query tiles x 16 heads > 132 SMs, so some CTAs run two tiles.
    Case("d128_full_persistent_prefetch_q", T=1024, S=1000, N=16, K=4, Dqk=128, Dv=128,
         blocks=BlockSizes(reuse_q_for_o=False, persistent=True)),
    Case("d128_causal_persistent_o_in_q_learnable", T=1024, S=1024, N=16, K=16, Dqk=128,
         Dv=128, window=(-1, 0), softmax="learnable", blocks=BlockSizes(persistent=True)),
    # tma_tails (written 2026-12-06 without a GPU): in place, a query tile past T wholly
    # (block_q 192 over T = 1000 leaves a warpgroup's rows of the last tile past it), KV splits,
    # and lengths off the multiples of 8 (padded copies)
    Case("d128_causal_tma_tails", T=1000, S=904, N=8, K=2, Dqk=128, Dv=128, window=(-1, 0),
         bottom_right=True, blocks=BlockSizes(tma_tails=True)),
    # 2026-12-07 without a GPU: named_release (one producer warp), with the overlap in FA3's
    # order, persistent causal in snake rounds, three warpgroups and 4 stages (16 barriers)
    Case("d128_causal_named_release_overlap", T=1024, S=1024, N=8, K=2, Dqk=128, Dv=128,
         window=(-1, 0), blocks=BlockSizes(named_release=True, intra_wg_overlap=True)),
    Case("d128_causal_persistent_snake_named_release", T=1000, S=1000, N=16, K=16, Dqk=128,
         Dv=128, window=(-1, 0), blocks=BlockSizes(reuse_q_for_o=False, persistent=True,
                                                   named_release=True)),
    Case("d128_causal_overlap_240_regs", T=1024, S=1024, N=8, K=8, Dqk=128, Dv=128,
         window=(-1, 0), blocks=BlockSizes(intra_wg_overlap=True, compute_registers=240,
                                           memory_registers=24)),
    Case("d64_three_wg_named_release_tails", T=1000, S=1000, Dqk=64, Dv=64, window=(-1, 0),
         blocks=BlockSizes(block_q=192, num_compute_wgs=3, num_stages=4, named_release=True)),
    Case("d64_three_wg_tma_tails", T=1000, S=1000, Dqk=64, Dv=64,
         blocks=BlockSizes(block_q=192, num_compute_wgs=3, num_stages=4, tma_tails=True)),
    Case("kv_splits_tma_tails", T=200, S=1000, N=4, K=1, Dqk=128, Dv=128, softmax="learnable",
         blocks=BlockSizes(block_q=64, num_compute_wgs=1, num_splits=3, tma_tails=True)),
    Case("tma_tails_odd_lengths_padded", T=1001, S=999, N=2, K=1, Dqk=128, Dv=128,
         window=(100, 0), blocks=BlockSizes(tma_tails=True, persistent=True)),
]


def visible(case: Case) -> np.ndarray:
    """bool [T, S], built here independently of masks.py."""
    i = np.arange(case.T)[:, None] + (case.S - case.T if case.bottom_right else 0)
    d = i - np.arange(case.S)[None, :]
    vis = np.ones((case.T, case.S), bool)
    if case.window[0] >= 0:
        vis &= d <= case.window[0]
    if case.window[1] >= 0:
        vis &= d >= -case.window[1]
    return vis


def make_inputs(case: Case, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (1, case.T, case.N, case.Dqk), jnp.float32)
    k = jax.random.normal(ks[1], (1, case.S, case.K, case.Dqk), jnp.float32)
    v = jax.random.normal(ks[2], (1, case.S, case.K, case.Dv), jnp.float32)
    return tuple(x.astype(case.dtype) for x in (q, k, v))


def make_sink(case: Case):
    """float32 [N] for learnable softmax (spread over [-1.5, 1.5], so it moves the output)."""
    if case.softmax != "learnable":
        return None
    return jax.random.uniform(jax.random.key(7), (case.N,), jnp.float32, -1.5, 1.5)


def reference(case: Case, q, k, v, scale, sink):
    mask = ("causal_bottom_right" if case.bottom_right else "causal") if case.window[1] == 0 else "none"
    window = case.window if case.window[0] >= 0 or case.window[1] > 0 else None
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return flashmesh.attention(*f32, mask=mask, window=window, scale=scale,
                               logits_soft_cap=case.cap, softmax=case.softmax, sink=sink,
                               implementation="reference", return_lse=True)


def plain_low_precision(case: Case, q, k, v, scale, sink):
    """Attention computed in the input dtype throughout (FlashAttention's 'plain' baseline);
    a sink is one more logit column with value 0."""
    G = case.N // case.K
    kk, vv = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, kk) * jnp.asarray(scale, q.dtype)
    if case.cap is not None:
        cap = jnp.asarray(case.cap, q.dtype)
        s = cap * jnp.tanh(s / cap)
    vis = jnp.asarray(visible(case))[None, None]
    s = jnp.where(vis, s, jnp.asarray(-jnp.inf, q.dtype))
    if case.softmax != "vanilla":
        z = jnp.zeros((case.N,), q.dtype) if sink is None else sink.astype(q.dtype)
        s = jnp.concatenate([s, jnp.broadcast_to(z[None, :, None, None], s.shape[:3] + (1,))], -1)
        vis = jnp.concatenate([jnp.broadcast_to(vis, s.shape[:3] + (case.S,)),
                               jnp.ones(s.shape[:3] + (1,), bool)], -1)
    seen = vis.any(axis=-1, keepdims=True)
    p = jax.nn.softmax(jnp.where(seen, s, jnp.zeros((), q.dtype)), axis=-1)
    p = jnp.where(vis, p, jnp.zeros((), q.dtype))[..., :case.S]
    return jnp.einsum("bnts,bsnh->btnh", p, vv)


def check_case(case: Case, *, interpret: bool):
    q, k, v = make_inputs(case)
    scale = 1.0 / np.sqrt(case.Dqk)
    sink = make_sink(case)
    out, lse = sm90.forward(q, k, v, scale=scale, window=case.window,
                            bottom_right=case.bottom_right, logits_soft_cap=case.cap,
                            softmax=case.softmax, sink=sink, block_sizes=case.blocks,
                            interpret=interpret)
    ref_out, ref_lse = reference(case, q, k, v, scale, sink)
    assert np.isfinite(np.asarray(out, np.float32)).all() and np.isfinite(np.asarray(lse)).all()
    assert out.shape == ref_out.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    assert lse.shape == ref_lse.shape and lse.dtype == jnp.float32, (lse.shape, lse.dtype)
    assert_fa_rule(f"{case.name} out", out.astype(jnp.float32), ref_out,
                   plain_low_precision(case, q, k, v, scale, sink).astype(jnp.float32))
    assert_close(f"{case.name} lse", lse, ref_lse, rtol=0.0, atol=1e-4)
    empty = ~visible(case).any(axis=1)  # [T]
    if empty.any():
        np.testing.assert_array_equal(np.asarray(out, np.float32)[:, empty], 0.0)
        empty_lse = {"vanilla": EMPTY_ROW_LSE, "off_by_one": 0.0}[case.softmax]
        np.testing.assert_array_equal(np.asarray(lse)[:, :, empty], np.float32(empty_lse))
    # the cases mean what they say
    assert (case.name != "empty_rows") or empty.sum() == 192
    assert (case.name not in ("off_by_one_empty_rows", "kv_splits_empty_parts_off_by_one")
            or empty.sum() == 64)
    assert (case.name != "three_wg_ring_empty_tile") or empty.sum() == 256  # all of tile 0 + 64


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_interpret(case, interpreter):
    check_case(case, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + GPU_CASES, ids=lambda c: c.name)
def test_forward_gpu(case):
    check_case(case, interpret=False)


# The GPU path (P as a register operand, both GEMMs in flight) lowered on CPU through Pallas
# and Mosaic GPU's Python passes (layout inference, dialect lowering; not ptxas), for each
# schedule: (T, Dqk, Dv, window, softmax, cap, BlockSizes).
LOWERINGS = [
    (1024, 128, 128, (-1, 0), "vanilla", None, BlockSizes()),
    (1024, 128, 128, (-1, -1), "vanilla", None, BlockSizes(num_stages=3)),
    (1000, 64, 64, (-1, 0), "vanilla", None, BlockSizes(block_q=192, num_compute_wgs=3,
                                                        num_stages=4)),
    (1000, 128, 64, (100, 20), "learnable", 2.0, BlockSizes(block_kv=64)),
    (512, 256, 256, (-1, 0), "off_by_one", None, BlockSizes(block_kv=64, num_stages=1,
                                                            block_q=64, num_compute_wgs=1)),
    (1024, 128, 128, (-1, 0), "learnable", None, BlockSizes(num_splits=4)),  # KV splits
    (1000, 128, 128, (-1, -1), "vanilla", None, BlockSizes(reuse_q_for_o=False,
                                                           persistent=True)),
    (1000, 96, 96, (-1, 0), "vanilla", None, BlockSizes(block_kv=64)),  # 64-byte swizzle
    (1000, 80, 32, (-1, -1), "vanilla", None, BlockSizes(block_kv=64)),  # 32-byte swizzle
    (1000, 128, 128, (-1, 0), "vanilla", None, BlockSizes(tma_tails=True)),  # T read in place
    (1000, 128, 128, (-1, 0), "vanilla", None,  # one producer warp, named barriers
     BlockSizes(named_release=True, intra_wg_overlap=True, persistent=True, reuse_q_for_o=False)),
    (1000, 64, 64, (-1, 0), "vanilla", None, BlockSizes(block_q=192, num_compute_wgs=3,
                                                        num_stages=4, named_release=True)),
]


@pytest.mark.parametrize("T, Dqk, Dv, window, softmax, cap, blocks", LOWERINGS)
def test_gpu_path_lowers_on_cpu(T, Dqk, Dv, window, softmax, cap, blocks):
    from jax.experimental.mosaic.gpu import core as mosaic_core

    q = jax.ShapeDtypeStruct((1, T, 2, Dqk), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, T, 2, Dv), jnp.bfloat16)
    sink = jax.ShapeDtypeStruct((2,), jnp.float32) if softmax == "learnable" else None

    def lower():  # a fresh jit each time: lowerings are cached
        f = jax.jit(lambda q, k, v, sink: sm90.forward(
            q, k, v, scale=0.1, window=window, softmax=softmax, sink=sink, logits_soft_cap=cap,
            block_sizes=blocks))
        f.trace(q, q, v, sink).lower(lowering_platforms=("cuda",))

    # Mosaic GPU's own shared memory count (its error under a 1-byte limit, raised before the
    # body is lowered) is BlockSizes'.
    spec = sm90.spec_for(q, q, v, scale=0.1, window=window, softmax=softmax)
    with mosaic_core.artificial_shared_memory_limit(1), pytest.raises(ValueError) as e:
        lower()
    assert f"smem_bytes={blocks.smem_bytes(spec)} " in str(e.value), str(e.value)
    lower()


@pytest.mark.parametrize("T, S, in_place", [(200, 136, (200, 136, 136, 200)),
                                            (200, 130, (200, 192, 192, 200)),
                                            (100, 136, (128, 136, 136, 128))])
def test_tma_tails_reads_lengths_in_place(T, S, in_place):
    """With tma_tails, q (k and v) of a length that is a multiple of 8 reach the kernel
    unpadded and O leaves it unsliced (the default); other lengths are still padded copies.
    Without it, every tail is."""
    q = jax.ShapeDtypeStruct((1, T, 2, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, S, 2, 64), jnp.bfloat16)

    def lengths(blocks):
        return kernel_lengths(lambda q, k, v: sm90.forward(q, k, v, scale=0.1, block_sizes=blocks),
                              q, kv, kv)

    blocks = BlockSizes(block_q=128, block_kv=64, tma_tails=False)
    assert lengths(dataclasses.replace(blocks, tma_tails=True)) == in_place
    Tp, Sp = -(-T // 128) * 128, -(-S // 64) * 64
    assert lengths(blocks) == (Tp, Sp, Sp, Tp)


def test_refuses_features_and_bad_sinks():
    with pytest.raises(ValueError, match="named_release=True with num_stages=5 and num_compute_wgs=3 "
                                         "needs 18 named barriers"):
        BlockSizes(block_q=192, num_compute_wgs=3, num_stages=5, named_release=True)
    q = jnp.zeros((1, 192, 2, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"softmax='learnable' needs sink of shape \(2,\)"):
        sm90.forward(q, kv, kv, scale=0.125, softmax="learnable", interpret=True)
    with pytest.raises(ValueError, match="sink must be None for softmax='vanilla'"):
        sm90.forward(q, kv, kv, scale=0.125, sink=jnp.zeros((2,)), interpret=True)
    with pytest.raises(ValueError, match="logits_soft_cap=-1.0 must be positive"):
        sm90.forward(q, kv, kv, scale=0.125, logits_soft_cap=-1.0, interpret=True)
    with pytest.raises(NotImplementedError, match="qk_dim=24: must be a multiple of 16"):
        sm90.forward(q[:, :128, :, :24], kv[..., :24], kv, scale=0.125, interpret=True)
    with pytest.raises(NotImplementedError, match="dtype=float32"):
        f32 = kv.astype(jnp.float32)
        sm90.forward(q[:, :128].astype(jnp.float32), f32, f32, scale=0.125, interpret=True)
    spec = dataclasses.replace(sm90.spec_for(q[:, :128], kv, kv, scale=0.125), bias_shape=(1, 1, 128, 128))
    with pytest.raises(ValueError, match=r"bias must be a float array of shape \(1, 1, 128, 128\), got None"):
        sm90.forward_spec(q[:, :128], kv, kv, spec, interpret=True)
    with pytest.raises(ValueError, match="bias must be None for a spec without bias_shape"):
        sm90.forward_spec(q[:, :128], kv, kv, dataclasses.replace(spec, bias_shape=None),
                          bias=jnp.zeros((1, 1, 128, 128)), interpret=True)
    with pytest.raises(ValueError, match="num_heads=2 must be a multiple of num_kv_heads=3"):
        sm90.forward(q, jnp.zeros((1, 128, 3, 64), jnp.bfloat16),
                     jnp.zeros((1, 128, 3, 64), jnp.bfloat16), scale=0.125)


@pytest.mark.parametrize("q_tiles, heads, batch, ctas", [(64, 32, 1, 132), (16, 32, 4, 132),
                                                          (5, 3, 2, 7), (3, 1, 1, 3)])
@pytest.mark.parametrize("q_major, snake", [(False, False), (True, False), (True, True)])
def test_persistent_tiles_cover_each_tile_once(q_tiles, heads, batch, ctas, q_major, snake):
    """Every (query tile, head, batch) goes to exactly one CTA of the persistent grid; with
    snake, causal work (tile index + 1, longest first) is spread within a few tiles' work of
    the mean where plain q-major rounds are not."""
    from flashmesh.attention.pallas_mosaic_gpu_sm90_parts import persistent_tiles

    ctas = min(ctas, q_tiles * heads * batch)
    rounds = -(-q_tiles * heads * batch // ctas)

    def cta(_):
        num_local, coords = persistent_tiles(q_tiles, heads, batch, q_major=q_major, snake=snake)
        return num_local, jnp.stack([jnp.stack(coords(jnp.int32(i))) for i in range(rounds)])

    num_local, tiles = jax.vmap(cta, axis_name="sm")(jnp.arange(ctas))
    num_local, tiles = np.asarray(num_local), np.asarray(tiles)
    got = [tuple(tiles[c, i]) for c in range(ctas) for i in range(num_local[c])]
    every = {(q, h, b) for q in range(q_tiles) for h in range(heads) for b in range(batch)}
    assert len(got) == len(every) and set(got) == every
    if (q_tiles, heads, batch) == (64, 32, 1):  # causal 8k, 32 heads, 128-row tiles, 132 SMs
        work = [sum(q_tiles - tiles[c, i, 0] for i in range(num_local[c])) for c in range(ctas)]
        spread = (max(work) - np.mean(work)) / np.mean(work)
        assert (spread < 0.01) if snake else (spread > 0.03), spread
