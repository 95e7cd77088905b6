"""TE's logical-axis sharding flow through flashmesh.te: parameters boxed with TE's logical names,
`extend_logical_axis_rules` mapping them to the current MeshResource, and
`nn.logical_to_mesh_sharding` (TE's encoder examples) placing a TransformerLayer's weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flashmesh.te as te
import flashmesh.te.flax as te_flax
from flashmesh.te.sharding import MeshResource, get_sharding_map_logic_axis_to_mesh_axis

E, F, HEADS = 32, 64, 4


def _mesh(shape=(2, 2), names=("data", "model")):
    """A mesh of Auto axes, as TE's examples build (`jax.sharding.Mesh`)."""
    return jax.sharding.Mesh(np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


def test_no_mesh_no_rules():
    assert get_sharding_map_logic_axis_to_mesh_axis() == {}
    assert te_flax.extend_logical_axis_rules((("batch", "data"),)) == (("batch", "data"),)


@pytest.mark.filterwarnings("ignore:.*context manager has been deprecated")
@pytest.mark.parametrize("enter", ["with_mesh", "set_mesh"])  # TE's examples use `with mesh:`
def test_rules_follow_the_mesh_resource(enter):
    mesh = _mesh()
    resource = MeshResource(dp_resource="data", tp_resource="model")
    context = mesh if enter == "with_mesh" else jax.set_mesh(mesh)
    with context, te.autocast(mesh_resource=resource):
        rules = dict(te_flax.extend_logical_axis_rules((("mine", None),)))
    assert rules["mine"] is None
    assert rules["nvte_batch"] == "data" and rules["nvte_w_tp"] == "model"
    assert rules["nvte_head"] == "model" and rules["nvte_hidden_tp"] == "model"
    assert rules["nvte_w_fsdp"] is None and rules["nvte_w_joined"] is None
    # fsdp of size > 1 takes the batch; tpsp of size > 1 takes tp's names
    with jax.set_mesh(_mesh((2, 2), ("fsdp", "tpsp"))), te.autocast(
            mesh_resource=MeshResource(fsdp_resource="fsdp", tpsp_resource="tpsp", dp_resource="fsdp")):
        rules = dict(te_flax.extend_logical_axis_rules(()))
    assert rules["nvte_batch"] == "fsdp" and rules["nvte_w_fsdp"] == "fsdp"
    assert rules["nvte_w_tp"] == "tpsp" and rules["nvte_seqlen_tp"] == "tpsp"


def test_rules_conflicts_and_bad_input():
    with jax.set_mesh(_mesh()), te.autocast(mesh_resource=MeshResource(dp_resource="data",
                                                                         tp_resource="model")):
        same = te_flax.extend_logical_axis_rules((("nvte_w_tp", "model"),))
        assert [r for r in same if r[0] == "nvte_w_tp"] == [("nvte_w_tp", "model")]
        with pytest.raises(ValueError, match="nvte_w_tp"):
            te_flax.extend_logical_axis_rules((("nvte_w_tp", "data"),))
        with pytest.raises(ValueError, match="rule"):
            te_flax.extend_logical_axis_rules((("a", "b", "c"),))
    with jax.set_mesh(_mesh()), te.autocast(mesh_resource=MeshResource(tp_resource="tensor")):
        with pytest.raises(ValueError, match="tp_resource='tensor'"):
            te_flax.extend_logical_axis_rules(())
    with jax.set_mesh(_mesh()), te.autocast(mesh_resource=MeshResource(tp_resource="data",
                                                                       tpsp_resource="model")):
        with pytest.raises(ValueError, match="both be active"):
            te_flax.extend_logical_axis_rules(())
    with jax.set_mesh(_mesh()), te.autocast():  # no MeshResource: TE's MeshResource(), all None
        assert set(dict(te_flax.extend_logical_axis_rules(())).values()) == {None}


def test_manual_axes_map_to_none():
    """Inside shard_map a sharding constraint cannot name a manual axis: those map to None
    (every axis manual: no rules at all, as TE's)."""
    mesh = _mesh()
    resource = MeshResource(fsdp_resource="data", tp_resource="model")
    seen = {}

    def body(x):
        seen["rules"] = get_sharding_map_logic_axis_to_mesh_axis()
        return x

    with jax.set_mesh(mesh), te.autocast(mesh_resource=resource):
        jax.shard_map(body, in_specs=P("data"), out_specs=P("data"), axis_names={"data"})(
            jnp.zeros((4, 2)))
        assert seen["rules"]["nvte_w_fsdp"] is None and seen["rules"]["nvte_w_tp"] == "model"
        jax.shard_map(body, in_specs=P("data"), out_specs=P("data"))(jnp.zeros((4, 2)))
        assert seen["rules"] == {}


def test_te_example_flow_shards_the_layer_and_keeps_its_output():
    """TE's multi-GPU encoder example: eval_shape(init) -> nn.get_partition_spec ->
    nn.logical_to_mesh_sharding(specs, mesh, extend_logical_axis_rules(())) -> jit(init,
    out_shardings): the tensor-parallel weights split over 'model', and the sharded layer's
    output equals the one-device layer's."""
    layer = te_flax.TransformerLayer(hidden_size=E, mlp_hidden_size=F, num_attention_heads=HEADS,
                                     enable_relative_embedding=False, hidden_dropout=0.0,
                                     attention_dropout=0.0)
    x = jax.random.normal(jax.random.key(1), (4, 8, E), jnp.float32)
    key = jax.random.key(0)
    mesh = _mesh()
    with jax.set_mesh(mesh), te.autocast(mesh_resource=MeshResource(dp_resource="data",
                                                                      tp_resource="model")):
        abstract = jax.eval_shape(lambda k, a: layer.init(k, a, deterministic=True), key, x)
        rules = te_flax.extend_logical_axis_rules(())
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
        variables = jax.jit(lambda k, a: layer.init(k, a, deterministic=True),
                            out_shardings=shardings)(key, x)
        x_sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
        out = jax.jit(lambda v, a: layer.apply(v, a, deterministic=True))(variables, x_sharded)
    qkv = variables["params"]["attention"]["qkv"]["kernel"]
    assert isinstance(qkv, nn.LogicallyPartitioned)
    assert qkv.value.sharding.spec == P(None, None, "model")
    assert variables["params"]["mlp"]["wo_kernel"].value.sharding.spec == P("model", None)
    assert variables["params"]["attention"]["out"]["kernel"].value.sharding.spec == P("model", None)
    one_device = layer.apply(jax.device_get(nn.unbox(variables)), x, deterministic=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(one_device), rtol=2e-5, atol=2e-5)
