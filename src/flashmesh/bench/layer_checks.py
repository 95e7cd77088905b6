"""Numerics of the layer preset: every row against a float32 reference on its own parameters.

Shape legend: B batch, T sequence, H hidden, F FFN width, N heads, D = H // N.

Two references, both float32 at `precision=HIGHEST` (no TF32):

* `flax_mha` rows (the guide's plain Flax layer and TEUnfusedTransformerLayer with Flax
  attention) against the guide's `FlaxTransformerLayer` itself, their parameters renamed onto
  its tree;
* `te` rows (TransformerEngine's structure) against `reference_layer`, plain JAX written here
  with einsum attention: the parameters of each row map onto one canonical tree (`CANONICAL`).

Every map is a renaming plus reshapes and transposes, so it is linear: the same map carries a
row's parameter gradients onto the reference's, and the comparison covers the output, dx and
every parameter's gradient. FP8 rows are compared with their bf16 twin on the same parameters
(their float32 error is stated too). Errors are relative L2, ||got - want|| / ||want||, per
tensor (a parameter gradient's denominator floored, GRAD_FLOOR); a row's verdict uses the worst.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from flashmesh.bench import layer_models

# canonical tree: {"ln1", "ln2": {"scale", "bias"}, "qkv", "out", "fc1", "fc2": {"kernel", "bias"}};
# kernels [in, out]; the QKV kernel [H, 3H] holds per head its q, k, v columns ([H, N, 3, D]).
CANONICAL = ("ln1", "qkv", "out", "ln2", "fc1", "fc2")
# A row in a float dtype may err at most this many times the plain computation in that dtype
# (reference_layer in bf16 against float32), plus this absolute floor (FlashAttention's rule).
TOLERANCE_FACTOR, TOLERANCE_FLOOR = 2.5, 1e-3
# FP8 against its bf16 twin: E5M2 gradients carry ~6 % error per GEMM (research/fp8_layer.md,
# 3.2); 0.2 leaves ~3x that for the layer's GEMM chain, while a stale, zero or saturated scale
# gives errors of order 1.
FP8_TOLERANCE = 0.2
# A parameter gradient is measured against its own norm, or against this fraction of the whole
# gradient's norm apportioned to its size, whichever is larger: the gradient of Flax attention's
# key bias is exactly zero in exact arithmetic (softmax ignores a constant added to a row), so
# its own norm is rounding noise, and rounding noise over noise says nothing.
GRAD_FLOOR = 1e-2
# Gradients that are zero in exact arithmetic, left out of the verdict (rounding noise against a
# zero reference says nothing, and would make the Flax structure's yardstick meaningless):
# Flax attention's key bias (softmax ignores a constant added to a row of logits).
ZERO_GRADIENTS = ("['MultiHeadDotProductAttention_0']['key']['bias']",)


class Unchecked(Exception):
    """A row that runs but cannot be checked (the reason is the message): it is timed and
    reported as unchecked."""


class ParameterLayoutError(Unchecked):
    """A row's parameters are not laid out as its map expects (names or shapes)."""


def _get(tree, *path):
    node = tree
    for key in path:
        if not hasattr(node, "keys") or key not in node:
            have = sorted(node.keys()) if hasattr(node, "keys") else type(node).__name__
            raise ParameterLayoutError(f"no {'/'.join(path)} in the parameters (at {key!r}: {have})")
        node = node[key]
    return node


def _norm(p, bias="ln_bias"):
    return {"scale": _get(p, "scale"), "bias": _get(p, bias)}


def _dense(p, kernel="kernel", bias="bias"):
    return {"kernel": _get(p, kernel), "bias": _get(p, bias)}


def _mlp_fused(p, H, F):
    """LayerNormMLP's wi [H, 1, F], wo [F, H] onto fc1, fc2 (one activation)."""
    wi, bi = _get(p, "wi_kernel"), _get(p, "wi_bias")
    if wi.shape != (H, 1, F) or bi.shape != (1, F):
        raise ParameterLayoutError(f"LayerNormMLP wi_kernel {wi.shape} / wi_bias {bi.shape} must be "
                                   f"({H}, 1, {F}) / (1, {F})")
    return {"ln2": _norm(p), "fc1": {"kernel": wi.reshape(H, F), "bias": bi.reshape(F)},
            "fc2": _dense(p, "wo_kernel", "wo_bias")}


def to_canonical(name: str, params, shape) -> dict:
    """A `te`-family row's parameters (or their gradients) on the canonical tree."""
    H, F, N = shape.hidden, shape.ffn, shape.heads
    base = name.removesuffix("_fp8")
    if base == "jax_cudnn":
        return {k: dict(_get(params, k)) for k in CANONICAL}
    if base == "te_unfused":
        mlp = _get(params, "TEUnfusedMLP_0")
        return {"ln1": _norm(_get(params, "LayerNorm_0")), "qkv": _dense(_get(params, "DenseGeneral_0")),
                "out": _dense(_get(params, "DenseGeneral_1")), "ln2": _norm(_get(params, "LayerNorm_1")),
                "fc1": _dense(_get(mlp, "DenseGeneral_0")), "fc2": _dense(_get(mlp, "DenseGeneral_1"))}
    if base == "te_fused":
        ln_qkv = _get(params, "LayerNormDenseGeneral_0")
        return {"ln1": _norm(ln_qkv), "qkv": _dense(ln_qkv), "out": _dense(_get(params, "DenseGeneral_0")),
                **_mlp_fused(_get(params, "LayerNormMLP_0"), H, F)}
    if base in ("transformer_layer", "transformer_layer_no_attn_dropout"):
        # TransformerEngine's fused QKV kernel is [H, 3, N * D] (q, k, v blocks); canonical
        # interleaves them per head.
        qkv = _get(params, "attention", "qkv")
        w, b = _get(qkv, "kernel"), _get(qkv, "bias")
        D = H // N
        if w.shape != (H, 3, H) or b.shape != (3, H):
            raise ParameterLayoutError(f"attention/qkv kernel {w.shape} / bias {b.shape} must be "
                                       f"({H}, 3, {H}) / (3, {H})")
        w = w.reshape(H, 3, N, D).transpose(0, 2, 1, 3).reshape(H, 3 * H)
        b = b.reshape(3, N, D).transpose(1, 0, 2).reshape(3 * H)
        return {"ln1": _norm(qkv), "qkv": {"kernel": w, "bias": b},
                "out": _dense(_get(params, "attention", "out")), **_mlp_fused(_get(params, "mlp"), H, F)}
    raise ValueError(f"no canonical map for layer variant {name!r}")


def to_flax(name: str, params) -> dict:
    """A `flax_mha`-family row's parameters (or gradients) on FlaxTransformerLayer's tree."""
    if name == "flax":
        return params
    if name != "te_unfused_flax_attention":
        raise ValueError(f"no Flax map for layer variant {name!r}")
    mlp = _get(params, "TEUnfusedMLP_0")
    return {"LayerNorm_0": _norm(_get(params, "LayerNorm_0")), "Dense_0": _dense(_get(params, "DenseGeneral_0")),
            "MultiHeadDotProductAttention_0": _get(params, "MultiHeadDotProductAttention_0"),
            "LayerNorm_1": _norm(_get(params, "LayerNorm_1")),
            "FlaxMLP_0": {"Dense_0": _dense(_get(mlp, "DenseGeneral_0")),
                          "Dense_1": _dense(_get(mlp, "DenseGeneral_1"))}}


def attention_scale(model: layer_models.Model, shape) -> float:
    """The logit scale a `te` row applies: 1/sqrt(D), except TransformerLayer, which (as in
    TransformerEngine) scales only with scale_attn_logits=True and otherwise folds 1/sqrt(D)
    into the query kernel's initialisation."""
    if model.variant.name.startswith("transformer_layer") and not getattr(model.module, "scale_attn_logits", False):
        return 1.0
    return 1.0 / math.sqrt(shape.head_dim)


# -- the plain-JAX reference ----------------------------------------------------------------------
def _row(v):
    """[C] -> [1, 1, C]: broadcast explicitly (the tests forbid implicit rank promotion)."""
    return v.reshape(1, 1, -1)


def _ln(x, p, eps):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * _row(p["scale"]) + _row(p["bias"])


def _affine(x, p):
    return x @ p["kernel"] + _row(p["bias"])


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def reference_layer(p: dict, x: jax.Array, *, heads: int, scale: float, eps: float = 1e-5) -> jax.Array:
    """TransformerEngine's layer structure in einsums: x [B, T, H] -> [B, T, H], causal."""
    B, T, H = x.shape
    D = H // heads
    qkv = _affine(_ln(x, p["ln1"], eps), p["qkv"]).reshape(B, T, heads, 3, D)
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    logits = jnp.einsum("btnd,bsnd->bnts", q, k) * jnp.asarray(scale, x.dtype)
    causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
    probs = jax.nn.softmax(jnp.where(causal, logits, jnp.asarray(-1e30, x.dtype)), axis=-1)
    o = jnp.einsum("bnts,bsnd->btnd", probs, v).reshape(B, T, H)
    x = x + _affine(o, p["out"])
    h = _gelu_tanh(_affine(_ln(x, p["ln2"], eps), p["fc1"]))
    return x + _affine(h, p["fc2"])


def grads_fn(fn, dtype=None):
    """jit: (params, x, dy) -> (y, d params, dx) of <fn(params, x), dy>; with `dtype`, every
    input is cast to it first (inside the jitted call, so nothing compiles per leaf)."""
    def loss(p, x, dy):
        y = fn(p, x)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)

    @jax.jit
    def run(params, x, dy):
        if dtype is not None:
            params, x, dy = jax.tree.map(lambda a: a.astype(dtype), (params, x, dy))
        (_, y), (dp, dx) = value_and_grad(params, x, dy)
        return y, dp, dx

    return run


@functools.lru_cache(maxsize=None)
def te_reference(heads: int, scale: float, dtype=jnp.float32):
    """`grads_fn` of `reference_layer` in `dtype` (one compiled program per configuration,
    shared by every row of a run)."""
    return grads_fn(functools.partial(reference_layer, heads=heads, scale=scale), dtype)


@functools.lru_cache(maxsize=None)
def flax_reference(hidden: int, ffn: int, heads: int, dtype=jnp.float32):
    """`grads_fn` of the guide's FlaxTransformerLayer in `dtype` (parameters too), dropout off."""
    module = layer_models.FlaxTransformerLayer(hidden, ffn, heads)
    return grads_fn(lambda p, x: module.apply({"params": p}, x, attention_mask=None, deterministic=True),
                    dtype)


def reference_outputs(run, params, x, dy):
    """A float32 reference `run` with float32 matmuls (HIGHEST: no TF32 or bf16 passes)."""
    with jax.default_matmul_precision("highest"):
        return run(params, x, dy)


def perturbed(variables, seed: int):
    """The variables with every parameter moved by noise (0.1 x its spread, or 0.1 where it is
    constant: LayerNorm's ones, zero biases), so that no bias or scale is trivially checked.
    Drawn on the host (numpy), so that no random program compiles per parameter shape."""
    rng = np.random.default_rng(seed)

    def move(p):
        a = np.asarray(p, np.float32)
        spread = float(a.std())
        a = a + rng.standard_normal(a.shape, dtype=np.float32) * np.float32(0.1 * (spread if spread > 0 else 1.0))
        return jax.device_put(a.astype(p.dtype))

    return {**variables, "params": jax.tree.map(move, variables["params"])}


# -- comparison -----------------------------------------------------------------------------------
def rel_l2(got, want, floor: float = 0.0) -> float:
    """||got - want|| / max(||want||, floor) in float64 on the host (0 when both are 0, inf
    when only want is): no program compiles per tree or shape."""
    got, want = np.asarray(got, np.float64).ravel(), np.asarray(want, np.float64).ravel()
    num, denom = float(np.linalg.norm(got - want)), max(float(np.linalg.norm(want)), floor)
    return num / denom if denom > 0 else (0.0 if num == 0 else math.inf)


def compare(got: tuple, want: tuple) -> dict:
    """got, want: (y, d params on one tree, dx). {"out", "dx", "dparams", "worst_param", "error"}:
    relative L2 errors; dparams is the worst parameter gradient's (named in worst_param), each
    measured against at least GRAD_FLOOR of the whole gradient's norm apportioned to its size
    (ZERO_GRADIENTS are left out)."""
    (y, dp, dx), (wy, wdp, wdx) = got, want
    paths = jax.tree_util.tree_flatten_with_path(wdp)[0]
    mine = jax.tree.leaves(dp)
    if len(mine) != len(paths):
        raise ParameterLayoutError(f"{len(mine)} parameter gradients against the reference's {len(paths)}")
    for (path, w), g in zip(paths, mine):
        if np.shape(g) != np.shape(w):
            raise ParameterLayoutError(f"gradient {jax.tree_util.keystr(path)} has shape {np.shape(g)}, "
                                       f"the reference's {np.shape(w)}")
    want_leaves = [np.asarray(w, np.float64) for _, w in paths]
    total = math.sqrt(sum(float(np.sum(np.square(w))) for w in want_leaves))
    size = sum(w.size for w in want_leaves)
    worst, worst_name = 0.0, ""
    for (path, _), w, g in zip(paths, want_leaves, mine):
        if jax.tree_util.keystr(path) in ZERO_GRADIENTS:
            continue
        e = rel_l2(g, w, GRAD_FLOOR * total * math.sqrt(w.size / size))
        if not e <= worst:  # NaN counts as worst
            worst, worst_name = e, jax.tree_util.keystr(path)
    out_error, dx_error = rel_l2(y, wy), rel_l2(dx, wdx)
    out = {"out": out_error, "dx": dx_error, "dparams": worst, "worst_param": worst_name}
    out["error"] = max(out["out"], out["dx"], out["dparams"], key=lambda e: (math.isnan(e), e))
    return out


def plain_low_precision_error(shape, x, dy, seed: int) -> float:
    """The worst relative L2 error of `reference_layer` computed in x's dtype (default matmul
    precision) against float32 HIGHEST, on random canonical parameters: what a plain layer in
    that dtype loses, the yardstick of every non-FP8 row's tolerance."""
    params = perturbed({"params": layer_models.init_jax_layer(jax.random.key(seed), shape.hidden, shape.ffn,
                                                              jnp.float32)}, seed)["params"]
    scale = 1.0 / math.sqrt(shape.head_dim)
    low = te_reference(shape.heads, scale, jnp.dtype(x.dtype))(params, x, dy)
    return compare(low, reference_outputs(te_reference(shape.heads, scale), params, x, dy))["error"]


def plain_flax_low_precision_error(shape, x, dy, seed: int) -> float:
    """The same for the guide's Flax structure (FlaxTransformerLayer, parameters and all in x's
    dtype): the yardstick of the `flax_mha` rows, whose structure (re-projected heads, f32
    parameters) rounds differently from the TE structure's. Under JAX's standard promotion, as
    the guide runs, whatever the caller set: flax.linen's LayerNorm promotes bf16 with float32."""
    with jax.numpy_dtype_promotion("standard"):
        return _plain_flax_low_precision_error(shape, x, dy, seed)


def _plain_flax_low_precision_error(shape, x, dy, seed: int) -> float:
    module = layer_models.FlaxTransformerLayer(shape.hidden, shape.ffn, shape.heads)
    variables = jax.jit(lambda k, x: module.init(k, x, attention_mask=None, deterministic=True))(
        jax.random.key(seed), x.astype(jnp.float32))
    params = perturbed(variables, seed)["params"]
    run = functools.partial(flax_reference, shape.hidden, shape.ffn, shape.heads)
    low = run(jnp.dtype(x.dtype))(params, x, dy)
    return compare(low, reference_outputs(run(), params, x, dy))["error"]
