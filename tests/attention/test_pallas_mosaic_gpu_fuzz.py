"""A 1001-draw random fuzz of `pallas_mosaic_gpu` on a Hopper GPU against the float32 reference.

Thirteen families fix what the kernels compile for (head dims 64-256 and MLA pairs, bf16 /
f16, masks, windows, GQA / MQA, tails, T != S in both alignments, sinks, soft cap, bias,
dropout, segments, the window kernel, KV splits); each takes 77 draws of what is data: q, k, v,
the output cotangent, bias and sink values, segment layouts (ids, with and without positions,
and lengths; empty rows included) and dropout keys. Every draw: output and dq, dk, dv (and
dbias; dsink within 5e-2, a cancelling sum) finite and within relative L2 2e-2 (bf16; f16 5e-3)
of the reference in float32 at full matmul precision; each output row within 0.1 of its
reference row (relative L2: a wrong tile range, mask or run of dropped elements moves whole
rows, which a whole-tensor norm could average away); and every query row that sees no key
exactly 0 with zero dq. On CPU only the families' static checks run (the interpreter would take
hours at these sizes).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashmesh
import semantics
from flashmesh.attention import pallas_mosaic_gpu
from flashmesh.attention.api import normalize
from mosaic_testing import rel_l2

DRAWS = 77
TOL = {"bfloat16": 2e-2, "float16": 5e-3}
ROW_TOL = 0.1
# dsink sums p_sink * (dO . O - dO . V) over every row, a cancelling sum: chunked in bf16 is
# already 1.25e-2 from the float32 reference on these draws.
TOLS = dict(dsink=5e-2)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    T: int
    S: int
    N: int
    K: int
    Dqk: int
    Dv: int | None = None
    dtype: str = "bfloat16"
    mask: str = "causal"
    window: tuple[int, int] | None = None
    softmax: str = "vanilla"
    cap: float | None = None
    dropout: float = 0.0
    bias: str | None = None  # a semantics.BIAS_SHAPES pattern
    segments: str | None = None  # a semantics.SEGMENT_RECIPES name (self attention: T == S)
    B: int = 2


FAMILIES = [
    Family("d64_causal_gqa", T=256, S=256, N=4, K=2, Dqk=64),
    Family("d128_full_tails_mqa", T=200, S=136, N=4, K=1, Dqk=128, mask="none"),
    Family("d128_window_kernel_gqa", T=384, S=384, N=8, K=2, Dqk=128, window=(64, 0)),
    Family("d64_f16_bottom_right_off_by_one", T=128, S=320, N=2, K=2, Dqk=64, dtype="float16",
           mask="causal_bottom_right", softmax="off_by_one"),
    Family("d128_packed_ids_learnable", T=256, S=256, N=4, K=2, Dqk=128, segments="ids_empty_row",
           softmax="learnable"),
    Family("d64_seqlens_dropout", T=224, S=224, N=4, K=4, Dqk=64, mask="padding", segments="seqlens",
           dropout=0.1),
    Family("d128_bias_cap", T=192, S=192, N=4, K=2, Dqk=128, bias="1NTS", cap=10.0),
    Family("d96_causal", T=200, S=200, N=2, K=1, Dqk=96),
    Family("mla_128_64", T=256, S=256, N=4, K=1, Dqk=128, Dv=64),
    Family("d256_causal", T=128, S=128, N=2, K=2, Dqk=256, B=1),
    Family("mla_192_128_full", T=160, S=160, N=2, K=1, Dqk=192, Dv=128, mask="none", B=1),
    Family("d128_two_sided_window_packed_pos_dropout", T=256, S=256, N=4, K=2, Dqk=128, mask="none",
           window=(32, 32), segments="ids_pos", dropout=0.2, bias="B1TS"),
    Family("d128_decode_splits", T=16, S=1024, N=8, K=2, Dqk=128, mask="causal_bottom_right"),
]


def _options(f: Family, segments=None, bias=None, sink=None, key=None) -> dict:
    return dict(mask=f.mask, window=f.window, segments=segments, bias=bias, sink=sink,
                softmax=f.softmax, logits_soft_cap=f.cap, dropout_rate=f.dropout, dropout_rng=key)


def _draw(f: Family, rng: np.random.Generator):
    Dv = f.Dv or f.Dqk
    q, k, v = semantics.random_qkv(rng, f.B, f.T, f.S, f.N, f.K, f.Dqk, Dv)
    g = rng.standard_normal((f.B, f.T, f.N, Dv)).astype(np.float32)
    bias = None if f.bias is None else semantics.random_bias(rng, f.bias, f.B, f.N, f.T, f.S)
    sink = semantics.random_sink(rng, f.N) if f.softmax == "learnable" else None
    seg = None if f.segments is None else semantics.SEGMENT_RECIPES[f.segments](rng, f.B, f.T, f.S)
    key = jax.random.key(int(rng.integers(2**31))) if f.dropout else None
    return (q, k, v, g, bias, sink), seg, key


@functools.lru_cache(maxsize=None)
def _step(f: Family, implementation: str, dtype: str):
    """jit((q, k, v, g, bias, sink), segments, key) -> (out, dq, dk, dv, dbias, dsink)."""
    def run(arrays, segments, key):
        q, k, v, g, bias, sink = arrays

        def out(q, k, v, bias, sink):
            cast = lambda x: None if x is None else x.astype(dtype)  # noqa: E731
            return flashmesh.attention(cast(q), cast(k), cast(v), implementation=implementation,
                                       **_options(f, segments, cast(bias), sink, key))

        o, vjp = jax.vjp(out, q, k, v, bias, sink)
        return (o, *vjp(g.astype(o.dtype)))

    def traced_at_full_precision(*args):  # the reference's f32 dots must not run in TF32
        with jax.default_matmul_precision("highest"):
            return run(*args)
    return jax.jit(traced_at_full_precision)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_families_are_runs_the_kernels_take(family):
    """Static: every family is a call pallas_mosaic_gpu accepts (whatever the device)."""
    rng = np.random.default_rng(0)
    (q, k, v, _, bias, sink), seg, key = _draw(family, rng)
    dt = jnp.dtype(family.dtype)
    spec = normalize(jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt),
                     **_options(family, None if seg is None else seg.descriptor(),
                                None if bias is None else jnp.asarray(bias, dt), sink, key))[1]
    assert pallas_mosaic_gpu.static_reason(spec) is None, (family.name, pallas_mosaic_gpu.static_reason(spec))
    pallas_mosaic_gpu.config(spec, "NVIDIA H200")  # an H200 has tiles for it (raises otherwise)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_gpu_fuzz(family):
    rng = np.random.default_rng(zlib.crc32(family.name.encode()))
    fused, reference = _step(family, "pallas_mosaic_gpu", family.dtype), _step(family, "reference", "float32")
    names = ("out", "dq", "dk", "dv", "dbias", "dsink")
    for draw in range(DRAWS):
        host, seg, key = _draw(family, rng)
        arrays = tuple(None if x is None else jnp.asarray(x, jnp.float32) for x in host)
        segments = None if seg is None else seg.descriptor()
        got = fused(arrays, segments, key)
        want = reference(arrays, segments, key)
        for name, a, e in zip(names, got, want):
            if e is not None:
                rel_l2(f"{family.name} draw {draw} {name}", a, e, TOLS.get(name, TOL[family.dtype]))
        out, dq, e_out = np.asarray(got[0], np.float32), np.asarray(got[1], np.float32), np.asarray(want[0])
        dead = np.all(e_out == 0, axis=-1) & np.all(np.asarray(want[1]) == 0, axis=-1)  # [B, T, N]
        row_err = np.linalg.norm(out - e_out, axis=-1) / np.maximum(np.linalg.norm(e_out, axis=-1), 1e-30)
        worst = np.unravel_index(np.argmax(np.where(dead, 0.0, row_err)), row_err.shape)
        assert np.where(dead, 0.0, row_err).max() <= ROW_TOL, (
            f"{family.name} draw {draw}: output row {worst} off by {row_err[worst]:.3g} (relative L2)")
        assert np.all(out[dead] == 0) and np.all(dq[dead] == 0), f"{family.name} draw {draw}: rows that see no key"
