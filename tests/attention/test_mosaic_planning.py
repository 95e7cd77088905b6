"""Planning of the Mosaic GPU kernels (pallas_mosaic_gpu_ranges, _common and _table): tile ranges against a
brute-force dense element mask, LPT orders, KV splits, BlockSizes and the config table."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashmesh.attention import masks
from flashmesh.attention import pallas_mosaic_gpu_common as mg
from flashmesh.attention import pallas_mosaic_gpu_ranges as tile_ranges
from flashmesh.attention import pallas_mosaic_gpu_table as config_table
from flashmesh.attention.spec import AttentionInputs, AttentionSpec

H100 = "NVIDIA H100 80GB HBM3"


def make_spec(T, S, window=(-1, -1), bottom_right=False, *, B=1, N=1, K=1, Dqk=64, Dv=None,
              dtype="bfloat16", segments=None):
    return AttentionSpec(batch=B, q_len=T, kv_len=S, num_heads=N, num_kv_heads=K, qk_dim=Dqk,
                         v_dim=Dqk if Dv is None else Dv, dtype=dtype, scale=0.125, window=window,
                         bottom_right=bottom_right, segments=segments)


def dense_visible(T, S, window, offset, bq, bk):
    """bool [nq*bq, nk*bk]: query i sees key j (rows past T all False, columns past S too)."""
    nq, nk = -(-T // bq), -(-S // bk)
    i = np.arange(nq * bq)[:, None]
    j = np.arange(nk * bk)[None, :]
    d = i + offset - j
    vis = (i < T) & (j < S)
    if window[0] >= 0:
        vis &= d <= window[0]
    if window[1] >= 0:
        vis &= d >= -window[1]
    return vis


def tile_classes(vis, T, bq, bk):
    """EMPTY / PARTIAL / FULL per tile from a dense mask: FULL = every real row sees every
    column of the tile (a column past S is never visible, so its tile is never FULL)."""
    nq, nk = vis.shape[0] // bq, vis.shape[1] // bk
    cls = np.zeros((nq, nk), int)
    for a in range(nq):
        rows = vis[a * bq:min(T, (a + 1) * bq)]
        for b in range(nk):
            t = rows[:, b * bk:(b + 1) * bk]
            cls[a, b] = masks.FULL if t.all() else (masks.PARTIAL if t.any() else masks.EMPTY)
    return cls


def expected_ranges(cls):
    """(lo, full_lo, full_hi, hi) per row of a class matrix, by a plain loop."""
    out = []
    for row in cls:
        seen = np.flatnonzero(row != masks.EMPTY)
        if not len(seen):
            out.append((0, 0, 0, 0))
            continue
        lo, hi = int(seen[0]), int(seen[-1]) + 1
        full = np.flatnonzero(row == masks.FULL)
        if len(full):
            f_lo, f_hi = int(full[0]), int(full[-1]) + 1
        else:
            f_lo = f_hi = lo
        out.append((lo, f_lo, f_hi, hi))
    return np.array(out).reshape(-1, 4)


def as_array(r):
    return np.stack([np.asarray(x) for x in r], axis=-1)


def check_against_dense(r, vis, T, bq, bk, transpose=False):
    """Outside [lo, hi) nothing is visible; inside [full_lo, full_hi) everything is."""
    r = as_array(r)
    for a, (lo, f_lo, f_hi, hi) in enumerate(r):
        assert 0 <= lo <= f_lo <= f_hi <= hi
        if transpose:  # per key tile: rows are query tiles
            strip = vis[:, a * bk:(a + 1) * bk]
            assert not strip[:lo * bq].any() and not strip[hi * bq:].any()
            assert strip[f_lo * bq:min(T, f_hi * bq)].all()
        else:
            strip = vis[a * bq:(a + 1) * bq]
            assert not strip[:, :lo * bk].any() and not strip[:, hi * bk:].any()
            assert strip[:min(T, (a + 1) * bq) - a * bq, f_lo * bk:f_hi * bk].all()


def pairs(r, m, transpose=False):
    """bool [n, m] (or its transpose): tile pairs inside [lo, hi) and inside [full_lo, full_hi)."""
    r = as_array(r)
    b = np.arange(m)[None]
    inside = (b >= r[:, :1]) & (b < r[:, 3:])
    full = (b >= r[:, 1:2]) & (b < r[:, 2:3])
    return (inside.T, full.T) if transpose else (inside, full)


sides = st.one_of(st.just(-1), st.integers(0, 80), st.integers(100, 400))


@settings(max_examples=50, deadline=None)
@given(T=st.integers(1, 200), S=st.integers(1, 200), bq=st.sampled_from([8, 16, 32, 64]),
       bk=st.sampled_from([8, 16, 24, 64]), left=sides, right=st.one_of(st.just(0), sides),
       bottom_right=st.booleans())
def test_static_ranges_match_dense_mask(T, S, bq, bk, left, right, bottom_right):
    spec = make_spec(T, S, (left, right), bottom_right)
    nq, nk = -(-T // bq), -(-S // bk)
    vis = dense_visible(T, S, (left, right), spec.diagonal_offset, bq, bk)
    cls = tile_classes(vis, T, bq, bk)

    r = tile_ranges.kv_ranges(spec, bq, bk)
    assert r.lo.shape == (nq,) and all(x.dtype == np.int32 for x in r)
    np.testing.assert_array_equal(as_array(r), expected_ranges(cls))
    check_against_dense(r, vis, T, bq, bk)
    inside, full = pairs(r, nk)
    assert (cls[inside] != masks.EMPTY).all() and (cls[~inside] == masks.EMPTY).all()
    np.testing.assert_array_equal(full, cls == masks.FULL)  # the FULL tiles are one run

    q = tile_ranges.q_ranges(spec, bq, bk)
    assert q.lo.shape == (nk,)
    np.testing.assert_array_equal(as_array(q), expected_ranges(cls.T))
    check_against_dense(q, vis, T, bq, bk, transpose=True)
    q_inside, q_full = pairs(q, nq, transpose=True)
    np.testing.assert_array_equal(q_inside, inside)  # the same (query tile, key tile) pairs
    np.testing.assert_array_equal(q_full, full)

    closed = tile_ranges.band_kv_range(np.arange(nq), q_len=T, kv_len=S, window=(left, right),
                              diagonal_offset=spec.diagonal_offset, block_q=bq, block_kv=bk)
    np.testing.assert_array_equal(as_array(closed), as_array(r))

    for ranges, order in ((r, tile_ranges.q_tile_order(r)), (q, tile_ranges.kv_tile_order(q))):
        np.testing.assert_array_equal(np.sort(order), np.arange(len(ranges.lo)))
        work = ranges.count[order]
        assert (np.diff(work) <= 0).all()

    splits = int(np.random.default_rng(T * S).integers(1, 5))
    parts = as_array(tile_ranges.split_ranges(r, splits))  # [splits, nq, 4]
    for a in range(nq):
        tiles = [t for lo, _, _, hi in parts[:, a] for t in range(lo, hi)]
        assert tiles == list(range(r.lo[a], r.hi[a]))
        fulls = [t for _, f_lo, f_hi, _ in parts[:, a] for t in range(f_lo, f_hi)]
        assert fulls == list(range(r.full_lo[a], r.full_hi[a]))


def test_small_shapes_exhaustively():
    """Every small combination (hypothesis above samples larger ones): both forms of the
    ranges against the dense mask, and tile indices past the end see nothing."""
    for T in (1, 5, 16, 23, 40):
        for S in (1, 7, 16, 41):
            for bq, bk in ((8, 8), (16, 8), (8, 24)):
                for window in ((-1, -1), (-1, 0), (3, 0), (0, 5), (7, 2), (-1, 6), (20, -1)):
                    for bottom_right in (False, True):
                        spec = make_spec(T, S, window, bottom_right)
                        vis = dense_visible(T, S, window, spec.diagonal_offset, bq, bk)
                        want = expected_ranges(tile_classes(vis, T, bq, bk))
                        nq = -(-T // bq)
                        np.testing.assert_array_equal(as_array(tile_ranges.kv_ranges(spec, bq, bk)), want)
                        closed = tile_ranges.band_kv_range(
                            np.arange(nq + 2), q_len=T, kv_len=S, window=window,
                            diagonal_offset=spec.diagonal_offset, block_q=bq, block_kv=bk)
                        np.testing.assert_array_equal(as_array(closed)[:nq], want)
                        assert not as_array(closed)[nq:].any()


def test_closed_form_traced_and_causal_lpt():
    T, S, bq, bk = 300, 520, 64, 64
    spec = make_spec(T, S, (-1, 0), bottom_right=True)
    kw = dict(q_len=T, kv_len=S, window=spec.window, diagonal_offset=spec.diagonal_offset,
              block_q=bq, block_kv=bk)
    traced = jax.jit(lambda t: tile_ranges.band_kv_range(t, **kw))(jnp.arange(5, dtype=jnp.int32))
    np.testing.assert_array_equal(as_array(traced), as_array(tile_ranges.kv_ranges(spec, bq, bk)))
    square = tile_ranges.kv_ranges(make_spec(512, 512, (-1, 0)), 64, 64)
    np.testing.assert_array_equal(tile_ranges.q_tile_order(square), np.arange(8)[::-1])
    np.testing.assert_array_equal(tile_ranges.kv_tile_order(tile_ranges.q_ranges(make_spec(512, 512, (-1, 0)), 64, 64)),
                                  np.arange(8))


def packed(rng, B, L):
    """Packed segment ids (1-based, documents of 50-90 tokens, then 0-20 tokens of padding 0)
    and canonical positions, [B, L] each."""
    ids = np.zeros((B, L), np.int32)
    pos = np.zeros((B, L), np.int32)
    for b in range(B):
        start, d, end_all = 0, 1, L - int(rng.integers(0, 21))
        while start < end_all:
            end = min(start + int(rng.integers(50, 91)), end_all)
            ids[b, start:end] = d
            pos[b, start:end] = np.arange(end - start)
            start, d = end, d + 1
    return ids, pos


@pytest.mark.parametrize("window", [(-1, 0), (80, 0), (-1, -1)])
def test_dynamic_ranges_from_segments(window):
    B, L, bq, bk = 3, 200, 32, 16
    rng = np.random.default_rng(sum(window) + 7)
    ids, pos = packed(rng, B, L)
    spec = make_spec(L, L, window, B=B, segments="packed")
    inputs = AttentionInputs(q=None, k=None, v=None, q_segment_ids=jnp.asarray(ids),
                             kv_segment_ids=jnp.asarray(ids), q_positions=jnp.asarray(pos),
                             kv_positions=jnp.asarray(pos))
    kv, q = jax.jit(lambda x: (tile_ranges.kv_ranges(spec, bq, bk, x), tile_ranges.q_ranges(spec, bq, bk, x)))(inputs)
    order = jax.jit(tile_ranges.q_tile_order)(kv)
    assert kv.lo.shape == (B, -(-L // bq)) and q.lo.shape == (B, -(-L // bk))
    bound, q_bound = tile_ranges.kv_ranges(spec, bq, bk), tile_ranges.q_ranges(spec, bq, bk)
    nq, nk = -(-L // bq), -(-L // bk)
    for b in range(B):
        d = pos[b][:, None] - pos[b][None, :]
        vis = (ids[b][:, None] == ids[b][None, :]) & (ids[b][:, None] != 0)
        if window[0] >= 0:
            vis &= d <= window[0]
        if window[1] >= 0:
            vis &= d >= -window[1]
        vis = np.pad(vis, ((0, nq * bq - L), (0, nk * bk - L)))
        row = jax.tree.map(lambda x: np.asarray(x)[b], kv)
        check_against_dense(row, vis, L, bq, bk)
        check_against_dense(jax.tree.map(lambda x: np.asarray(x)[b], q), vis, L, bq, bk, transpose=True)
        # The static bound covers every batch row (packed: everything, no FULL tile).
        assert (bound.lo <= row.lo).all() and (bound.hi >= row.hi).all()
        assert (bound.full_lo == bound.full_hi).all() and (q_bound.hi == nq).all()
        o = np.asarray(order)[b]
        assert sorted(o) == list(range(nq)) and (np.diff(row.count[o]) <= 0).all()
    assert (kv.full_hi > kv.full_lo).any()  # some tiles inside one document run unmasked


def test_padding_bound_is_the_band():
    spec = make_spec(130, 130, (-1, 0), segments="padding")
    band = tile_ranges.kv_ranges(make_spec(130, 130, (-1, 0)), 32, 32)
    bound = tile_ranges.kv_ranges(spec, 32, 32)
    np.testing.assert_array_equal(bound.lo, band.lo)
    np.testing.assert_array_equal(bound.hi, band.hi)
    assert (bound.full_lo == bound.full_hi).all()


# -- BlockSizes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    (dict(block_q=96), ["block_q=96", "128"]),
    (dict(block_q=64, num_compute_wgs=2), ["block_q=64", "128"]),
    (dict(block_q=128, num_compute_wgs=3), ["block_q=128", "192"]),
    (dict(block_kv=264), ["block_kv=264", "256"]),
    (dict(block_kv=60), ["block_kv=60", "multiple of 8"]),
    (dict(num_stages=0), ["num_stages=0", ">= 1"]),
    (dict(num_compute_wgs=4, block_q=256), ["num_compute_wgs=4", "1, 2 or 3"]),
    (dict(compute_registers=250), ["compute_registers=250", "multiple of 8"]),
    (dict(compute_registers=256, memory_registers=40), ["compute_registers=256", "512", "552"]),
    (dict(block_q=128.0), ["block_q=128.0"]),
    (dict(block_q=64, num_compute_wgs=1, pingpong=True), ["pingpong=True", "num_compute_wgs >= 2"]),
    (dict(intra_wg_overlap=1), ["intra_wg_overlap=1", "bool"]),
    (dict(lpt_order=None), ["lpt_order=None", "bool"]),
])
def test_block_sizes_errors(kwargs, words):
    with pytest.raises(ValueError) as e:
        mg.BlockSizes(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_block_sizes_for_a_call():
    bs = mg.BlockSizes(block_q=192, num_compute_wgs=3)
    assert (bs.compute_registers, bs.memory_registers, bs.rows_per_wg) == (160, 32, 64)
    d128 = make_spec(4096, 4096, Dqk=128)
    assert mg.BlockSizes().validate_for(d128) == mg.BlockSizes()
    with pytest.raises(ValueError, match=r"block_kv=96 must be a multiple of 64 for bfloat16"):
        mg.BlockSizes(block_kv=96).validate_for(d128)
    with pytest.raises(ValueError, match=r"block_kv=64 must be a multiple of 128 for float8_e4m3fn"):
        mg.BlockSizes(block_kv=64).validate_for(make_spec(256, 256, Dqk=128, dtype="float8_e4m3fn"))
    with pytest.raises(ValueError, match=r"shared memory"):
        mg.BlockSizes(block_kv=128, num_stages=3).validate_for(make_spec(256, 256, Dqk=256))
    with pytest.raises(ValueError, match=r"accumulators need 256 registers"):
        mg.BlockSizes(block_kv=256, num_stages=1, intra_wg_overlap=False).validate_for(
            make_spec(256, 256, Dqk=128, Dv=256))
    with pytest.raises(ValueError, match=r"accumulators need 320 registers .*P in flight"):
        mg.BlockSizes(block_kv=256, num_stages=1, intra_wg_overlap=True).validate_for(make_spec(256, 256, Dqk=128, Dv=256))
    with pytest.raises(NotImplementedError, match="v_dim=512"):
        mg.BlockSizes().validate_for(make_spec(256, 256, Dqk=64, Dv=512))


def test_schedule_defaults():
    bs = mg.BlockSizes()
    assert (bs.pingpong, bs.intra_wg_overlap, bs.reuse_q_for_o, bs.lpt_order) == (True, False, True, True)
    assert mg.BlockSizes(block_q=64, num_compute_wgs=1).pingpong is False  # nobody to take turns with
    assert mg.BlockSizes(block_q=192, num_compute_wgs=3).pingpong is True
    assert mg.BlockSizes(pingpong=False).pingpong is False


def test_shared_memory_count():
    """smem_bytes by hand (1024-byte aligned buffers + 8 bytes per mbarrier); the kernel test
    checks the same numbers against Mosaic GPU's own count."""
    K = 1024
    d128 = make_spec(4096, 4096, (-1, 0), Dqk=128)
    # Q 32 K (O reuses it), K and V 3 x 32 K each, lse 512 B -> 1 K; 2 + 4 * 3 barriers.
    bs3 = mg.BlockSizes(num_stages=3)
    assert bs3.smem_bytes(d128) == (32 + 192 + 1) * K + 8 * 14 == 230512
    assert bs3.validate_for(d128) is bs3  # 3 stages fit at d128 once O reuses Q
    with pytest.raises(ValueError, match=r"needs 263280 bytes .* at most 232448 \(227 KB\)"):
        mg.BlockSizes(num_stages=3, reuse_q_for_o=False).validate_for(d128)
    # 3 warpgroups of 64 rows at d128: Q 48 K, K and V 2 x 32 K each, lse 768 B -> 1 K.
    bs = mg.BlockSizes(block_q=192, num_compute_wgs=3)
    assert bs.smem_bytes(d128) == (48 + 128 + 1) * K + 8 * 11
    # Dqk != Dv: O gets its own buffer; a learnable sink adds its rows and W barriers.
    mla = make_spec(4096, 4096, (-1, 0), Dqk=128, Dv=64)
    bs = mg.BlockSizes()
    assert not bs.o_reuses_q(mla)
    assert bs.smem_bytes(mla) == (32 + 64 + 32 + 16 + 1) * K + 8 * 10  # Q, K, V, O, lse
    learnable = dataclasses.replace(mla, softmax="learnable")
    assert bs.smem_bytes(learnable) == bs.smem_bytes(mla) + K + 8 * 2


# -- the table and default_for ------------------------------------------------------------------

ANCHORS = {  # name: (spec, expected (block_q, block_kv, num_stages, num_compute_wgs))
    "seed000_gqa_swa": (make_spec(4096, 4096, (128, 0), B=2, N=128, K=8, Dqk=128),
                        mg.WindowBlockSizes(block_kv=64, num_compute_wgs=2, q_buffers=4, q_ahead=2)),
    "seed000_mla": (make_spec(4096, 4096, (-1, 0), B=2, N=128, K=8, Dqk=128, Dv=64), (128, 128, 2, 2)),
    "full_4k_h16_d128": (make_spec(4096, 4096, B=4, N=16, K=16, Dqk=128), (128, 128, 2, 2)),
    "causal_8k_h32_d128": (make_spec(8192, 8192, (-1, 0), N=32, K=32, Dqk=128), (128, 128, 2, 2)),
    "causal_8k_h32_d64": (make_spec(8192, 8192, (-1, 0), N=32, K=32, Dqk=64), (192, 128, 4, 3)),
    "gqa_causal_16k": (make_spec(16384, 16384, (-1, 0), N=64, K=8, Dqk=128), (128, 128, 2, 2)),
    "d256_causal_8k": (make_spec(8192, 8192, (-1, 0), N=16, K=16, Dqk=256), (128, 64, 2, 2)),
    "swa1024_32k_gqa": (make_spec(32768, 32768, (1023, 0), N=64, K=8, Dqk=128), (128, 128, 2, 2)),
}


@pytest.mark.parametrize("name", sorted(ANCHORS))
def test_default_for_anchors(name):
    spec, expected = ANCHORS[name]
    entry = config_table.matching_entry(spec, H100)
    assert entry is not None and entry["anchor"] == name
    # a tuned entry names the run that measured it (benchmarks/results/*-tune/)
    assert entry["tuned"] is ("flashmesh tune" in entry["source"])
    for kind in (H100, "NVIDIA H200"):
        bs = config_table.default_for(spec, kind)
        if isinstance(expected, mg.WindowBlockSizes):  # the window kernel's entry
            assert bs == expected
            continue
        assert (bs.block_q, bs.block_kv, bs.num_stages, bs.num_compute_wgs) == expected
    if isinstance(bs, mg.BlockSizes):
        assert config_table.split_kv(spec, bs) == 1  # every anchor fills the chip


def test_default_for_heuristic_and_devices():
    for spec in (make_spec(1000, 3000, Dqk=96), make_spec(40, 40, Dqk=64),
                 make_spec(2048, 2048, (-1, 0), Dqk=128, dtype="float8_e4m3fn"),
                 make_spec(512, 512, (63, 64), Dqk=192, Dv=128), make_spec(512, 512, Dqk=256)):
        assert config_table.matching_entry(spec, H100) is None
        bs = config_table.default_for(spec, H100)
        assert bs == config_table.heuristic(spec) and bs.smem_bytes(spec) <= mg.SMEM_BYTES
    assert config_table.default_for(make_spec(40, 40, Dqk=64), H100).num_compute_wgs == 1
    assert config_table.default_for(make_spec(2048, 2048, Dqk=128, dtype="float8_e4m3fn"), H100).block_kv == 128
    assert config_table.default_for(make_spec(512, 512, (63, 64), Dqk=192, Dv=128), H100).block_kv == 64
    # no band mask: persistent, O in its own buffer where it fits (d96: 2 stages of 128 keys
    # plus Q and O fit); a causal call keeps the launch grid
    full = config_table.default_for(make_spec(4000, 4000, N=32, K=8, Dqk=96), H100)
    assert full.persistent and not full.reuse_q_for_o
    assert not config_table.heuristic(make_spec(4000, 4000, (-1, 0), N=32, K=8, Dqk=96)).persistent
    # a persistent table entry (full_4k_h16_d128's) on a call too small to fill the chip: KV
    # splits on the launch grid instead
    small = config_table.default_for(make_spec(200, 136, N=4, K=1, Dqk=128), H100)
    assert small.num_splits > 1 and not small.persistent
    with pytest.raises(NotImplementedError, match="Hopper"):
        config_table.default_for(make_spec(128, 128), "NVIDIA A100-SXM4-80GB")


def test_table_entries_all_validate_and_are_reachable():
    raw = json.loads(config_table.CONFIGS_PATH.read_text())
    table = config_table.load_table()
    assert raw == table and len(table["entries"]) >= 7
    for entry in table["entries"]:
        key = entry["key"]
        width = key.get("max_window")
        window = {"none": (-1, -1), "causal": (-1, 0),
                  "window": (width - 1 if width else 2000, 0)}[key["mask"]]
        group = key.get("group", 1)
        L = key.get("max_len", max(key.get("min_len", 4096), 4096))
        for dtype in key["dtypes"]:
            spec = make_spec(L, L, window, N=8 * group, K=8, Dqk=key["qk_dim"], Dv=key["v_dim"],
                             dtype=dtype)
            assert config_table.matching_entry(spec, H100) is entry, entry["anchor"]
            assert config_table.default_for(spec, H100) == config_table.forward_config(entry["config"]).validate_for(spec)


def test_backward_entries_validate_and_are_reachable(tmp_path):
    from flashmesh.attention import pallas_mosaic_gpu_sm90_bwd_tiles as bwd_tiles

    entries = config_table.load_table()["backward_entries"]
    assert len(entries) >= 4 and all(e["tuned"] for e in entries)
    for entry in entries:  # a call of each key's kind (its group, a window within its bound)
        key = entry["key"]
        window = {"none": (-1, -1), "causal": (-1, 0),
                  "window": (key.get("max_window", 256) // 2 - 1, 0)}[key["mask"]]
        L = key.get("max_len", 4096)
        spec = make_spec(L, L, window, N=8 * key.get("group", 1), K=8, Dqk=key["qk_dim"], Dv=key["v_dim"])
        assert bwd_tiles.measured_entry(spec) is entry, entry["anchor"]
        assert bwd_tiles.default_for(spec) == bwd_tiles.BackwardBlockSizes(**entry["config"])
    assert bwd_tiles.measured_entry(make_spec(4096, 4096, (128, 0), Dqk=64)) is None  # windows
    assert bwd_tiles.measured_entry(make_spec(4096, 4096, Dqk=64)) is None  # full d64: only 128 timed
    raw = json.loads(config_table.CONFIGS_PATH.read_text())
    raw["backward_entries"].append(dict(raw["backward_entries"][0], config={"block_q": 32}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="BackwardBlockSizes.block_q=32"):
        config_table.load_table(str(bad))
    raw["backward_entries"][-1]["config"] = raw["backward_entries"][0]["config"]
    bad.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=rf"backward_entries\[{len(entries)}\] repeats the key"):
        config_table.load_table(str(bad))


def test_split_kv_for_decoding():
    spec = make_spec(64, 32768, (-1, 0), bottom_right=True, N=8, K=1, Dqk=128)
    bs = mg.BlockSizes(block_q=64, num_compute_wgs=1)
    s = config_table.split_kv(spec, bs)
    longest = int(tile_ranges.kv_ranges(spec, 64, 128).count.max())
    assert 1 < s <= longest and 8 * s >= 0.8 * 132 * 0.85  # the splits fill most of a wave
    assert config_table.split_kv(make_spec(64, 64, N=8), bs) == 1  # one key tile: nothing to split
    with pytest.raises(ValueError, match="num_sms=0"):
        config_table.split_kv(spec, bs, num_sms=0)
    # the configuration a decoding call gets splits its keys that way
    chosen = config_table.default_for(spec, H100)
    assert chosen.num_splits == config_table.split_kv(spec, chosen) > 1, chosen
    with pytest.raises(ValueError, match="num_splits=0 must be in"):
        mg.BlockSizes(num_splits=0)


def test_split_part_in_a_kernel_is_split_ranges():
    """The scalar form the kernel evaluates per CTA equals the array form, split by split."""
    spec = make_spec(300, 1000, (200, 0), bottom_right=True)
    r = tile_ranges.kv_ranges(spec, 64, 64)
    parts = tile_ranges.split_ranges(r, 5)
    for s in range(5):
        for i in range(len(r.lo)):
            one = tile_ranges.split_part(tile_ranges.TileRanges(*(jnp.int32(x[i]) for x in r)), jnp.int32(s), 5)
            assert tuple(int(x) for x in one) == tuple(int(x[s, i]) for x in parts), (s, i)
