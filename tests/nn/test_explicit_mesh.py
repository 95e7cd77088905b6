"""The modules on a mesh of Explicit axes (sharding in types, `jax.make_mesh`'s default): JAX
checks every reshape and contraction there, and `dense_general` lays each GEMM out so that
they pass (`flashmesh.nn.gemm_layout`). Sharded results equal the one-device ones, forward
and gradients, in float32 and under FP8 autocast."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flashmesh.te as te
import flashmesh.te.flax as te_flax
from flashmesh.nn.dense import dense_general
from flashmesh.nn.gemm_layout import Layout
from flashmesh.te.sharding import MeshResource


def _mesh():
    return jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def _normal(shape, seed):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# (x shape, x spec, kernel shape, kernel spec, bias spec, n_contract, y spec): data-parallel rows
# with a column-parallel fused QKV kernel [E, 3, F@model] (the sharded axis last: merged through
# [E, F, 3]), a row-parallel kernel over heads [H@model, D, E] (the output summed over model),
# sequence-parallel rows [B, T@model] (a sharded minor lead axis) into a replicated kernel, the
# same rows into a column-parallel kernel (the columns keep model, the rows are gathered: TE's
# sequence parallelism), an FSDP kernel sharded along K over the rows' axis (gathered), and on a
# three-axis mesh x and the kernel sharded differently along K (the kernel takes x's).
CASES = {
    "qkv": ((4, 6, 8), P("data"), (8, 3, 4), P(None, None, "model"), P(None, "model"), 1,
            P("data", None, None, "model")),
    "row": ((4, 6, 2, 4), P("data", None, "model"), (2, 4, 8), P("model"), P(), 2, P("data", None, None)),
    "seq": ((2, 4, 8), P(None, "model"), (8, 6), P(), P(), 1, P(None, "model", None)),
    "seq_column": ((2, 4, 8), P("data", "model"), (8, 6), P(None, "model"), P("model"), 1,
                   P("data", None, "model")),
    "fsdp": ((4, 6, 8), P("data"), (8, 4), P("data", "model"), P("model"), 1, P("data", None, "model")),
    "three_axes": ((2, 2, 4), P("b", None, "c"), (2, 4, 2, 1), P("a", "c", "b", None), P("a", None), 2,
                   P(None, "b", None)),
}


@pytest.mark.parametrize("fp8", [False, True], ids=["float32", "fp8"])
@pytest.mark.parametrize("case", CASES)
def test_dense_general_on_explicit_axes_equals_one_device(case, fp8):
    x_shape, x_spec, k_shape, k_spec, b_spec, n_contract, y_spec = CASES[case]
    x, kernel, bias = _normal(x_shape, 0), _normal(k_shape, 1), _normal(k_shape[n_contract:], 2)
    dy = _normal(x_shape[:len(x_shape) - n_contract] + k_shape[n_contract:], 3)
    recipe = te.recipe.DelayedScaling(amax_history_len=4) if fp8 else None
    state = {q: (jnp.full((1,), 4.0), jnp.zeros(4)) for q in ("x", "kernel", "grad")} if fp8 else None

    def dense(x, kernel, bias):
        return dense_general(x, kernel, n_contract, recipe, state, bias=bias)

    def loss(x, kernel, bias):
        return jnp.sum(dense(x, kernel, bias) * dy)

    one = jax.grad(loss, argnums=(0, 1, 2))(x, kernel, bias)
    y_one = dense(x, kernel, bias)
    mesh = (jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Explicit,) * 3)
            if case == "three_axes" else _mesh())
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in
                ((x, x_spec), (kernel, k_spec), (bias, b_spec))]
        assert Layout.of(args[0], args[1], n_contract).mesh is not None
        y = jax.jit(dense)(*args)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    got = tuple(jax.typeof(y).sharding.spec)
    assert got + (None,) * (y.ndim - len(got)) == tuple(y_spec), got
    tol = dict(rtol=1e-5, atol=1e-5) if not fp8 else dict(rtol=1e-5, atol=1e-4)  # summation order
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_one), **tol)
    for g, g_one, a in zip(grads, one, args):
        assert jax.typeof(g).sharding.spec == jax.typeof(a).sharding.spec
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_one), **tol)


def test_untyped_layout_is_the_plain_flatten():
    x, kernel = _normal((2, 3, 4), 0), _normal((4, 2, 5), 1)
    layout = Layout.of(x, kernel, 1)
    assert layout.mesh is None and layout.lead == (2, 3) and layout.out == (2, 5)
    assert layout.x2(x).shape == (6, 4) and layout.k2(kernel).shape == (4, 10)


@pytest.mark.parametrize("fp8, x_spec", [(False, P("data")), (True, P("data")),
                                         (False, P("data", "model"))],
                         ids=["float32", "fp8", "float32_sequence_parallel"])
def test_transformer_layer_on_explicit_axes_equals_one_device(fp8, x_spec):
    """TE's multi-GPU recipe (logical axes -> extend_logical_axis_rules -> shardings) on an
    Explicit (data, model) mesh: fused QKV and gated MLP kernels split over 'model', GQA, and
    the input's sequence split over 'model' too (gathered before the QKV GEMM); the output and
    every gradient equal the one-device layer's."""
    layer = te_flax.TransformerLayer(hidden_size=32, mlp_hidden_size=64, num_attention_heads=4,
                                     num_gqa_groups=2, mlp_activations=("gelu", "linear"),
                                     use_bias=True, enable_relative_embedding=False,
                                     hidden_dropout=0.0, attention_dropout=0.0)
    x = _normal((4, 8, 32), 1)
    recipe = te.recipe.DelayedScaling() if fp8 else None
    mesh = _mesh()

    def loss(v, a):
        return jnp.sum(jnp.square(layer.apply(v, a, deterministic=True)))

    with jax.set_mesh(mesh), te.autocast(enabled=fp8, recipe=recipe, mesh_resource=MeshResource(
            dp_resource="data", tp_resource="model")):
        init = jax.jit(lambda k, a: layer.init(k, a, deterministic=True))
        abstract = jax.eval_shape(init, jax.random.key(0), x)
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh,
                                                te_flax.extend_logical_axis_rules(()))
        variables = jax.jit(init, out_shardings=shardings)(jax.random.key(0), x)
        xs = jax.device_put(x, NamedSharding(mesh, x_spec))
        out = jax.jit(lambda v, a: layer.apply(v, a, deterministic=True))(variables, xs)
        grads = nn.unbox(jax.jit(jax.grad(loss))(variables, xs))
    assert variables["params"]["attention"]["kv"]["kernel"].value.sharding.spec == P(None, None, "model")
    assert variables["params"]["mlp"]["wi_kernel"].value.sharding.spec == P(None, None, "model")
    plain = jax.device_get(nn.unbox(variables))
    with te.autocast(enabled=fp8, recipe=recipe):
        out_one = jax.jit(lambda v, a: layer.apply(v, a, deterministic=True))(plain, x)
        grads_one = jax.jit(jax.grad(loss))(plain, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_one), rtol=2e-5, atol=2e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4,
                                                         atol=2e-4), grads, grads_one)


# (x spec, scale/bias spec): the scale sharded over the rows' axis (an FSDP scale: JAX refused
# the product, f32[B@data, T, H] * f32[H@data]) and over an axis other than the features'.
LN_CASES = {"fsdp_scale": (P("data", "model"), P("data")), "crossed": (P(None, None, "model"), P("data"))}


@pytest.mark.parametrize("fp8", [False, True], ids=["float32", "fp8"])
@pytest.mark.parametrize("case", LN_CASES)
def test_layernorm_dense_on_explicit_axes_equals_one_device(case, fp8):
    """LayerNormDenseGeneral (LayerNorm, then the GEMM; under FP8 the GEMM quantises the
    LayerNorm's output from its parts) with its scale and bias lying anywhere on the mesh:
    output and every gradient equal one device's, each gradient lying as its parameter."""
    x_spec, p_spec = LN_CASES[case]
    module = te_flax.LayerNormDenseGeneral(features=8, use_bias=True)
    x = _normal((4, 6, 16), 0)
    recipe = te.recipe.DelayedScaling() if fp8 else None
    with te.autocast(enabled=fp8, recipe=recipe):
        variables = nn.unbox(module.init(jax.random.key(0), x))
    variables = jax.tree.map(lambda a: a + 0.1 * _normal(a.shape, 5) if a.ndim == 1 and a.size == 16
                             else a, variables)  # scale and bias away from ones and zeros

    def loss(v, a):
        y, _ = module.apply(v, a)
        return jnp.sum(jnp.square(y))

    with te.autocast(enabled=fp8, recipe=recipe):
        out_one, _ = jax.jit(module.apply)(variables, x)
        grads_one = jax.jit(jax.grad(loss, argnums=(0, 1)))(variables, x)
    mesh = _mesh()
    with jax.set_mesh(mesh), te.autocast(enabled=fp8, recipe=recipe):
        place = lambda a: jax.device_put(a, NamedSharding(mesh, p_spec if a.ndim == 1 and a.size == 16 else P()))
        v_mesh, x_mesh = jax.tree.map(place, variables), jax.device_put(x, NamedSharding(mesh, x_spec))
        out, _ = jax.jit(module.apply)(v_mesh, x_mesh)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(v_mesh, x_mesh)
    ln = grads[0]["params"]
    assert jax.typeof(ln["scale"]).sharding.spec == jax.typeof(v_mesh["params"]["scale"]).sharding.spec
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_one), rtol=2e-5, atol=2e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4,
                                                         atol=2e-4), grads, grads_one)
