"""The delayed-scaling update step by step against hand-computed values, quantisation, and
the recipes' validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashmesh.quantization import scaling
from flashmesh.quantization.recipe import (DelayedScaling, Float8CurrentScaling, Format,
                                           MXFP8BlockScaling, NVFP4BlockScaling)
from flashmesh.quantization.autocast import active_recipe, autocast


def _step(scale, history, amax, recipe, fp8_max=448.0):
    s, h = scaling.update(jnp.asarray([scale], jnp.float32), jnp.asarray(history, jnp.float32),
                          jnp.asarray([amax], jnp.float32), fp8_max, recipe)
    return float(s[0]), [float(v) for v in h]


def test_update_max_rolls_the_history():
    r = DelayedScaling(amax_history_len=4, amax_compute_algo="max")
    # step 1: history [0, 0, 0, 0], amax 2 -> hist [2,0,0,0], scale 448/2, roll -> [0,0,0,2]
    s, h = _step(1.0, [0, 0, 0, 0], 2.0, r)
    assert s == 224.0 and h == [0, 0, 0, 2.0]
    # step 2: amax 8 -> [8,0,0,2] max 8 -> 56; roll -> [0,0,2,8]
    s, h = _step(s, h, 8.0, r)
    assert s == 56.0 and h == [0, 0, 2.0, 8.0]
    # step 3: amax 1 -> [1,0,2,8] max 8 -> 56; roll -> [0,2,8,1]
    s, h = _step(s, h, 1.0, r)
    assert s == 56.0 and h == [0, 2.0, 8.0, 1.0]
    # step 4: amax 1 -> [1,2,8,1] -> 56; roll -> [2,8,1,1] then history[0] = 0 drops the 2
    s, h = _step(s, h, 1.0, r)
    assert s == 56.0 and h == [0, 8.0, 1.0, 1.0]
    # step 5: amax 1 -> [1,8,1,1]: the 8 is still there -> 56; roll -> [8,1,1,1] -> [0,1,1,1]
    s, h = _step(s, h, 1.0, r)
    assert s == 56.0 and h == [0, 1.0, 1.0, 1.0]
    # step 6: the 8 has left the window -> 448
    s, h = _step(s, h, 1.0, r)
    assert s == 448.0


def test_update_most_recent_and_margin():
    r = DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent", margin=2)
    s, h = _step(1.0, [0, 5.0, 9.0], 4.0, r)
    assert s == 448.0 / 4.0 / 4.0 and h == [0, 9.0, 4.0]


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
def test_update_keeps_the_scale_for_zero_or_non_finite_amax(bad):
    r = DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent")
    s, _ = _step(3.5, [0, 0], bad, r)
    assert s == 3.5
    # "max" with an empty history and a zero amax also keeps the scale
    s, _ = _step(3.5, [0, 0], 0.0, DelayedScaling(amax_history_len=2))
    assert s == 3.5


def test_e5m2_gradients_use_their_own_maximum():
    s, _ = _step(1.0, [0, 0], 1024.0, DelayedScaling(amax_history_len=2), fp8_max=57344.0)
    assert s == 56.0


def test_quantize_clips_and_rounds():
    x = jnp.asarray([1.0, -3.0, 1000.0, -1e6, 0.3], jnp.float32)
    q = scaling.quantize(x, jnp.asarray([2.0], jnp.float32), jnp.float8_e4m3fn)
    assert q.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(q.astype(jnp.float32), [2.0, -6.0, 448.0, -448.0, 0.625])


def test_current_scale():
    r = Float8CurrentScaling()
    assert float(scaling.current_scale(jnp.asarray([4.0]), 448.0, r)[0]) == 112.0
    assert float(scaling.current_scale(jnp.asarray([0.0]), 448.0, r)[0]) == 1.0
    p2 = Float8CurrentScaling(use_power_2_scales=True)
    assert float(scaling.current_scale(jnp.asarray([4.0]), 448.0, p2)[0]) == 64.0


def test_amax_reduces_over_shard_map_axes():
    mesh = jax.make_mesh((4,), ("data",))
    x = jnp.arange(16.0, dtype=jnp.float32).reshape(4, 4) - 3.0
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P("data")))
    f = jax.shard_map(scaling.amax, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P())
    assert float(f(x)[0]) == 12.0


def test_recipes_validate_and_name_formats():
    assert Format.HYBRID.forward_dtype == jnp.float8_e4m3fn
    assert Format.HYBRID.backward_dtype == jnp.float8_e5m2
    assert Format.E4M3.backward_dtype == jnp.float8_e4m3fn
    assert DelayedScaling(fp8_format="hybrid").fp8_format is Format.HYBRID
    with pytest.raises(ValueError, match="amax_compute_algo"):
        DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="amax_history_len"):
        DelayedScaling(amax_history_len=0)
    with pytest.raises(ValueError, match="margin"):
        DelayedScaling(margin=-1)
    with pytest.raises(NotImplementedError, match="reduce_amax"):
        DelayedScaling(reduce_amax=False)


def test_autocast_scopes_the_recipe():
    assert active_recipe() is None
    r = DelayedScaling(amax_history_len=16)
    with autocast(enabled=True, recipe=r):
        assert active_recipe() is r
        with autocast(enabled=False):
            assert active_recipe() is None
        assert active_recipe() is r
    assert active_recipe() is None
    with pytest.raises(ValueError, match="enabled"):
        with autocast(enabled=1):
            pass
    for block_scaled in (MXFP8BlockScaling(), NVFP4BlockScaling()):
        with pytest.raises(NotImplementedError, match="Blackwell"):
            with autocast(enabled=True, recipe=block_scaled):
                pass
