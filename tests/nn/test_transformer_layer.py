"""flashmesh.nn.TransformerLayer against a plain-JAX layer with the same parameters."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from flashmesh.nn.relative import relative_position_buckets
from flashmesh.nn.transformer import TransformerLayer, TransformerLayerType
from test_multihead import (B, E, H, N, T, _close, _ln, _padding_mask, _x,
                            assert_axes_on_every_param, causal)
from test_multihead import reference as mha_reference

S, F = 6, 48
DECODER = TransformerLayerType.DECODER


def _gelu(x):  # the tanh form, as TE's
    return 0.5 * x * (1.0 + jnp.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


ACTS = {"gelu": _gelu, "silu": lambda x: x / (1.0 + jnp.exp(-x)), "relu": lambda x: jnp.maximum(x, 0.0),
        "linear": lambda x: x}


def _layer(**kwargs):
    return TransformerLayer(hidden_size=E, mlp_hidden_size=F, num_attention_heads=N, **kwargs)


@functools.partial(jax.jit, static_argnames=("cfg",))
def reference(params, x, enc, self_visible, cross_visible, cfg):
    """The layer in plain JAX; cfg: the module's (hashable) fields that matter."""
    decoder = cfg.layer_type == DECODER
    post, zc = cfg.apply_residual_connection_post_layernorm, cfg.zero_centered_gamma
    bias = None
    if cfg.enable_relative_embedding:
        buckets = relative_position_buckets(T, T, num_buckets=32, max_distance=128,
                                            bidirectional=not decoder)
        bias = params["relpos_bias"]["rel_embedding"][:, buckets][None]
    rope = cfg.rotary_pos_emb_group_method if cfg.enable_rotary_pos_emb else None
    name = "self_attention" if decoder else "attention"
    attn = params[name]
    lnp = attn["qkv"] if "qkv" in attn else attn["query"]
    a = mha_reference(attn, x, x, visible=self_visible, self_attn=True, rope=rope, bias=bias,
                      input_ln=not cfg.output_layernorm, zero_centered=zc,
                      K=cfg.num_gqa_groups or N)
    residual = (x if cfg.output_layernorm else _ln(x, lnp, zero_centered=zc)) if post else x
    x = a + residual
    if decoder:
        cross = params["encoder_decoder_attention"]
        c = mha_reference(cross, x, enc, visible=cross_visible, self_attn=False, rope=rope,
                          zero_centered=zc, K=cfg.num_gqa_groups or N)
        x = c + (_ln(x, cross["query"], zero_centered=zc) if post else x)
    mlp = params["mlp"]
    h = _ln(x, mlp, zero_centered=zc)
    u = jnp.einsum("bte,enf->btnf", h, mlp["wi_kernel"])
    if "wi_bias" in mlp:
        u = u + mlp["wi_bias"][None, None]
    acts = cfg.mlp_activations
    g = ACTS[acts[0]](u[:, :, 0])
    if len(acts) == 2:
        g = g * ACTS[acts[1]](u[:, :, 1])
    y = jnp.einsum("btf,fe->bte", g, mlp["wo_kernel"])
    if "wo_bias" in mlp:
        y = y + mlp["wo_bias"][None, None]
    z = y + (h if post else x)
    if cfg.output_layernorm:
        z = _ln(z, params["output_layernorm"], zero_centered=zc)
    return z


def _random_variables(layer, x, enc, seed=0):
    """Parameters of the layer's tree (traced, not compiled) with random values."""
    shapes = nn.unbox(jax.eval_shape(lambda k: layer.init(k, x, enc, deterministic=True),
                                     jax.random.key(0)))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = path[-1].key
        if name in ("kernel", "wi_kernel", "wo_kernel"):
            return jnp.asarray(rng.normal(size=leaf.shape) / np.sqrt(leaf.shape[0]), leaf.dtype)
        base = 1.0 if name == "scale" and not layer.zero_centered_gamma else 0.0
        return jnp.asarray(base + 0.1 * rng.normal(size=leaf.shape), leaf.dtype)
    return {"params": jax.tree_util.tree_map_with_path(draw, shapes["params"])}


def _apply(layer, **kwargs):
    return jax.jit(lambda v, x, enc, *masks: layer.apply(v, x, enc, *masks, **kwargs))


CFG_FIELDS = ("layer_type", "apply_residual_connection_post_layernorm", "zero_centered_gamma",
              "enable_relative_embedding", "enable_rotary_pos_emb", "rotary_pos_emb_group_method",
              "output_layernorm", "num_gqa_groups", "mlp_activations")
Cfg = collections.namedtuple("Cfg", CFG_FIELDS)


def _cfg(layer):
    """The fields reference() reads, as a hashable static argument."""
    return Cfg(*(getattr(layer, f) for f in CFG_FIELDS))


CASES = {
    "encoder_default": dict(),
    "encoder_post_residual_output_ln_gated": dict(
        apply_residual_connection_post_layernorm=True, output_layernorm=True,
        mlp_activations=("silu", "linear"), use_bias=True, self_attn_mask_type="padding"),
    "encoder_rmsnorm_rotary_gqa": dict(
        layernorm_type="rmsnorm", zero_centered_gamma=True, enable_rotary_pos_emb=True,
        enable_relative_embedding=False, num_gqa_groups=2, fuse_qkv_params=False),
    "decoder_relative_rotary": dict(layer_type=DECODER, enable_rotary_pos_emb=True,
                                    rotary_pos_emb_group_method="alternate",
                                    mlp_activations=("gelu", "linear")),
    "decoder_post_residual": dict(layer_type=DECODER, apply_residual_connection_post_layernorm=True,
                                  self_attn_mask_type="padding_causal", use_bias=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_plain_jax(case):
    layer = _layer(**CASES[case])
    x, enc = _x(0), _x(1, S)
    variables = _random_variables(layer, x, enc)
    self_mask, self_vis = _padding_mask([T, 5], [T, 5], T, T)
    cross_mask, cross_vis = _padding_mask([T, T], [S, 4], T, S)
    if layer.self_attn_mask_type == "causal":
        self_vis = causal(T, T)
    elif "causal" in layer.self_attn_mask_type:
        self_vis = self_vis & causal(T, T)
    decoder = layer.layer_type == DECODER
    masks = (self_mask, cross_mask) if decoder else (self_mask,)
    got = _apply(layer, deterministic=True)(variables, x, enc if decoder else None, *masks)
    want = reference(variables["params"], x, enc, self_vis, cross_vis, _cfg(layer))
    _close(got, want, atol=5e-5)
    assert got.dtype == jnp.float32 and got.shape == (B, T, E)


def test_parameter_tree_and_axes():
    layer = _layer(layer_type=DECODER, use_bias=True, mlp_activations=("gelu", "linear"),
                   output_layernorm=True, softmax_type="learnable")
    x, enc = _x(0), _x(1, S)
    variables = jax.eval_shape(lambda k: layer.init(k, x, enc, deterministic=True),
                               jax.random.key(0))
    params = nn.unbox(variables)["params"]
    assert set(params) == {"relpos_bias", "self_attention", "encoder_decoder_attention", "mlp",
                           "output_layernorm"}
    assert params["relpos_bias"]["rel_embedding"].shape == (N, 32)
    assert params["mlp"]["wi_kernel"].shape == (E, 2, F) and params["mlp"]["wo_kernel"].shape == (F, E)
    assert params["self_attention"]["qkv"]["kernel"].shape == (E, 3, E)
    assert "scale" not in params["self_attention"]["qkv"]  # output_layernorm: no input LN
    assert params["encoder_decoder_attention"]["kv"]["kernel"].shape == (E, 2, E)
    assert_axes_on_every_param(variables)
    axes, P = nn.get_partition_spec(variables)["params"], jax.sharding.PartitionSpec
    # TE's logical names (transformer_engine/jax/flax/transformer.py's TransformerLayer)
    assert axes["mlp"]["wi_kernel"] == P("nvte_w_fsdp", "nvte_w_joined", "nvte_w_tp")
    assert axes["mlp"]["wo_kernel"] == P("nvte_w_tp", "nvte_w_fsdp")
    assert axes["mlp"]["wi_bias"] == P("nvte_w_joined", "nvte_w_tp")
    assert axes["output_layernorm"]["scale"] == P("nvte_w_no_shard")
    assert axes["relpos_bias"]["rel_embedding"] == P("heads", "relpos_buckets")


def test_te_defaults():
    layer = TransformerLayer()
    assert (layer.hidden_size, layer.mlp_hidden_size, layer.num_attention_heads) == (512, 2048, 8)
    assert layer.hidden_dropout == 0.1 and layer.attention_dropout == 0.1
    assert layer.intermediate_dropout == 0.0 and layer.enable_relative_embedding
    assert layer.self_attn_mask_type == "causal" and layer.layer_type == TransformerLayerType.ENCODER
    assert layer.mlp_activations == ("gelu",) and layer.fuse_qkv_params and layer.scaled_query_init


def _zero_mlp(variables):
    """The MLP's output projection set to 0: the layer's output is the attention block's."""
    params = jax.tree.map(lambda a: a, variables["params"])
    params["mlp"] = dict(params["mlp"], wo_kernel=jnp.zeros_like(params["mlp"]["wo_kernel"]))
    return {"params": params}


def test_dropouts():
    x = _x(2)
    base = _layer(hidden_dropout=0.0, attention_dropout=0.0, enable_relative_embedding=False)
    variables = _zero_mlp(_random_variables(base, x, None))
    clean = _apply(base, deterministic=True)(variables, x, None) - x  # attention block output
    key = jax.random.key(3)

    @functools.lru_cache(None)
    def compiled(layer):
        return jax.jit(lambda v, x, k: layer.apply(v, x, deterministic=False, rngs={"dropout": k}))

    def block(layer, key):
        return np.asarray(compiled(layer)(variables, x, key) - x)

    # hidden dropout, shared along the sequence axis: each (batch, feature) kept or dropped.
    hidden = base.clone(hidden_dropout=0.5, hidden_dropout_dims=(1,))
    got = block(hidden, key)
    kept = np.abs(got) > 0
    assert (kept == kept[:, :1]).all() and 0.2 < kept.mean() < 0.8
    np.testing.assert_allclose(got[kept], 2 * np.asarray(clean)[kept], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(block(hidden, key), got)  # reproducible from the key
    assert not np.array_equal(block(hidden, jax.random.key(4)), got)

    # drop_path: a whole batch row's block output is kept (x 1/(1-p)) or dropped.
    deep = base.clone(drop_path=0.5)
    rows = [block(deep, jax.random.key(s)) for s in range(4)]
    for got in rows:
        for b in range(B):
            if np.abs(got[b]).max() > 0:
                np.testing.assert_allclose(got[b], 2 * np.asarray(clean)[b], rtol=1e-5, atol=1e-5)
    assert any(np.abs(r[b]).max() == 0 for r in rows for b in range(B))

    # Training without the rng stream fails (attention dropout too, TE's default 0.1).
    for layer in (hidden, base.clone(attention_dropout=0.1)):
        with pytest.raises(Exception, match="dropout"):
            jax.eval_shape(lambda v: layer.apply(v, x, deterministic=False), variables)


def test_decoder_decode_equals_the_full_pass():
    layer = _layer(layer_type=DECODER, enable_rotary_pos_emb=True, attention_dropout=0.0,
                   hidden_dropout=0.0, num_gqa_groups=2)
    x, enc = _x(5), _x(6, S)
    cross_mask, _ = _padding_mask([T, T], [S, 3], T, S)
    variables = _random_variables(layer, x, enc)
    full = _apply(layer, deterministic=True)(variables, x, enc, None, cross_mask)
    shapes = nn.unbox(jax.eval_shape(lambda k: layer.init(
        k, x, enc, None, cross_mask, deterministic=True, decode=True, max_decode_length=T),
        jax.random.key(0)))
    cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes["cache"])
    step = jax.jit(lambda v, xt: layer.apply(v, xt, enc, None, cross_mask[:, :, :1],
                                             deterministic=True, decode=True,
                                             max_decode_length=T, mutable=["cache"]))
    outs = []
    for t in range(T):
        out, state = step({"params": variables["params"], "cache": cache}, x[:, t:t + 1])
        cache = state["cache"]
        outs.append(out)
    _close(jnp.concatenate(outs, axis=1), full, atol=5e-5)


def test_bad_calls():
    x = _x(7)
    with pytest.raises(ValueError, match="DECODER"):
        jax.eval_shape(lambda k: _layer().init(k, x, decode=True), jax.random.key(0))
    with pytest.raises(ValueError, match="encoded"):
        jax.eval_shape(lambda k: _layer(layer_type=DECODER).init(k, x), jax.random.key(0))
    with pytest.raises(ValueError, match="low_rank_adaptation_scope='everything'"):
        jax.eval_shape(lambda k: _layer(low_rank_adaptation_scope="everything").init(k, x),
                       jax.random.key(0))
    with pytest.raises(ValueError, match="multiple"):
        jax.eval_shape(lambda k: TransformerLayer(hidden_size=E, num_attention_heads=5).init(k, x),
                       jax.random.key(0))


def test_fp8_autocast_covers_every_projection():
    """Every GEMM is one of flashmesh.nn's dense modules, so autocast gives each its state."""
    from flashmesh.quantization import COLLECTION, DelayedScaling, autocast
    layer = _layer(layer_type=DECODER)
    x, enc = _x(0), _x(1, S)
    with autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
        variables = jax.eval_shape(lambda k: layer.init(k, x, enc, deterministic=True),
                                   jax.random.key(0))
    metas = variables[COLLECTION]
    assert set(metas["self_attention"]) == {"qkv", "out"}
    assert set(metas["encoder_decoder_attention"]) == {"query", "kv", "out"}
    for block in ("self_attention", "encoder_decoder_attention"):
        for gemm in metas[block].values():
            assert set(gemm) >= {"x_scale", "kernel_amax_history", "grad_scale"}
    assert {"x_0_scale", "x_1_scale"} <= set(metas["mlp"])


def test_compute_follows_the_inputs_dtype():
    """float32 parameters, bfloat16 inputs: bfloat16 out (TE asserts the same)."""
    layer = _layer(layer_type=DECODER, enable_rotary_pos_emb=True, softmax_type="learnable")
    x, enc = _x(0).astype(jnp.bfloat16), _x(1, S).astype(jnp.bfloat16)
    variables = jax.eval_shape(lambda k: layer.init(k, x, enc, deterministic=True), jax.random.key(0))
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(variables["params"]))
    out = jax.eval_shape(lambda v: layer.apply(v, x, enc, deterministic=True), variables)
    assert out.dtype == jnp.bfloat16 and out.shape == (B, T, E)
    cache = jax.eval_shape(lambda k: layer.init(k, x, enc, deterministic=True, decode=True),
                           jax.random.key(0))["cache"]["self_attention"]
    assert cache["cached_key"].dtype == jnp.bfloat16


def test_reproducible_reaches_every_attention_call(monkeypatch):
    """TransformerLayer(reproducible=True) (a flashmesh field, not TE's) passes it to both of a
    decoder's attention calls, and the output equals the default's (on a CPU the same
    implementation runs either way)."""
    from flashmesh.attention import api
    from flashmesh.te import attention as te_attention

    seen, attention = [], api.attention

    def recording(*args, **options):
        seen.append(options.get("reproducible"))
        return attention(*args, **options)

    monkeypatch.setattr(te_attention.api, "attention", recording)
    x, enc = _x(1), _x(2, S)
    layer = _layer(layer_type=DECODER, reproducible=True)
    variables = layer.init(jax.random.key(0), x, enc, deterministic=True)
    seen.clear()
    out = layer.apply(variables, x, enc, deterministic=True)
    assert seen == [True, True]
    np.testing.assert_array_equal(out, _layer(layer_type=DECODER).apply(variables, x, enc, deterministic=True))


@pytest.mark.parametrize("scope,mlp", [("all", True), ("exclude_mlp", False), ("mlp", True)])
def test_lora_scope_reaches_the_mlp(scope, mlp):
    """TE's scopes: 'all' and 'mlp' give the MLP its four LoRA kernels, 'exclude_mlp' none."""
    x = _x(2)
    layer = _layer(low_rank_adaptation_scope=scope, low_rank_adaptation_dim=4)
    params = nn.unbox(jax.eval_shape(lambda k: layer.init(k, x), jax.random.key(0)))["params"]["mlp"]
    names = {"wi_lora_a_kernel", "wi_lora_b_kernel", "wo_lora_a_kernel", "wo_lora_b_kernel"}
    assert (names <= set(params)) if mlp else not (names & set(params))
    if mlp:
        assert params["wi_lora_a_kernel"].shape == (E, 1, 4) and params["wo_lora_b_kernel"].shape == (4, E)
