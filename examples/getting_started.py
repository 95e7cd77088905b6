"""JAX: Getting Started — the reference guide (shared/reference/004), run on flashmesh.

The guide's code in its order, unchanged but for its import lines:

    import transformer_engine.jax as te                 ->  import flashmesh.te as te
    import transformer_engine.jax.flax as te_flax       ->  import flashmesh.te.flax as te_flax
    from transformer_engine.jax.flax.transformer import DotProductAttention as TEDotProductAttention
        ->  from flashmesh.te.flax.transformer import DotProductAttention as TEDotProductAttention
    from transformer_engine.common.recipe import Format, DelayedScaling
        ->  from flashmesh.te.recipe import Format, DelayedScaling

`quickstart_jax_utils` is examples/quickstart_jax_utils.py (flashmesh.bench's speedometer, which
synchronises, and under FP8 autocast writes the FP8 state back every step as training does).
Two additions are marked "flashmesh:": `import sys` and the `--small` block after the layer
configuration, which shrinks the sizes (hidden 64, FFN 256, 4 heads, T 32, B 2) and the timed
steps so that the whole guide runs on a CPU in seconds (the test suite runs it that way).

The guide's classes also live, as the one copy in the package, in
src/flashmesh/bench/layer_models.py (`flashmesh bench --preset layer` times them at any size);
this file is the guide itself, so their text is here a second time, and
tests/examples/test_getting_started.py checks that the two copies are the same.

    python examples/getting_started.py            # the guide's sizes (GPU)
    python examples/getting_started.py --small    # CPU size
"""

import sys  # flashmesh: for --small

import jax
import jax.numpy as jnp
from flax import linen as nn
import quickstart_jax_utils as utils
from typing import Optional

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

# Layer configuration
hidden_size = 4096
sequence_length = 2048
batch_size = 4
ffn_hidden_size = 16384
num_attention_heads = 32
dtype = jnp.bfloat16

if "--small" in sys.argv:  # flashmesh: a size that runs on a CPU in seconds (CI), and few timed steps
    hidden_size, ffn_hidden_size, num_attention_heads = 64, 256, 4
    sequence_length, batch_size = 32, 2
    from flashmesh.bench.speedometer import set_default_iterations
    set_default_iterations(timing_iters=2, warmup_iters=1)

# Synthetic data
key, dropout_key = jax.random.split(jax.random.PRNGKey(42))
x = jax.random.normal(key, (batch_size, sequence_length, hidden_size)).astype(dtype)
dy = jax.random.normal(key, (batch_size, sequence_length, hidden_size)).astype(dtype)

# Initialize the FlaxTransformerLayer
flax_transformer = FlaxTransformerLayer(
    hidden_size=hidden_size,
    ffn_hidden_size=ffn_hidden_size,
    num_attention_heads=num_attention_heads,
)

# Initialize parameters
params = flax_transformer.init(key, x, attention_mask=None, deterministic=False)

print("Pure Flax FlaxTransformerLayer initialized successfully!")
print(f"Parameter shapes: {jax.tree_util.tree_map(lambda x: x.shape, params)}")

# Example usage of forward pass
y = flax_transformer.apply(params, x, attention_mask=None, deterministic=True)
print(f"Input shape: {x.shape}")
print(f"Output shape: {y.shape}")
print(f"Output dtype: {y.dtype}")
print("Forward pass completed successfully!")

import importlib
import quickstart_jax_utils
importlib.reload(quickstart_jax_utils)

utils.speedometer(
    model_apply_fn=flax_transformer.apply,
    variables=params,
    input=x,
    output_grad=dy,
    dropout_key=dropout_key,
    forward_kwargs={"attention_mask": None, "deterministic": False},
)

import flashmesh.te as te
import flashmesh.te.flax as te_flax

from flashmesh.te.flax.transformer import DotProductAttention as TEDotProductAttention


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

te_unfused_transformer_with_flax_MHA = TEUnfusedTransformerLayer(
    hidden_size,
    ffn_hidden_size,
    num_attention_heads,
    use_te_attention=False
)

te_params = te_unfused_transformer_with_flax_MHA.init(key, x, attention_mask=None, deterministic=False)

utils.speedometer(
    model_apply_fn=te_unfused_transformer_with_flax_MHA.apply,
    variables=te_params,  # Ensure the correct `params` is passed
    input=x,
    output_grad=dy,
    dropout_key=dropout_key,
    forward_kwargs={"attention_mask": None, "deterministic": False},
)

te_unfused_transformer = TEUnfusedTransformerLayer(
    hidden_size,
    ffn_hidden_size,
    num_attention_heads,
)

te_params = te_unfused_transformer.init(key, x, attention_mask=None, deterministic=False)

utils.speedometer(
    model_apply_fn=te_unfused_transformer.apply,
    variables=te_params,  # Ensure the correct `params` is passed
    input=x,
    output_grad=dy,
    dropout_key=dropout_key,
    forward_kwargs={"attention_mask": None, "deterministic": False},
)

from flashmesh.te.recipe import Format, DelayedScaling
fp8_format = Format.HYBRID
fp8_recipe = DelayedScaling(fp8_format=fp8_format, amax_history_len=16, amax_compute_algo="max")

with te.autocast(enabled=True, recipe=fp8_recipe):
    te_unfused_params = te_unfused_transformer.init(key, x, attention_mask=None, deterministic=False)

    # Example usage of forward
    y = te_unfused_transformer.apply(te_unfused_params, x, attention_mask=None, deterministic=True)

utils.speedometer(
    model_apply_fn=te_unfused_transformer.apply,
    variables=te_unfused_params,  # Ensure the correct `params` is passed
    input=x,
    output_grad=dy,
    dropout_key=dropout_key,
    forward_kwargs={"attention_mask": None, "deterministic": False},
    autocast_kwargs = { "enabled": True, "recipe": fp8_recipe}
)

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

te_fused_transformer = TEFusedTransformerLayer(
    hidden_size,
    ffn_hidden_size,
    num_attention_heads
)

with te.autocast(enabled=True, recipe=fp8_recipe):
    te_fused_params = te_fused_transformer.init(key, x, attention_mask=None, deterministic=False)
    # Example usage of forward
    y = te_fused_transformer.apply(te_fused_params, x, attention_mask=None, deterministic=True)

utils.speedometer(
    model_apply_fn=te_fused_transformer.apply,
    variables=te_fused_params,
    input=x,
    output_grad=dy,
    dropout_key=dropout_key,
    forward_kwargs={"attention_mask": None, "deterministic": False},
    autocast_kwargs = { "enabled": True, "recipe": fp8_recipe}
)

te_transformer = te_flax.TransformerLayer(
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
    hidden_dropout=0.0
)

with te.autocast(enabled=True, recipe=fp8_recipe):
    te_transformer_params = te_transformer.init(key, x, deterministic=False)
    y = te_transformer.apply(te_transformer_params, x, attention_mask=None, deterministic=True)

utils.speedometer(
    model_apply_fn=te_transformer.apply,
    model_init_fn=te_transformer.init,
    variables=te_transformer_params,
    input=x,
    output_grad=dy,
    dropout_key=dropout_key,
    forward_kwargs={"attention_mask": None, "deterministic": False},
    autocast_kwargs = { "enabled": True, "recipe": fp8_recipe }
)
