"""The Hopper backward kernels (pallas_mosaic_gpu_sm90_bwd) against autodiff of the reference.

dq, dk, dv (and dsink) come from `backward_spec` at random cotangents, given the forward's out
and lse from the float32 reference (so the backward is tested alone), and are compared with
`jax.vjp` of `reference.attention` on the float32-upcast inputs. On CPU the kernels run in
Mosaic GPU's interpreter (tiny shapes; its race detector on for some cases); the `gpu`-marked
copies run the same cases compiled, plus a few larger ones with the default tiles. Without a
GPU, the compiled path is still lowered through Mosaic GPU for cuda (register operands, SMEM
count), and the closed-form query ranges are checked against `q_ranges`.

Cases: no mask, causal (several tiles: skipped, masked and unmasked), causal GQA, a left window
with key tiles no query sees (exactly zero dk, dv, never loaded), a two-sided window with MQA,
bottom-right T != S, tails (T, S not tile multiples), rows that see no key (exactly zero dq, no
NaN), soft cap, off-by-one and learnable sinks (dsink), MLA dims 128/64 in f16.

Tolerance: relative L2 error per gradient <= 1e-2 for bf16 (2e-3 for f16) against float32, with
the worst element printed; the kernels' error is the bf16 rounding of P, dS and the outputs
(about 2.5e-3 measured), a wrong mask or range gives O(1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from flashmesh.attention import pallas_mosaic_gpu_sm90 as sm90
from flashmesh.attention import pallas_mosaic_gpu_sm90_bwd as bwd
from flashmesh.attention.pallas_mosaic_gpu_sm90_bwd_tiles import band_q_range
from flashmesh.attention import reference
from flashmesh.attention.pallas_mosaic_gpu_ranges import q_ranges
from flashmesh.attention.spec import AttentionInputs
from mosaic_testing import interpreter, kernel_lengths, rel_l2  # noqa: F401  (interpreter: a fixture)

BBS = bwd.BackwardBlockSizes


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
    blocks: BBS | None = BBS(num_stages=2)  # None: default_for
    races: bool = False  # run the interpreter's race detector


ONE_WG = BBS(block_q=64, block_kv=64, block_q_dq=64, block_kv_dq=64, num_stages=2,
             num_compute_wgs=1)
CASES = [  # race detection (about 2x slower in the interpreter) on the cases marked races=True
    # Rows past 151 see no key but the window reaches padded keys 136..191: only their mask
    # keeps P = exp2(0 - EMPTY_ROW_LSE) = inf out of dq.
    Case("tails_window_soft_cap_empty_rows", T=256, S=136, N=1, K=1, window=(16, 0), cap=1.5,
         blocks=ONE_WG),
    Case("mla_f16_single_stage", N=1, K=1, Dqk=128, Dv=64, window=(-1, 0), dtype="float16",
         blocks=dataclasses.replace(ONE_WG, num_stages=1), races=True),
    # two compute warpgroups on one stage at d128 (ran on the H200 on 2026-12-02, the fused
    # form). Outside this suite's 8 CPU devices the interpreter can deadlock on it with 2 CPUs:
    # XLA's host-callback threads, sized by the CPUs (NPROC overrides), all blocked in waits
    Case("single_stage_two_wgs_d128_fused", T=128, S=128, N=1, K=1, Dqk=128, Dv=128,
         blocks=BBS(num_stages=1, fused_dq=True)),
    # one fused kernel (dQ += dS K inside the dK/dV kernel, five GEMMs): 4 x 4 causal tiles,
    # G = 2 heads per CTA; then 2 warpgroups, tails, a cap and a learnable sink
    Case("fused_dq_causal_gqa", T=256, S=256, N=2, K=1, window=(-1, 0),
         blocks=dataclasses.replace(ONE_WG, fused_dq=True), races=True),
    Case("fused_dq_two_wgs_tails_cap_learnable", T=200, S=136, N=2, K=2, cap=1.5,
         softmax="learnable", blocks=BBS(num_stages=2, fused_dq=True)),
    Case("fused_dq_stagger_full", T=256, S=200, N=2, K=1, window=(-1, -1),
         blocks=dataclasses.replace(ONE_WG, fused_dq=True, stagger_q=True)),  # 3 key tiles rotated, the tail not
    # dQ split by columns (each warpgroup 64 of the 128, both warpgroups' dSᵀ): GQA, tails,
    # causal, a sink; races on (the dSᵀ exchange between the warpgroups)
    Case("fused_dq_columns_d128_causal_gqa_tails", T=200, S=136, N=2, K=1, Dqk=128, Dv=64,
         window=(-1, 0), softmax="off_by_one", blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True),
         races=True),
    # wg_ranges: each warpgroup computes only the streamed tiles its own 64 rows meet and
    # passes over the others (both kernels; the dK/dV CTA's 128 keys meet 5 query tiles, each
    # warpgroup 4; races on: the pass-over's barrier phases and releases)
    Case("wg_ranges_window_gqa_tails", T=300, S=260, N=2, K=1, window=(40, 10),
         blocks=BBS(num_stages=2, wg_ranges=True), races=True),
    # fused dQ (each warpgroup's own partial), bottom-right causal: rows past the diagonal's
    # reach see no key, so a warpgroup of the last dQ tiles meets nothing
    Case("wg_ranges_fused_window_br_empty_rows", T=256, S=192, N=2, K=2, window=(60, 0),
         bottom_right=True, softmax="off_by_one", blocks=BBS(num_stages=2, fused_dq=True, wg_ranges=True)),
    # the tuner's fused window candidate with overlap (d128, GQA), races on
    Case("wg_ranges_fused_overlap_d128_window_gqa", T=256, S=256, N=2, K=1, Dqk=128, Dv=128,
         window=(70, 0), blocks=BBS(num_stages=2, fused_dq=True, wg_ranges=True, overlap=True),
         races=True),
    # persistent_dq: the interpreter's few CTAs each loop over several (batch, head, q tile)
    # tiles, the ring running on across them; with wg_ranges, tails and rows that see no key
    Case("persistent_dq_wg_ranges_window_tails_empty_rows", T=300, S=200, N=3, K=1, window=(40, 0),
         bottom_right=True, cap=1.5, blocks=BBS(num_stages=2, wg_ranges=True, persistent_dq=True),
         races=True),
    # delta_in_dq: the dQ kernel computes delta from O and dO and writes it for the dK/dV
    # kernel (run after it); persistent (delta_smem rewritten per tile), a learnable sink
    # (dsink from the kernel's delta), tails
    Case("delta_in_dq_persistent_causal_gqa_tails_learnable", T=200, S=264, N=2, K=1,
         window=(-1, 0), bottom_right=True, softmax="learnable",
         blocks=BBS(num_stages=2, persistent_dq=True, delta_in_dq=True), races=True),
    # persistent_dq under a causal mask: the query-tile-major order (3 CTAs over 4 x 2 tiles)
    Case("persistent_dq_causal_q_major_gqa", T=256, S=256, N=2, K=1, window=(-1, 0),
         blocks=dataclasses.replace(ONE_WG, persistent_dq=True)),
    # tma_tails: q, dO, O, k, v of lengths that are multiples of 8 (not of the tiles) read in
    # place, TMA filling the rows past their ends with zeros, dQ, dK, dV written in place; the
    # two-kernel form with delta from O (the dQ kernel's tail tile past T), then the fused one
    # whose second warpgroup's keys 192..255 lie wholly past S (a load all of zeros)
    Case("tma_tails_delta_in_dq_causal_gqa", T=200, S=136, N=2, K=1, window=(-1, 0),
         blocks=BBS(num_stages=2, delta_in_dq=True, tma_tails=True), races=True),
    Case("tma_tails_fused_columns_d128_learnable", T=200, S=136, N=2, K=1, Dqk=128, Dv=64,
         softmax="learnable", blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True,
                                         tma_tails=True)),
    # fold_stats: Sᵀ's and dPᵀ's accumulators start from -lse / scale and -delta; bottom-right
    # causal with T > S (rows that see no key: EMPTY_ROW_LSE folded in, masked away), tails,
    # the fused form by columns
    Case("fold_stats_fused_columns_d128_empty_rows_tails", T=200, S=136, N=2, K=1, Dqk=128,
         Dv=64, window=(-1, 0), bottom_right=True,
         blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True, fold_stats=True)),
    # dq_writer: the memory warpgroup's second warp issues the partial dQ's reduce-adds
    # (races on: the dq_full / dq_empty hand-off); by columns with both new options and tails
    Case("dq_writer_fold_columns_d128_causal_gqa_tails", T=200, S=136, N=2, K=1, Dqk=128, Dv=64,
         window=(-1, 0), blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True, dq_writer=True,
                                    fold_stats=True), races=True),
    # ds_sync: the dSᵀ exchange through a named barrier (races on: its fence and bar.sync)
    Case("ds_sync_columns_d128_window_tails", T=200, S=264, N=2, K=1, Dqk=128, Dv=128,
         window=(50, 0), blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True, ds_sync=True),
         races=True),
    # d256: delta summed over O's and dO's two 128-column slices
    Case("delta_in_dq_d256_column_slices", T=128, S=128, N=1, K=1, Dqk=256, Dv=256, window=(-1, 0),
         blocks=dataclasses.replace(ONE_WG, num_stages=1, split_dkv=True, delta_in_dq=True)),
]
GPU_CASES = [  # default tiles (3 stages, 2 warpgroups), many ring wraps; d256 and MLA 192/128
    # run in the interpreter before the H200 passed them (2026-12-01); GPU only for CI time
    Case("learnable_cap_window_tails", T=72, S=200, K=1, window=(30, 10), cap=2.0,
         softmax="learnable", blocks=ONE_WG),
    # the split dK/dV passes (what d256 and MLA 192/128 take), here at d64 with a sink
    Case("split_dkv_passes_learnable_gqa", T=128, S=192, N=2, K=1, window=(-1, 0),
         softmax="learnable", blocks=dataclasses.replace(ONE_WG, split_dkv=True)),
    Case("full_tails", T=200, S=136, N=1, K=1, blocks=None, races=True),  # default_for tiles
    # Keys past 127 are seen by no query: their tiles are skipped and get exactly zero.
    Case("window_left_unseen_keys", T=128, S=256, N=1, K=1, window=(40, 0), blocks=ONE_WG),
    Case("off_by_one_empty_rows", T=128, S=64, N=1, K=1, window=(-1, 0), bottom_right=True,
         softmax="off_by_one", blocks=ONE_WG),
    # a head dim off the 128-byte swizzle (64-byte rows) with GQA
    Case("d96_causal_gqa_64b_swizzle", T=128, S=192, N=2, K=1, Dqk=96, Dv=96, window=(-1, 0),
         blocks=ONE_WG),
    # band-mask cases the interpreter cases already cover in combination (CI time)
    # T > S bottom-right: the first 192 query rows see no key (a whole dQ tile has lo == hi).
    Case("empty_rows", T=256, S=64, N=1, K=1, window=(-1, 0), bottom_right=True),
    # 4 x 4 tiles: skipped, masked and unmasked ones, and G = 2 query heads per dK/dV CTA.
    Case("causal_gqa", T=256, S=256, N=2, K=1, window=(-1, 0), blocks=ONE_WG),
    Case("window_both_sides_mqa", N=2, K=1, window=(30, 20)),
    Case("causal_bottom_right", T=128, S=256, N=1, K=1, window=(-1, 0), bottom_right=True),
    Case("gpu_d256_causal_split_dkv", T=1000, S=1000, N=4, K=2, Dqk=256, Dv=256, window=(-1, 0),
         blocks=None),
    Case("gpu_mla_192_128_window", T=700, S=900, N=4, K=1, Dqk=192, Dv=128, window=(200, 0),
         bottom_right=True, blocks=None),
    Case("gpu_d128_causal_gqa", T=1024, S=1024, N=8, K=2, Dqk=128, Dv=128, window=(-1, 0),
         blocks=None),
    Case("gpu_d64_window_tails_br", T=1000, S=1100, N=4, K=4, window=(256, 0),
         bottom_right=True, blocks=None),
    # the fused backward (not yet compiled on a GPU when written, 2026-12-02)
    Case("gpu_fused_dq_d128_causal_gqa", T=1024, S=1024, N=8, K=2, Dqk=128, Dv=128,
         window=(-1, 0), blocks=BBS(num_stages=2, fused_dq=True)),
    Case("gpu_fused_dq_d64_window_tails_br", T=1000, S=1100, N=4, K=4, window=(256, 0),
         bottom_right=True, blocks=BBS(num_stages=2, fused_dq=True)),
    Case("gpu_fused_dq_d128_full_tails", T=700, S=900, N=4, K=4, Dqk=128, Dv=128,
         blocks=BBS(num_stages=2, fused_dq=True)),
    Case("gpu_fused_dq_mla_128_64_f16", T=512, S=512, N=4, K=1, Dqk=128, Dv=64, window=(-1, 0),
         dtype="float16", blocks=BBS(num_stages=2, fused_dq=True)),
    Case("gpu_fused_dq_stagger_d128_full", T=1024, S=1024, N=4, K=4, Dqk=128, Dv=128,
         window=(-1, -1), blocks=BBS(num_stages=2, fused_dq=True, stagger_q=True)),
    Case("gpu_fused_dq_stagger_d64_full_tails", T=1000, S=1000, N=4, K=2, window=(-1, -1),
         blocks=BBS(block_q=128, num_stages=2, fused_dq=True, stagger_q=True)),
    Case("gpu_fused_dq_off_by_one_empty_rows", T=128, S=64, N=1, K=1, window=(-1, 0),
         bottom_right=True, softmax="off_by_one", blocks=dataclasses.replace(ONE_WG, fused_dq=True)),
    # dQ by columns: passed on the H200 at 55bed4f, except window_br_cap, whose first config
    # did not fit (fixed after; not yet run on a GPU)
    Case("gpu_fused_dq_columns_d128_causal_gqa", T=1024, S=1024, N=8, K=2, Dqk=128, Dv=128,
         window=(-1, 0), blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True)),
    Case("gpu_fused_dq_columns_d128_full_tails_stagger", T=700, S=900, N=4, K=4, Dqk=128, Dv=128,
         blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True, stagger_q=True)),
    Case("gpu_fused_dq_columns_d128_window_br_cap", T=1000, S=1100, N=4, K=2, Dqk=128, Dv=128,
         window=(256, 0), bottom_right=True, cap=2.0, softmax="learnable",
         blocks=BBS(num_stages=1, fused_dq=True, dq_columns=True)),
    Case("gpu_fused_dq_columns_mla_128_64_f16", T=512, S=512, N=4, K=1, Dqk=128, Dv=64,
         window=(-1, 0), dtype="float16", blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True)),
    # overlap (GEMMs under the step's arithmetic): written 2026-12-05 without a GPU, lowered for
    # cuda on CPU (test_gpu_path_lowers_for_cuda); these are its first compiled runs
    Case("gpu_overlap_d128_causal_gqa_tails", T=1000, S=1000, N=8, K=2, Dqk=128, Dv=128,
         window=(-1, 0), blocks=BBS(num_stages=2, block_kv_dq=128, overlap=True)),
    Case("gpu_overlap_d128_full_cap_learnable", T=700, S=900, N=4, K=4, Dqk=128, Dv=128,
         cap=2.0, softmax="learnable", blocks=BBS(num_stages=2, overlap=True)),
    Case("gpu_overlap_diagonal_one_wg_empty_rows", T=200, S=128, N=2, K=1, window=(0, 0),
         softmax="off_by_one", blocks=dataclasses.replace(ONE_WG, overlap=True)),
    Case("gpu_overlap_fused_columns_d128_causal", T=1024, S=1024, N=4, K=2, Dqk=128, Dv=128,
         window=(-1, 0), blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True, overlap=True)),
    Case("gpu_overlap_fused_d64_full_tails_stagger", T=1000, S=1000, N=4, K=2, window=(-1, -1),
         blocks=BBS(block_q=128, num_stages=2, fused_dq=True, stagger_q=True, overlap=True)),
    Case("gpu_overlap_fused_mla_128_64_f16_window", T=512, S=600, N=4, K=1, Dqk=128, Dv=64,
         window=(100, 20), dtype="float16",
         blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True, overlap=True)),
    # wg_ranges (each warpgroup its own tiles; written 2026-12-05 without a GPU): the window
    # anchor's form (128:8 heads scaled down, window (128, 0)), with overlap and 3 stages,
    # causal tails, fused, a cap with a learnable sink
    Case("gpu_wg_ranges_d128_window_gqa", T=1024, S=1024, N=16, K=1, Dqk=128, Dv=128,
         window=(128, 0), blocks=BBS(num_stages=2, wg_ranges=True)),
    Case("gpu_wg_ranges_overlap_d128_window_tails", T=1000, S=1000, N=8, K=2, Dqk=128, Dv=128,
         window=(128, 0), blocks=BBS(num_stages=3, overlap=True, wg_ranges=True)),
    Case("gpu_wg_ranges_d128_causal_tails_br", T=700, S=900, N=4, K=4, Dqk=128, Dv=128,
         window=(-1, 0), bottom_right=True, blocks=BBS(num_stages=2, wg_ranges=True)),
    Case("gpu_wg_ranges_fused_d64_window_cap_learnable", T=1000, S=1100, N=4, K=4,
         window=(200, 30), cap=2.0, softmax="learnable",
         blocks=BBS(num_stages=2, fused_dq=True, wg_ranges=True)),
    # the fused form on each warpgroup's own tiles at the window anchor's form (128:8 heads
    # scaled down, window (128, 0)), without and with overlap (2026-12-07: the tuner's third
    # and fourth window candidates)
    Case("gpu_wg_ranges_fused_d128_window_gqa", T=1024, S=1024, N=16, K=1, Dqk=128, Dv=128,
         window=(128, 0), blocks=BBS(num_stages=2, fused_dq=True, wg_ranges=True)),
    Case("gpu_wg_ranges_fused_overlap_d128_window_gqa_tails", T=1000, S=1000, N=16, K=1,
         Dqk=128, Dv=128, window=(128, 0),
         blocks=BBS(num_stages=2, fused_dq=True, wg_ranges=True, overlap=True)),
    # persistent_dq (written 2026-12-05 without a GPU): 132 CTAs over every tile
    Case("gpu_persistent_dq_wg_ranges_d128_window_gqa", T=1024, S=1024, N=16, K=1, Dqk=128,
         Dv=128, window=(128, 0), blocks=BBS(num_stages=2, wg_ranges=True, persistent_dq=True)),
    Case("gpu_persistent_dq_d128_causal_tails_learnable", T=1000, S=1000, N=8, K=2, Dqk=128,
         Dv=128, window=(-1, 0), softmax="learnable",
         blocks=BBS(num_stages=2, block_kv_dq=128, persistent_dq=True)),
    Case("gpu_persistent_dq_d64_full_br_one_wg", T=200, S=300, N=4, K=1, bottom_right=True,
         window=(-1, 0), blocks=dataclasses.replace(ONE_WG, persistent_dq=True)),
    # delta_in_dq (written 2026-12-05 without a GPU): the window anchor's entry with it, and
    # the two-kernel default's tiles under a causal mask with a learnable sink
    Case("gpu_delta_in_dq_window_persistent_wg_ranges", T=1024, S=1024, N=16, K=1, Dqk=128,
         Dv=128, window=(128, 0),
         blocks=BBS(num_stages=2, wg_ranges=True, persistent_dq=True, delta_in_dq=True)),
    Case("gpu_delta_in_dq_d128_causal_tails_learnable", T=1000, S=1000, N=8, K=2, Dqk=128,
         Dv=128, window=(-1, 0), softmax="learnable", blocks=BBS(num_stages=2, delta_in_dq=True)),
    Case("gpu_delta_in_dq_mla_128_64_f16", T=512, S=512, N=4, K=1, Dqk=128, Dv=64,
         window=(-1, 0), dtype="float16", blocks=BBS(num_stages=2, delta_in_dq=True)),
    # tma_tails (written 2026-12-06 without a GPU): the two-kernel default and the fused form
    # with lengths read in place, then lengths off the multiples of 8 (padded copies)
    Case("gpu_tma_tails_d128_causal_gqa", T=1000, S=904, N=8, K=2, Dqk=128, Dv=128,
         window=(-1, 0), bottom_right=True, blocks=BBS(num_stages=2, tma_tails=True)),
    Case("gpu_tma_tails_fused_columns_d128_full", T=712, S=904, N=4, K=4, Dqk=128, Dv=128,
         blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True, tma_tails=True)),
    # fold_stats (written 2026-12-07 without a GPU): the table's causal d128 fused form, the
    # two-kernel form with overlap, tails with rows that see no key, MLA in f16
    Case("gpu_fold_stats_overlap_fused_columns_d128_causal", T=1024, S=1024, N=8, K=2, Dqk=128,
         Dv=128, window=(-1, 0), blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True,
                                            overlap=True, fold_stats=True)),
    Case("gpu_fold_stats_overlap_d128_causal_gqa_tails_br", T=1000, S=904, N=8, K=2, Dqk=128,
         Dv=128, window=(-1, 0), bottom_right=True, softmax="learnable",
         blocks=BBS(num_stages=2, overlap=True, fold_stats=True)),
    Case("gpu_dq_writer_fold_overlap_columns_d128_causal_gqa", T=1024, S=1024, N=8, K=2,
         Dqk=128, Dv=128, window=(-1, 0), blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True,
                                                     overlap=True, dq_writer=True, fold_stats=True)),
    Case("gpu_ds_sync_writer_fold_overlap_columns_d128_causal", T=1024, S=1024, N=8, K=2,
         Dqk=128, Dv=128, window=(-1, 0), blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True,
                                                     overlap=True, dq_writer=True, ds_sync=True,
                                                     fold_stats=True)),
    Case("gpu_ds_sync_columns_d128_full_tails", T=700, S=904, N=4, K=4, Dqk=128, Dv=128,
         blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True, ds_sync=True)),
    Case("gpu_dq_writer_columns_d128_full_tails", T=700, S=904, N=4, K=4, Dqk=128, Dv=128,
         blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True, dq_writer=True)),
    Case("gpu_dq_writer_d64_window_tails_br", T=1000, S=1100, N=4, K=4, window=(256, 0),
         bottom_right=True, blocks=BBS(num_stages=2, fused_dq=True, overlap=True, dq_writer=True)),
    # in the interpreter before CI time moved them here (2026-12-07): the two-kernel form's
    # fold under a two-sided window with a sink; the writer warp of one warpgroup, staggered
    Case("gpu_fold_stats_window_gqa_learnable", T=256, S=200, N=2, K=1, window=(40, 10),
         softmax="learnable", blocks=BBS(num_stages=2, fold_stats=True)),
    Case("gpu_dq_writer_one_wg_stagger_full", T=256, S=200, N=2, K=1, window=(-1, -1),
         blocks=dataclasses.replace(ONE_WG, fused_dq=True, stagger_q=True, dq_writer=True)),
    Case("gpu_fold_stats_empty_rows_one_wg", T=256, S=64, N=1, K=1, window=(-1, 0),
         bottom_right=True, blocks=dataclasses.replace(ONE_WG, fold_stats=True)),
    Case("gpu_fold_stats_fused_mla_128_64_f16_window", T=512, S=600, N=4, K=1, Dqk=128, Dv=64,
         window=(100, 20), dtype="float16",
         blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True, fold_stats=True)),
    Case("gpu_tma_tails_persistent_delta_window_odd", T=1001, S=999, N=8, K=1, Dqk=128,
         Dv=128, window=(128, 0), blocks=BBS(num_stages=2, wg_ranges=True, persistent_dq=True,
                                             delta_in_dq=True, tma_tails=True)),
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
    ks = jax.random.split(jax.random.key(seed), 5)
    shapes = [(1, case.T, case.N, case.Dqk), (1, case.S, case.K, case.Dqk),
              (1, case.S, case.K, case.Dv), (1, case.T, case.N, case.Dv)]
    q, k, v, do = (jax.random.normal(key, shape, jnp.float32).astype(case.dtype)
                   for key, shape in zip(ks, shapes))
    sink = None
    if case.softmax == "learnable":
        sink = jax.random.uniform(ks[4], (case.N,), jnp.float32, -1.5, 1.5)
    return q, k, v, do, sink


def check_case(case: Case, *, interpret):
    q, k, v, do, sink = make_inputs(case)
    spec = sm90.spec_for(q, k, v, scale=1.0 / np.sqrt(case.Dqk), window=case.window,
                         bottom_right=case.bottom_right, logits_soft_cap=case.cap,
                         softmax=case.softmax)

    @jax.jit  # one compilation instead of op-by-op dispatch: most of the time on CPU
    def ref_and_grads(q, k, v, sink, do):
        def ref(q, k, v, sink):
            return reference.attention(AttentionInputs(q, k, v, sink=sink), spec)

        with jax.default_matmul_precision("highest"):  # no TF32 in the reference on a GPU
            (out, lse), vjp = jax.vjp(ref, q, k, v, sink)
            return out, lse, vjp((do, jnp.zeros_like(lse)))

    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    out, lse, expected = ref_and_grads(*f32[:3], sink, f32[3])
    got = bwd.backward_spec(q, k, v, out.astype(q.dtype), lse, do, spec, sink=sink,
                            block_sizes=case.blocks, interpret=interpret)
    tol = 1e-2 if case.dtype == "bfloat16" else 2e-3
    for name, g, x, e in zip(("dq", "dk", "dv"), got, (q, k, v), expected):
        assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype)
        rel_l2(f"{case.name} {name}", g, e, tol)
    if case.softmax == "learnable":
        assert got[3].shape == (case.N,) and got[3].dtype == jnp.float32
        rel_l2(f"{case.name} dsink", got[3], expected[3], tol)
    else:
        assert got[3] is None
    vis = visible(case)
    empty_q, unseen_k = ~vis.any(axis=1), ~vis.any(axis=0)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32)[:, empty_q], 0.0)
    for g in got[1:3]:
        np.testing.assert_array_equal(np.asarray(g, np.float32)[:, unseen_k], 0.0)
    # the cases mean what they say
    assert case.name != "empty_rows" or empty_q.sum() == 192
    assert case.name != "tails_window_soft_cap_empty_rows" or empty_q.sum() == 104
    assert case.name != "window_left_unseen_keys" or unseen_k.sum() == 128


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_backward_interpret(case, interpreter):
    check_case(case, interpret=plgpu.InterpretGPUParams(detect_races=case.races))
    assert not (case.races and interpreter.get_races().races_found), f"{case.name}: a race"


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + GPU_CASES, ids=lambda c: c.name)
def test_backward_gpu(case):
    check_case(case, interpret=False)


@pytest.mark.parametrize("case", [
    Case("d128_gqa_window_cap_learnable", T=512, S=512, N=4, K=2, Dqk=128, Dv=128,
         window=(100, 0), cap=2.0, softmax="learnable", blocks=None),
    Case("d80_dv32_32b_swizzle_default_tiles", T=300, S=300, N=2, K=1, Dqk=80, Dv=32,
         window=(-1, 0), blocks=None),
    Case("d256_split_dkv_default_tiles", T=512, S=512, N=2, K=1, Dqk=256, Dv=256,
         window=(-1, 0), blocks=None),
    Case("mla_192_128_split_dkv_default_tiles", T=300, S=300, N=2, K=1, Dqk=192, Dv=128,
         blocks=None),
    Case("mla_128_64_f16_one_wg_tails", T=200, S=300, N=1, K=1, Dqk=128, Dv=64,
         window=(-1, 0), bottom_right=True, dtype="float16",
         blocks=dataclasses.replace(ONE_WG, num_stages=3)),
    # the fused kernel: TMA reduce-add into a jax.Ref, dSᵀ as WGMMA's transposed A; one launch
    Case("fused_dq_d128_causal_gqa", T=512, S=512, N=4, K=2, Dqk=128, Dv=128, window=(-1, 0),
         blocks=BBS(num_stages=2, fused_dq=True)),
    Case("fused_dq_stagger_d128_full", T=512, S=512, N=4, K=4, Dqk=128, Dv=128,
         blocks=BBS(num_stages=2, fused_dq=True, stagger_q=True)),
    Case("fused_dq_columns_d128_causal", T=512, S=512, N=4, K=2, Dqk=128, Dv=128, window=(-1, 0),
         blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True)),
    # overlap: the pipelined dK/dV step (its dV GEMM in flight under dSᵀ's arithmetic)
    Case("overlap_d128_causal_cap_learnable", T=512, S=520, N=4, K=2, Dqk=128, Dv=128,
         window=(-1, 0), cap=2.0, softmax="learnable", blocks=BBS(num_stages=2, overlap=True)),
    Case("overlap_fused_columns_d128_window", T=512, S=512, N=4, K=2, Dqk=128, Dv=128,
         window=(64, 0), blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True, overlap=True)),
    Case("overlap_fused_d64_one_wg", T=200, S=300, N=2, K=1, window=(-1, -1),
         blocks=dataclasses.replace(ONE_WG, fused_dq=True, overlap=True)),
    Case("wg_ranges_overlap_d128_window", T=512, S=512, N=4, K=1, Dqk=128, Dv=128,
         window=(128, 0), blocks=BBS(num_stages=3, overlap=True, wg_ranges=True)),
    Case("persistent_dq_wg_ranges_d128_window", T=512, S=512, N=4, K=1, Dqk=128, Dv=128,
         window=(128, 0), blocks=BBS(num_stages=2, wg_ranges=True, persistent_dq=True)),
    Case("wg_ranges_fused_overlap_d128_window", T=512, S=512, N=16, K=1, Dqk=128, Dv=128,
         window=(128, 0), blocks=BBS(num_stages=2, fused_dq=True, wg_ranges=True, overlap=True)),
    Case("delta_in_dq_persistent_d128_window", T=512, S=512, N=4, K=1, Dqk=128, Dv=128,
         window=(128, 0), blocks=BBS(num_stages=2, wg_ranges=True, persistent_dq=True,
                                     delta_in_dq=True)),
    Case("delta_in_dq_mla_128_64", T=512, S=512, N=4, K=1, Dqk=128, Dv=64, window=(-1, 0),
         blocks=BBS(num_stages=2, delta_in_dq=True)),
    Case("tma_tails_fused_columns_d128", T=1000, S=904, N=4, K=2, Dqk=128, Dv=128,
         window=(-1, 0), blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True, tma_tails=True)),
    Case("tma_tails_delta_in_dq_persistent_d128", T=1000, S=904, N=4, K=1, Dqk=128, Dv=128,
         window=(128, 0), blocks=BBS(num_stages=2, wg_ranges=True, persistent_dq=True,
                                     delta_in_dq=True, tma_tails=True)),
    # fold_stats: the accumulators' initial values (run_state over ACC.init), each form
    Case("fold_stats_overlap_fused_columns_d128_causal", T=512, S=512, N=4, K=2, Dqk=128,
         Dv=128, window=(-1, 0), blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True,
                                            overlap=True, fold_stats=True)),
    Case("dq_writer_fold_overlap_columns_d128_causal", T=512, S=512, N=4, K=2, Dqk=128,
         Dv=128, window=(-1, 0), blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True,
                                            overlap=True, dq_writer=True, fold_stats=True)),
    Case("ds_sync_writer_fold_overlap_columns_d128_causal", T=512, S=512, N=4, K=2, Dqk=128,
         Dv=128, window=(-1, 0), blocks=BBS(num_stages=2, fused_dq=True, dq_columns=True,
                                            overlap=True, dq_writer=True, ds_sync=True,
                                            fold_stats=True)),
    Case("fold_stats_d64_window_one_wg", T=200, S=300, N=2, K=1, window=(40, 0),
         blocks=dataclasses.replace(ONE_WG, fold_stats=True)),
    Case("fold_stats_overlap_d128_cap_unfolded", T=512, S=512, N=4, K=2, Dqk=128, Dv=128,
         cap=2.0, blocks=BBS(num_stages=2, overlap=True, fold_stats=True)),
    # d256: delta summed over two 128-column slices of O and dO (one warpgroup, one stage)
    Case("delta_in_dq_d256_split_dkv_one_wg", T=256, S=256, N=2, K=1, Dqk=256, Dv=256,
         window=(-1, 0), blocks=dataclasses.replace(ONE_WG, num_stages=1, split_dkv=True,
                                                    delta_in_dq=True)),
], ids=lambda c: c.name)
def test_gpu_path_lowers_for_cuda(case, monkeypatch):
    """The compiled path (register A operands, in-place accumulators) lowers through Mosaic GPU
    on a machine without a GPU, and Mosaic's shared-memory count stays within smem_bytes."""
    import jax.experimental.mosaic.gpu.core as mosaic_core

    counted, tree_size = [], mosaic_core._smem_tree_size

    def count(tree):  # Mosaic's shared-memory total of a kernel, recorded per launch
        counted.append(tree_size(tree))
        return counted[-1]

    monkeypatch.setattr(mosaic_core, "_smem_tree_size", count)
    q, k, v, do, sink = make_inputs(case)
    spec = sm90.spec_for(q, k, v, scale=0.1, window=case.window, bottom_right=case.bottom_right,
                         logits_soft_cap=case.cap, softmax=case.softmax)
    lse = jnp.zeros((1, case.N, case.T), jnp.float32)
    f = jax.jit(lambda *a: bwd.backward_spec(*a, spec, sink=sink, block_sizes=case.blocks))
    f.trace(q, k, v, do, lse, do).lower(lowering_platforms=("cuda",))
    blocks = bwd.default_for(spec) if case.blocks is None else case.blocks
    estimate = blocks.smem_bytes(spec)
    if blocks.fused_dq:  # no dQ kernel
        assert len(counted) == 1 and set(estimate) == {"dkv"}, (counted, estimate)
        assert counted[0] <= estimate["dkv"], (counted, estimate)
        return
    if blocks.delta_in_dq:  # the dQ kernel runs first (it writes delta)
        dq, *dkv = counted
    else:
        *dkv, dq = counted  # the split dK/dV passes are two launches
    assert len(dkv) == (2 if blocks.split_dkv else 1), counted
    assert max(dkv) <= estimate["dkv"] and dq <= estimate["dq"], (counted, estimate)


@pytest.mark.parametrize("tails, lengths", [(False, (256, 256, 256, 256)),
                                             (True, (200, 136, 136, 136))])
def test_tma_tails_reads_lengths_in_place(tails, lengths):
    """The dK/dV kernel's q, k, v operands and dk (axis 1) with and without tma_tails: T = 200
    and S = 136 in place, or padded to the tiles' multiples (256)."""
    case = Case("lengths", T=200, S=136)
    q, k, v, do, _ = make_inputs(case)
    spec = sm90.spec_for(q, k, v, scale=0.1)
    lse = jnp.zeros((1, case.N, case.T), jnp.float32)
    blocks = BBS(num_stages=2, tma_tails=tails)
    f = lambda *a: bwd.backward_spec(*a, spec, block_sizes=blocks)
    assert kernel_lengths(f, q, k, v, do, lse, do) == lengths


@pytest.mark.parametrize("T,S,window,bottom_right,bq,bkv", [
    (256, 256, (-1, 0), False, 64, 128), (200, 136, (-1, -1), False, 64, 64),
    (128, 256, (40, 0), False, 64, 64), (72, 200, (30, 10), False, 64, 64),
    (256, 64, (-1, 0), True, 64, 128), (1000, 1100, (256, 0), True, 64, 128),
    (130, 500, (5, 300), True, 128, 64), (300, 70, (0, 0), False, 64, 64),
    (513, 257, (-1, 3), False, 64, 128), (90, 330, (100, -1), True, 128, 128),
])
def test_band_q_range_matches_q_ranges(T, S, window, bottom_right, bq, bkv):
    kv = jnp.zeros((1, S, 1, 64), jnp.bfloat16)
    spec = sm90.spec_for(jnp.zeros((1, T, 1, 64), jnp.bfloat16), kv, kv, scale=1.0,
                         window=window, bottom_right=bottom_right)
    expected = q_ranges(spec, bq, bkv)
    kw = dict(q_len=T, kv_len=S, window=window, diagonal_offset=spec.diagonal_offset,
              block_q=bq, block_kv=bkv)
    tiles = np.arange(-(-S // bkv), dtype=np.int32)
    for got in (band_q_range(tiles, **kw), jax.jit(lambda t: band_q_range(t, **kw))(tiles)):
        for field, g, e in zip(expected._fields, got, expected):
            np.testing.assert_array_equal(np.asarray(g), e, err_msg=field)
    # a key tile made only of padding (the wrapper's lcm padding) sees nothing
    past = band_q_range(np.int32(-(-S // bkv)), **kw)
    assert all(int(x) == 0 for x in past)


@pytest.mark.parametrize("T,S,window,bottom_right,rows_q,rows_kv,W", [
    (300, 260, (40, 10), False, 64, 64, 2), (256, 192, (60, 0), True, 64, 64, 2),
    (4096, 4096, (128, 0), False, 64, 64, 2), (1000, 1100, (200, 30), True, 64, 64, 2),
    (513, 257, (-1, 3), False, 128, 64, 2), (700, 900, (-1, 0), True, 64, 64, 2),
])
def test_wg_ranges_cover_every_visible_pair(T, S, window, bottom_right, rows_q, rows_kv, W):
    """What wg_ranges lets a warpgroup pass over holds no pair its own rows see: per dK/dV CTA
    (W * rows_kv keys, query steps of rows_q) and per dQ CTA (W * rows_q queries, key steps of
    rows_kv), every streamed tile outside a warpgroup's clamped range is invisible to its rows,
    and the FULL run is fully visible to them. The window anchor's form saves a step per head."""
    from flashmesh.attention.pallas_mosaic_gpu_ranges import band_kv_range, clamp_within

    kv = jnp.zeros((1, S, 1, 64), jnp.bfloat16)
    spec = sm90.spec_for(jnp.zeros((1, T, 1, 64), jnp.bfloat16), kv, kv, scale=1.0,
                         window=window, bottom_right=bottom_right)
    vis = visible(Case("v", T=T, S=S, window=window, bottom_right=bottom_right))
    kw = dict(q_len=T, kv_len=S, window=window, diagonal_offset=spec.diagonal_offset)
    passed_over = 0
    for band, step, own_rows, transpose in ((band_q_range, rows_q, rows_kv, True),
                                            (band_kv_range, rows_kv, rows_q, False)):
        grid = vis.T if transpose else vis  # [own axis, streamed axis]
        for tile in range(-(-grid.shape[0] // (W * own_rows))):
            cta = band(np.int32(tile), block_q=step if transpose else W * own_rows,
                       block_kv=W * own_rows if transpose else step, **kw)
            for w in range(W):
                sub = band(np.int32(tile * W + w), block_q=step if transpose else own_rows,
                           block_kv=own_rows if transpose else step, **kw)
                own = clamp_within(cta, sub)
                assert cta.lo <= own.lo <= own.full_lo <= own.full_hi <= own.hi <= cta.hi
                rows = grid[(tile * W + w) * own_rows:(tile * W + w + 1) * own_rows]
                for s in range(int(cta.lo), int(cta.hi)):
                    seen = rows[:, s * step:(s + 1) * step]
                    if not own.lo <= s < own.hi:
                        assert not seen.any(), (tile, w, s)
                        passed_over += 1
                    elif own.full_lo <= s < own.full_hi:  # (a query tail may be FULL: its
                        # padded rows carry dO = 0; a key tile past S never is)
                        assert seen.all() and (transpose or seen.shape[1] == step), (tile, w, s)
    if window == (128, 0):  # per head, each kernel: 2 of an inner CTA's 8 warpgroup-steps
        # (4 streamed tiles, 3 per warpgroup), 1 of the edge CTA's 4: 63 of 252, a quarter
        assert passed_over == 2 * (31 * 2 + 1), passed_over
    else:
        assert passed_over > 0


def test_block_sizes_and_refusals():
    with pytest.raises(ValueError, match=r"BackwardBlockSizes.block_kv=96 must be a positive "
                                         r"multiple of 64 \* num_compute_wgs = 128"):
        BBS(block_kv=96)
    with pytest.raises(ValueError, match=r"BackwardBlockSizes.block_q=32 must be a multiple of 64"):
        BBS(block_q=32)
    with pytest.raises(ValueError, match="BackwardBlockSizes.num_stages=0"):
        BBS(num_stages=0)
    with pytest.raises(ValueError, match="compute_registers=248 \\* num_compute_wgs=2"):
        BBS(compute_registers=248)
    q = jnp.zeros((1, 128, 2, 128), jnp.bfloat16)
    spec = sm90.spec_for(q, q, q, scale=0.1)
    # d128 bf16, dK/dV: 4 stages x 64 rows x (2 * 256 B + 8 B of lse, delta) + 128 keys x 512 B;
    # dQ: 128 rows x 520 B + 4 stages x 64 keys x 512 B; each + 2 KiB of slack (Mosaic counted
    # 198848 bytes for both when lowering for cuda). 5 stages do not fit.
    assert BBS(num_stages=4).smem_bytes(spec) == {"dkv": 4 * 64 * 520 + 128 * 512 + 2048,
                                                  "dq": 128 * 520 + 4 * 64 * 512 + 2048}
    with pytest.raises(ValueError, match=r"num_stages=5.*dkv kernel needs 233984 bytes"):
        BBS(num_stages=5).validate_for(spec)
    # the table's backward_entries where their config fits, else the untuned rule (3 stages)
    assert bwd.default_for(spec) == BBS(block_kv_dq=128, num_stages=2)
    window = dataclasses.replace(spec, window=(64, 0))
    assert bwd.default_for(window) == BBS(num_stages=3)
    d64 = sm90.spec_for(*(jnp.zeros((1, 128, 2, 64), jnp.bfloat16),) * 3, scale=0.1, window=(-1, 0))
    assert bwd.default_for(d64) == BBS(block_q=128, num_stages=2, fused_dq=True)
    reproducible = dataclasses.replace(d64, reproducible=True)
    assert not bwd.default_for(reproducible).fused_dq  # reductions in a fixed order
    with pytest.raises(ValueError, match="fused_dq=True cannot give reproducible=True"):
        BBS(fused_dq=True).validate_for(reproducible)
    assert not bwd.default_for(dataclasses.replace(d64, bias_shape=(1, 1, 128, 128))).fused_dq
    # d256 and MLA 192/128: dK, dV, Sᵀ, dPᵀ in f32 and Pᵀ, dSᵀ in 16 bits need more than 240
    # registers at once (256 for 192/128), so they take the split dK/dV passes (d256 with one
    # stage: K, V of 128 keys and one ring slot of Q, dO fill 192 KiB)
    d256 = jnp.zeros((1, 128, 2, 256), jnp.bfloat16)
    big = sm90.spec_for(d256, d256, d256, scale=0.1)
    assert BBS().registers(big)["dkv"] > 240
    assert bwd.default_for(big) == BBS(split_dkv=True, num_stages=1)
    mla = sm90.spec_for(*(jnp.zeros((1, 128, 2, d), jnp.bfloat16) for d in (192, 192, 128)), scale=0.1)
    assert BBS().registers(mla)["dkv"] == 256 and bwd.default_for(mla).split_dkv
    assert BBS(split_dkv=True).registers(mla)["dkv"] <= 240
    with pytest.raises(ValueError, match="split_dkv=1 must be a bool"):
        BBS(split_dkv=1)
    with pytest.raises(ValueError, match="overlap=1 must be a bool"):
        BBS(overlap=1)
    with pytest.raises(ValueError, match="overlap=True needs split_dkv=False"):
        BBS(overlap=True, split_dkv=True)
    with pytest.raises(ValueError, match="stagger_q=True needs fused_dq=True"):
        BBS(stagger_q=True)
    with pytest.raises(ValueError, match="ds_sync=True needs dq_columns=True"):
        BBS(fused_dq=True, ds_sync=True)
    with pytest.raises(ValueError, match="dq_writer=True needs fused_dq=True"):
        BBS(dq_writer=True)
    with pytest.raises(ValueError, match="dq_writer=True needs wg_ranges=False"):
        BBS(fused_dq=True, dq_writer=True, wg_ranges=True)
    with pytest.raises(ValueError, match="fused_dq=True needs split_dkv=False"):
        BBS(fused_dq=True, split_dkv=True)
    with pytest.raises(ValueError, match="fused_dq=True cannot take a bias"):
        BBS(fused_dq=True).validate_for(dataclasses.replace(spec, bias_shape=(1, 1, 128, 128)))
    # fused, d128 bf16: the dK/dV kernel plus dSᵀ (128 keys x 64 queries x 2 B) and each
    # warpgroup's float32 partial dQ (64 x 128 x 4 B); the accumulators peak at dK, dV and
    # then dQ with the 16-bit dSᵀ, Pᵀ: 128 + max(64 + 16, 64 + 32) = 224 registers per thread
    fused = BBS(num_stages=2, fused_dq=True)
    assert fused.smem_bytes(spec) == {"dkv": 2 * 64 * 520 + 128 * 512 + 128 * 64 * 2 + 2 * 64 * 128 * 4 + 2048}
    assert fused.registers(spec) == {"dkv": 224}
    with pytest.raises(ValueError, match=r"num_stages=3.*dkv kernel needs"):
        BBS(num_stages=3, fused_dq=True).validate_for(spec)
    # dQ by columns: dSᵀ twice (by step parity), each partial dQ 64 x 64 x 4 B; the partial's
    # registers halve: 128 + max(64 + 16, 32 + 32) = 208
    columns = BBS(num_stages=2, fused_dq=True, dq_columns=True)
    assert columns.smem_bytes(spec) == {"dkv": 2 * 64 * 520 + 128 * 512 + 2 * 128 * 64 * 2 + 2 * 64 * 64 * 4 + 2048}
    assert columns.registers(spec) == {"dkv": 208}
    with pytest.raises(ValueError, match="dq_columns=True needs fused_dq=True and num_compute_wgs=2"):
        BBS(dq_columns=True)
    with pytest.raises(ValueError, match="dq_columns=True needs fused_dq=True and num_compute_wgs=2"):
        dataclasses.replace(ONE_WG, fused_dq=True, dq_columns=True)
    with pytest.raises(ValueError, match="dq_columns=True needs qk_dim a multiple of 128 for bfloat16"):
        columns.validate_for(d64)
    x = jnp.zeros((1, 128, 2, 128), jnp.bfloat16)
    lse = jnp.zeros((1, 2, 128), jnp.float32)
    bad = dataclasses.replace(spec, bias_shape=(1, 1, 128, 128))
    with pytest.raises(ValueError, match=r"bias must be a float array of shape \(1, 1, 128, 128\)"):
        bwd.backward_spec(x, x, x, x, lse, x, bad, bias=jnp.zeros((1, 2, 128, 128)), interpret=True)
    with pytest.raises(ValueError, match="segments='padding' needs tables"):
        bwd.backward_spec(x, x, x, x, lse, x, dataclasses.replace(spec, segments="padding"),
                          interpret=True)
    with pytest.raises(ValueError, match=r"lse.shape=\(1, 128, 2\) must be \(1, 2, 128\)"):
        bwd.backward_spec(x, x, x, x, lse.swapaxes(1, 2), x, spec, interpret=True)
    with pytest.raises(ValueError, match=r"softmax='learnable' needs sink of shape \(2,\)"):
        bwd.backward_spec(x, x, x, x, lse, x, dataclasses.replace(spec, softmax="learnable"),
                          interpret=True)
    with pytest.raises(NotImplementedError, match="qk_dim=24: must be a multiple of 16"):
        small = sm90.spec_for(x[..., :24], x[..., :24], x, scale=0.1)
        bwd.backward_spec(x[..., :24], x[..., :24], x, x, lse, x, small, interpret=True)
