"""The getting-started guide's decoder layers (reference/004) as models of any size.

Shape legend: B batch, T sequence, H hidden (model width), F FFN width, N heads, D = H // N.

The guide's classes are below exactly as the guide writes them, with its imports mapped onto
flashmesh (`transformer_engine.jax` -> `flashmesh.te`, `transformer_engine.jax.flax` ->
`flashmesh.te.flax`). examples/getting_started.py is the guide itself and so holds the same
class text a second time; this module is the one copy in src, and tests/examples compares the
two texts so that they cannot drift apart.

Besides the guide's classes: `guide_transformer_layer` (the guide's `te_flax.TransformerLayer`
configuration) and a hand-written JAX layer with flashmesh attention (cuDNN on a GPU), the
ceiling a library layer can hope to reach. `VARIANTS` names the rows of `flashmesh bench
--preset layer` and `build` makes one at a size; `layer_checks.py` maps each one's parameters
onto a float32 reference.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

# ---- the guide's code (reference/004), verbatim but for the import lines ----------------------
# examples/getting_started.py is the guide itself and repeats these classes word for word; this is
# the one copy in src (tests/examples/test_getting_started.py holds the two texts equal).
import jax
import jax.numpy as jnp
from flax import linen as nn
from typing import Optional

import flashmesh.te as te
import flashmesh.te.flax as te_flax
from flashmesh.te.flax.transformer import DotProductAttention as TEDotProductAttention


class FlaxMLP(nn.Module):
    """Feed-forward network in Transformer layer
    Built with plain Flax modules.
    """
    hidden_size: int
    ffn_hidden_size: int

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x = nn.Dense(features=self.ffn_hidden_size, use_bias=True)(x)
        x = nn.gelu(x, approximate=True)  # equivalent to tanh approximation
        x = nn.Dense(features=self.hidden_size, use_bias=True)(x)
        return x


class FlaxTransformerLayer(nn.Module):
    """Basic Transformer layer using plain Flax modules"""
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    layernorm_eps: float = 1e-5
    attention_dropout: float = 0.1

    def setup(self):
        self.kv_channels = self.hidden_size // self.num_attention_heads

    @nn.compact
    def __call__(
        self,
        x: jnp.ndarray,
        attention_mask: Optional[jnp.ndarray] = None,
        deterministic: bool = False
    ) -> jnp.ndarray:
        # Create causal mask if not provided
        if attention_mask is None:
            attention_mask = nn.make_causal_mask(x[..., 0], dtype=jnp.bool_)

        res = x
        x = nn.LayerNorm(epsilon=self.layernorm_eps)(x)

        # Fused QKV projection
        qkv = nn.Dense(features=3 * self.hidden_size, use_bias=True)(x)
        qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = jnp.split(qkv, 3, axis=3)

        # Reshape to [batch, seq_len, num_heads * head_dim] for Flax MultiHeadDotProductAttention
        q_reshaped = q.reshape(q.shape[0], q.shape[1], self.hidden_size)
        k_reshaped = k.reshape(k.shape[0], k.shape[1], self.hidden_size)
        v_reshaped = v.reshape(v.shape[0], v.shape[1], self.hidden_size)

        # Attention using Flax's MultiHeadDotProductAttention
        attention = nn.MultiHeadDotProductAttention(
            num_heads=self.num_attention_heads,
            qkv_features=self.kv_channels,
            dropout_rate=self.attention_dropout,
        )
        x = attention(q_reshaped, k_reshaped, v_reshaped, mask=attention_mask, deterministic=deterministic)

        x = res + x

        # Second residual connection
        res = x
        x = nn.LayerNorm(epsilon=self.layernorm_eps)(x)

        # MLP
        mlp = FlaxMLP(
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
        )
        x = mlp(x)

        return x + res


class TEUnfusedMLP(nn.Module):
    hidden_size : int
    ffn_hidden_size: int

    @nn.compact
    def __call__(self, x: jnp.ndarray, deterministic: bool) -> jnp.ndarray:
        x = te_flax.DenseGeneral(features=self.ffn_hidden_size, use_bias=True) (x)
        x = x.reshape(*x.shape[:-1], 1, x.shape[-1])
        x = te.activation.activation(x, activation_type=('gelu',))
        x = te_flax.DenseGeneral(features=self.hidden_size, use_bias=True) (x)
        return x


class TEUnfusedTransformerLayer(nn.Module):
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    layernorm_eps: float = 1e-5
    attention_dropout: float = 0.1
    use_te_attention: bool = True  # True for TE attention, False for Flax attention

    def setup(self):
        self.kv_channels = self.hidden_size // self.num_attention_heads

    @nn.compact
    def __call__(
        self,
        x: jnp.ndarray,
        attention_mask: Optional[jnp.ndarray] = None,
        deterministic: bool = False
    ) -> jnp.ndarray:
        # Create causal mask if not provided
        if attention_mask is None:
            attention_mask = nn.make_causal_mask(x[..., 0], dtype=jnp.bool_)

        res = x
        x = te_flax.LayerNorm(epsilon=self.layernorm_eps)(x)

        # Fused QKV projection
        qkv = te_flax.DenseGeneral(features=3 * self.hidden_size, use_bias=True)(x)
        qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = jnp.split(qkv, 3, axis=3)

        # Attention - either TE or Flax implementation
        if self.use_te_attention:
            # Use TE's DotProductAttention
            attention = TEDotProductAttention(
                head_dim=self.kv_channels,
                num_attention_heads=self.num_attention_heads,
                num_gqa_groups=self.num_attention_heads,  # No GQA
                attention_dropout=self.attention_dropout,
                attn_mask_type='causal',
            )
            x = attention(q, k, v, sequence_descriptor=None, deterministic=deterministic)
            # Reshape from [batch, seq_len, num_heads, head_dim] to [batch, seq_len, hidden_size]
            x = x.reshape((x.shape[0], x.shape[1], x.shape[2] * x.shape[3]))
            x = te_flax.DenseGeneral(features=self.hidden_size, use_bias=True)(x)
            x = nn.Dropout(rate=self.attention_dropout)(x, deterministic=deterministic)
        else:
            # Use Flax's MultiHeadDotProductAttention
            q_reshaped = q.reshape(q.shape[0], q.shape[1], self.hidden_size)
            k_reshaped = k.reshape(k.shape[0], k.shape[1], self.hidden_size)
            v_reshaped = v.reshape(v.shape[0], v.shape[1], self.hidden_size)

            attention = nn.MultiHeadDotProductAttention(
                num_heads=self.num_attention_heads,
                qkv_features=self.kv_channels,
                dropout_rate=self.attention_dropout,
            )
            x = attention(q_reshaped, k_reshaped, v_reshaped, mask=attention_mask, deterministic=deterministic)

        x = res + x

        # Second residual connection
        res = x
        x = te_flax.LayerNorm(epsilon=self.layernorm_eps)(x)

        # MLP
        mlp = TEUnfusedMLP(
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size
        )

        x = mlp(x, deterministic=deterministic)

        return x + res


class TEFusedTransformerLayer(nn.Module):
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    layernorm_eps: float = 1e-5
    attention_dropout: float = 0.1

    def setup(self):
        self.kv_channels = self.hidden_size // self.num_attention_heads

    @nn.compact
    def __call__(
        self,
        x: jnp.ndarray,
        attention_mask: Optional[jnp.ndarray] = None,
        deterministic: bool = False
    ) -> jnp.ndarray:
        res = x

         # Fused QKV projection
        qkv,_ = te_flax.LayerNormDenseGeneral(features=3 * self.hidden_size,
                                              epsilon=self.layernorm_eps,
                                              use_bias=True,
                                              return_layernorm_output=False)(x)
        qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = jnp.split(qkv, 3, axis=3)

        # Attention using TE's DotProductAttention
        attention = TEDotProductAttention(
            head_dim=self.kv_channels,
            num_attention_heads=self.num_attention_heads,
            num_gqa_groups=self.num_attention_heads,
            attention_dropout=self.attention_dropout,
            attn_mask_type='causal',
        )
        x = attention(q, k, v, sequence_descriptor=None, deterministic=deterministic)
        # Reshape from [batch, seq_len, num_heads, head_dim] to [batch, seq_len, hidden_size]
        x = x.reshape((x.shape[0], x.shape[1], x.shape[2] * x.shape[3]))
        x = te_flax.DenseGeneral(features=self.hidden_size, use_bias=True)(x)
        x = nn.Dropout(rate=self.attention_dropout)(x, deterministic=deterministic)

        x = res + x

        # Second residual connection
        res = x
        x,_ = te_flax.LayerNormMLP(intermediate_dim=self.ffn_hidden_size,
                                 epsilon=self.layernorm_eps,
                                 use_bias=True,
                                 activations=('gelu',),
                                 intermediate_dropout_rate=0.0,
                                 return_layernorm_output=False
                                 )(x, deterministic=deterministic)

        return x + res
# ---- end of the guide's code ------------------------------------------------------------------


def guide_transformer_layer(hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                            **changes):
    """The guide's `te_flax.TransformerLayer(...)`, field for field (attention dropout keeps
    TransformerLayer's default 0.1, as in the guide), with `changes` on top."""
    return te_flax.TransformerLayer(
        hidden_size=hidden_size,
        mlp_hidden_size=ffn_hidden_size,
        num_attention_heads=num_attention_heads,
        mlp_activations=("gelu",),
        self_attn_mask_type='causal',
        layernorm_epsilon=1e-5,
        use_bias=True,
        intermediate_dropout=0.0,
        enable_relative_embedding=False,
        self_attn_bias_type='no_bias',
        hidden_dropout=0.0,
        **changes,
    )


# ---- the hand-written JAX layer (the ceiling reference) -----------------------------------------
@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def init_jax_layer(key: jax.Array, hidden: int, ffn: int, dtype) -> dict:
    """Parameters of `jax_layer` in `dtype`: LayerNorms at (1, 0), kernels variance-scaled by
    fan-in, biases 0; kernels are [in, out], the QKV kernel's columns per head (q, k, v)."""
    k1, k2, k3, k4 = jax.random.split(key, 4)

    def dense(key, fan_in, fan_out):
        w = jax.random.normal(key, (fan_in, fan_out), jnp.float32) * (fan_in ** -0.5)
        return {"kernel": w.astype(dtype), "bias": jnp.zeros((fan_out,), dtype)}

    def norm():
        return {"scale": jnp.ones((hidden,), dtype), "bias": jnp.zeros((hidden,), dtype)}

    return {"ln1": norm(), "qkv": dense(k1, hidden, 3 * hidden), "out": dense(k2, hidden, hidden),
            "ln2": norm(), "fc1": dense(k3, hidden, ffn), "fc2": dense(k4, ffn, hidden)}


def _layernorm(x, p, eps):
    """LayerNorm with float32 statistics, output in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    scale, bias = (p[k].astype(jnp.float32).reshape(1, 1, -1) for k in ("scale", "bias"))
    return (y * scale + bias).astype(x.dtype)


def _dense(x, p):
    return x @ p["kernel"].astype(x.dtype) + p["bias"].astype(x.dtype).reshape(1, 1, -1)


def jax_layer(params: dict, x: jax.Array, *, heads: int, eps: float = 1e-5,
              implementation: str | None = None) -> jax.Array:
    """The guide's layer (pre-LN, causal self-attention, tanh-GELU MLP, no dropout) written by
    hand: x [B, T, H] -> [B, T, H] in x's dtype, attention by `flashmesh.attention`.

    Example:
      >>> p = init_jax_layer(jax.random.key(0), 64, 256, jnp.bfloat16)
      >>> jax_layer(p, jnp.ones((2, 32, 64), jnp.bfloat16), heads=4).shape
      (2, 32, 64)
    """
    import flashmesh

    B, T, H = x.shape
    qkv = _dense(_layernorm(x, params["ln1"], eps), params["qkv"]).reshape(B, T, heads, 3, H // heads)
    o = flashmesh.attention(qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2], mask="causal",
                            implementation=implementation)
    x = x + _dense(o.reshape(B, T, H), params["out"])
    h = _dense(_layernorm(x, params["ln2"], eps), params["fc1"])
    return x + _dense(jax.nn.gelu(h, approximate=True), params["fc2"])


def jax_layer_implementation(platform: str) -> str | None:
    """cuDNN where it exists (a GPU), else flashmesh's automatic choice (named in the row)."""
    return "cudnn" if platform == "gpu" else None


# ---- the rows of the layer preset ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Variant:
    """One row. family: "flax_mha" (the guide's plain-Flax structure: Flax's multi-head attention
    re-projects q, k, v to N heads of (H / N) / N) or "te" (TransformerEngine's: attention on the
    QKV projection's heads). fp8: runs under FP8 autocast with the guide's DelayedScaling, and is
    checked against `bf16_twin` on the same parameters. standard_promotion: flax.linen's modules
    mix a bf16 input with float32 parameters, which needs JAX's standard dtype promotion.
    recipe: the FP8 recipe of an fp8 row (`fp8_recipe`): "guide" or "fp8_attention"."""

    name: str
    description: str
    family: str
    fp8: bool = False
    bf16_twin: str | None = None
    standard_promotion: bool = False
    recipe: str = "guide"


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("flax", "the guide's FlaxTransformerLayer (plain Flax, float32 parameters)", "flax_mha",
            standard_promotion=True),
    Variant("te_unfused_flax_attention", "TEUnfusedTransformerLayer(use_te_attention=False): flashmesh "
            "LayerNorm, DenseGeneral, activation; Flax's attention", "flax_mha", standard_promotion=True),
    Variant("te_unfused", "TEUnfusedTransformerLayer: flashmesh LayerNorm, DenseGeneral, activation and "
            "DotProductAttention", "te"),
    Variant("te_fused", "TEFusedTransformerLayer in bf16: LayerNormDenseGeneral + LayerNormMLP", "te"),
    Variant("te_unfused_fp8", "TEUnfusedTransformerLayer under FP8 autocast (DelayedScaling, HYBRID, "
            "history 16, max)", "te", fp8=True, bf16_twin="te_unfused"),
    Variant("te_fused_fp8", "TEFusedTransformerLayer under FP8 autocast", "te", fp8=True,
            bf16_twin="te_fused"),
    Variant("transformer_layer", "te_flax.TransformerLayer, the guide's configuration, bf16", "te"),
    Variant("transformer_layer_fp8", "te_flax.TransformerLayer under FP8 autocast", "te", fp8=True,
            bf16_twin="transformer_layer"),
    Variant("transformer_layer_no_attn_dropout", "te_flax.TransformerLayer, the guide's configuration "
            "with attention_dropout=0 (attention on cuDNN; the guide's rows draw flashmesh's dropout "
            "mask, on a Hopper GPU inside pallas_mosaic_gpu), bf16", "te"),
    Variant("transformer_layer_no_attn_dropout_fp8", "the same under FP8 autocast", "te", fp8=True,
            bf16_twin="transformer_layer_no_attn_dropout"),
    Variant("transformer_layer_fp8_attention", "te_flax.TransformerLayer with attention_dropout=0 under "
            "FP8 autocast with FP8 attention (DelayedScaling E4M3, fp8_dpa=True: cuDNN's FP8 attention "
            "forward and backward; XLA's FP8 attention takes no e5m2 gradient, so not HYBRID)", "te",
            fp8=True, bf16_twin="transformer_layer_no_attn_dropout", recipe="fp8_attention"),
    Variant("jax_cudnn", "hand-written JAX layer: bf16 weights, flashmesh.attention(implementation="
            "'cudnn'), no dropout (the ceiling)", "te"),
)}


def fp8_recipe(kind: str = "guide"):
    """"guide": the guide's DelayedScaling(HYBRID, amax_history_len=16, amax_compute_algo='max');
    "fp8_attention": the same history with E4M3 throughout and fp8_dpa=True."""
    from flashmesh.te.recipe import DelayedScaling, Format

    if kind == "fp8_attention":
        return DelayedScaling(fp8_format=Format.E4M3, amax_history_len=16, amax_compute_algo="max",
                              fp8_dpa=True)
    if kind != "guide":
        raise ValueError(f"recipe kind {kind!r} must be 'guide' or 'fp8_attention'")
    return DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")


def attention_detail(shape, dtype, dropout: float, fp8_attention: bool) -> str:
    """Which implementation a TE-structure row's attention call gets on this machine (what
    flashmesh.explain chooses for it), for the report."""
    if fp8_attention:
        return "attention: cuDNN FP8 (fp8_dpa)"
    import flashmesh

    q = jax.ShapeDtypeStruct((shape.B, shape.T, shape.heads, shape.hidden // shape.heads), dtype)
    kw = dict(dropout_rate=dropout, dropout_rng=jax.random.key(0)) if dropout else {}
    chosen = flashmesh.explain(q, q, q, mask="causal", **kw).chosen
    return f"attention: {chosen}" + (f" (dropout {dropout})" if dropout else "")


@dataclasses.dataclass(frozen=True)
class Model:
    """A built row: `init(key, x) -> variables`, `apply(variables, x, deterministic, rngs) -> y`,
    both to be called under `autocast()`. `module` is the Flax module (None for jax_cudnn);
    `heads` and `detail` feed the parameter maps and the report."""

    variant: Variant
    init: Callable[[jax.Array, jax.Array], Any]
    apply: Callable[..., jax.Array]
    autocast_kwargs: dict
    module: Any = None
    heads: int = 0
    detail: str = ""

    def autocast(self):
        return te.autocast(**self.autocast_kwargs)


def build(name: str, shape, dtype, platform: str) -> Model:
    """The row `name` at `shape` (a shapes.LayerShape); `dtype` is the input dtype (and the
    hand-written layer's weights)."""
    if name not in VARIANTS:
        raise ValueError(f"layer variant {name!r} must be one of {sorted(VARIANTS)}")
    variant = VARIANTS[name]
    H, F, N = shape.hidden, shape.ffn, shape.heads
    cast = dict(enabled=True, recipe=fp8_recipe(variant.recipe)) if variant.fp8 else dict(enabled=False)
    if name == "jax_cudnn":
        impl = jax_layer_implementation(platform)
        return Model(variant, lambda key, x: {"params": init_jax_layer(key, H, F, dtype)},
                     lambda v, x, deterministic, rngs: jax_layer(v["params"], x, heads=N, implementation=impl),
                     cast, heads=N, detail=f"attention: {impl or 'automatic (no cuDNN off a GPU)'}")
    base = name.removesuffix("_fp8")
    if base == "flax":
        module = FlaxTransformerLayer(H, F, N)
    elif base in ("te_unfused", "te_unfused_flax_attention"):
        module = TEUnfusedTransformerLayer(H, F, N, use_te_attention=base == "te_unfused")
    elif base == "te_fused":
        module = TEFusedTransformerLayer(H, F, N)
    elif base in ("transformer_layer_no_attn_dropout", "transformer_layer_fp8_attention"):
        module = guide_transformer_layer(H, F, N, attention_dropout=0.0)
    else:
        module = guide_transformer_layer(H, F, N)
    detail = ("" if variant.family == "flax_mha" else
              attention_detail(shape, dtype, module.attention_dropout, variant.recipe == "fp8_attention"))
    # The guide inits with deterministic=False (Flax draws dropout keys from the params key).
    # Unboxed: the rows run on one device, and the checks map the parameters as arrays.
    return Model(variant, lambda key, x: nn.unbox(module.init(key, x, attention_mask=None,
                                                              deterministic=False)),
                 lambda v, x, deterministic, rngs: module.apply(v, x, attention_mask=None,
                                                                deterministic=deterministic, rngs=rngs),
                 cast, module=module, heads=N, detail=detail)
