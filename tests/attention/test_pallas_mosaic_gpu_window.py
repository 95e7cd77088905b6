"""The window kernel (pallas_mosaic_gpu_sm90_window) against the float32 reference, and where
it is chosen.

On CPU it runs in Mosaic GPU's interpreter (tiny shapes); the `gpu`-marked copy runs the same
cases compiled, plus the seed shape's heads at full length. Without a GPU the compiled path is
lowered for cuda and Mosaic's shared-memory count must equal `WindowBlockSizes.smem_bytes`.

Cases: causal window (128, 0) with GQA 4:1 shared by two warpgroups and a tail (T = 200),
a two-sided window with T != S and the learnable sink (one warpgroup, MQA),
the off-by-one sink with the soft cap and a 4-tile band, and bottom-right T > S with a
narrow window, where whole query blocks see no key (out 0, lse EMPTY_ROW_LSE); ping-pong with
two heads and with one head per warpgroup (a hang in the interpreter if the turns unbalance);
rings of three and four Q slots (`q_buffers`, `q_ahead`) that the heads go round more than
once, with the interpreter's race detector on; the persistent grid (runs of items crossing kv
heads, the band's tile ring, the Q ring across items), races on. Gradients
go through the registered backend (window forward, general backward) once.

Tolerance: the forward tests' FlashAttention rule (semantics.assert_fa_rule); lse 1e-4.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from flashmesh.attention import pallas_mosaic_gpu as pmg
from flashmesh.attention import pallas_mosaic_gpu_common as common
from flashmesh.attention import pallas_mosaic_gpu_sm90 as sm90
from flashmesh.attention import pallas_mosaic_gpu_sm90_window as window
from flashmesh.attention import pallas_mosaic_gpu_table as config_table
from flashmesh.attention.api import normalize
from flashmesh.attention.pallas_mosaic_gpu_common import WindowBlockSizes
from flashmesh.attention.spec import EMPTY_ROW_LSE
from mosaic_testing import interpreter, rel_l2  # noqa: F401  (interpreter: a fixture)
from semantics import assert_close, assert_fa_rule
from test_pallas_mosaic_gpu import Case, make_inputs, make_sink, plain_low_precision, reference, visible

CASES = [
    (Case("two_sided_t_ne_s_learnable_mqa", T=150, S=230, N=1, K=1, window=(30, 20),
          softmax="learnable"), WindowBlockSizes(num_compute_wgs=1)),
    (Case("empty_blocks", T=256, S=64, N=2, K=2, window=(8, 0), bottom_right=True),
     WindowBlockSizes(num_compute_wgs=1)),
    # ping-pong: two warpgroups taking turns on the named barriers, two heads each
    (Case("pingpong_gqa_two_wgs", T=100, S=100, N=4, K=1, window=(50, 0)),
     WindowBlockSizes(pingpong=True)),
    (Case("pingpong_one_head_each", T=64, S=80, N=2, K=1, window=(20, 5)),
     WindowBlockSizes(pingpong=True)),
    # a ring of Q slots (the interpreter's race detector on): five heads a warpgroup go round
    # three slots (two loads ahead) with O in Q's slot; nine round four with O in slots of its
    # own (Dqk != Dv); two heads, fewer than the loads ahead; ping-pong, all loads in the prologue
    (Case("q_ring_3_five_heads", T=70, S=70, N=5, K=1, window=(40, 0)),
     WindowBlockSizes(num_compute_wgs=1, q_buffers=3)),
    (Case("q_ring_4_nine_heads_mla", T=70, S=70, N=9, K=1, Dqk=64, Dv=32, window=(40, 0)),
     WindowBlockSizes(num_compute_wgs=1, q_buffers=4)),
    (Case("q_ring_4_two_heads", T=70, S=70, N=2, K=1, window=(40, 0)),
     WindowBlockSizes(num_compute_wgs=1, q_buffers=4)),
    # loading two heads ahead into four slots: the slot of the head before last, whose O store
    # may still be reading the next slot (a wait that allows two store groups in flight)
    (Case("q_ring_4_ahead_2_seven_heads", T=70, S=70, N=7, K=1, window=(40, 0)),
     WindowBlockSizes(num_compute_wgs=1, q_buffers=4, q_ahead=2)),
    (Case("q_ring_3_ahead_1_pingpong", T=64, S=64, N=10, K=1, window=(30, 0)),
     WindowBlockSizes(pingpong=True, q_buffers=3, q_ahead=1)),
    (Case("q_ring_4_pingpong_mla", T=64, S=64, N=6, K=1, Dqk=64, Dv=32, window=(30, 0)),
     WindowBlockSizes(pingpong=True, q_buffers=4)),
    # tma_tails: Q, K, V read in place (T, S multiples of 8): the last block's rows 192..255
    # past T = 200, the band's keys past S = 136 zeros from TMA, O's rows past T dropped
    (Case("tma_tails_two_sided_learnable", T=200, S=136, N=2, K=1, window=(40, 10),
          softmax="learnable"), WindowBlockSizes(num_compute_wgs=1, tma_tails=True)),
    # overlap_heads: head t's P·V with head t + 1's S (in turn in the interpreter, the same
    # ring, loads and stores): seven heads in a 4-slot ring two ahead, a learnable sink; two
    # warpgroups of one head each (no overlapped step); races on
    (Case("q_ring_overlap_heads_seven_ahead_2_learnable", T=70, S=70, N=7, K=1, window=(40, 0),
          softmax="learnable"), WindowBlockSizes(num_compute_wgs=1, q_buffers=4, q_ahead=2,
                                                 overlap_heads=True)),
    (Case("q_ring_overlap_heads_one_head_each_cap", T=64, S=80, N=2, K=1, window=(20, 5), cap=2.0),
     WindowBlockSizes(overlap_heads=True)),
    (Case("q_ring_overlap_heads_two_wgs_three_heads_mla_off_by_one", T=100, S=100, N=6, K=1, Dqk=64,
          Dv=32, window=(40, 0), softmax="off_by_one"), WindowBlockSizes(overlap_heads=True)),
    # persistent (3 CTAs in the interpreter, races on): 8 items (4 blocks, 2 kv heads) in runs
    # of 2, 3, 3, one crossing kv heads; the band's 64-key tiles a ring the next block refills
    # one slot of; kv heads switching where the next band holds the same tiles (all reloaded);
    # a 4-slot ring two ahead running on across items with a sink and T != S; the ping-pong
    # with whole blocks that see no key
    (Case("persistent_gqa_two_wgs_crossing_kv_heads", T=200, S=200, N=4, K=2, window=(100, 0)),
     WindowBlockSizes(persistent=True)),
    (Case("persistent_kv_heads_switch_same_band", T=128, S=128, N=8, K=4, window=(100, 0)),
     WindowBlockSizes(persistent=True)),
    (Case("persistent_q_ring_4_ahead_2_two_sided_learnable", T=150, S=230, N=6, K=2, window=(30, 20),
          softmax="learnable"), WindowBlockSizes(num_compute_wgs=1, q_buffers=4, q_ahead=2, persistent=True)),
    # one head a warpgroup an item against a ring loading three ahead: the prologue's loads
    # reach into the next items (a hang when they stopped at the first item's heads)
    (Case("persistent_q_ring_4_one_head_each", T=200, S=200, N=6, K=3, window=(30, 0)),
     WindowBlockSizes(q_buffers=4, persistent=True)),
    # reload_band: the whole band again at every item (kv heads crossing, a 3-slot ring)
    (Case("persistent_reload_band_crossing_kv_heads", T=200, S=200, N=6, K=2, window=(64, 0)),
     WindowBlockSizes(num_compute_wgs=1, q_buffers=3, persistent=True, reload_band=True)),
    (Case("persistent_pingpong_empty_blocks", T=256, S=64, N=4, K=2, window=(8, 0), bottom_right=True),
     WindowBlockSizes(pingpong=True, persistent=True)),
]
GPU_CASES = [
    # run in the interpreter before the H200 passed them (2026-12-01); GPU only for CI time
    (Case("off_by_one_cap_four_tiles", T=192, S=192, N=2, K=1, window=(100, 10), cap=2.0,
          softmax="off_by_one"), WindowBlockSizes()),
    (Case("causal_w128_gqa_two_wgs_tail", T=200, S=200, N=4, K=1, window=(128, 0)),
     WindowBlockSizes()),
    (Case("seed_heads_w128", T=4096, S=4096, N=16, K=1, Dqk=128, Dv=128, window=(128, 0)),
     WindowBlockSizes()),
    (Case("seed_heads_w128_pingpong", T=4096, S=4096, N=16, K=1, Dqk=128, Dv=128, window=(128, 0)),
     WindowBlockSizes(pingpong=True)),
    (Case("off_by_one_cap_pingpong", T=192, S=192, N=2, K=1, window=(100, 10), cap=2.0,
          softmax="off_by_one"), WindowBlockSizes(pingpong=True)),
    (Case("seed_heads_w128_q_ring_4", T=4096, S=4096, N=16, K=1, Dqk=128, Dv=128, window=(128, 0)),
     WindowBlockSizes(q_buffers=4)),
    (Case("seed_heads_w128_pingpong_q_ring_3", T=4096, S=4096, N=16, K=1, Dqk=128, Dv=128,
          window=(128, 0)), WindowBlockSizes(pingpong=True, q_buffers=3)),
    (Case("seed_heads_w128_q_ring_4_ahead_2", T=4096, S=4096, N=16, K=1, Dqk=128, Dv=128,
          window=(128, 0)), WindowBlockSizes(q_buffers=4, q_ahead=2)),
    # tma_tails (written 2026-12-06 without a GPU): in place, then off the multiples of 8
    (Case("w128_tma_tails", T=1000, S=1000, N=16, K=1, Dqk=128, Dv=128, window=(128, 0)),
     WindowBlockSizes(tma_tails=True)),
    # overlap_heads (written 2026-12-07 without a GPU): the anchor's form with the table's ring,
    # then tails, a two-sided window and a sink with O in slots of its own (Dv != Dqk)
    (Case("seed_heads_w128_overlap_heads_q_ring_4_ahead_2", T=4096, S=4096, N=16, K=1, Dqk=128,
          Dv=128, window=(128, 0)), WindowBlockSizes(q_buffers=4, q_ahead=2, overlap_heads=True)),
    # persistent (written 2026-12-07 without a GPU): 256 items (64 blocks, 4 kv heads of 16
    # query heads) on the SMs, with the table's ring, the band reloaded and the ping-pong; tails
    (Case("persistent_w128_q_ring_4_ahead_2", T=4096, S=4096, N=64, K=4, Dqk=128, Dv=128,
          window=(128, 0)), WindowBlockSizes(q_buffers=4, q_ahead=2, persistent=True)),
    (Case("persistent_w128_reload_band", T=4096, S=4096, N=64, K=4, Dqk=128, Dv=128,
          window=(128, 0)), WindowBlockSizes(q_buffers=4, q_ahead=2, persistent=True, reload_band=True)),
    (Case("persistent_w128_pingpong_tails", T=4001, S=4001, N=64, K=4, Dqk=128, Dv=128,
          window=(128, 0)), WindowBlockSizes(pingpong=True, q_buffers=3, persistent=True)),
    (Case("overlap_heads_two_sided_mla_learnable_tails", T=1000, S=1000, N=8, K=2, Dqk=128, Dv=64,
          window=(40, 10), softmax="learnable"), WindowBlockSizes(overlap_heads=True)),
    (Case("w128_tma_tails_odd_padded", T=999, S=999, N=16, K=1, Dqk=128, Dv=128,
          window=(128, 0)), WindowBlockSizes(tma_tails=True, pingpong=True)),
]


def check_case(case: Case, bs: WindowBlockSizes, *, interpret, scale: float | None = None,
               q_mult: float = 1.0):
    q, k, v = make_inputs(case)
    q = (q.astype(jnp.float32) * q_mult).astype(q.dtype)
    scale = 1.0 / np.sqrt(case.Dqk) if scale is None else scale
    sink = make_sink(case)
    spec = sm90.spec_for(q, k, v, scale=scale, window=case.window, bottom_right=case.bottom_right,
                         logits_soft_cap=case.cap, softmax=case.softmax)
    assert common.window_reason(spec, bs) is None
    out, lse = window.forward_spec(q, k, v, spec, sink=sink, block_sizes=bs, interpret=interpret)
    ref_out, ref_lse = reference(case, q, k, v, scale, sink)
    assert out.shape == ref_out.shape and out.dtype == q.dtype and lse.dtype == jnp.float32
    assert_fa_rule(f"{case.name} out", out.astype(jnp.float32), ref_out,
                   plain_low_precision(case, q, k, v, scale, sink).astype(jnp.float32))
    assert_close(f"{case.name} lse", lse, ref_lse, rtol=0.0, atol=1e-4)
    empty = ~visible(case).any(axis=1)
    if empty.any():
        np.testing.assert_array_equal(np.asarray(out, np.float32)[:, empty], 0.0)
        want = {"vanilla": EMPTY_ROW_LSE, "off_by_one": 0.0}.get(case.softmax)
        if want is not None:
            np.testing.assert_array_equal(np.asarray(lse)[:, :, empty], np.float32(want))
    assert case.name != "empty_blocks" or empty.sum() == 192  # whole blocks see nothing


@pytest.mark.parametrize("case, bs", CASES, ids=lambda c: getattr(c, "name", ""))
def test_window_interpret(case, bs, interpreter):
    races = case.name.startswith(("q_ring", "persistent"))
    check_case(case, bs, interpret=plgpu.InterpretGPUParams(detect_races=True) if races else True)
    assert not (races and interpreter.get_races().races_found), f"{case.name}: a race"


@pytest.mark.parametrize("scale, q_mult", [(-0.3, 1.0), (0.0, 1.0), (0.125, 30.0)],
                         ids=["negative_scale", "zero_scale", "logits_near_700"])
def test_window_scales_interpret(scale, q_mult, interpreter):
    """The scale folded into exp2's argument only where it may be (scale > 0, no cap), and the
    row max taken in the same units as the logits: logits near 700 underflow every exp2 if the
    max is of the raw logits while the exponent is scaled."""
    case = Case("scales", T=80, S=80, N=2, K=1, window=(30, 0))
    check_case(case, WindowBlockSizes(pingpong=True), interpret=True, scale=scale, q_mult=q_mult)


@pytest.mark.gpu
@pytest.mark.parametrize("case, bs", CASES + GPU_CASES, ids=lambda c: getattr(c, "name", ""))
def test_window_gpu(case, bs):
    check_case(case, bs, interpret=False)


def test_gradients_through_the_backend_interpret(interpreter):
    """The registered custom VJP with the window forward and the general backward."""
    from flashmesh.attention import pallas_mosaic_gpu_sm90_bwd as bwd
    from flashmesh.attention import reference as ref_backend

    case = Case("grad", T=100, S=100, N=2, K=1, window=(64, 0))
    q, k, v = make_inputs(case)
    g = jax.random.normal(jax.random.key(9), q.shape, jnp.float32)
    inputs, spec = normalize(q, k, v, mask="causal", window=(64, 0))
    blocks = (WindowBlockSizes(), bwd.BackwardBlockSizes(num_stages=1))

    def loss(f, q, k, v):
        i, s = normalize(q, k, v, mask="causal", window=(64, 0))
        return jnp.sum(f(i, s)[0].astype(jnp.float32) * g)

    got = jax.grad(lambda *a: loss(lambda i, s: pmg.attention_with(i, s, *blocks, interpret=True), *a),
                   argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: loss(ref_backend.attention, *a), argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        rel_l2(name, a, b, 1e-2)


@pytest.mark.parametrize("T, N, K, D, Dv, win, softmax, cap, pingpong, q_buffers", [
    (4096, 16, 1, 128, 128, (128, 0), "vanilla", None, False, 2),
    (4096, 16, 1, 128, 128, (128, 0), "vanilla", None, True, 2),
    (4096, 16, 1, 128, 128, (128, 0), "vanilla", None, True, (4, 2)),  # 226 KB of 227
    (1000, 4, 2, 128, 64, (100, 30), "learnable", 5.0, True, 2),
    (1000, 4, 2, 128, 64, (64, 0), "learnable", 5.0, True, 3),  # O in slots of its own
    (512, 2, 1, 64, 64, (64, 64), "off_by_one", None, False, 2),
    (1000, 16, 1, 128, 128, (128, 0), "vanilla", None, False, "tma_tails"),  # T, S in place
    (4096, 16, 1, 128, 128, (128, 0), "vanilla", None, "overlap_heads", (4, 2)),
    (1000, 4, 2, 128, 64, (64, 0), "learnable", 5.0, "overlap_heads", 3),
])
def test_gpu_path_lowers_on_cpu(T, N, K, D, Dv, win, softmax, cap, pingpong, q_buffers):
    q = jax.ShapeDtypeStruct((2, T, N, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, T, K, D), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, T, K, Dv), jnp.bfloat16)
    sink = jax.ShapeDtypeStruct((N,), jnp.float32) if softmax == "learnable" else None
    spec = sm90.spec_for(q, k, v, scale=0.1, window=win, softmax=softmax, logits_soft_cap=cap)
    tails = q_buffers == "tma_tails"
    nq, ahead = q_buffers if isinstance(q_buffers, tuple) else (2 if tails else q_buffers, None)
    overlap = pingpong == "overlap_heads"  # (the ping-pong's column: off with the overlap)
    bs = WindowBlockSizes(pingpong=pingpong is True, q_buffers=nq, q_ahead=ahead, tma_tails=tails,
                          overlap_heads=overlap)
    check_lowering(q, k, v, sink, spec, bs)


@pytest.mark.parametrize("T, N, K, win, bs", [
    # persistent: the anchor's form (16 heads a group, 8 kv heads) with the table's ring, and
    # with the band reloaded and the ping-pong; a 4-tile band of 64-key tiles, two of 128, tails
    (4096, 128, 8, (128, 0), WindowBlockSizes(q_buffers=4, q_ahead=2, persistent=True)),
    (4096, 128, 8, (128, 0), WindowBlockSizes(q_buffers=4, q_ahead=2, persistent=True, reload_band=True)),
    (4096, 128, 8, (128, 0), WindowBlockSizes(pingpong=True, q_buffers=3, persistent=True)),
    (1000, 16, 2, (100, 30), WindowBlockSizes(persistent=True)),
    (1000, 16, 2, (60, 30), WindowBlockSizes(block_kv=128, persistent=True)),
], ids=["anchor", "anchor_reload_band", "anchor_pingpong", "four_tiles_tails", "block_kv_128"])
def test_persistent_lowers_on_cpu(T, N, K, win, bs):
    q = jax.ShapeDtypeStruct((2, T, N, 128), jnp.bfloat16)
    k = v = jax.ShapeDtypeStruct((2, T, K, 128), jnp.bfloat16)
    spec = sm90.spec_for(q, k, v, scale=0.1, window=win)
    check_lowering(q, k, v, None, spec, bs)


def check_lowering(q, k, v, sink, spec, bs: WindowBlockSizes):
    """The GPU form lowers for cuda on this CPU, and Mosaic GPU counts smem_bytes of shared
    memory for it (a limit of one byte makes it say how many it needs)."""
    from jax.experimental.mosaic.gpu import core as mosaic_core

    def lower():
        f = jax.jit(lambda q, k, v, s: window.forward_spec(q, k, v, spec, sink=s, block_sizes=bs))
        f.trace(q, k, v, sink).lower(lowering_platforms=("cuda",))

    with mosaic_core.artificial_shared_memory_limit(1), pytest.raises(ValueError) as e:
        lower()
    assert f"smem_bytes={bs.smem_bytes(spec)} " in str(e.value), str(e.value)
    lower()


def _spec(T=4096, N=128, K=8, D=128, **kw):
    q = jnp.zeros((1, T, N, D), jnp.bfloat16)
    kv = jnp.zeros((1, T, K, D), jnp.bfloat16)
    return normalize(q, kv, kv, **kw)[1]


def test_where_it_applies_and_is_chosen():
    seed = _spec(mask="causal", window=(128, 0))
    bs = WindowBlockSizes()
    assert bs.band_tiles(seed) == 3 and common.window_reason(seed, bs) is None
    assert WindowBlockSizes(block_kv=128).band_tiles(seed) == 2
    # the seed shape's table entry names the window kernel (tuned 2026-12-06: a 4-slot Q ring
    # loading 2 heads ahead); explain says so
    chosen = pmg.config(seed, "NVIDIA H200")[0]
    assert chosen == WindowBlockSizes(q_buffers=4, q_ahead=2), chosen
    assert "window kernel, a band of 3x64 keys" in pmg.describe(seed, "NVIDIA H200")
    # and where it does not apply, why (the general kernel runs those)
    for spec, words in [
        (_spec(mask="causal"), "both sides bounded"),
        (_spec(mask="causal", window=(300, 0)), "span 384 > 256"),
        (_spec(mask="causal", window=(128, 0), dropout_rate=0.1, dropout_rng=jax.random.key(0)),
         "dropout"),
        (_spec(N=3, K=1, mask="causal", window=(64, 0)), "not a multiple of num_compute_wgs=2"),
    ]:
        assert words in common.window_reason(spec, bs), (words, common.window_reason(spec, bs))
        assert isinstance(pmg.config(spec, "NVIDIA H200")[0], common.BlockSizes)
    assert config_table.heuristic(_spec(N=3, K=1, mask="causal", window=(64, 0))) == WindowBlockSizes(
        num_compute_wgs=1)
    with pytest.raises(NotImplementedError, match="both sides bounded"):
        bs.validate_for(_spec(mask="causal"))
    with pytest.raises(ValueError, match="block_kv=96 must be 64 or 128"):
        WindowBlockSizes(block_kv=96)
    with pytest.raises(ValueError, match="pingpong=True needs num_compute_wgs=2, got 1"):
        WindowBlockSizes(num_compute_wgs=1, pingpong=True)
    with pytest.raises(ValueError, match="pingpong must be a bool"):
        WindowBlockSizes(pingpong=1)
    with pytest.raises(ValueError, match="persistent must be a bool"):
        WindowBlockSizes(persistent=1)
    # persistent: 2 x 3 barriers for the band's K and V slots (2 x 1 reloading the whole band)
    # and 2 for their release
    assert (WindowBlockSizes(persistent=True).smem_bytes(seed) - bs.smem_bytes(seed)) == 8 * 6
    assert (WindowBlockSizes(persistent=True, reload_band=True).smem_bytes(seed)
            - bs.smem_bytes(seed)) == 8 * 2
    with pytest.raises(ValueError, match="persistent=True needs overlap_heads=False"):
        WindowBlockSizes(persistent=True, overlap_heads=True)
    with pytest.raises(ValueError, match="reload_band=True needs persistent=True"):
        WindowBlockSizes(reload_band=True)
    with pytest.raises(ValueError, match="overlap_heads=True needs pingpong=False"):
        WindowBlockSizes(pingpong=True, overlap_heads=True)
    # overlap_heads holds S, O and P at once: 208 registers a thread at the seed's band of
    # 192 keys, 256 (refused) at a band of 256
    assert WindowBlockSizes(overlap_heads=True).overlap_registers(seed) == 208
    assert common.window_reason(seed, WindowBlockSizes(overlap_heads=True)) is None
    assert "need 256 registers a thread, above 216" in common.window_reason(
        seed, WindowBlockSizes(block_kv=128, overlap_heads=True))
    with pytest.raises(ValueError, match="q_buffers=5 must be 2, 3 or 4"):
        WindowBlockSizes(q_buffers=5)
    assert WindowBlockSizes(q_buffers=4).ahead == 3 and WindowBlockSizes().ahead == 1
    assert WindowBlockSizes(q_buffers=3) == WindowBlockSizes(q_buffers=3, q_ahead=2)
    assert dataclasses.replace(WindowBlockSizes(), q_buffers=4).ahead == 3  # the default follows
    assert WindowBlockSizes(q_buffers=4, q_ahead=2).ahead == 2
    for bad in (0, 3):
        with pytest.raises(ValueError, match=f"q_ahead={bad} must be None or in 1 .. q_buffers - 1 = 2"):
            WindowBlockSizes(q_buffers=3, q_ahead=bad)
    # the seed shape takes four Q slots a warpgroup (226 KB), not five of anything larger
    assert WindowBlockSizes(q_buffers=4).smem_bytes(seed) <= common.SMEM_BYTES
    assert "shared memory" in common.window_reason(_spec(mask="causal", window=(128, 0), D=256),
                                                   WindowBlockSizes(q_buffers=3))
    fields = config_table.config_fields(bs)
    assert fields["kernel"] == "window" and config_table.forward_config(fields) == bs
    assert dataclasses.asdict(config_table.forward_config({"block_q": 128})) == dataclasses.asdict(
        common.BlockSizes(block_q=128))
