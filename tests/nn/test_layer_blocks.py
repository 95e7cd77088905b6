"""LayerNorm, DenseGeneral, LayerNormDenseGeneral, LayerNormMLP and activation against plain
Flax / plain JAX compositions given the same parameters (float32, tight)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from flashmesh.nn import (DenseGeneral, LayerNorm, LayerNormDenseGeneral, LayerNormMLP, activation,
                          layernorm)
from flashmesh.nn.activations import ActivationParams

TOL = dict(rtol=2e-5, atol=2e-5)


def _x(shape=(2, 8, 32), seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def _add(y, bias):
    return y + bias.reshape((1,) * (y.ndim - bias.ndim) + bias.shape)


def _randomise(params, seed=7):
    """Random values for every parameter (initial ones, ones and zeros, would hide bugs),
    unboxed (init returns them boxed with their logical axes)."""
    leaves, tree = jax.tree.flatten(nn.unbox(params))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [jax.random.normal(k, p.shape, p.dtype) * 0.5 + (1.0 if p.ndim == 1 else 0.0)
                                     for k, p in zip(keys, leaves)])


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_layernorm_equals_flax(kind, zero_centered):
    x = _x()
    module = LayerNorm(epsilon=1e-5, layernorm_type=kind, zero_centered_gamma=zero_centered)
    params = _randomise(module.init(jax.random.key(0), x)["params"])
    ours = module.apply({"params": params}, x)
    gamma = params["scale"] + (1.0 if zero_centered else 0.0)
    if kind == "layernorm":
        flax_ln = nn.LayerNorm(epsilon=1e-5)
        expected = flax_ln.apply({"params": {"scale": gamma, "bias": params["ln_bias"]}}, x)
    else:
        assert "ln_bias" not in params  # RMSNorm has no bias, as in TE
        expected = nn.RMSNorm(epsilon=1e-5).apply({"params": {"scale": gamma}}, x)
    np.testing.assert_allclose(ours, expected, **TOL)


def test_layernorm_keeps_input_dtype_and_zero_centred_init():
    x = _x(dtype=jnp.bfloat16)
    module = LayerNorm(zero_centered_gamma=True)
    variables = nn.unbox(module.init(jax.random.key(0), x))
    assert float(jnp.abs(variables["params"]["scale"]).max()) == 0.0
    assert variables["params"]["scale"].dtype == jnp.float32
    assert module.apply(variables, x).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="layernorm_type"):
        layernorm(x, jnp.ones(32), None, layernorm_type="batchnorm")


@pytest.mark.parametrize("spelling,canonical", [("RMSNorm", "rmsnorm"), ("rms_norm", "rmsnorm"),
                                                ("LayerNorm", "layernorm"), ("layer-norm", "layernorm")])
def test_layernorm_type_read_as_te_reads_it(spelling, canonical):
    # TE's canonicalize_norm_type ignores case, '-' and '_': its spellings give the same layer
    x = _x()
    ours, theirs = (LayerNorm(layernorm_type=t) for t in (spelling, canonical))
    variables = theirs.init(jax.random.key(0), x)
    assert jax.tree.structure(ours.init(jax.random.key(0), x)) == jax.tree.structure(variables)
    np.testing.assert_array_equal(ours.apply(variables, x), theirs.apply(variables, x))


@pytest.mark.parametrize("features,axis", [(24, -1), ((4, 6), -1), (16, (-2, -1))])
def test_dense_general_equals_flax(features, axis):
    x = _x((2, 8, 4, 8))
    module = DenseGeneral(features=features, axis=axis)
    params = _randomise(module.init(jax.random.key(0), x)["params"])
    expected = nn.DenseGeneral(features=features, axis=axis).apply({"params": params}, x)
    np.testing.assert_allclose(module.apply({"params": params}, x), expected, **TOL)


def test_dense_general_non_trailing_axis_and_lora():
    x = _x((2, 8, 6))
    module = DenseGeneral(features=5, axis=1, use_bias=False)
    params = _randomise(module.init(jax.random.key(0), x)["params"])
    expected = jnp.einsum("btd,tf->bdf", x, params["kernel"])
    np.testing.assert_allclose(module.apply({"params": params}, x), expected, **TOL)

    lora = DenseGeneral(features=5, enable_low_rank_adaptation=True, low_rank_adaptation_dim=3,
                        low_rank_adaptation_alpha=6.0)
    params = _randomise(lora.init(jax.random.key(1), x)["params"])
    expected = (_add(x @ params["kernel"], params["bias"])
                + 2.0 * (x @ params["lora_a_kernel"] @ params["lora_b_kernel"]))
    np.testing.assert_allclose(lora.apply({"params": params}, x), expected, **TOL)


def test_lora_of_a_fused_projection_has_one_adapter_per_block_as_in_te():
    x = _x((2, 8, 6))
    lora = DenseGeneral(features=(3, 10), use_bias=False, enable_low_rank_adaptation=True,
                        low_rank_adaptation_dim=4)
    params = _randomise(lora.init(jax.random.key(1), x)["params"])
    assert params["lora_a_kernel"].shape == (6, 3, 4) and params["lora_b_kernel"].shape == (3, 4, 10)
    expected = (jnp.einsum("btd,dqf->btqf", x, params["kernel"])
                + jnp.einsum("btd,dqr,qrf->btqf", x, params["lora_a_kernel"], params["lora_b_kernel"]))
    np.testing.assert_allclose(lora.apply({"params": params}, x), expected, rtol=1e-4, atol=1e-4)


def test_bf16_input_computes_in_bf16_from_f32_params():
    x = _x(dtype=jnp.bfloat16)
    module = DenseGeneral(features=16)
    variables = nn.unbox(module.init(jax.random.key(0), x))
    assert variables["params"]["kernel"].dtype == jnp.float32
    y = module.apply(variables, x)
    assert y.dtype == jnp.bfloat16
    expected = x.astype(jnp.float32) @ variables["params"]["kernel"].astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_allclose(y.astype(jnp.float32), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("return_ln", [False, True])
def test_layernorm_dense_general_equals_composition(return_ln):
    x = _x()
    module = LayerNormDenseGeneral(features=(3, 16), epsilon=1e-5, use_bias=True,
                                   return_layernorm_output=return_ln, depth_scaling=2.0)
    params = _randomise(module.init(jax.random.key(0), x)["params"])
    y, ln_out = module.apply({"params": params}, x)
    ln = nn.LayerNorm(epsilon=1e-5).apply(
        {"params": {"scale": params["scale"], "bias": params["ln_bias"]}}, x)
    expected = _add(jnp.einsum("btd,dhf->bthf", ln, params["kernel"]), params["bias"]) / 2.0
    np.testing.assert_allclose(y, expected, **TOL)
    if return_ln:
        np.testing.assert_allclose(ln_out, ln, **TOL)
    else:
        assert ln_out is None


@pytest.mark.parametrize("acts", [("gelu",), ("relu",), ("silu",), ("gelu", "linear"),
                                  ("silu", "linear"), ("squared_relu", "linear"), ("tanh",),
                                  ("linear", "gelu")])
def test_layernorm_mlp_equals_composition(acts):
    x = _x()
    module = LayerNormMLP(intermediate_dim=48, activations=acts, use_bias=True, epsilon=1e-5,
                          layernorm_type="rmsnorm")
    params = _randomise(module.init(jax.random.key(0), x, deterministic=True)["params"])
    y, _ = module.apply({"params": params}, x, deterministic=True)
    ln = nn.RMSNorm(epsilon=1e-5).apply({"params": {"scale": params["scale"]}}, x)
    h = _add(jnp.einsum("btd,dnf->btnf", ln, params["wi_kernel"]), params["wi_bias"])
    f = {"gelu": lambda v: nn.gelu(v, approximate=True), "relu": nn.relu, "silu": nn.silu,
         "squared_relu": lambda v: nn.relu(v) ** 2, "linear": lambda v: v, "tanh": jnp.tanh}
    if acts[0] == "linear":  # TE reverses a pair given linear first: gelu(h0) * h1
        acts = acts[::-1]
    a = f[acts[0]](h[..., 0, :])
    if len(acts) == 2:
        a = a * f[acts[1]](h[..., 1, :])
    expected = _add(a @ params["wo_kernel"], params["wo_bias"])
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5 * float(jnp.abs(expected).max()))


def test_layernorm_mlp_lora_equals_composition():
    """TE's LoRA on both GEMMs: h += x A B * alpha / r per gated block, out += a A' B' * alpha / r."""
    x = _x()
    module = LayerNormMLP(intermediate_dim=48, activations=("silu", "linear"), use_bias=True,
                          enable_low_rank_adaptation=True, low_rank_adaptation_dim=3,
                          low_rank_adaptation_alpha=6.0)
    params = _randomise(module.init(jax.random.key(0), x, deterministic=True)["params"])
    assert params["wi_lora_a_kernel"].shape == (32, 2, 3) and params["wi_lora_b_kernel"].shape == (2, 3, 48)
    assert params["wo_lora_a_kernel"].shape == (48, 3) and params["wo_lora_b_kernel"].shape == (3, 32)
    y, _ = module.apply({"params": params}, x, deterministic=True)
    ln = nn.LayerNorm(epsilon=1e-6).apply({"params": {"scale": params["scale"], "bias": params["ln_bias"]}}, x)
    h = _add(jnp.einsum("btd,dnf->btnf", ln, params["wi_kernel"]), params["wi_bias"])
    h = h + 2.0 * jnp.einsum("btd,dnr,nrf->btnf", ln, params["wi_lora_a_kernel"], params["wi_lora_b_kernel"])
    a = nn.silu(h[..., 0, :]) * h[..., 1, :]
    expected = (_add(a @ params["wo_kernel"], params["wo_bias"])
                + 2.0 * (a @ params["wo_lora_a_kernel"] @ params["wo_lora_b_kernel"]))
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5 * float(jnp.abs(expected).max()))
    zero_b = nn.unbox(module.init(jax.random.key(0), x, deterministic=True))  # B at zero: no change
    plain = LayerNormMLP(intermediate_dim=48, activations=("silu", "linear"), use_bias=True)
    kept = {k: v for k, v in zero_b["params"].items() if "lora" not in k}
    np.testing.assert_allclose(module.apply(zero_b, x, deterministic=True)[0],
                               plain.apply({"params": kept}, x, deterministic=True)[0], rtol=1e-6)


def test_layernorm_mlp_intermediate_dropout():
    x = _x()
    module = LayerNormMLP(intermediate_dim=64, intermediate_dropout_rate=0.5)
    variables = module.init(jax.random.key(0), x, deterministic=True)
    y_det, _ = module.apply(variables, x, deterministic=True)
    y_a, _ = module.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    y_b, _ = module.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
    assert not np.allclose(y_a, y_det) and not np.allclose(y_a, y_b)
    with pytest.raises(Exception, match="dropout"):
        module.apply(variables, x, deterministic=False)  # needs the rng stream


def test_clamped_swiglu_equals_gpt_oss_formula():
    """GPT-OSS's clamped SwiGLU (TE's ('clamped_silu', 'clamped_linear')): min(h0, limit) times
    sigmoid(alpha min(h0, limit)) times (clip(h1, -limit, limit) + 1), in the module with TE's
    activation_params dict (given linear first too) and in `activation` with ActivationParams."""
    x = _x() * 4.0
    limit, alpha = 1.5, 1.3

    def swiglu(h):
        g = jnp.minimum(h[..., 0, :], limit)
        return g * jax.nn.sigmoid(alpha * g) * (jnp.clip(h[..., 1, :], -limit, limit) + 1.0)

    for acts in [("clamped_silu", "clamped_linear"), ("clamped_linear", "clamped_silu")]:
        module = LayerNormMLP(intermediate_dim=48, activations=acts, use_bias=True,
                              activation_params={"limit": limit, "alpha": alpha})
        params = _randomise(module.init(jax.random.key(0), x, deterministic=True)["params"])
        y, _ = module.apply({"params": params}, x, deterministic=True)
        ln = nn.LayerNorm(epsilon=1e-6).apply({"params": {"scale": params["scale"], "bias": params["ln_bias"]}}, x)
        h = _add(jnp.einsum("btd,dnf->btnf", ln, params["wi_kernel"]), params["wi_bias"])
        assert float(jnp.mean(jnp.abs(h) > limit)) > 0.1  # the clamp is exercised
        expected = _add(swiglu(h) @ params["wo_kernel"], params["wo_bias"])
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5 * float(jnp.abs(expected).max()))
    h = _x((2, 3, 2, 8)) * 4.0
    got = activation(h, ("clamped_silu", "clamped_linear"),
                     act_params=ActivationParams.create(("clamped_silu", "clamped_linear"),
                                                        limit=limit, alpha=alpha))
    np.testing.assert_allclose(got, swiglu(h), **TOL)
    default = jnp.minimum(h[..., 0, :], 7.0) * jax.nn.sigmoid(1.702 * jnp.minimum(h[..., 0, :], 7.0))
    np.testing.assert_allclose(activation(h, ("clamped_silu", "clamped_linear")),
                               default * (jnp.clip(h[..., 1, :], -7.0, 7.0) + 1.0), **TOL)
    with pytest.raises(ValueError, match="take no parameters"):
        LayerNormMLP(intermediate_dim=8, activation_params={"limit": 1.0}).init(
            jax.random.key(0), x, deterministic=True)
    with pytest.raises(ValueError, match="unknown"):
        ActivationParams.create(("clamped_silu", "clamped_linear"), beta=1.0)
    with pytest.raises(ValueError, match="act_params"):
        activation(h, ("clamped_silu", "clamped_linear"), act_params={"limit": 1.0})


def test_activation_function():
    h = _x((2, 3, 2, 8))
    np.testing.assert_allclose(activation(h[..., :1, :], ("gelu",)),
                               nn.gelu(h[..., 0, :], approximate=True), **TOL)
    np.testing.assert_allclose(activation(h, ("silu", "linear")), nn.silu(h[..., 0, :]) * h[..., 1, :], **TOL)
    with pytest.raises(ValueError, match="x.shape\\[-2\\]"):
        activation(h, ("gelu",))
    with pytest.raises(ValueError, match="unknown"):
        activation(h, ("tanhh", "linear"))


def _saved_residuals(f, *args) -> list[str]:
    """What autodiff keeps from f's forward for the backward (jax's own account)."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(f, *args)
    return out.getvalue().strip().splitlines()


@pytest.mark.parametrize("acts", [("gelu",), ("silu", "linear")])
def test_activation_keeps_only_its_input_for_the_backward(acts):
    """The float32 intermediates (GELU's tanh) are recomputed in the backward, not stored:
    the only residual is the bf16 input; values and gradients are those of the plain form."""
    h = _x((4, len(acts), 16), dtype=jnp.bfloat16)

    def loss(h):
        return activation(h, acts).astype(jnp.float32).sum()

    saved = _saved_residuals(loss, h)
    assert len(saved) == 1 and saved[0].startswith("bf16[4,%d,16]" % len(acts)), saved

    def plain(h):
        hf = h.astype(jnp.float32)
        y = nn.gelu(hf[..., 0, :], approximate=True) if acts == ("gelu",) else nn.silu(hf[..., 0, :]) * hf[..., 1, :]
        return y.astype(h.dtype).astype(jnp.float32).sum()

    np.testing.assert_array_equal(jax.grad(loss)(h), jax.grad(plain)(h))
    # forward mode still works, with the plain form's values
    got = jax.jvp(lambda h: activation(h, acts).astype(jnp.float32).sum(), (h,), (h,))
    want = jax.jvp(plain, (h,), (h,))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_f32_kernel_weight_gradient_is_a_bf16_gemm_then_a_cast():
    """With float32 parameters and bf16 inputs, the weight gradient's GEMM outputs bf16 and the
    cast to float32 sits behind an optimisation barrier (fused, XLA makes it a slow float32-out
    Triton GEMM on Hopper); the gradient is the bf16 GEMM's, cast."""
    x = _x((8, 32), dtype=jnp.bfloat16)
    kernel = _x((32, 16), seed=1)

    def loss(kernel):
        from flashmesh.nn.dense import dense_general

        return dense_general(x, kernel, 1).astype(jnp.float32).sum()

    eqns = jax.make_jaxpr(jax.grad(loss))(kernel).jaxpr.eqns
    producer = {id(v): e for e in eqns for v in e.outvars}
    # the chain: the bf16 weight-gradient GEMM (maybe transposed) -> barrier -> cast to f32
    # (the forward's barrier sits on the cast kernel; the gradient's is its transpose)
    barrier = [e for e in eqns if e.primitive.name == "optimization_barrier"][-1]
    source = producer[id(barrier.invars[0])]
    if source.primitive.name == "transpose":
        source = producer[id(source.invars[0])]
    assert source.primitive.name == "dot_general" and source.outvars[0].aval.dtype == jnp.bfloat16
    casts = [e for e in eqns if e.primitive.name == "convert_element_type"
             and id(e.invars[0]) == id(barrier.outvars[0])]
    assert casts and casts[0].outvars[0].aval.dtype == jnp.float32
    expected = jnp.dot(x.T, jnp.ones((8, 16), jnp.bfloat16)).astype(jnp.float32)
    np.testing.assert_array_equal(jax.grad(loss)(kernel), expected)


@pytest.mark.parametrize("module", [DenseGeneral(features=(2, 8)), LayerNormMLP(intermediate_dim=24, use_bias=True)])
def test_bias_is_added_to_the_2d_gemm_result(module):
    """The bias joins the GEMM's [M, N] result before the reshape to [..., N...] (the form XLA
    folds into cuBLAS's bias epilogue): every add of a bias reads a 2-D dot_general result."""
    x = _x(dtype=jnp.bfloat16)
    variables = module.init(jax.random.key(0), x, **({} if isinstance(module, DenseGeneral) else {"deterministic": True}))
    jaxpr = jax.make_jaxpr(lambda v: module.apply(v, x, **({} if isinstance(module, DenseGeneral) else {"deterministic": True})))(variables).jaxpr
    eqns = list(jaxpr.eqns)
    dots = {id(e.outvars[0]) for e in eqns if e.primitive.name == "dot_general"}
    bias_adds = [e for e in eqns if e.primitive.name == "add" and any(id(v) in dots for v in e.invars)]
    assert len(bias_adds) == len(dots) == (1 if isinstance(module, DenseGeneral) else 2)
    assert all(len(e.outvars[0].aval.shape) == 2 for e in bias_adds)


@pytest.mark.parametrize("module,call", [
    (LayerNorm(), {}), (DenseGeneral(features=8, kernel_axes=("embed", "mlp"), bias_axes=("mlp",)), {}),
    (LayerNormDenseGeneral(features=8, kernel_axes=("embed", "mlp")), {}),
    (LayerNormMLP(intermediate_dim=16), {"deterministic": True})])
def test_every_parameter_has_logical_axes(module, call):
    """Each parameter comes boxed with its logical axes (TE's nn.with_logical_partitioning)."""
    x = _x()
    variables = module.init(jax.random.key(0), x, **call)
    assert set(variables) == {"params"}
    for name, value in variables["params"].items():
        assert isinstance(value, nn.LogicallyPartitioned), name
        assert len(value.names) in (0, value.value.ndim), (name, value.names)
    specs = nn.get_partition_spec(variables)["params"]
    if isinstance(module, LayerNormMLP):
        assert specs["wi_kernel"] == jax.sharding.PartitionSpec("embed", "act", "mlp")
        assert specs["wo_kernel"] == jax.sharding.PartitionSpec("mlp", "embed")


def test_logical_axes_shard_on_a_mesh():
    """flax partitioning maps the axis names to a tensor-parallel mesh's spec."""
    module = LayerNormMLP(intermediate_dim=16)
    variables = module.init(jax.random.key(0), _x(), deterministic=True)
    rules = (("embed", None), ("act", None), ("mlp", "tp"))
    specs = nn.get_partition_spec(variables)["params"]
    mesh_axes = jax.tree.map(lambda names: nn.logical_to_mesh_axes(names, rules), specs,
                             is_leaf=lambda v: isinstance(v, jax.sharding.PartitionSpec))
    assert tuple(mesh_axes["wi_kernel"]) == (None, None, "tp")
    assert tuple(mesh_axes["wo_kernel"]) == ("tp", None)


def test_kernel_inits_follow_te():
    """TE draws DenseGeneral's kernel with variance_scaling(1, 'fan_in', 'truncated_normal') over
    its whole shape (flax's default axes: [E, 3, F] has fan-in 3E) and LayerNormMLP's wi_kernel
    block by block ([H, F] each, keys split in turn, stacked on axis -2)."""
    E, F = 256, 512
    x = jnp.ones((2, E))
    kernel = nn.unbox(DenseGeneral(features=(3, F)).init(jax.random.key(0), x))["params"]["kernel"]
    want = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")(
        jax.random.key(0), (E, 3, F))
    assert kernel.shape == (E, 3, F)
    np.testing.assert_allclose(float(kernel.std()), float(want.std()), rtol=0.02)
    np.testing.assert_allclose(float(kernel.std()), (3 * E) ** -0.5, rtol=0.05)

    init = nn.initializers.lecun_normal()
    mlp = LayerNormMLP(intermediate_dim=F, activations=("silu", "linear"), kernel_init=init)
    wi = nn.unbox(mlp.init(jax.random.key(1), jnp.ones((2, 4, E)), deterministic=True))["params"]["wi_kernel"]
    assert wi.shape == (E, 2, F)
    # The module's init key reaches wi_kernel's init; each block is one draw of init over [E, F]
    # with the keys TE splits, so the blocks are independent, each with fan-in E.
    for block in (wi[:, 0], wi[:, 1]):
        np.testing.assert_allclose(float(block.std()), E ** -0.5, rtol=0.05)
    assert abs(float(jnp.corrcoef(wi[:, 0].ravel(), wi[:, 1].ravel())[0, 1])) < 0.02
