"""`TransformerLayer`: TransformerEngine's encoder / decoder layer (fields, defaults, call).

    encoder:  x = x + drop(attention(x))                  (self-attention, relative bias)
              x = x + drop(mlp(x))
    decoder:  x = x + drop(self_attention(x))             (unidirectional relative bias)
              x = x + drop(encoder_decoder_attention(x, encoded))
              x = x + drop(mlp(x))

Each block normalises its input first (the LayerNorm fused into its first projection);
`apply_residual_connection_post_layernorm` takes the residual from that LayerNorm's output
instead of its input, and `output_layernorm` moves the self-attention's LayerNorm to the end
of the layer ("post-LN"; the MLP and the cross-attention keep theirs, as in TE). "drop" is the
hidden dropout (`hidden_dropout`, shared along `hidden_dropout_dims`) then stochastic depth
(`drop_path`: one draw per batch row), the latter after the self-attention and the MLP.

Submodules carry TE's (T5X's) names: relpos_bias, attention (encoder) or self_attention and
encoder_decoder_attention (decoder), mlp, output_layernorm. Masks follow MultiHeadAttention
(True = masked out; see flashmesh.nn.multihead): `attention_mask` is read for padding
self_attn_mask_types only, `encoder_decoder_mask` always (the cross-attention's type is
'padding'; None means no padding).
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Sequence

import jax.numpy as jnp
from flax import linen as nn
from jaxtyping import Array, Float

from flashmesh.nn import partitioning as P
from flashmesh.nn.dropout import Dropout
from flashmesh.nn.layernorm import LayerNorm
from flashmesh.nn.mlp import LayerNormMLP
from flashmesh.nn.multihead import MultiHeadAttention, lora_scope
from flashmesh.nn.relative import RelativePositionBiases

__all__ = ["TransformerLayer", "TransformerLayerType"]


class TransformerLayerType(enum.Enum):
    """ENCODER: self-attention and MLP; DECODER: adds cross-attention over `encoded`."""

    ENCODER = "encoder"
    DECODER = "decoder"


class TransformerLayer(nn.Module):
    """One transformer layer (TransformerEngine's `TransformerLayer`).

    Shapes: inputs [B, T, E] ([T, B, E] with transpose_batch_sequence), E = hidden_size;
    encoded [B, S, E] for decoders; masks [B, 1, T, T] and [B, 1, T, S] (True = masked out).

    Attributes (TE's defaults):
      hidden_size (512), mlp_hidden_size (2048), num_attention_heads (8), num_gqa_groups (None).
      layernorm_type ('layernorm'), layernorm_epsilon (1e-6), zero_centered_gamma (False).
      hidden_dropout (0.1), hidden_dropout_dims (()): dropout on each block's output.
      attention_dropout (0.1): on the attention probabilities.
      intermediate_dropout (0.0), intermediate_dropout_dims (()): on the MLP's activation.
      dropout_rng_name ('dropout'): the rng stream of every dropout.
      mha_kernel_init (None: variance_scaling(1, 'fan_in', 'normal')), mlp_kernel_init (None:
        LayerNormMLP's variance_scaling(1, 'fan_in', 'truncated_normal')).
      mlp_activations (('gelu',)): one activation or a gated pair, e.g. ('silu', 'linear').
      mlp_activation_params (None), use_bias (False), bias_init (zeros).
      apply_residual_connection_post_layernorm (False), output_layernorm (False).
      float32_attention_logits (False): accepted; flashmesh's logits are float32 anyway.
      layer_type (ENCODER), self_attn_mask_type ('causal'), self_attn_bias_type (None).
      enable_relative_embedding (True), relative_embedding (None: RelativePositionBiases(32
        buckets, max_distance 128, variance_scaling(1, 'fan_avg', 'uniform')), a module
        called (q_len, k_len, bidirectional) -> [1, N, T, S]).
      enable_rotary_pos_emb (False), rotary_pos_emb_windows ((1, 10000)),
        rotary_pos_emb_group_method ('consecutive').
      low_rank_adaptation_scope ('none'), _dim (32), _alpha (None): TE's LoRA on the attention
        projections and the MLP's two GEMMs, as the scope names them ('all', 'mlp', ...).
      dtype (float32): the parameters' dtype; computation follows the inputs'.
      drop_path (0.0), fuse_qkv_params (True), transpose_batch_sequence (False),
      enable_sequence_parallel (False; True raises NotImplementedError), scale_attn_logits
      (False), scaled_query_init (True), window_size (None), softmax_type ('vanilla'),
      score_mod, score_mod_bprop (None; anything else raises NotImplementedError).
      reproducible: flashmesh's, not TE's: both attentions bit-identical run to run
        (`flashmesh.attention(reproducible=True)`).

    Call: `(inputs, encoded=None, attention_mask=None, encoder_decoder_mask=None,
    deterministic=False, decode=False, max_decode_length=None)` -> [B, T, E] in the inputs'
    dtype. Decoding (decoders only) keeps MultiHeadAttention's cache; max_decode_length sizes
    the relative bias, which each step slices to its rows; rotary embeddings place a step's
    tokens at the cache index in both attentions, so decoding token by token equals the
    full pass.

    Example:
      >>> layer = TransformerLayer(hidden_size=64, mlp_hidden_size=256, num_attention_heads=4)
      >>> variables = layer.init({"params": key, "dropout": key}, x)       # x [B, T, 64]
      >>> y = layer.apply(variables, x, deterministic=True)
    """

    hidden_size: int = 512
    mlp_hidden_size: int = 2048
    num_attention_heads: int = 8
    num_gqa_groups: int | None = None
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    hidden_dropout: float = 0.1
    hidden_dropout_dims: Sequence[int] = ()
    attention_dropout: float = 0.1
    intermediate_dropout: float = 0.0
    intermediate_dropout_dims: Sequence[int] = ()
    dropout_rng_name: str = "dropout"
    mha_kernel_init: Callable | None = None
    mlp_kernel_init: Callable | None = None
    mlp_activations: Sequence[str] = ("gelu",)
    mlp_activation_params: dict | None = None
    use_bias: bool = False
    bias_init: Callable = nn.initializers.zeros
    apply_residual_connection_post_layernorm: bool = False
    output_layernorm: bool = False
    float32_attention_logits: bool = False
    layer_type: TransformerLayerType = TransformerLayerType.ENCODER
    self_attn_mask_type: str = "causal"
    self_attn_bias_type: str | None = None
    enable_relative_embedding: bool = True
    relative_embedding: nn.Module | None = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: tuple[float, float] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    low_rank_adaptation_scope: str = "none"
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    dtype: Any = jnp.float32
    drop_path: float = 0.0
    fuse_qkv_params: bool = True
    transpose_batch_sequence: bool = False
    enable_sequence_parallel: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    window_size: tuple[int, int] | None = None
    softmax_type: str = "vanilla"
    score_mod: Callable | None = None
    score_mod_bprop: Callable | None = None
    reproducible: bool = False

    def _check(self, inputs, encoded, decode: bool) -> None:
        if not isinstance(self.layer_type, TransformerLayerType):
            raise ValueError(f"layer_type must be a TransformerLayerType, got {self.layer_type!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be a multiple of "
                             f"num_attention_heads={self.num_attention_heads}")
        if inputs.ndim != 3 or inputs.shape[-1] != self.hidden_size:
            raise ValueError(f"inputs must be [B, T, hidden_size={self.hidden_size}], got "
                             f"{inputs.shape}")
        decoder = self.layer_type == TransformerLayerType.DECODER
        if decode and not decoder:
            raise ValueError("decode=True needs layer_type=TransformerLayerType.DECODER")
        if decoder and encoded is None:
            raise ValueError("layer_type=DECODER needs encoded= (the encoder's output)")
        if any(not -inputs.ndim <= d < inputs.ndim for d in self.hidden_dropout_dims):
            raise ValueError(f"hidden_dropout_dims={tuple(self.hidden_dropout_dims)} must be "
                             f"axes of the {inputs.ndim}-D input")

    def _attention(self, name: str, *, mask_type, bias_type, input_layernorm: bool):
        return MultiHeadAttention(
            head_dim=self.hidden_size // self.num_attention_heads,
            num_attention_heads=self.num_attention_heads, num_gqa_groups=self.num_gqa_groups,
            attention_dropout=self.attention_dropout, dropout_rng_name=self.dropout_rng_name,
            input_layernorm=input_layernorm, layernorm_type=self.layernorm_type,
            layernorm_epsilon=self.layernorm_epsilon,
            return_layernorm_output=self.apply_residual_connection_post_layernorm,
            zero_centered_gamma=self.zero_centered_gamma, kernel_init=self.mha_kernel_init,
            use_bias=self.use_bias, bias_init=self.bias_init, attn_mask_type=mask_type,
            attn_bias_type=bias_type, enable_rotary_pos_emb=self.enable_rotary_pos_emb,
            rotary_pos_emb_windows=self.rotary_pos_emb_windows,
            rotary_pos_emb_group_method=self.rotary_pos_emb_group_method,
            low_rank_adaptation_scope=self.low_rank_adaptation_scope,
            low_rank_adaptation_dim=self.low_rank_adaptation_dim,
            low_rank_adaptation_alpha=self.low_rank_adaptation_alpha, dtype=self.dtype,
            fuse_qkv_params=self.fuse_qkv_params,
            transpose_batch_sequence=self.transpose_batch_sequence,
            enable_sequence_parallel=self.enable_sequence_parallel,
            scale_attn_logits=self.scale_attn_logits, scaled_query_init=self.scaled_query_init,
            float32_logits=self.float32_attention_logits, window_size=self.window_size,
            softmax_type=self.softmax_type, score_mod=self.score_mod,
            score_mod_bprop=self.score_mod_bprop, reproducible=self.reproducible, name=name)

    def _relative_bias(self, inputs, decode: bool, max_decode_length):
        if not self.enable_relative_embedding:
            return None
        rel = self.relative_embedding or RelativePositionBiases(
            num_buckets=32, max_distance=128, num_attention_heads=self.num_attention_heads,
            embedding_init=nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
            dtype=self.dtype, name="relpos_bias")
        length = inputs.shape[0 if self.transpose_batch_sequence else 1]
        if self.layer_type == TransformerLayerType.ENCODER:
            return rel(length, length, True)
        if decode and max_decode_length:
            length = max_decode_length
        return rel(length, length, False)

    def _dropout(self, x, deterministic: bool, drop_path: bool):
        """Hidden dropout, then stochastic depth (one draw per batch row) when `drop_path`."""
        x = Dropout(rate=self.hidden_dropout, broadcast_dims=tuple(self.hidden_dropout_dims),
                    rng_collection=self.dropout_rng_name)(x, deterministic=deterministic)
        if drop_path and self.drop_path > 0.0:
            batch_axis = 1 if self.transpose_batch_sequence else 0
            dims = tuple(d for d in range(x.ndim) if d != batch_axis)
            x = Dropout(rate=self.drop_path, broadcast_dims=dims,
                        rng_collection=self.dropout_rng_name)(x, deterministic=deterministic)
        return x

    def _residual(self, inputs, ln_out):
        if not self.apply_residual_connection_post_layernorm:
            return inputs
        if ln_out is None:  # TE asserts the same
            raise ValueError("apply_residual_connection_post_layernorm needs the block's "
                             "LayerNorm output, and this block returned none")
        return ln_out

    @nn.compact
    def __call__(self, inputs: Float[Array, "B T E"], encoded: Float[Array, "B S E"] | None = None,
                 attention_mask=None, encoder_decoder_mask=None, deterministic: bool = False,
                 decode: bool = False, max_decode_length: int | None = None):
        self._check(inputs, encoded, decode)
        decoder = self.layer_type == TransformerLayerType.DECODER
        bias = self._relative_bias(inputs, decode, max_decode_length)
        # A decode step's tokens sit at the self-attention's cache index; the cross-attention's
        # rotary embedding places its queries there too (TE rotates them at 0 .. T-1).
        cache = self.variables.get("cache", {}).get("self_attention", {})
        positions = None
        if decode and "cache_index" in cache:
            T = inputs.shape[0 if self.transpose_batch_sequence else 1]
            positions = cache["cache_index"].astype(jnp.int32) + jnp.arange(T, dtype=jnp.int32)

        x, ln_out = self._attention(
            "self_attention" if decoder else "attention", mask_type=self.self_attn_mask_type,
            bias_type=self.self_attn_bias_type, input_layernorm=not self.output_layernorm)(
                inputs, inputs, attention_mask, bias, deterministic=deterministic, decode=decode)
        x = self._dropout(x, deterministic, drop_path=True) + self._residual(inputs, ln_out)

        if decoder:
            y, ln_out = self._attention("encoder_decoder_attention", mask_type="padding",
                                        bias_type="no_bias", input_layernorm=True)(
                x, encoded, encoder_decoder_mask, deterministic=deterministic, positions=positions)
            x = self._dropout(y, deterministic, drop_path=False) + self._residual(x, ln_out)

        z, ln_out = LayerNormMLP(
            intermediate_dim=self.mlp_hidden_size, layernorm_type=self.layernorm_type,
            epsilon=self.layernorm_epsilon, zero_centered_gamma=self.zero_centered_gamma,
            scale_axes=(P.W_NO_SHARD_AXES,), ln_bias_axes=(P.W_NO_SHARD_AXES,),
            kernel_init=self.mlp_kernel_init,
            kernel_axes_1=(P.W_FSDP_AXES, P.W_JOINED_AXES, P.W_TP_AXES),
            kernel_axes_2=(P.W_TP_AXES, P.W_FSDP_AXES), use_bias=self.use_bias,
            bias_init=self.bias_init, bias_axes_1=(P.W_JOINED_AXES, P.W_TP_AXES),
            bias_axes_2=(P.W_NO_SHARD_AXES,),
            return_layernorm_output=self.apply_residual_connection_post_layernorm,
            activations=tuple(self.mlp_activations), activation_params=self.mlp_activation_params,
            intermediate_dropout_rng_name=self.dropout_rng_name,
            intermediate_dropout_rate=self.intermediate_dropout,
            intermediate_hidden_dropout_dims=tuple(self.intermediate_dropout_dims),
            enable_low_rank_adaptation="mlp" in lora_scope(self.low_rank_adaptation_scope),
            low_rank_adaptation_dim=self.low_rank_adaptation_dim,
            low_rank_adaptation_alpha=self.low_rank_adaptation_alpha,
            dtype=self.dtype, transpose_batch_sequence=self.transpose_batch_sequence,
            name="mlp")(x, deterministic=deterministic)
        z = self._dropout(z, deterministic, drop_path=True) + self._residual(x, ln_out)

        if self.output_layernorm:
            z = LayerNorm(epsilon=self.layernorm_epsilon, layernorm_type=self.layernorm_type,
                          zero_centered_gamma=self.zero_centered_gamma,
                          scale_axes=(P.W_NO_SHARD_AXES,), bias_axes=(P.W_NO_SHARD_AXES,),
                          dtype=self.dtype, name="output_layernorm")(z)
        return z
