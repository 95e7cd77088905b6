"""FP8 GEMMs and the fp8_metas state through the modules: numerics against the unquantised
layer, the state update as the state's cotangent, max combination under reuse, scan and
gradient accumulation, sharding, checkpoints, and the errors a user meets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashmesh.te as te
from flax import linen as nn
from flashmesh.nn import DenseGeneral, LayerNormDenseGeneral, LayerNormMLP
from flashmesh.quantization import (accumulate_gradients, combine_by_max, dense, update_fp8_metas)
from flashmesh.quantization.recipe import DelayedScaling, Float8CurrentScaling, Format

R = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)


def _init(module, *args, **kwargs):
    """module.init's variables, the parameters unboxed (init boxes them with logical axes)."""
    return nn.unbox(module.init(*args, **kwargs))


def _x(shape=(4, 16, 64), seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _rel(a, b):
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


def _train_steps(module, variables, x, dy, steps, recipe=R, call=None):
    """`steps` FP8 steps with the state threaded; returns (variables, last output, last grads)."""
    call = call or {}

    def loss(v, x):
        y = module.apply(v, x, **call)
        y = y[0] if isinstance(y, tuple) else y
        return jnp.sum(y * dy), y

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    for _ in range(steps):
        with te.autocast(enabled=True, recipe=recipe):
            (_, y), grads = step(variables, x)
        variables = update_fp8_metas(variables, grads[0])
    return variables, y, grads


def test_fp8_dense_within_fp8_tolerance_of_float32_after_the_scales_settle():
    x, module = _x(), DenseGeneral(features=48)
    with te.autocast(enabled=True, recipe=R):
        variables = _init(module, jax.random.key(1), x)
    dy = _x((4, 16, 48), seed=2)
    variables, y, (g_vars, g_x) = _train_steps(module, variables, x, dy, steps=3)

    ref_loss = lambda p, x: jnp.vdot(module.apply({"params": p}, x), dy)
    y_ref = module.apply({"params": variables["params"]}, x)
    gp_ref, gx_ref = jax.grad(ref_loss, argnums=(0, 1))(variables["params"], x)
    # e4m3 has 3 mantissa bits (relative rounding 2^-4), e5m2 2 bits (2^-3): errors of a few %.
    assert _rel(y, y_ref) < 0.04
    assert _rel(g_x, gx_ref) < 0.08
    assert _rel(g_vars["params"]["kernel"], gp_ref["kernel"]) < 0.08
    np.testing.assert_allclose(g_vars["params"]["bias"], gp_ref["bias"], rtol=1e-5)  # bias is exact
    # and it is really quantised: not equal to the float32 result
    assert _rel(y, y_ref) > 1e-4


def test_the_state_update_is_the_cotangent_with_te_values():
    x, module = _x(), DenseGeneral(features=8, use_bias=False)
    with te.autocast(enabled=True, recipe=R):
        variables = _init(module, jax.random.key(1), x)
    metas = variables["fp8_metas"]
    assert sorted(metas) == sorted(f"{q}_{k}" for q in ("x", "kernel", "grad")
                                   for k in ("scale", "amax_history"))
    assert metas["x_scale"].shape == (1,) and metas["x_amax_history"].shape == (4,)
    dy = _x((4, 16, 8), seed=3)
    new, _, _ = _train_steps(module, variables, x, dy, steps=1)
    m = new["fp8_metas"]
    for name, tensor, fp8_max in (("x", x, 448.0), ("kernel", variables["params"]["kernel"], 448.0),
                                  ("grad", dy, 57344.0)):
        amax = float(jnp.abs(tensor).max())
        np.testing.assert_allclose(m[f"{name}_scale"], [fp8_max / amax], rtol=1e-6)
        np.testing.assert_allclose(m[f"{name}_amax_history"], [0, 0, 0, amax], rtol=1e-6)


def test_current_scaling_needs_no_state():
    x, module = _x(), LayerNormMLP(intermediate_dim=32)
    with te.autocast(enabled=True, recipe=Float8CurrentScaling()):
        variables = _init(module, jax.random.key(1), x, deterministic=True)
    assert "fp8_metas" not in variables
    dy = _x(seed=5)
    _, y, _ = _train_steps(module, variables, x, dy, 1, recipe=Float8CurrentScaling(),
                           call={"deterministic": True})
    y_ref, _ = module.apply(variables, x, deterministic=True)
    assert 1e-4 < _rel(y, y_ref) < 0.08  # two GEMMs' e4m3 rounding


def test_init_outside_autocast_then_fp8_apply_is_a_clear_error():
    x, module = _x(), LayerNormDenseGeneral(features=8)
    variables = _init(module, jax.random.key(0), x)
    with pytest.raises(ValueError, match="init inside flashmesh.te.autocast"):
        with te.autocast(enabled=True, recipe=R):
            module.apply(variables, x)


def test_history_length_must_match_the_recipe():
    x, module = _x(), DenseGeneral(features=8)
    with te.autocast(enabled=True, recipe=R):
        variables = _init(module, jax.random.key(0), x)
    with pytest.raises(ValueError, match="amax_history_len"):
        with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=8)):
            module.apply(variables, x)


def test_unused_state_is_kept_not_wiped():
    x, module = _x(), DenseGeneral(features=8)
    with te.autocast(enabled=True, recipe=R):
        variables = _init(module, jax.random.key(0), x)
    variables = dict(variables, fp8_metas=jax.tree.map(lambda v: v + 2.0, variables["fp8_metas"]))
    grads = jax.grad(lambda v: jnp.sum(module.apply(v, x)))(variables)  # outside autocast
    jax.tree.map(np.testing.assert_array_equal, update_fp8_metas(variables, grads)["fp8_metas"],
                 variables["fp8_metas"])


class _Twice(nn.Module):
    """One DenseGeneral applied to two inputs in one apply (shared weights and FP8 state)."""

    @nn.compact
    def __call__(self, pair):
        dense = DenseGeneral(features=8, use_bias=False, name="shared")
        return jnp.sum(dense(pair[0])) + jnp.sum(dense(pair[1]))


def test_a_module_used_twice_in_one_apply_combines_by_max_without_help():
    small, large = _x((2, 4, 16), seed=1), 10.0 * _x((2, 4, 16), seed=2)
    module = _Twice()
    with te.autocast(enabled=True, recipe=R):
        variables = _init(module, jax.random.key(0), (small, large))
        grads = jax.jit(jax.grad(lambda v: module.apply(v, (small, large))))(variables)
    m = update_fp8_metas(variables, grads)["fp8_metas"]["shared"]
    amax = float(jnp.abs(large).max())
    np.testing.assert_allclose(m["x_amax_history"], [0, 0, 0, amax], rtol=1e-6)
    np.testing.assert_allclose(m["x_scale"], [448.0 / amax], rtol=1e-6)


@pytest.mark.parametrize("first", ["zeros", "inf"])
def test_a_use_whose_amax_keeps_the_scale_does_not_decide_the_combination(first):
    """One pass over both uses: with one use all zeros, the other use's scale (the zero use
    alone would keep the old scale, 1 at the first step, and min would have picked it); with one
    use non-finite, the old scale (as one pass's inf amax keeps it)."""
    other = 10.0 * _x((2, 4, 16), seed=2)
    odd = jnp.zeros_like(other) if first == "zeros" else other.at[0, 0, 0].set(jnp.inf)
    module = _Twice()
    with te.autocast(enabled=True, recipe=R):
        variables = _init(module, jax.random.key(0), (odd, other))
        grads = jax.jit(jax.grad(lambda v: module.apply(v, (odd, other))))(variables)
    m = update_fp8_metas(variables, grads)["fp8_metas"]["shared"]
    want = 448.0 / float(jnp.abs(other).max()) if first == "zeros" else 1.0
    np.testing.assert_allclose(m["x_scale"], [want], rtol=1e-6)
    # What the step returns is a usable scale by itself (TE's loops write it over the state).
    assert np.isfinite(np.asarray(grads["fp8_metas"]["shared"]["x_scale"])).all()


def test_a_module_used_twice_combines_under_eager_grad_too():
    """Eager (un-jitted) jax.grad adds the two uses' cotangents outside any trace; the combining
    dtype's accumulation runs there as well (it raised KeyError for EArray)."""
    small, large = _x((2, 4, 16), seed=1), 10.0 * _x((2, 4, 16), seed=2)
    module = _Twice()
    with te.autocast(enabled=True, recipe=R):
        variables = _init(module, jax.random.key(0), (small, large))
        eager = jax.grad(lambda v: module.apply(v, (small, large)))(variables)
        jitted = jax.jit(jax.grad(lambda v: module.apply(v, (small, large))))(variables)
    for name in ("x_scale", "x_amax_history", "grad_scale", "kernel_amax_history"):
        np.testing.assert_allclose(update_fp8_metas(variables, eager)["fp8_metas"]["shared"][name],
                                   update_fp8_metas(variables, jitted)["fp8_metas"]["shared"][name],
                                   rtol=1e-6)


def test_te_update_collections_writes_every_collection_over_the_original():
    """TE's update_collections(new, original): each collection of `new` replaces the original's
    (FrozenDict kept); fp8_metas merges as update_fp8_metas (an unused quantiser keeps its state)."""
    from flax.core import FrozenDict

    module = DenseGeneral(features=8)
    x = _x((2, 4, 16))
    with te.autocast(enabled=True, recipe=R):
        variables = _init(module, jax.random.key(0), x)
        grads = jax.jit(jax.grad(lambda v: jnp.sum(module.apply(v, x))))(variables)
    others = {"fp8_metas": variables["fp8_metas"], "cache": {"k": jnp.zeros(3)}}
    new = {"fp8_metas": grads["fp8_metas"], "cache": {"k": jnp.ones(3)}}
    out = te.update_collections(new, others)
    np.testing.assert_array_equal(out["cache"]["k"], jnp.ones(3))
    want = update_fp8_metas(variables, grads)["fp8_metas"]
    for leaf_out, leaf_want in zip(jax.tree.leaves(out["fp8_metas"]), jax.tree.leaves(want)):
        np.testing.assert_array_equal(leaf_out, leaf_want)
    assert te.update_collections({"cache": {"k": jnp.ones(3)}}, others)["fp8_metas"] is others["fp8_metas"]
    frozen = te.update_collections(FrozenDict(new), FrozenDict(others))
    assert isinstance(frozen, FrozenDict) and te.NVTE_FP8_COLLECTION_NAME == "fp8_metas"


def test_te_recipe_fields():
    assert Format.HYBRID.value.max_fwd == 448.0 and Format.HYBRID.value.max_bwd == 57344.0
    assert Format.E4M3.value == (448.0, 448.0)
    assert DelayedScaling().backward_override is None
    for recipe in (DelayedScaling, Float8CurrentScaling):
        with pytest.raises(NotImplementedError, match="backward_override='high_precision'"):
            recipe(backward_override="high_precision")


def test_one_jitted_function_follows_autocast():
    """The recipe is part of jit's cache key: the same jitted function called inside and
    outside autocast (or under another recipe) is not the other's program."""
    x, module = _x(), DenseGeneral(features=8)
    with te.autocast(enabled=True, recipe=R):
        variables = _init(module, jax.random.key(0), x)
    f = jax.jit(lambda v, x: module.apply(v, x))
    with te.autocast(enabled=True, recipe=R):
        y8 = f(variables, x)
    y = f(variables, x)
    np.testing.assert_allclose(y, module.apply(variables, x), rtol=1e-6)
    assert not np.allclose(y8, y)
    with te.autocast(enabled=True, recipe=DelayedScaling(fp8_format=Format.E4M3, amax_history_len=4)):
        g8 = jax.jit(jax.grad(lambda v: jnp.sum(f(v, x) ** 2)))(variables)
    # under E4M3 the gradient's state uses e4m3's maximum, 448, not e5m2's
    grad_amax = float(update_fp8_metas(variables, g8)["fp8_metas"]["grad_amax_history"][-1])
    np.testing.assert_allclose(update_fp8_metas(variables, g8)["fp8_metas"]["grad_scale"], [448.0 / grad_amax],
                               rtol=1e-6)


def test_forward_quantises_with_the_stored_scale():
    """A stored scale far too large clips: the forward uses the state, not the current amax."""
    x, module = _x(), DenseGeneral(features=8, use_bias=False)
    with te.autocast(enabled=True, recipe=R):
        variables = _init(module, jax.random.key(0), x)
        metas = dict(variables["fp8_metas"], x_scale=jnp.full((1,), 1e4, jnp.float32))
        y = module.apply(dict(variables, fp8_metas=metas), x)
    clipped = jnp.clip(x * 1e4, -448.0, 448.0) / 1e4
    expected = clipped @ variables["params"]["kernel"].astype(jnp.float8_e4m3fn).astype(jnp.float32)
    np.testing.assert_allclose(y, expected, rtol=0.1, atol=0.02)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_gradients_are_exactly_those_of_the_dequantised_product(dtype):
    """dx and dw equal the dequantised operands' products (scales applied exactly); f16 does not
    overflow (the raw FP8 products exceed its range)."""
    x, w = _x((32, 64)).astype(dtype), _x((64, 16), seed=1)
    g = _x((32, 16), seed=2).astype(dtype)
    s = {"x": 30.0, "kernel": 40.0, "grad": 2000.0}
    state = {q: (jnp.full((1,), v, jnp.float32), jnp.zeros(4, jnp.float32)) for q, v in s.items()}
    y, vjp = jax.vjp(lambda x, w: dense(x, w, state, R), x, w)
    dx, dw = vjp(g)
    deq = lambda t, sc, f8: jnp.clip(t.astype(jnp.float32) * sc, -float(jnp.finfo(f8).max),
                                     float(jnp.finfo(f8).max)).astype(f8).astype(jnp.float32) / sc
    xd, wd, gd = deq(x, 30.0, jnp.float8_e4m3fn), deq(w, 40.0, jnp.float8_e4m3fn), deq(g, 2000.0, jnp.float8_e5m2)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, want in ((y, xd @ wd), (dx, gd @ wd.T), (dw, xd.T @ gd)):
        assert bool(jnp.all(jnp.isfinite(got.astype(jnp.float32))))
        np.testing.assert_allclose(got.astype(jnp.float32), want, **tol)


def test_reuse_combines_by_max_not_sum():
    module = DenseGeneral(features=8, use_bias=False)
    small, large = _x((2, 4, 16), seed=1), 10.0 * _x((2, 4, 16), seed=2)
    with te.autocast(enabled=True, recipe=R):
        variables = _init(module, jax.random.key(0), small)

    def loss(v):
        v = combine_by_max(v)
        return jnp.sum(module.apply(v, small)) + jnp.sum(module.apply(v, large))

    with te.autocast(enabled=True, recipe=R):
        grads = jax.jit(jax.grad(loss))(variables)
    m = update_fp8_metas(variables, grads)["fp8_metas"]
    amax = float(jnp.abs(large).max())
    np.testing.assert_allclose(m["x_amax_history"], [0, 0, 0, amax], rtol=1e-6)
    np.testing.assert_allclose(m["x_scale"], [448.0 / amax], rtol=1e-6)


def test_scan_over_microbatches_combines_by_max():
    module = DenseGeneral(features=8, use_bias=False)
    xs = _x((3, 2, 4, 16)) * jnp.asarray([1.0, 7.0, 2.0]).reshape(3, 1, 1, 1)
    with te.autocast(enabled=True, recipe=R):
        variables = _init(module, jax.random.key(0), xs[0])

    def loss(v):
        v = combine_by_max(v)
        body = lambda c, x: (c + jnp.sum(module.apply(v, x)), None)
        return jax.lax.scan(body, jnp.float32(0), xs)[0]

    with te.autocast(enabled=True, recipe=R):
        grads = jax.jit(jax.grad(loss))(variables)
    m = update_fp8_metas(variables, grads)["fp8_metas"]
    np.testing.assert_allclose(m["x_amax_history"][-1], float(jnp.abs(xs).max()), rtol=1e-6)
    # the parameters' gradient is still the sum over microbatches
    g_ref = sum(jax.grad(lambda v, x=x: jnp.sum(module.apply(v, x)))({"params": variables["params"]})["params"]["kernel"]
                for x in xs)
    assert _rel(grads["params"]["kernel"], g_ref) < 0.08


def test_accumulate_gradients_takes_the_max_state():
    module = DenseGeneral(features=8, use_bias=False)
    a, b = _x((2, 4, 16), seed=1), 5.0 * _x((2, 4, 16), seed=2)
    with te.autocast(enabled=True, recipe=R):
        variables = _init(module, jax.random.key(0), a)
        g = [jax.grad(lambda v, x=x: jnp.sum(module.apply(v, x)))(variables) for x in (a, b)]
    total = accumulate_gradients(accumulate_gradients(None, g[0]), g[1])
    np.testing.assert_allclose(total["params"]["kernel"], g[0]["params"]["kernel"] + g[1]["params"]["kernel"])
    m = update_fp8_metas(variables, total)["fp8_metas"]
    np.testing.assert_allclose(m["x_scale"], [448.0 / float(jnp.abs(b).max())], rtol=1e-6)


def test_remat_gives_the_same_state_and_grads():
    module = LayerNormMLP(intermediate_dim=32)
    x, dy = _x(), _x(seed=4)
    with te.autocast(enabled=True, recipe=R):
        variables = _init(module, jax.random.key(0), x, deterministic=True)

    def loss(v, x, remat):
        f = lambda v, x: module.apply(v, x, deterministic=True)[0]
        return jnp.vdot(jax.checkpoint(f)(v, x) if remat else f(v, x), dy)

    with te.autocast(enabled=True, recipe=R):
        plain = jax.jit(jax.grad(loss), static_argnums=2)(variables, x, False)
        remat = jax.jit(jax.grad(loss), static_argnums=2)(variables, x, True)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), plain, remat)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_sharded_data_parallel_step_equals_one_device(axis_type):
    """Under jit over a data-parallel mesh the amaxes are global, so the FP8 state after two
    steps equals the unsharded one, with sharding in types (Explicit) or not (Auto)."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    module = DenseGeneral(features=8)
    x, dy = _x((8, 4, 16)), _x((8, 4, 8), seed=2)
    with te.autocast(enabled=True, recipe=R):
        variables = _init(module, jax.random.key(0), x)
    one, _, _ = _train_steps(module, variables, x, dy, 2)
    shard = jax.sharding.NamedSharding(mesh, jax.P("data"))
    two, _, _ = _train_steps(module, variables, jax.device_put(x, shard), jax.device_put(dy, shard), 2)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), one["fp8_metas"], two["fp8_metas"])


@pytest.mark.parametrize("recipe", [R, Float8CurrentScaling()], ids=["delayed", "current"])
def test_data_parallel_shard_map_equals_one_device(recipe):
    """Inside `shard_map` (manual-axis types checked, the default) over a data-parallel mesh:
    the replicated kernel's gradient is the sum over the shards, the amaxes are global, so dx
    and the new state equal the one-device ones exactly and dw to the bf16 rounding of the
    shards' partial sums."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x, w, dy = _x((16, 32)).astype(jnp.bfloat16), _x((32, 24), seed=1), _x((16, 24), seed=2)
    state = ({q: (jnp.full((1,), 8.0), jnp.zeros(4)) for q in ("x", "kernel", "grad")}
             if isinstance(recipe, DelayedScaling) else None)

    def loss(x, w, state, dy):
        return jnp.sum(dense(x, w, state, recipe).astype(jnp.float32) * dy)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    one = jax.jit(grad)(x, w, state, dy)
    rows, rep = jax.P("data"), jax.P()
    sharded = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=(rows, rep, rep, rows),
                                    out_specs=(rows, rep, rep)))(x, w, state, dy)
    np.testing.assert_array_equal(np.asarray(one[0], np.float32), np.asarray(sharded[0], np.float32))
    assert _rel(sharded[1], one[1]) < 1e-2
    jax.tree.map(np.testing.assert_array_equal, one[2], sharded[2])


@pytest.mark.parametrize("kernel_spec", [("model", None), (None, "model")], ids=["row", "column"])
def test_tensor_parallel_kernel_with_explicit_axes_equals_one_device(kernel_spec):
    """Sharding in types (Explicit axes) on a (data, model) mesh with a row- or column-parallel
    kernel: the input gradient takes x's sharding (the dgrad contracts the column-parallel
    axis), the weight gradient the kernel's, and both equal the unsharded ones."""
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    x, w = _x((16, 32)).astype(jnp.bfloat16), _x((32, 24), seed=1)
    state = {q: (jnp.full((1,), 4.0), jnp.zeros(4)) for q in ("x", "kernel", "grad")}

    def loss(x, w):
        return jnp.sum(jnp.square(dense(x, w, state, R).astype(jnp.float32)))

    one = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    x_spec = jax.P("data", "model" if kernel_spec[0] == "model" else None)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, x_spec))
        ws = jax.device_put(w, jax.sharding.NamedSharding(mesh, jax.P(*kernel_spec)))
        dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, ws)
    assert jax.typeof(dx).sharding.spec == x_spec and jax.typeof(dw).sharding.spec == jax.P(*kernel_spec)
    f32 = [np.asarray(a, np.float32) for a in (dx, one[0], dw, one[1])]
    assert _rel(f32[0], f32[1]) < 1e-2 and _rel(f32[2], f32[3]) < 1e-2


def test_checkpoint_round_trip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    module = LayerNormMLP(intermediate_dim=32)
    x, dy = _x(), _x(seed=4)
    with te.autocast(enabled=True, recipe=R):  # boxed parameters, as init returns them
        variables = module.init(jax.random.key(0), x, deterministic=True)
    plain, y_plain, _ = _train_steps(module, nn.unbox(variables), x, dy, 2,
                                     call={"deterministic": True})
    variables, y, _ = _train_steps(module, variables, x, dy, 2, call={"deterministic": True})
    assert isinstance(variables["params"]["wi_kernel"], nn.LogicallyPartitioned)
    np.testing.assert_array_equal(y, y_plain)  # the boxes change nothing
    jax.tree.map(np.testing.assert_array_equal, nn.unbox(variables), plain)
    state = {"params": variables["params"], "fp8_metas": variables["fp8_metas"]}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "step2", state)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "step2", state)
    jax.tree.map(np.testing.assert_array_equal, restored, state)
    # training continues identically from the restored state
    a, _, _ = _train_steps(module, dict(variables), x, dy, 1, call={"deterministic": True})
    b, _, _ = _train_steps(module, dict(variables, **restored), x, dy, 1, call={"deterministic": True})
    jax.tree.map(np.testing.assert_array_equal, a["fp8_metas"], b["fp8_metas"])


def test_dense_function_form():
    x, w = _x((32, 64)), _x((64, 16), seed=1)
    state = {q: (jnp.full((1,), 50.0), jnp.zeros(4)) for q in ("x", "kernel", "grad")}
    y = dense(x, w, state, R)
    assert y.shape == (32, 16) and y.dtype == jnp.float32
    assert _rel(y, x @ w) < 0.05


def _all_eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (custom VJPs, pjit)."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


def test_kernel_is_quantised_once_and_its_forward_copy_is_an_fp8_transpose():
    """The FP8 kernel [K, N] is quantised once and its two layouts pass an optimisation
    barrier together, so XLA cannot re-read the float32 kernel for the forward's copy; the
    forward is still the product of the quantised operands."""
    x, w = _x((32, 64)).astype(jnp.bfloat16), _x((64, 16), seed=1)
    state = {q: (jnp.full((1,), 4.0), jnp.zeros(4)) for q in ("x", "kernel", "grad")}
    jaxpr = jax.make_jaxpr(lambda x, w: jax.vjp(lambda x, w: dense(x, w, state, R), x, w)[0])(x, w)
    lines = str(jaxpr).splitlines()
    (barrier,) = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "optimization_barrier"]
    # the kernel [K, N] and the forward's [N, K] operand, both FP8, from one quantisation
    assert [(v.aval.shape, v.aval.dtype) for v in barrier.outvars] == [
        ((64, 16), jnp.float8_e4m3fn), ((16, 64), jnp.float8_e4m3fn)]
    quantised = [line for line in lines if "convert_element_type" in line and "f8_e4m3fn[" in line.split("=")[0]]
    assert len(quantised) == 2, quantised  # x once, the kernel once
    xq = (x.astype(jnp.float32) * 4.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    wq = (w * 4.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    np.testing.assert_allclose(dense(x, w, state, R).astype(jnp.float32), (xq @ wq / 16.0).astype(jnp.bfloat16).astype(jnp.float32),
                               rtol=2e-2, atol=2e-2)


def test_fp8_mlp_stores_the_activation_and_its_input_cotangent_in_their_dtype():
    """Under FP8 without the fused MLP (here current scaling) the activation's output (forward)
    and its input's cotangent (backward) pass an optimization barrier in bf16, so XLA stores them
    in bf16 rather than the activation's float32 (the H200's FP8 train step wrote both as float32
    [B, T, F] arrays); outside FP8 none."""
    x = _x((2, 8, 64)).astype(jnp.bfloat16)
    module = LayerNormMLP(intermediate_dim=96, dtype=jnp.bfloat16)

    def barriers(fp8):
        with te.autocast(enabled=fp8, recipe=Float8CurrentScaling()):
            variables = _init(module, jax.random.key(1), x, deterministic=True)
            loss = lambda v, x: jnp.sum(module.apply(v, x, deterministic=True)[0].astype(jnp.float32))  # noqa: E731
            jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(variables, x)
        return [line.split("=")[0].split(":")[1].strip() for line in str(jaxpr).splitlines()
                if "optimization_barrier" in line and "bf16" in line.split("=")[0]]

    # the activation's output [B, T, F], then (backward) its input's cotangent [B, T, 1, F]
    assert barriers(True) == ["bf16[2,8,96]", "bf16[2,8,1,96]"]
    assert barriers(False) == []


def test_stored_forward_and_backward_are_identities():
    from flashmesh.nn import mlp

    x = _x((3, 5))
    for f in (mlp._stored_forward, mlp._stored_backward):
        y, vjp = jax.vjp(f, x)
        np.testing.assert_array_equal(y, x)
        np.testing.assert_array_equal(vjp(2.0 * x)[0], 2.0 * x)
