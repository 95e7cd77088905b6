"""The Mosaic GPU kernels with packed segments, padding, explicit positions and a post-scale
bias, through the registered backend's custom VJP (`pallas_mosaic_gpu.attention_with`),
against the float32 reference: output, lse and dq, dk, dv (and dsink, dbias).

On CPU the kernels run in Mosaic GPU's interpreter (tiny shapes); the `gpu`-marked copies run
compiled on a Hopper GPU, plus 16 packed documents at the default tiles. Without a GPU the
compiled path is lowered for cuda (Mosaic's shared-memory count is checked against ours).

Cases: packed documents whose boundaries fall inside tiles, a trailing padding run, a window
(so positions are read) with GQA, tails (T not a tile multiple) and the learnable sink; padding
(one segment per row) for cross attention T != S without a window (ids only) with dropout;
a bias shared over the batch ([1, N, T, S]) with causal GQA, tails and the soft cap (the bias
joins the logit before the cap); a per-batch bias ([B, 1, T, S]) on the packed documents.
Padding tokens hold NaN in q, k, v and in the bias: they must not reach any output.

Tolerance: relative L2 error <= 1e-2 (bf16) per output and gradient, as the band-mask tests;
a wrong segment mask or tile range gives O(1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashmesh
from flashmesh.attention import pallas_mosaic_gpu as pmg
from flashmesh.attention import pallas_mosaic_gpu_sm90 as sm90
from flashmesh.attention import pallas_mosaic_gpu_sm90_bwd as bwd
from flashmesh.attention import pallas_mosaic_gpu_tokens as tokens
from flashmesh.attention.api import normalize
from flashmesh.attention.pallas_mosaic_gpu_common import BlockSizes
from flashmesh.attention.spec import EMPTY_ROW_LSE
from mosaic_testing import interpreter, rel_l2  # noqa: F401  (interpreter: a fixture)

FWD = BlockSizes(block_q=128, block_kv=64, num_stages=2, num_compute_wgs=2)
BWD = bwd.BackwardBlockSizes(block_q=64, block_kv=128, block_q_dq=128, block_kv_dq=64, num_stages=2)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_ids: tuple  # per batch row: (segment id, length) runs; id 0 is padding
    kv_ids: tuple | None = None  # None: the same as q_ids (self attention)
    N: int = 2
    K: int = 1
    D: int = 64
    mask: str = "causal"
    window: tuple[int, int] | None = None
    softmax: str = "vanilla"
    dropout_rate: float = 0.0
    seqlens: bool = False  # the descriptor from lengths (padding at the end) instead of ids
    bias: tuple[int, int] | None = None  # (B|1, N|1) of a bias [B|1, N|1, T, S]
    cap: float | None = None
    T: int = 200  # the lengths of a case without segments (q_ids None, batch 2)
    S: int = 136
    blocks: tuple | None = (FWD, BWD)  # None: the backend's defaults


def ids_of(runs) -> np.ndarray:
    return np.array([np.concatenate([np.full(n, i, np.int32) for i, n in row]) for row in runs])


PACKED = (((1, 50), (2, 40), (3, 36), (0, 10)), ((1, 90), (2, 46)))  # T = 136


CASES = []  # in the interpreter: FUSED_CASE below (the others passed on the H200, 2026-12-01)
GPU_CASES = [  # the default tiles; 16 documents of uneven lengths in T = 4096
    # run in the interpreter before the H200 passed them (2026-12-01); GPU only for CI time
    # Row 0: three documents (boundaries at 50 and 90, inside tiles) then 10 padding tokens;
    # row 1: two documents. A window of 40 on top of causal reads positions.
    # with the soft cap: a padding pair's cap slope is NaN (its bias is), its gradient still 0
    Case("packed_window_gqa_tails_learnable_bias_cap", q_ids=PACKED, window=(40, 0),
         softmax="learnable", bias=(2, 1), cap=5.0),
    # Cross attention with padding: 70 / 100 valid queries of 100, 110 / 40 valid keys of 110.
    Case("padding_cross_no_window_dropout", mask="none", dropout_rate=0.2, seqlens=True,
         q_ids=(((1, 70), (0, 30)), ((1, 100),)), kv_ids=(((1, 110),), ((1, 40), (0, 70)))),
    Case("bias_shared_causal_gqa_tails_cap", q_ids=None, bias=(1, 2), cap=5.0, T=136, S=100),
    Case("gpu_16_documents_causal_d128", N=8, K=2, D=128, blocks=None,
         q_ids=(tuple((i + 1, n) for i, n in enumerate(
             [97, 400, 31, 256, 512, 129, 64, 300, 199, 255, 257, 130, 70, 600, 300, 306])),)),
    # the fused backward (BackwardBlockSizes.fused_dq) over the block map's tile ranges, with
    # padding and dropout (not yet compiled on a GPU when written, 2026-12-02)
    Case("gpu_fused_dq_padding_cross_dropout", mask="none", dropout_rate=0.2, seqlens=True,
         q_ids=(((1, 70), (0, 30)), ((1, 100),)), kv_ids=(((1, 110),), ((1, 40), (0, 70))),
         blocks=(FWD, dataclasses.replace(BWD, fused_dq=True))),
    Case("gpu_fused_dq_columns_16_documents_causal_d128", N=8, K=2, D=128,
         blocks=(FWD, dataclasses.replace(BWD, fused_dq=True, dq_columns=True)),
         q_ids=(tuple((i + 1, n) for i, n in enumerate(
             [97, 400, 31, 256, 512, 129, 64, 300, 199, 255, 257, 130, 70, 600, 300, 306])),)),
    # the overlapped backward step (BackwardBlockSizes.overlap; written without a GPU, 2026-12-05)
    Case("gpu_overlap_packed_window_gqa_tails_learnable_bias_cap", q_ids=PACKED, window=(40, 0),
         softmax="learnable", bias=(2, 1), cap=5.0,
         blocks=(FWD, dataclasses.replace(BWD, overlap=True))),
    Case("gpu_overlap_fused_padding_cross_dropout", mask="none", dropout_rate=0.2, seqlens=True,
         q_ids=(((1, 70), (0, 30)), ((1, 100),)), kv_ids=(((1, 110),), ((1, 40), (0, 70))),
         blocks=(FWD, dataclasses.replace(BWD, fused_dq=True, overlap=True))),
    # wg_ranges (written 2026-12-05 without a GPU): a window with a bias (the dK/dV kernel
    # passes over tiles, the dQ kernel, which writes dbias, keeps the CTA's range) and with
    # packed documents (both warpgroups take the block map's range)
    Case("gpu_wg_ranges_window_bias_cap", q_ids=None, window=(40, 0), bias=(2, 1), cap=5.0,
         blocks=(FWD, dataclasses.replace(BWD, wg_ranges=True))),
    Case("gpu_wg_ranges_packed_window_dropout", q_ids=PACKED, window=(40, 0), dropout_rate=0.1,
         blocks=(FWD, dataclasses.replace(BWD, wg_ranges=True))),
    # fold_stats (written 2026-12-07 without a GPU): with a bias and a cap the usual form runs
    # (a finite additive mask makes |lse| large); 16 documents fused, the ids' mask folded
    Case("gpu_fold_stats_packed_window_gqa_tails_bias", q_ids=PACKED, window=(40, 0),
         bias=(2, 1), blocks=(FWD, dataclasses.replace(BWD, fold_stats=True, overlap=True))),
    Case("gpu_fold_stats_fused_columns_16_documents_causal_d128", N=8, K=2, D=128,
         blocks=(FWD, dataclasses.replace(BWD, fused_dq=True, dq_columns=True, overlap=True,
                                          fold_stats=True, dq_writer=True)),
         q_ids=(tuple((i + 1, n) for i, n in enumerate(
             [97, 400, 31, 256, 512, 129, 64, 300, 199, 255, 257, 130, 70, 600, 300, 306])),)),
    # delta_in_dq (written 2026-12-05 without a GPU): delta from the dQ kernel, persistent, with
    # padding, dropout and a bias
    Case("gpu_delta_in_dq_persistent_padding_cross_dropout_bias", mask="none", dropout_rate=0.2,
         seqlens=True, bias=(2, 1), q_ids=(((1, 70), (0, 30)), ((1, 100),)),
         kv_ids=(((1, 110),), ((1, 40), (0, 70))),
         blocks=(FWD, dataclasses.replace(BWD, delta_in_dq=True, persistent_dq=True))),
]
# In the interpreter: the fused backward with packed documents, a window and dropout; delta
# computed by the dQ kernel under dropout (its (1 - r)) with a learnable sink (dsink from it).
FUSED_CASE = Case("fused_dq_packed_window_dropout", q_ids=PACKED, window=(40, 0), dropout_rate=0.25,
                  blocks=(FWD, dataclasses.replace(BWD, fused_dq=True)))
# fold_stats over the block map's tiles (the ids' mask on an accumulator that holds s - lse/c;
# GPU only for CI time: the interpreter runs the fold under band masks in the backward's file)
FOLD_CASE = Case("fold_stats_packed_window_gqa_tails", q_ids=PACKED, window=(40, 0),
                 blocks=(FWD, dataclasses.replace(BWD, fold_stats=True)))
DELTA_CASE = Case("delta_in_dq_packed_window_dropout_learnable", q_ids=PACKED, window=(40, 0),
                  dropout_rate=0.25, softmax="learnable",
                  blocks=(FWD, dataclasses.replace(BWD, delta_in_dq=True)))


def visible(case: Case, q_ids, kv_ids) -> np.ndarray:
    """bool [B, T, S], built here from the ids (self attention or no segments; positions are
    offsets from each segment's start, the descriptor's default)."""
    def positions(ids):
        idx = np.arange(ids.shape[1])
        starts = np.array([[np.flatnonzero(row == row[i])[0] for i in idx] for row in ids])
        return idx[None] - starts

    vis = (q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids != 0)[:, :, None]
    if case.mask == "causal" or case.window is not None:
        d = positions(q_ids)[:, :, None] - positions(kv_ids)[:, None, :]
        left, right = case.window or (-1, 0)
        vis &= (d <= left) if left >= 0 else True
        vis &= d >= -right
    return vis


def make(case: Case, seed: int = 0):
    if case.q_ids is None:  # no segments: every token valid
        q_ids, kv_ids = np.ones((2, case.T), np.int32), np.ones((2, case.S), np.int32)
    else:
        q_ids = ids_of(case.q_ids)
        kv_ids = q_ids if case.kv_ids is None else ids_of(case.kv_ids)
    (B, T), S = q_ids.shape, kv_ids.shape[1]
    ks = jax.random.split(jax.random.key(seed), 6)
    shapes = [(B, T, case.N, case.D), (B, S, case.K, case.D), (B, S, case.K, case.D),
              (B, T, case.N, case.D)]
    q, k, v, g = (jax.random.normal(key, shape, jnp.float32) for key, shape in zip(ks, shapes))
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    # whatever padding holds never reaches a valid output (nor the padding's own, 0)
    q = jnp.where((q_ids == 0)[:, :, None, None], jnp.nan, q).astype(jnp.bfloat16)
    k = jnp.where((kv_ids == 0)[:, :, None, None], jnp.nan, k).astype(jnp.bfloat16)
    v = jnp.where((kv_ids == 0)[:, :, None, None], jnp.inf, v).astype(jnp.bfloat16)
    segments = None
    if case.q_ids is None:
        pass
    elif case.seqlens:
        lengths = (jnp.asarray((q_ids != 0).sum(1), jnp.int32), jnp.asarray((kv_ids != 0).sum(1), jnp.int32))
        segments = flashmesh.SequenceDescriptor.from_seqlens(lengths)
    else:
        ids = jnp.asarray(q_ids) if case.kv_ids is None else (jnp.asarray(q_ids), jnp.asarray(kv_ids))
        segments = flashmesh.SequenceDescriptor.from_segment_ids_and_pos(ids)
    sink = (jax.random.uniform(ks[4], (case.N,), jnp.float32, -1.5, 1.5)
            if case.softmax == "learnable" else None)
    bias = None
    if case.bias is not None:  # N(0, 4): it moves the softmax; NaN where a padding row or column
        bias = 2.0 * jax.random.normal(ks[5], case.bias + (T, S), jnp.float32)
        pad = (q_ids == 0)[:, None, :, None] | (kv_ids == 0)[:, None, None, :]
        bias = jnp.where(pad[:case.bias[0]], jnp.nan, bias)
    options = dict(mask=case.mask, window=case.window, segments=segments, softmax=case.softmax,
                   dropout_rate=case.dropout_rate, logits_soft_cap=case.cap,
                   dropout_rng=jax.random.key(5) if case.dropout_rate else None)
    return (q, k, v, g, sink, bias), options, q_ids, kv_ids


def check_case(case: Case, *, interpret: bool):
    (q, k, v, g, sink, bias), options, q_ids, kv_ids = make(case)

    def kernel(q, k, v, sink, bias):
        inputs, spec = normalize(q, k, v, return_lse=True, **dict(options, sink=sink, bias=bias))
        if case.blocks is None:
            return pmg.attention(inputs, spec)
        return pmg.attention_with(inputs, spec, *case.blocks, interpret=interpret)

    def reference(q, k, v, sink, bias):
        return flashmesh.attention(q, k, v, return_lse=True, implementation="reference",
                                   **dict(options, sink=sink, bias=bias))

    def loss(f, q, k, v, sink, bias):
        out, lse = f(q, k, v, sink, bias)
        return jnp.sum(out.astype(jnp.float32) * g), (out, lse)

    # dq, dk, dv, then dsink and dbias where present
    argnums = (0, 1, 2) + ((3,) if sink is not None else ()) + ((4,) if bias is not None else ())
    names = ("dq", "dk", "dv") + (("dsink",) if sink is not None else ()) + (
        ("dbias",) if bias is not None else ())
    (grads, (out, lse)) = jax.jit(jax.grad(lambda *a: loss(kernel, *a), argnums, has_aux=True))(
        q, k, v, sink, bias)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (want, (ref_out, ref_lse)) = jax.grad(lambda *a: loss(reference, *a), argnums,
                                          has_aux=True)(*f32, sink, bias)
    valid_q, valid_kv = q_ids != 0, kv_ids != 0
    rel_l2(f"{case.name} out", out, ref_out, 1e-2)
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    # a bias is read in bf16: its rounding (2^-9 of N(0, 4)) moves the lse by up to ~1e-2
    np.testing.assert_allclose(lse.transpose(0, 2, 1)[valid_q], ref_lse.transpose(0, 2, 1)[valid_q],
                               rtol=0, atol=3e-2 if bias is not None else 1e-3)
    for name, got, expected in zip(names, grads, want):
        rel_l2(f"{case.name} {name}", got, expected, 1e-2)
    if bias is not None:  # the bias's own shape and dtype; exactly zero where nothing is seen
        dbias = np.asarray(grads[-1])
        assert dbias.shape == bias.shape and grads[-1].dtype == bias.dtype
        unseen = ~visible(case, q_ids, kv_ids)[:, None]  # [B, 1, T, S]
        unseen = unseen.all(axis=0, keepdims=True) if case.bias[0] == 1 else unseen
        np.testing.assert_array_equal(np.broadcast_to(dbias, unseen.shape[:1] + dbias.shape[1:])[
            np.broadcast_to(unseen, unseen.shape[:1] + dbias.shape[1:])], 0.0)
        assert unseen.any()
    # padding: output 0 and zero gradient (NaN inputs included), lse of an empty row
    np.testing.assert_array_equal(np.asarray(out, np.float32)[~valid_q], 0.0)
    np.testing.assert_array_equal(np.asarray(grads[0], np.float32)[~valid_q], 0.0)
    for dx in grads[1:3]:
        np.testing.assert_array_equal(np.asarray(dx, np.float32)[~valid_kv], 0.0)
    if case.softmax == "vanilla":
        np.testing.assert_array_equal(lse.transpose(0, 2, 1)[~valid_q], np.float32(EMPTY_ROW_LSE))
    # the cases mean what they say: padding present, and tiles outside a document are skipped
    assert (~valid_q).any() or case.name.startswith(("gpu", "bias_shared"))
    inputs, spec = normalize(q, k, v, **dict(options, sink=sink, bias=bias))
    if case.q_ids is not None:
        assert spec.segments == ("padding" if case.seqlens else "packed"), spec.segments
    if case.blocks is not None and case.q_ids is not None:
        nq, nk = -(-spec.q_len // FWD.block_q), -(-spec.kv_len // FWD.block_kv)
        ranges = tokens.kernel_arrays(spec, tokens.from_inputs(spec, inputs), FWD.block_q,
                                      FWD.block_kv, q_len=nq * FWD.block_q,
                                      kv_len=nk * FWD.block_kv).ranges
        assert (np.asarray(ranges[..., 3] - ranges[..., 0]) < nk).any(), np.asarray(ranges)


@pytest.mark.parametrize("case", CASES + [FUSED_CASE, DELTA_CASE], ids=lambda c: c.name)
def test_segments_interpret(case, interpreter):
    check_case(case, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + GPU_CASES + [FUSED_CASE, DELTA_CASE, FOLD_CASE],
                         ids=lambda c: c.name)
def test_segments_gpu(case):
    check_case(case, interpret=False)


@pytest.mark.parametrize("window, blocks, bias", [
    ((-1, 0), BlockSizes(), None), ((-1, -1), BlockSizes(num_stages=2, block_kv=64), None),
    ((100, 0), BlockSizes(block_kv=64, intra_wg_overlap=True), None),
    ((-1, 0), BlockSizes(block_kv=64), (1, 4)),
])
def test_gpu_path_lowers_with_tables(window, blocks, bias, monkeypatch):
    """Forward and backward with segment tables (and a bias) lower for cuda without a GPU; the
    forward's shared memory is exactly sm90.smem_bytes, the backward's within its estimate."""
    import jax.experimental.mosaic.gpu.core as mosaic_core

    counted, tree_size = [], mosaic_core._smem_tree_size

    def count(tree):
        counted.append(tree_size(tree))
        return counted[-1]

    monkeypatch.setattr(mosaic_core, "_smem_tree_size", count)
    B, T, N, K, D = 2, 1000, 4, 2, 128
    mask = "causal" if window[1] == 0 else "none"
    ids = jnp.zeros((B, T), jnp.int32)
    q = jax.ShapeDtypeStruct((B, T, N, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, K, D), jnp.bfloat16)
    bias_arg = None if bias is None else jnp.zeros(bias + (T, T), jnp.bfloat16)
    inputs, spec = normalize(jnp.zeros(q.shape, q.dtype), jnp.zeros(kv.shape, kv.dtype),
                             jnp.zeros(kv.shape, kv.dtype), mask=mask, bias=bias_arg,
                             window=None if window[0] < 0 else window,
                             segments=flashmesh.SequenceDescriptor.from_segment_ids_and_pos(ids + 1))
    assert tokens.per_side(spec) == (2 if spec.has_window else 1)
    table = jax.ShapeDtypeStruct((B, T), jnp.int32)
    lse = jax.ShapeDtypeStruct((B, N, T), jnp.float32)

    def both(q, k, v, do, lse, bias, a, b, c, d):
        t = tokens.TokenTables(a, b, c, d)
        out, _ = sm90.forward_spec(q, k, v, spec, tables=t, bias=bias, block_sizes=blocks)
        return out, bwd.backward_spec(q, k, v, do, lse, do, spec, tables=t, bias=bias)

    jax.jit(both).trace(q, kv, kv, q, lse, bias_arg, *[table] * 4).lower(
        lowering_platforms=("cuda",))
    estimate = bwd.default_for(spec).smem_bytes(spec)
    assert len(counted) == 3, counted
    assert counted[0] == sm90.smem_bytes(spec, blocks), (counted, sm90.smem_bytes(spec, blocks))
    assert counted[1] <= estimate["dkv"] and counted[2] <= estimate["dq"], (counted, estimate)


@pytest.mark.parametrize("splits", [1, 2])
def test_bias_of_minus_inf_over_full_tiles_interpret(splits, interpreter):
    """A bias of -inf over every key of rows 0..63 and over the first key tile of rows
    64..127, with no mask (every tile FULL), whole and in 2 KV splits: the hidden rows give
    exactly 0 and EMPTY_ROW_LSE, the others the reference, never NaN."""
    ks = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(key, (1, 128, 2, 64), jnp.float32).astype(jnp.bfloat16) for key in ks)
    bias = jnp.zeros((1, 1, 128, 128), jnp.float32)
    bias = bias.at[:, :, :64].set(-jnp.inf).at[:, :, 64:, :64].set(-jnp.inf)
    inputs, spec = normalize(q, k, v, mask="none", bias=bias, return_lse=True)
    blocks = BlockSizes(block_q=64, block_kv=64, num_compute_wgs=1, num_splits=splits)
    out, lse = sm90.attention(inputs, spec, block_sizes=blocks, interpret=True)
    ref_out, ref_lse = flashmesh.attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask="none",
                                           bias=bias, return_lse=True, implementation="reference")
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    np.testing.assert_array_equal(out[:, :64], 0.0)
    np.testing.assert_array_equal(lse[:, :, :64], np.float32(EMPTY_ROW_LSE))
    rel_l2("out", out[:, 64:], np.asarray(ref_out)[:, 64:], 1e-2)
    np.testing.assert_allclose(lse[:, :, 64:], np.asarray(ref_lse)[:, :, 64:], rtol=0, atol=1e-4)


def test_static_reason_accepts_segments_and_tables_are_checked():
    q = jnp.zeros((2, 128, 2, 64), jnp.bfloat16)
    ids = jnp.ones((2, 128), jnp.int32)
    segments = flashmesh.SequenceDescriptor.from_segment_ids_and_pos(ids)
    inputs, spec = normalize(q, q, q, mask="causal", segments=segments)
    assert pmg.static_reason(spec) is None
    with pytest.raises(ValueError, match="needs tables"):
        sm90.forward_spec(q, q, q, spec, interpret=True)
    t = tokens.from_inputs(spec, inputs)
    with pytest.raises(ValueError, match=r"tables.kv_segment_ids must be int32 \(2, 128\)"):
        sm90.forward_spec(q, q, q, spec, tables=t._replace(kv_segment_ids=ids[:1]), interpret=True)
    _, band = normalize(q, q, q, mask="causal")
    with pytest.raises(ValueError, match="tables must be None"):
        sm90.forward_spec(q, q, q, band, tables=t, interpret=True)
