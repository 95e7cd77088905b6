"""`masks.py`: the element mask equals the oracle's, the block map is conservative-correct
everywhere and exact for implicit positions, and the dropout hash is deterministic, unbiased
and seed-dependent."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import semantics as sem
from flashmesh.attention import masks, normalize

SHAPES = [(2, 13, 13), (2, 9, 21), (2, 21, 9)]  # (B, T, S): few shapes, few compiles
TILES = [(4, 4), (3, 5), (16, 2)]


def _spec_inputs(B, T, S, *, mask, window=None, segments=None):
    z = lambda L: np.zeros((B, L, 1, 1), np.float32)  # noqa: E731 (only shapes matter)
    desc = None if segments is None else segments.descriptor()
    return normalize(z(T), z(S), z(S), mask=mask, window=window, segments=desc)


def _tiles_check(classes, vis, bq, bk, *, exact: bool, where: str):
    """Every EMPTY tile has no visible pair, every FULL tile only visible pairs (key columns
    past S count as hidden: they are tile padding); with exact, the converse too."""
    classes = np.asarray(classes)
    B, T, S = vis.shape
    nq, nk = -(-T // bq), -(-S // bk)
    assert classes.shape in ((B, nq, nk), (1, nq, nk)), (classes.shape, (B, nq, nk))
    padded = np.zeros((B, T, nk * bk), bool)
    padded[:, :, :S] = vis
    for b, i, j in itertools.product(range(B), range(nq), range(nk)):
        tile = padded[b, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
        c = classes[b % classes.shape[0], i, j]
        at = f"{where}: tile (b={b}, q block {i}, k block {j}) of ({bq}, {bk})"
        if c == masks.EMPTY:
            assert not tile.any(), f"{at} is EMPTY but has visible pairs"
        elif c == masks.FULL:
            assert tile.all(), f"{at} is FULL but has hidden pairs"
        else:
            assert c == masks.PARTIAL, f"{at}: unknown class {c}"
            if exact:
                actual = "FULL" if tile.all() else "EMPTY"
                assert tile.any() and not tile.all(), f"{at} is PARTIAL but is {actual}"


# -- element mask ----------------------------------------------------------------------------------
@pytest.mark.parametrize("B,T,S", SHAPES)
@pytest.mark.parametrize("recipe", [None, "seqlens_empty_row", "offsets", "ids", "ids_pos_shifted"])
def test_element_mask_matches_oracle(B, T, S, recipe):
    rng = np.random.default_rng(T * 31 + S)
    seg = None if recipe is None else sem.SEGMENT_RECIPES[recipe](rng, B, T, S)
    bottom_right = "causal" if recipe == "ids_pos_shifted" else "causal_bottom_right"
    for mask, window in [("none", None), ("causal", None), ("causal", (3, 0)), ("none", (2, 1)),
                         (bottom_right, (4, 0))]:
        if seg is not None and mask != "none":
            mask = "padding_" + mask
        inputs, spec = _spec_inputs(B, T, S, mask=mask, window=window, segments=seg)
        got = masks.element_mask(spec, inputs, np.arange(T), np.arange(S))
        want = sem.visible(B, T, S, mask=mask, window=window, segments=seg)
        got = np.ones_like(want) if got is None else np.broadcast_to(np.asarray(got), want.shape)
        np.testing.assert_array_equal(got, want, err_msg=f"{recipe} {mask} {window}")


def test_element_mask_hides_tile_padding_columns():
    inputs, spec = _spec_inputs(1, 5, 6, mask="none")
    got = np.asarray(masks.element_mask(spec, inputs, np.arange(5), np.arange(8)))
    assert got.shape == (1, 1, 8) or got.shape == (1, 5, 8)
    assert not np.broadcast_to(got, (1, 5, 8))[..., 6:].any()
    assert np.broadcast_to(got, (1, 5, 8))[..., :6].all()
    assert masks.element_mask(spec, inputs, np.arange(5), np.arange(6)) is None  # nothing hidden


# -- block map -------------------------------------------------------------------------------------
def test_block_map_is_exact_for_implicit_positions():
    """No segments: positions are 0..T-1 (shifted for bottom-right) and 0..S-1, so tile minima
    and maxima decide exactly. Random lengths, windows, diagonals and tile sizes."""
    rng = np.random.default_rng(0)
    for trial in range(150):
        T, S = (int(x) for x in rng.integers(1, 40, size=2))
        mask = str(rng.choice(["none", "causal", "causal_bottom_right"]))
        left = int(rng.choice([-1, 0, 1, 3, 7, 20]))
        right = 0 if mask != "none" else int(rng.choice([-1, 0, 1, 2, 9]))
        window = None if (left, right) == (-1, -1) else (left, right)
        bq, bk = (int(x) for x in rng.integers(1, 17, size=2))
        inputs, spec = _spec_inputs(1, T, S, mask=mask, window=window)
        classes = masks.block_map(spec, inputs, bq, bk)
        assert isinstance(classes, np.ndarray), "no segments: the static (numpy) path"
        vis = sem.visible(1, T, S, mask=mask, window=window)
        _tiles_check(classes, vis, bq, bk, exact=True,
                     where=f"trial {trial}: T={T} S={S} {mask} window={window}")


@pytest.mark.parametrize("B,T,S", SHAPES[:2])
@pytest.mark.parametrize("recipe", ["seqlens_empty_row", "offsets", "ids", "ids_pos_shifted"])
def test_block_map_is_conservative_with_segments(B, T, S, recipe):
    rng = np.random.default_rng(T * 7 + S + len(recipe))
    seg = sem.SEGMENT_RECIPES[recipe](rng, B, T, S)
    for mask, window in [("padding", None), ("padding_causal", None), ("padding_causal", (2, 0)),
                         ("padding", (1, 3))]:
        inputs, spec = _spec_inputs(B, T, S, mask=mask, window=window, segments=seg)
        vis = sem.visible(B, T, S, mask=mask, window=window, segments=seg)
        for bq, bk in TILES:
            classes = masks.block_map(spec, inputs, bq, bk)
            assert isinstance(classes, jax.Array), "segments: the traced (jnp) path"
            _tiles_check(classes, vis, bq, bk, exact=False, where=f"{recipe} {mask} {window}")


def test_block_map_is_conservative_for_unordered_segment_ids():
    """Ids need not increase along a row: [3, 3, 1, 1, 0, 2, 2, ...]; tile ranges overlap."""
    rng = np.random.default_rng(5)
    B, T, S = SHAPES[0]
    for trial in range(4):
        ids = np.repeat(rng.integers(0, 4, size=(B, T // 2 + 1)), 2, axis=1)[:, :T]
        seg = sem.Segments("ids", (ids, None), (ids, None))
        inputs, spec = _spec_inputs(B, T, S, mask="padding_causal", window=(3, 0), segments=seg)
        vis = sem.visible(B, T, S, mask="padding_causal", window=(3, 0), segments=seg)
        for bq, bk in TILES:
            _tiles_check(masks.block_map(spec, inputs, bq, bk), vis, bq, bk, exact=False,
                         where=f"unordered ids trial {trial}")


def test_block_map_finds_empty_and_full_tiles_where_it_should():
    """Not only correct but useful: causal maps skip the upper triangle, segment-aligned tiles
    are FULL, a padding row is EMPTY."""
    inputs, spec = _spec_inputs(1, 64, 64, mask="causal")
    c = masks.block_map(spec, inputs, 16, 16)[0]
    assert (np.triu(np.ones((4, 4), bool), 1) == (c == masks.EMPTY)).all()
    assert (np.tril(np.ones((4, 4), bool), -1) == (c == masks.FULL)).all()
    assert (np.diag(c) == masks.PARTIAL).all()
    seg = sem.Segments("offsets", (np.array([[16, 16, -1]]), np.array([[0, 16, -1]])),
                       (np.array([[16, 16, -1]]), np.array([[0, 16, -1]])))
    inputs, spec = _spec_inputs(1, 48, 48, mask="padding", segments=seg)
    c = np.asarray(masks.block_map(spec, inputs, 16, 16))[0]
    want = np.full((3, 3), masks.EMPTY)
    want[0, 0] = want[1, 1] = masks.FULL
    np.testing.assert_array_equal(c, want)


def test_block_map_static_path_only_without_segments():
    inputs, spec = _spec_inputs(2, 13, 21, mask="causal_bottom_right", window=(5, 0))
    assert isinstance(masks.block_map(spec, inputs, 4, 4), np.ndarray)
    seg = sem.SEGMENT_RECIPES["seqlens"](np.random.default_rng(0), 2, 13, 21)
    inputs, spec = _spec_inputs(2, 13, 21, mask="padding", segments=seg)
    c = masks.block_map(spec, inputs, 4, 4)
    assert isinstance(c, jax.Array) and c.shape == (2, 4, 6) and c.dtype == jnp.int8


def test_block_map_under_jit_equals_eager():
    B, T, S = SHAPES[1]
    seg = sem.SEGMENT_RECIPES["offsets"](np.random.default_rng(3), B, T, S)
    inputs, spec = _spec_inputs(B, T, S, mask="padding_causal", window=(2, 0), segments=seg)
    eager = masks.block_map(spec, inputs, 3, 5)
    jitted = jax.jit(lambda i: masks.block_map(spec, i, 3, 5))(inputs)
    np.testing.assert_array_equal(eager, jitted)


def test_block_map_memory_is_per_tile_not_per_pair():
    """A 1M x 1M causal map with 1024-tiles is a [1, 1024, 1024] int8 array, computed at once."""
    T = 2**20
    inputs, spec = _spec_inputs(1, 8, 8, mask="causal")
    spec = spec.__class__(**{**spec.__dict__, "q_len": T, "kv_len": T})
    c = masks.block_map(spec, inputs, 1024, 1024)
    assert c.shape == (1, 1024, 1024) and c.dtype == np.int8 and c.nbytes == 2**20
    assert (c == masks.EMPTY).sum() == 1024 * 1023 // 2


# -- dropout hash ----------------------------------------------------------------------------------
def _keep(seed, rate, shape=(2, 3, 64, 64)):
    B, N, T, S = shape
    return sem.dropout_keep_mask(jnp.asarray(seed, jnp.uint32), rate, B, N, T, S)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_dropout_keep_respects_the_rate(rate):
    keep = _keep([7, 11], rate)
    n = keep.size  # 24576: the kept fraction is within 5 standard deviations of 1 - rate
    assert abs(keep.mean() - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / n), keep.mean()
    for axis in range(4):  # and so is every slice along each axis (no structure)
        frac = keep.mean(axis=tuple(a for a in range(4) if a != axis))
        m = n / keep.shape[axis]
        assert (np.abs(frac - (1 - rate)) < 6 * np.sqrt(rate * (1 - rate) / m)).all(), (axis, frac)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.99999])
def test_dropout_keep_is_the_restated_hash_bit_for_bit(rate):
    """masks.dropout_keep against semantics.dropout_keep_np, the hash restated in numpy: the
    same elements over 262144 draws, a few of which sit exactly on the threshold (2 at rate
    0.1, 7 at 0.5; at 0.99999 only those 16-bit values of 65535 are kept), so a strict
    comparison or another split of the pair's bits would differ."""
    shape = (2, 4, 64, 512)
    keep = _keep([5, 9], rate, shape=shape)
    want = sem.dropout_keep_np([5, 9], rate, *shape)
    np.testing.assert_array_equal(keep, want)
    assert want.any() and not want.all()


def test_dropout_keep_probability_is_the_rate_in_65536ths():
    """Each decision reads 16 bits of a hash: the rate realised is a multiple of 1/65536 (the
    nearest), and the kept elements are scaled by its inverse (unbiased)."""
    assert masks.keep_probability(0.0) == 1.0
    assert masks.keep_probability(0.1) == 1.0 - 6554 / 65536
    assert masks.keep_probability(0.5) == 0.5
    assert masks.keep_probability(0.9999999) == 1.0 / 65536  # at least one value in 65536 kept
    for rate in (0.1, 0.3, 0.77):
        assert abs(masks.keep_probability(rate) - (1.0 - rate)) <= 2.0**-17
        assert masks.keep_probability(rate) == sem.keep_probability(rate)


@pytest.mark.parametrize("rate", [0.3, 0.5])
def test_dropout_keep_pairs_of_keys_are_independent(rate):
    """Keys 2m and 2m + 1 share one 32-bit hash, 16 bits each: their decisions must still be
    independent, as must a key's and its neighbours' in other pairs. Each pair of keys
    (j, j + d) is kept together (1 - rate)^2 of the time: within 6 standard deviations of the
    product's mean over disjoint pairs (d = 1, starting even or odd), and over overlapping ones
    (d = 2, 8; their variance is larger, at most twice)."""
    keep = _keep([5, 9], rate, shape=(2, 4, 64, 512)).astype(np.float64)
    p = masks.keep_probability(rate)
    for d, first in ((1, 0), (1, 1), (2, 0), (8, 0)):  # (2m, 2m+1), (2m+1, 2m+2), ...
        j = np.arange(first, keep.shape[-1] - d, 2)
        both = (keep[..., j] * keep[..., j + d]).mean()
        sd = np.sqrt(2 * p * p * (1 - p * p) / keep[..., j].size)
        assert abs(both - p * p) < 6 * sd, (d, first, both, p * p)
    pairs = keep.reshape(-1, 2)  # the four outcomes of a pair (2m, 2m+1)
    counts = np.bincount((pairs[:, 0] * 2 + pairs[:, 1]).astype(int), minlength=4) / len(pairs)
    expected = np.array([(1 - p) ** 2, (1 - p) * p, p * (1 - p), p * p])
    sd = np.sqrt(expected * (1 - expected) / len(pairs))
    assert (np.abs(counts - expected) < 6 * sd).all(), (counts, expected)


def test_dropout_keep_rate_zero_keeps_everything():
    assert _keep([3, 4], 0.0).all()


def test_dropout_keep_differs_between_seeds_and_positions():
    a, b, c = _keep([1, 2], 0.5), _keep([1, 3], 0.5), _keep([2, 2], 0.5)
    for other in (b, c):  # independent masks disagree on about half the elements
        assert 0.45 < np.mean(a != other) < 0.55
    assert 0.45 < np.mean(a[0] != a[1]) < 0.55  # batch rows
    assert 0.45 < np.mean(a[:, 0] != a[:, 1]) < 0.55  # heads
    assert 0.45 < np.mean(a[..., :32, :] != a[..., 32:, :]) < 0.55  # query rows
    assert 0.45 < np.mean(a != np.swapaxes(a, 2, 3)) < 0.55  # (i, j) is not (j, i)
    # neighbours are uncorrelated
    assert abs(np.corrcoef(a[..., :-1].ravel(), a[..., 1:].ravel())[0, 1]) < 0.05


def test_dropout_keep_of_a_tile_is_the_slice_of_the_whole():
    seed = jnp.asarray([5, 9], jnp.uint32)
    whole = _keep([5, 9], 0.4)
    b, n = np.arange(2)[:, None, None, None], np.arange(3)[None, :, None, None]
    i, j = np.arange(16, 40)[None, None, :, None], np.arange(33, 50)[None, None, None, :]
    tile = np.asarray(masks.dropout_keep(seed, 0.4, b, n, i, j))
    np.testing.assert_array_equal(tile, whole[:, :, 16:40, 33:50])
    one = masks.dropout_keep(seed, 0.4, 1, 2, 20, 40)  # scalars broadcast too
    assert bool(one) == whole[1, 2, 20, 40]
