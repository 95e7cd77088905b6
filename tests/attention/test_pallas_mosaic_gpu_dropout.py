"""Dropout in the Hopper kernels (pallas_mosaic_gpu_sm90, _sm90_bwd, the registered custom VJP).

What must hold: the kernels drop exactly the elements masks.dropout_keep drops, and the forward
and gradients match the reference backend given the same seed.
* Bit for bit: with q = 0 every visible probability is 1 / S, and V holds one-hot columns
  weighted 1, 2, 4, 8 per 64-key block. Each output element then encodes, as an integer, which
  of its 4 keys were kept. These are compared with masks.dropout_keep over every (b, n, i, j),
  under global query and head numbers (q_index, head_index) as context parallelism passes them.
  The hash's XLA half (`dropout_row_hash`) is also checked alone against masks.dropout_keep.
* Against the reference: out, lse and dq, dk, dv (dsink) through `pallas_mosaic_gpu.
  attention_with` (the registered custom VJP, in the interpreter on CPU) are compared with
  jax.vjp of reference.attention on float32 inputs, the same spec and the same seed (from
  api.normalize's dropout_rng), at random cotangents of out and lse. Cases: causal, a window
  with tails and a learnable sink, and bottom-right causal GQA with a soft cap.
  Tolerance: relative L2 error <= 1e-2 for bf16, as the backward's tests (2e-2 for dsink, a
  cancelling sum); measured about 2.5e-3. A wrong keep mask is O(1) off (the seed test shows
  how far: another seed moves out by more than 0.2 relative).
* Lowering for cuda on CPU (register operands, uint32 arithmetic through Mosaic GPU's passes)
  with Mosaic's shared-memory count.
The `gpu`-marked copies run the same cases compiled, and one larger case through
`flashmesh.attention(implementation="pallas_mosaic_gpu")`.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import flashmesh
from flashmesh.attention import masks, pallas_mosaic_gpu, reference
from flashmesh.attention import pallas_mosaic_gpu_sm90 as sm90
from flashmesh.attention import pallas_mosaic_gpu_sm90_bwd as bwd
from flashmesh.attention.api import normalize
from flashmesh.attention.pallas_mosaic_gpu_common import BlockSizes
from flashmesh.attention.pallas_mosaic_gpu_inputs import DROPOUT_KEY_MULT
from mosaic_testing import interpreter, rel_l2  # noqa: F401  (interpreter: a fixture)

BBS = bwd.BackwardBlockSizes
ONE_WG = BlockSizes(block_q=64, block_kv=64, num_stages=2, num_compute_wgs=1)
ONE_WG_BWD = BBS(block_q=64, block_kv=64, block_q_dq=64, block_kv_dq=64, num_stages=2,
                 num_compute_wgs=1)
TWO_WG = BlockSizes(block_q=128, block_kv=64, num_stages=2, num_compute_wgs=2)
TWO_WG_BWD = BBS(num_stages=2)


def expected_keep(inputs, rate: float, B: int, N: int, T: int, S: int) -> np.ndarray:
    """masks.dropout_keep at every (b, n, i, j) of a call, its numbers included: [B, N, T, S]."""
    n, i, j = masks.dropout_numbers(inputs, jnp.arange(N), jnp.arange(T), jnp.arange(S))
    keep = masks.dropout_keep(inputs.dropout_seed, rate, jnp.arange(B)[:, None, None, None],
                              n[None, :, None, None], i[None, None, :, None], j[None, None, None, :])
    return np.asarray(keep)


def test_row_hash_finishes_to_masks_dropout_keep():
    """dropout_row_hash, finished per element as the kernels do, is masks.dropout_keep."""
    B, T, S, N = 2, 70, 50, 3
    q = jnp.zeros((B, T, N, 64), jnp.bfloat16)
    k = jnp.zeros((B, S, 1, 64), jnp.bfloat16)
    for rate, seed, q_index, head_index in [
            (0.1, 0, None, None), (0.7, 11, jnp.arange(T, dtype=jnp.int32) * 5 + 3,
                                   jnp.asarray([9, 2, 40], jnp.int32))]:
        inputs, spec = normalize(q, k, k, dropout_rate=rate, dropout_rng=jax.random.key(seed))
        h = sm90.dropout_row_hash(spec, inputs.dropout_seed, q_index=q_index, head_index=head_index)
        assert h.shape == (B, N, T) and h.dtype == jnp.uint32
        kv = jnp.arange(S).astype(jnp.uint32)[None, None, None, :]
        x = h[..., None] + (kv >> 1) * jnp.uint32(DROPOUT_KEY_MULT)  # one hash per key pair
        got = masks.pair_bits(masks.mix32(x), kv) >= jnp.uint32(masks.dropout_threshold(rate))
        numbers = dataclasses.replace(inputs, q_index=q_index, head_index=head_index)
        want = expected_keep(numbers, rate, B, N, T, S)
        np.testing.assert_array_equal(np.asarray(got), want)
        assert 0.5 * rate < 1.0 - float(want.mean()) < 1.5 * rate


def check_keep_bits(interpret: bool, rate: float = 0.4):
    """The kernel's kept elements, decoded from its output, against masks.dropout_keep. At rate
    0.99999 the scale pins masks.keep_probability (1/65536, where 1 - rate is 1e-5: a kept
    element would decode to 1.5 times its code)."""
    B, T, S, N, K, D = 2, 136, 200, 2, 1, 64
    q = jnp.zeros((B, T, N, D), jnp.bfloat16)  # every logit 0: p = 1 / S for every key
    j = np.arange(S)
    onehot = np.zeros((S, D), np.float32)
    onehot[j, j % D] = 2.0 ** (j // D)  # key j adds 2**(j // 64) to output column j % 64
    v = jnp.broadcast_to(jnp.asarray(onehot, jnp.bfloat16)[None, :, None], (B, S, K, D))
    k = jax.random.normal(jax.random.key(1), (B, S, K, D), jnp.float32).astype(jnp.bfloat16)
    inputs, spec = normalize(q, k, v, mask="none", dropout_rate=rate,
                             dropout_rng=jax.random.key(3), return_lse=True)
    q_index = jnp.arange(T, dtype=jnp.int32) * 3 + 1000  # a context-parallel shard's numbers
    head_index = jnp.asarray([5, 2], jnp.int32)
    inputs = dataclasses.replace(inputs, q_index=q_index, head_index=head_index)
    out, lse = sm90.attention(inputs, spec, block_sizes=ONE_WG, interpret=interpret)
    code = np.rint(np.asarray(out, np.float32) * (S * masks.keep_probability(rate))).astype(np.int64)
    assert code.min() >= 0 and code.max() < 16
    blocks = -(-S // D)
    bits = (code[..., None] >> np.arange(blocks)) & 1  # [B, T, N, D, blocks]: key 64 * blk + d
    got = bits.transpose(0, 2, 1, 4, 3).reshape(B, N, T, blocks * D)[..., :S]
    want = expected_keep(inputs, rate, B, N, T, S)
    assert want.any() and not want.all()  # some kept and some dropped: the check means something
    mismatches = np.argwhere(got != want)
    assert len(mismatches) == 0, (f"{len(mismatches)} elements differ, first (b, n, i, j): "
                                  f"{mismatches[:5]}")
    np.testing.assert_allclose(np.asarray(lse), np.log(S), rtol=0, atol=1e-5)  # undropped


@pytest.mark.parametrize("rate", [0.4, 0.99999])
def test_keep_is_masks_dropout_keep_bit_for_bit(interpreter, rate):
    check_keep_bits(interpret=True, rate=rate)


@pytest.mark.gpu
def test_keep_is_masks_dropout_keep_bit_for_bit_gpu():
    check_keep_bits(interpret=False)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    T: int
    S: int
    N: int
    K: int
    D: int = 64
    options: tuple = ()  # api options besides the dropout ones
    rate: float = 0.25
    blocks: tuple = (ONE_WG, ONE_WG_BWD)


# In the interpreter, dropout runs in the fused-backward segments case (test_pallas_mosaic_gpu_
# segments_bias) and the bit-for-bit keep test; these passed on the H200 (2026-12-01, -02).
GPU_CASES = [
    # the forward in 2 KV splits (each drops its own keys' elements; merged by lse)
    Case("gqa_bottom_right_cap_kv_splits", T=128, S=256, N=2, K=1, rate=0.5,
         options=(("mask", "causal_bottom_right"), ("logits_soft_cap", 2.0)),
         blocks=(dataclasses.replace(ONE_WG, num_splits=2), ONE_WG_BWD)),
    Case("window_tails_learnable", T=136, S=136, N=2, K=1, rate=0.3,
         options=(("mask", "none"), ("window", (30, 10)), ("softmax", "learnable"))),
    Case("causal_two_wgs", T=128, S=128, N=2, K=2, options=(("mask", "causal"),),
         blocks=(TWO_WG, TWO_WG_BWD)),  # on CPU the segments test runs dropout with 2 warpgroups
    Case("gpu_d128_causal_gqa", T=1024, S=1024, N=8, K=2, D=128, options=(("mask", "causal"),),
         blocks=None),
    Case("gpu_d64_window_tails", T=1000, S=1100, N=4, K=4, rate=0.1,
         options=(("mask", "causal_bottom_right"), ("window", (256, 0))), blocks=None),
    # the fused backward (BackwardBlockSizes.fused_dq; not yet compiled on a GPU, 2026-12-02)
    Case("gpu_fused_dq_d128_causal_gqa", T=1024, S=1024, N=8, K=2, D=128, options=(("mask", "causal"),),
         blocks=(TWO_WG, dataclasses.replace(TWO_WG_BWD, fused_dq=True))),
    # dQ by columns (BackwardBlockSizes.dq_columns; passed on the H200 at 55bed4f)
    Case("gpu_fused_dq_columns_d128_causal_gqa", T=1024, S=1024, N=8, K=2, D=128,
         options=(("mask", "causal"),),
         blocks=(TWO_WG, dataclasses.replace(TWO_WG_BWD, fused_dq=True, dq_columns=True))),
    # the overlapped backward step (BackwardBlockSizes.overlap; written without a GPU, 2026-12-05)
    Case("gpu_overlap_d128_causal_gqa", T=1024, S=1024, N=8, K=2, D=128, options=(("mask", "causal"),),
         blocks=(TWO_WG, dataclasses.replace(TWO_WG_BWD, overlap=True))),
    Case("gpu_overlap_fused_columns_d128_window_tails", T=1000, S=1000, N=4, K=2, D=128,
         options=(("mask", "causal"), ("window", (200, 0))),
         blocks=(TWO_WG, dataclasses.replace(TWO_WG_BWD, fused_dq=True, dq_columns=True, overlap=True))),
    # each warpgroup's own tiles (BackwardBlockSizes.wg_ranges; written without a GPU, 2026-12-05)
    Case("gpu_wg_ranges_d128_window_gqa_tails", T=1000, S=1000, N=8, K=2, D=128,
         options=(("mask", "causal"), ("window", (128, 0))),
         blocks=(TWO_WG, dataclasses.replace(TWO_WG_BWD, wg_ranges=True))),
]


def check_case(case: Case, *, interpret: bool, implementation: str | None = None):
    ks = jax.random.split(jax.random.key(0), 6)
    B = 1
    shapes = [(B, case.T, case.N, case.D), (B, case.S, case.K, case.D), (B, case.S, case.K, case.D)]
    q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
               for key, shape in zip(ks, shapes))
    # The cotangent in bf16, as the kernel gets it; the reference sees the same values in f32.
    g_out = jax.random.normal(ks[3], (B, case.T, case.N, case.D), jnp.float32).astype(jnp.bfloat16)
    g_lse = jax.random.normal(ks[4], (B, case.N, case.T), jnp.float32)
    options = dict(case.options)
    sink = None
    if options.get("softmax") == "learnable":
        sink = jax.random.uniform(ks[5], (case.N,), jnp.float32, -1.5, 1.5)
    inputs, spec = normalize(q, k, v, sink=sink, dropout_rate=case.rate,
                             dropout_rng=jax.random.key(42), return_lse=True, **options)
    assert pallas_mosaic_gpu.static_reason(spec) is None

    def run(attend, q, k, v, sink):
        return attend(dataclasses.replace(inputs, q=q, k=k, v=v, sink=sink))

    if implementation is not None:  # the public path, dropout_rng included
        def kernel(q, k, v, sink):
            return flashmesh.attention(q, k, v, sink=sink, dropout_rate=case.rate,
                                       dropout_rng=jax.random.key(42), return_lse=True,
                                       implementation=implementation, **options)
    else:
        blocks = case.blocks

        def kernel(q, k, v, sink):
            def attend(i):
                return pallas_mosaic_gpu.attention_with(i, spec, *blocks, interpret=interpret)

            return run(attend, q, k, v, sink)

    (out, lse), vjp = jax.vjp(kernel, q, k, v, sink)
    got = vjp((g_out, g_lse))

    @jax.jit
    def expected(q, k, v, sink):
        with jax.default_matmul_precision("highest"):  # no TF32 in the reference on a GPU
            (o, l), ref_vjp = jax.vjp(lambda *a: run(lambda i: reference.attention(i, spec), *a),
                                      q, k, v, sink)
            return o, l, ref_vjp((g_out.astype(jnp.float32), g_lse))

    ref_out, ref_lse, want = expected(*(x.astype(jnp.float32) for x in (q, k, v)), sink)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    errors = {"out": rel_l2(f"{case.name} out", out, ref_out, 1e-2)}
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=0, atol=1e-4)
    # dsink sums terms of both signs over T, so its relative error is larger than the terms'
    # (6.7e-3 measured on window_tails_learnable, 2.1e-3 there without dropout).
    for name, a, b, tol in zip(("dq", "dk", "dv", "dsink"), got, want, (1e-2,) * 3 + (2e-2,)):
        if b is not None:
            errors[name] = rel_l2(f"{case.name} {name}", a, b, tol)
    return errors


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_forward_and_gradients_match_reference_gpu(case):
    check_case(case, interpret=False, implementation=None if case.blocks else "pallas_mosaic_gpu")


def _forward(seed: int | None, rate: float, interpret: bool):
    ks = jax.random.split(jax.random.key(7), 3)
    q, k, v = (jax.random.normal(key, (1, 64, 1, 64), jnp.float32).astype(jnp.bfloat16)
               for key in ks)
    rng = None if seed is None else jax.random.key(seed)
    inputs, spec = normalize(q, k, v, mask="causal", dropout_rate=rate, dropout_rng=rng)
    return np.asarray(sm90.attention(inputs, spec, block_sizes=ONE_WG, interpret=interpret)[0],
                      np.float32)


def check_seed_and_rate(interpret: bool):
    base, first, other = (_forward(s, r, interpret) for s, r in ((None, 0.0), (1, 0.3), (2, 0.3)))

    def rel(a, b):
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    assert rel(first, base) > 0.2 and rel(other, first) > 0.2, (rel(first, base), rel(other, first))


def test_seed_and_rate_change_the_output(interpreter):
    check_seed_and_rate(interpret=True)


@pytest.mark.gpu
def test_seed_and_rate_change_the_output_gpu():
    check_seed_and_rate(interpret=False)


def test_refusals_and_bad_arguments():
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    inputs, spec = normalize(q, q, q, dropout_rate=0.1, dropout_rng=jax.random.key(0))
    assert pallas_mosaic_gpu.static_reason(spec) is None
    cp = dataclasses.replace(inputs, kv_index=jnp.arange(128, dtype=jnp.int32))
    with pytest.raises(NotImplementedError, match="kv_index"):
        pallas_mosaic_gpu.attention_with(cp, spec, ONE_WG, ONE_WG_BWD, interpret=True)
    with pytest.raises(ValueError, match=r"needs dropout_hash uint32 \(1, 2, 128\)"):
        sm90.forward_spec(q, q, q, spec, block_sizes=ONE_WG, interpret=True)
    with pytest.raises(ValueError, match="dropout needs seed uint32 of shape"):
        sm90.dropout_row_hash(spec, jnp.zeros((2,), jnp.int32))
    no_dropout = dataclasses.replace(spec, dropout_rate=0.0)
    with pytest.raises(ValueError, match="dropout_hash must be None"):
        sm90.forward_spec(q, q, q, no_dropout, dropout_hash=jnp.zeros((1, 2, 128), jnp.uint32),
                          block_sizes=ONE_WG, interpret=True)
    x, lse = jnp.zeros((1, 128, 2, 64), jnp.bfloat16), jnp.zeros((1, 2, 128), jnp.float32)
    with pytest.raises(ValueError, match="needs dropout_hash"):
        bwd.backward_spec(x, x, x, x, lse, x, spec, interpret=True)
    with pytest.raises(ValueError, match=r"dropout_rate=1.5 must be in \[0, 1\)"):
        sm90.check(dataclasses.replace(spec, dropout_rate=1.5), ONE_WG)


@pytest.mark.parametrize("T, D, window, blocks, back", [
    (1024, 128, (-1, 0), BlockSizes(), None),  # ping-pong, P from registers
    (1024, 128, (100, 0), BlockSizes(intra_wg_overlap=True), None),  # both GEMMs in flight
    (1024, 128, (-1, 0), BlockSizes(), bwd.BackwardBlockSizes(num_stages=2, overlap=True)),
], ids=["pingpong", "overlap", "backward_overlap"])
def test_gpu_path_lowers_on_cpu(T, D, window, blocks, back, monkeypatch):
    """The compiled forward and backward with dropout (uint32 multiply, xor, logical shift and
    unsigned compare on WGMMA-layout arrays) lower through Mosaic GPU for cuda on a machine
    without a GPU; the forward's shared memory is `sm90.smem_bytes` exactly, the backward's
    within `BackwardBlockSizes.smem_bytes`."""
    import jax.experimental.mosaic.gpu.core as mosaic_core

    counted, tree_size = [], mosaic_core._smem_tree_size

    def count(tree):  # Mosaic's shared-memory total of a kernel, recorded per launch
        counted.append(tree_size(tree))
        return counted[-1]

    monkeypatch.setattr(mosaic_core, "_smem_tree_size", count)
    q = jax.ShapeDtypeStruct((1, T, 4, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, T, 2, D), jnp.bfloat16)
    spec = sm90.spec_for(q, kv, kv, scale=0.1, window=window, dropout_rate=0.1)
    seed = jax.ShapeDtypeStruct((2,), jnp.uint32)

    def fwd_and_bwd(q, k, v, seed, do):
        h = sm90.dropout_row_hash(spec, seed)
        out, lse = sm90.forward_spec(q, k, v, spec, dropout_hash=h, block_sizes=blocks)
        return bwd.backward_spec(q, k, v, out, lse, do, spec, dropout_hash=h, block_sizes=back)

    jax.jit(fwd_and_bwd).trace(q, kv, kv, seed, q).lower(lowering_platforms=("cuda",))
    estimate = (back or bwd.default_for(spec)).smem_bytes(spec)
    assert len(counted) == 3, counted
    assert counted[0] == sm90.smem_bytes(spec, blocks), (counted, sm90.smem_bytes(spec, blocks))
    assert counted[1] <= estimate["dkv"] and counted[2] <= estimate["dq"], (counted, estimate)


def test_keep_compare_lowers_unsigned(capfd):
    """The keep test `bits >= threshold` on uint32 lowers to an unsigned compare (arith.cmpi
    uge) and no integer compare in the mask is signed: the interpreter runs jnp's unsigned
    semantics whatever the lowering does, so only the lowered module shows a signed compare
    (a GPU-only wrong mask, should a jax release change its predicate tables)."""
    rows, keys = 64, 64

    def body(hash_gmem, p_gmem, out_gmem, hash_smem, p_smem, out_smem, bar):
        plgpu.copy_gmem_to_smem(hash_gmem, hash_smem, bar.at[0])
        plgpu.copy_gmem_to_smem(p_gmem, p_smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        row_hash = plgpu.load(hash_smem.at[...], layout=plgpu.Layout.WGMMA.reduce(1))
        keep = sm90.dropout_keep(row_hash, lax.axis_index("x") * keys, (rows, keys), 1, 0.1)
        out_smem[...] = jnp.where(keep, plgpu.load(p_smem.at[...], layout=plgpu.Layout.WGMMA), 0.0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem)
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((rows, keys), jnp.float32), grid=(2,),
                          grid_names=("x",), num_threads=1, thread_name="wg", debug=True,
                          scratch_types=[plgpu.SMEM((rows,), jnp.uint32), plgpu.SMEM((rows, keys), jnp.float32),
                                         plgpu.SMEM((rows, keys), jnp.float32), plgpu.Barrier(num_barriers=1)])
    capfd.readouterr()
    jax.jit(kernel).trace(jax.ShapeDtypeStruct((rows,), jnp.uint32),
                          jax.ShapeDtypeStruct((rows, keys), jnp.float32)).lower(lowering_platforms=("cuda",))
    printed = capfd.readouterr()
    predicates = set(re.findall(r"arith\.cmpi (\w+)", printed.out + printed.err))
    assert "uge" in predicates and not predicates & {"slt", "sle", "sgt", "sge"}, predicates


def test_config_fits_dropout_hashes_in_shared_memory(monkeypatch):
    """A table entry that fills shared memory loses a stage for the row hashes."""
    from flashmesh.attention import pallas_mosaic_gpu_common as common
    from flashmesh.attention import pallas_mosaic_gpu_table as config_table

    full = BlockSizes(block_q=128, block_kv=128, num_stages=3)
    monkeypatch.setattr(config_table, "default_for", lambda spec, kind: full)
    q = jnp.zeros((1, 128, 2, 128), jnp.bfloat16)
    plain = normalize(q, q, q, softmax="learnable", sink=jnp.zeros((2,)))[1]
    spec = dataclasses.replace(plain, dropout_rate=0.1)
    assert sm90.smem_bytes(plain, full) <= common.SMEM_BYTES < sm90.smem_bytes(spec, full)
    assert pallas_mosaic_gpu.config(plain)[0].num_stages == 3
    assert pallas_mosaic_gpu.config(spec)[0].num_stages == 2
