"""flashmesh.nn.MultiHeadAttention against plain JAX with the same parameters."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from flashmesh.nn.multihead import MultiHeadAttention, padding_descriptor

B, T, S, E, N, H = 2, 8, 6, 32, 4, 8


def _x(seed, length=T, width=E):
    # numpy draws: every jax op compiles on first use, and CI has 2 cores.
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, length, width)), jnp.float32)


def _ln(x, p, eps=1e-6, zero_centered=False):
    """LayerNorm, or RMSNorm when p has no ln_bias; zero_centered: gamma = 1 + scale."""
    gamma = p["scale"] + 1.0 if zero_centered else p["scale"]
    if "ln_bias" not in p:
        return x / jnp.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * gamma[None, None]
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * gamma[None, None] + p["ln_bias"][None, None]


def _lin(x, p):
    y = jnp.einsum("bte,e...->bt...", x, p["kernel"])
    return y + p["bias"][None, None] if "bias" in p else y


def _rope(x, method, positions):
    """Pairs rotated as plain index arithmetic (independent of flashmesh.nn.rotary)."""
    h = x.shape[-1]
    theta = np.asarray(positions)[:, None] / 10000.0 ** (2 * np.arange(h // 2) / h)  # [T, H/2]
    cos, sin = (jnp.asarray(f(theta)[None, :, None], jnp.float32) for f in (np.cos, np.sin))
    i = np.arange(h // 2)
    a_idx, b_idx = (2 * i, 2 * i + 1) if method == "consecutive" else (i, i + h // 2)
    a, b = x[..., a_idx], x[..., b_idx]
    out = jnp.zeros_like(x)
    return out.at[..., a_idx].set(a * cos - b * sin).at[..., b_idx].set(b * cos + a * sin)


@functools.partial(jax.jit, static_argnames=("self_attn", "K", "rope", "scale", "input_ln",
                                             "zero_centered"))
def reference(params, xq, xkv, *, visible, self_attn, K=N, rope=None, bias=None, scale=1.0,
              sink=None, input_ln=True, zero_centered=False):
    """Plain-JAX MultiHeadAttention: visible [B|1, T, S] bool; rows with no key give 0."""
    lnp = params["qkv"] if "qkv" in params else params["query"]
    hq = _ln(xq, lnp, zero_centered=zero_centered) if input_ln else xq
    kv_in = hq if self_attn else xkv
    if "qkv" in params:
        qkv = _lin(hq, params["qkv"])
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        q = _lin(hq, params["query"])
        if "kv" in params:
            kv = _lin(kv_in, params["kv"])
            k, v = kv[:, :, 0], kv[:, :, 1]
        else:
            k, v = _lin(kv_in, params["key"]), _lin(kv_in, params["value"])
    q = q.reshape(B, q.shape[1], N, H)
    k, v = (a.reshape(B, a.shape[1], K, H) for a in (k, v))
    if rope is not None:
        q, k = _rope(q, rope, np.arange(q.shape[1])), _rope(k, rope, np.arange(k.shape[1]))
    k, v = (jnp.repeat(a, N // K, axis=2) for a in (k, v))
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
    if bias is not None:
        logits = logits + bias
    vis = jnp.broadcast_to(visible[:, None], logits.shape)
    logits = jnp.where(vis, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    if sink is not None:
        m = jnp.maximum(m, sink.reshape(1, N, 1, 1))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    denom = p.sum(-1, keepdims=True)
    if sink is not None:
        denom = denom + jnp.exp(sink.reshape(1, N, 1, 1) - m)
    p = jnp.where(denom > 0, p / jnp.where(denom > 0, denom, 1.0), 0.0)
    out = jnp.einsum("bnts,bsnh->btnh", p, v).reshape(B, q.shape[1], N * H)
    return _lin(out, params["out"])


def causal(t, s):
    return np.tril(np.ones((t, s), bool))[None]


def _close(got, want, atol=2e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=atol, rtol=2e-5)


def _fns(module, self_attn, **kwargs):
    """Jitted init and apply (one compile each: eager Flax compiles every op on CPU)."""
    pair = (lambda a, b: (a, a)) if self_attn else (lambda a, b: (a, b))
    init = jax.jit(lambda key, a, b, *rest: nn.unbox(module.init(key, *pair(a, b), *rest,
                                                                 deterministic=True, **kwargs)))
    apply = jax.jit(lambda v, a, b, *rest: module.apply(v, *pair(a, b), *rest,
                                                        deterministic=True, **kwargs))
    return init, apply


def _random_params(module, xq, xkv, *args, seed=0, **kwargs):
    """The module's parameter tree (from tracing init, nothing compiled) with random values:
    kernels ~ N(0, 1/fan_in), LayerNorm scales ~ 1 + N(0, 0.1^2), the rest ~ N(0, 0.1^2)."""
    self_attn = xkv is xq
    shapes = nn.unbox(jax.eval_shape(
        lambda k, a, b: module.init(k, a, a if self_attn else b, *args, deterministic=True,
                                    **kwargs), jax.random.key(0), xq, xkv))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = path[-1].key
        if name == "kernel":
            value = rng.normal(size=leaf.shape) / np.sqrt(leaf.shape[0])
        elif name == "scale":
            value = 1.0 + 0.1 * rng.normal(size=leaf.shape)
        else:
            value = 0.1 * rng.normal(size=leaf.shape)
        return jnp.asarray(value, leaf.dtype)
    return {"params": jax.tree_util.tree_map_with_path(draw, shapes["params"])}


def _run(module, xq, xkv, *args, **kwargs):
    """(variables, out, ln_out) with random parameters; xkv is xq means self-attention."""
    variables = _random_params(module, xq, xkv, *args, **kwargs)
    out, ln_out = _fns(module, xkv is xq, **kwargs)[1](variables, xq, xkv, *args)
    return variables, out, ln_out


@pytest.mark.parametrize("fuse, K", [(True, N), (False, N), (True, 2), (False, 1)])
def test_self_attention_fused_unfused_gqa(fuse, K):
    x = _x(0)
    mha = MultiHeadAttention(head_dim=H, num_attention_heads=N, num_gqa_groups=K,
                             fuse_qkv_params=fuse, use_bias=True,
                             bias_init=nn.initializers.normal(0.1))
    variables, out, ln_out = _run(mha, x, x)
    params = variables["params"]
    names = ({"qkv", "out"} if fuse and K == N else {"query", "kv", "out"} if fuse
             else {"query", "key", "value", "out"})
    assert set(params) == names and ln_out is None
    want = reference(params, x, x, visible=causal(T, T), self_attn=True, K=K)
    _close(out, want)
    assert out.dtype == jnp.float32


def test_cross_attention_and_layernorm_output():
    xq, xkv = _x(0), _x(1, S, 24)
    mha = MultiHeadAttention(head_dim=H, num_attention_heads=N, attn_mask_type="no_mask",
                             return_layernorm_output=True)
    variables, out, ln_out = _run(mha, xq, xkv)
    params = variables["params"]
    assert params["kv"]["kernel"].shape == (24, 2, N * H)
    _close(out, reference(params, xq, xkv, visible=np.ones((1, T, S), bool), self_attn=False))
    _close(ln_out, _ln(xq, params["query"]))


@pytest.mark.parametrize("method", ["consecutive", "alternate"])
def test_rotary(method):
    x = _x(2)
    mha = MultiHeadAttention(head_dim=H, num_attention_heads=N, num_gqa_groups=2,
                             enable_rotary_pos_emb=True, rotary_pos_emb_group_method=method)
    variables, out, _ = _run(mha, x, x)
    _close(out, reference(variables["params"], x, x, visible=causal(T, T), self_attn=True,
                          K=2, rope=method))


def _padding_mask(q_lens, kv_lens, t, s, with_causal=False):
    """TE's convention: True = masked out."""
    vis = (np.arange(t)[None, :, None] < np.asarray(q_lens)[:, None, None]) & (
        np.arange(s)[None, None, :] < np.asarray(kv_lens)[:, None, None])
    if with_causal:
        vis = vis & causal(t, s)
    return jnp.asarray(~vis[:, None]), vis


@pytest.mark.parametrize("mask_type, with_causal", [("padding", False), ("padding_causal", True),
                                                    ("padding_causal", False)])
def test_padding_masks_and_fully_masked_rows(mask_type, with_causal):
    x = _x(3)
    mask, vis = _padding_mask([5, 0], [5, 0], T, T, with_causal)  # row 1 fully padded
    mha = MultiHeadAttention(head_dim=H, num_attention_heads=N, attn_mask_type=mask_type)
    variables, out, _ = _run(mha, x, x, mask)
    if mask_type == "padding_causal":
        vis = vis & causal(T, T)
    _close(out, reference(variables["params"], x, x, visible=vis, self_attn=True))
    out = np.asarray(out)
    assert (out[0, 5:] == 0).all() and (out[1] == 0).all()

    def loss(params, x):
        return jnp.sum(mha.apply({"params": params}, x, x, mask, deterministic=True)[0] ** 2)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(variables["params"], x)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert (np.asarray(grads[1])[1] == 0).all()  # a padded row gets no gradient


def test_cross_attention_padding():
    xq, xkv = _x(4), _x(5, S)
    mask, vis = _padding_mask([T, 3], [4, S], T, S)
    mha = MultiHeadAttention(head_dim=H, num_attention_heads=N, attn_mask_type="padding")
    variables, out, _ = _run(mha, xq, xkv, mask)
    _close(out, reference(variables["params"], xq, xkv, visible=vis, self_attn=False))


def test_padding_descriptor_reads_trailing_padding_only():
    mask, _ = _padding_mask([T, 3], [4, S], T, S)
    d = padding_descriptor(mask, B, T, S, causal=False, bottom_right=False)
    np.testing.assert_array_equal(np.asarray(d.q_seqlens), [T, 3])
    np.testing.assert_array_equal(np.asarray(d.kv_seqlens), [4, S])
    # With the causal structure included or not, the lengths are the same.
    cmask, _ = _padding_mask([5, 2], [5, 2], T, T, with_causal=True)
    d = padding_descriptor(cmask, B, T, T, causal=True, bottom_right=False)
    np.testing.assert_array_equal(np.asarray(d.q_seqlens), [5, 2])
    holes = mask.at[0, 0, :, 1].set(True)  # a masked key inside the sequence: not padding
    with pytest.raises(ValueError, match="trailing padding"):
        padding_descriptor(holes, B, T, S, causal=False, bottom_right=False)
    with pytest.raises(ValueError, match="trailing padding"):  # causal structure is not padding
        padding_descriptor(cmask, B, T, T, causal=False, bottom_right=False)
    with pytest.raises(ValueError, match="mask shape"):
        padding_descriptor(mask[:, 0], B, T, S, causal=False, bottom_right=False)
    # Traced masks cannot be checked: they are read as trailing padding.
    lens = jax.jit(lambda m: padding_descriptor(m, B, T, S, causal=False,
                                                bottom_right=False).kv_seqlens)(holes)
    np.testing.assert_array_equal(np.asarray(lens), [4, S])  # up to the last visible key
    # bottom-right causal with T > S: the first T - S queries see nothing, yet belong to the
    # sequence (a mask with the causal part in it, or without)
    br = ~(np.arange(S)[None, :] <= np.arange(T)[:, None] - (T - S))
    for m in (jnp.asarray(np.broadcast_to(br, (B, 1, T, S))), jnp.zeros((B, 1, T, S), bool)):
        d = padding_descriptor(m, B, T, S, causal=True, bottom_right=True)
        np.testing.assert_array_equal(np.asarray(d.q_seqlens), [T, T])
        np.testing.assert_array_equal(np.asarray(d.kv_seqlens), [S, S])


def test_traced_masks_that_are_not_trailing_padding_give_nan_rows():
    """Under jit (`_run`'s apply) a mask lengths cannot express makes its row NaN; the other
    rows are exact."""
    xq, xkv = _x(4), _x(5, S)
    mask, vis = _padding_mask([T, 3], [4, S], T, S)
    holes = mask.at[0, 0, :, 1].set(True)
    mha = MultiHeadAttention(head_dim=H, num_attention_heads=N, attn_mask_type="padding")
    variables, out, _ = _run(mha, xq, xkv, holes)
    assert np.isnan(np.asarray(out[0])).all()
    want = reference(variables["params"], xq, xkv, visible=vis, self_attn=False)
    _close(out[1], want[1])
    # self-attention, causal, sequence-major: the same row (now axis 1) is NaN, the other exact
    x = _x(6)
    cmask, cvis = _padding_mask([5, 3], [5, 3], T, T, with_causal=True)
    chole = cmask.at[0, 0, 4, 2].set(True)  # a hidden key inside a causal row: not padding
    kw = dict(head_dim=H, num_attention_heads=N, attn_mask_type="padding_causal")
    variables, good, _ = _run(MultiHeadAttention(**kw), x, x, cmask)
    _close(good, reference(variables["params"], x, x, visible=cvis, self_attn=True))
    xt = jnp.swapaxes(x, 0, 1)
    seq = _fns(MultiHeadAttention(**kw, transpose_batch_sequence=True), True)[1](variables, xt, xt, chole)[0]
    assert seq.shape == (T, B, E) and np.isnan(np.asarray(seq[:, 0])).all()
    _close(seq[:, 1], good[1])


def test_mask_ignored_for_causal_and_none_mask_for_padding():
    x = _x(6)
    mask, _ = _padding_mask([3, 4], [3, 4], T, T)
    mha = MultiHeadAttention(head_dim=H, num_attention_heads=N)  # causal: TE ignores the mask
    apply = _fns(mha, True)[1]
    variables = _random_params(mha, x, x)
    out = apply(variables, x, x)[0]
    _close(apply(variables, x, x, mask)[0], out, atol=0)
    padded = MultiHeadAttention(head_dim=H, num_attention_heads=N, attn_mask_type="padding_causal")
    _close(_fns(padded, True)[1](variables, x, x)[0], out, atol=0)


def test_bias_window_sink_and_scales():
    x = _x(7)
    bias = jax.random.normal(jax.random.key(8), (1, N, T, T))
    mha = MultiHeadAttention(head_dim=H, num_attention_heads=N, window_size=(2, 0),
                             softmax_type="learnable", scale_attn_logits=True)
    apply = _fns(mha, True)[1]
    params = dict(_random_params(mha, x, x, None, bias)["params"])
    assert params["softmax_offset"].shape == (1, N, 1, 1)
    params["softmax_offset"] = jnp.linspace(-1.0, 1.0, N).reshape(1, N, 1, 1)
    band = causal(T, T) & ~np.tril(np.ones((T, T), bool), -3)[None]
    want = reference(params, x, x, visible=band, self_attn=True, bias=bias, scale=H ** -0.5,
                     sink=params["softmax_offset"])
    _close(apply({"params": params}, x, x, None, bias)[0], want)
    pre = MultiHeadAttention(head_dim=H, num_attention_heads=N, attn_bias_type="pre_scale_bias",
                             scale_attn_logits=True)
    v2, out2, _ = _run(pre, x, x, None, bias)
    _close(out2, reference(v2["params"], x, x, visible=causal(T, T), self_attn=True,
                           bias=bias * H ** -0.5, scale=H ** -0.5))


def _shapes(module, x, **kwargs):
    """Variables' shapes and axis names (boxed) without computing anything."""
    return jax.eval_shape(lambda k, a: module.init(k, a, a, deterministic=True, **kwargs),
                          jax.random.key(0), x)


def assert_axes_on_every_param(variables):
    boxed = lambda v: isinstance(v, nn.LogicallyPartitioned)
    flat = jax.tree_util.tree_flatten_with_path(variables["params"], is_leaf=boxed)[0]
    for path, leaf in flat:
        assert boxed(leaf), path
        assert len(leaf.names) == leaf.value.ndim, (path, leaf.names)


def test_scaled_query_init_and_axes():
    x = _x(9)
    mha = MultiHeadAttention(head_dim=H, num_attention_heads=N, kernel_init=nn.initializers.ones)
    kernel = np.asarray(_fns(mha, True)[0](jax.random.key(0), x, x)["params"]["qkv"]["kernel"])
    np.testing.assert_allclose(kernel[:, 0], H ** -0.5)
    np.testing.assert_allclose(kernel[:, 1:], 1.0)
    for kw in [dict(use_bias=True), dict(num_gqa_groups=2, use_bias=True),
               dict(fuse_qkv_params=False, use_bias=True), dict(softmax_type="learnable")]:
        assert_axes_on_every_param(_shapes(MultiHeadAttention(head_dim=H, num_attention_heads=N, **kw), x))
    # TE's logical names (transformer_engine/jax/flax/transformer.py's MultiHeadAttention)
    names = nn.get_partition_spec(_shapes(MultiHeadAttention(head_dim=H, num_attention_heads=N), x))
    P = jax.sharding.PartitionSpec
    assert names["params"]["qkv"]["kernel"] == P("nvte_w_fsdp", "nvte_w_joined", "nvte_w_tp")
    assert names["params"]["qkv"]["scale"] == P("nvte_w_no_shard")
    assert names["params"]["out"]["kernel"] == P("nvte_w_tp", "nvte_w_fsdp")
    cross = jax.eval_shape(lambda k, a, b: MultiHeadAttention(head_dim=H, num_attention_heads=N).init(
        k, a, b, deterministic=True), jax.random.key(0), x, _x(1, S))
    cross = nn.get_partition_spec(cross)["params"]
    assert cross["kv"]["kernel"] == P("nvte_w_fsdp", "nvte_w_joined", "nvte_w_tp")
    assert cross["query"]["kernel"] == P("nvte_w_fsdp", "nvte_w_tp")


def test_dropout_needs_rng_and_differs():
    x = _x(10)
    mha = MultiHeadAttention(head_dim=H, num_attention_heads=N, attention_dropout=0.5)
    variables = _random_params(mha, x, x)
    plain = _fns(mha, True)[1](variables, x, x)[0]
    train = jax.jit(lambda v, a, key: mha.apply(v, a, a, deterministic=False,
                                                rngs={"dropout": key})[0])
    with pytest.raises(Exception, match="dropout"):
        jax.eval_shape(lambda v, a: mha.apply(v, a, a, deterministic=False), variables, x)
    a, b = train(variables, x, jax.random.key(1)), train(variables, x, jax.random.key(1))
    _close(a, b, atol=0)
    assert np.abs(np.asarray(a) - np.asarray(plain)).max() > 1e-3
    assert np.abs(np.asarray(train(variables, x, jax.random.key(2)) - a)).max() > 1e-3


def test_sequence_major():
    x = _x(11)
    mha = MultiHeadAttention(head_dim=H, num_attention_heads=N, enable_rotary_pos_emb=True)
    variables, out, _ = _run(mha, x, x)
    sm = MultiHeadAttention(head_dim=H, num_attention_heads=N, enable_rotary_pos_emb=True,
                            transpose_batch_sequence=True)
    xt = jnp.swapaxes(x, 0, 1)
    _close(jnp.swapaxes(_fns(sm, True)[1](variables, xt, xt)[0], 0, 1), out)


def test_decode_equals_the_full_causal_pass():
    x = _x(12)
    mha = MultiHeadAttention(head_dim=H, num_attention_heads=N, num_gqa_groups=2,
                             enable_rotary_pos_emb=True, window_size=(3, 0))
    shapes = _shapes(mha, x, decode=True)  # init creates TE's cache collection
    assert shapes["cache"]["cached_key"].shape == (B, T, 2, H)
    assert shapes["cache"]["cache_index"].shape == () and shapes["cache"]["cache_index"].dtype == jnp.int32
    variables = {"params": _random_params(mha, x, x)["params"],
                 "cache": jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes["cache"])}
    full = _fns(mha, True)[1]({"params": variables["params"]}, x, x)[0]
    step = jax.jit(lambda v, xt: mha.apply(v, xt, xt, decode=True, deterministic=True,
                                           mutable=["cache"]))
    cache, outs = variables["cache"], []
    for t in range(T):
        (out, _), state = step({"params": variables["params"], "cache": cache}, x[:, t:t + 1])
        cache = state["cache"]
        outs.append(out)
    assert int(cache["cache_index"]) == T
    _close(jnp.concatenate(outs, axis=1), full)


def test_bad_configuration():
    x = _x(13)
    with pytest.raises(ValueError, match="num_gqa_groups"):
        _shapes(MultiHeadAttention(head_dim=H, num_attention_heads=N, num_gqa_groups=3), x)
    with pytest.raises(NotImplementedError, match="sequence"):
        _shapes(MultiHeadAttention(head_dim=H, num_attention_heads=N, enable_sequence_parallel=True), x)
    with pytest.raises(NotImplementedError, match="score_mod"):
        _shapes(MultiHeadAttention(head_dim=H, num_attention_heads=N, score_mod=lambda s: s), x)


def test_te_deprecated_fields_as_te_handles_them():
    """num_heads / dropout_rate set their replacements; apply_residual_connection_post_layernorm
    and fuse_qkv only warn; output_layernorm is refused (all as TE's MultiHeadAttention)."""
    with pytest.warns(DeprecationWarning) as caught:
        mha = MultiHeadAttention(head_dim=8, num_attention_heads=2, num_heads=4, dropout_rate=0.2)
    assert mha.num_attention_heads == 4 and mha.attention_dropout == 0.2
    assert ["num_heads" in str(w.message) for w in caught] == [True, False]
    with pytest.warns(DeprecationWarning, match="fuse_qkv is deprecated and has no effect"):
        MultiHeadAttention(head_dim=8, num_attention_heads=2, fuse_qkv=False)
    with pytest.raises(ValueError, match="output_layernorm is deprecated"):
        MultiHeadAttention(head_dim=8, num_attention_heads=2, output_layernorm=True)
