"""A small decoder-only GPT over bytes, built from flashmesh's TransformerEngine-named modules.

token embedding (+ learned positions, or rotary inside attention) -> N x
`flashmesh.te.flax.TransformerLayer` (pre-LayerNorm, causal self-attention) -> final
`flashmesh.te.flax.LayerNorm` -> output projection (the embedding's transpose when tied,
else a `flashmesh.te.flax.DenseGeneral`) -> logits.

Parameters are float32; activations are bfloat16 (the embedding returns bf16 and the TE
modules compute in their input's dtype), logits come back in float32 for the loss. Under
`flashmesh.te.autocast(enabled=True, ...)` the layers' GEMMs run in FP8; the embedding and a
tied output projection stay bf16 (as TransformerEngine's own GPT examples keep them).

Shapes: B batch, T sequence length, H hidden size, V vocabulary (256 bytes).

Example:
  >>> config = GPTConfig(layers=2, hidden=128, seq=64)
  >>> model = GPT(config)
  >>> tokens = jnp.zeros((4, 64), jnp.int32)
  >>> variables = model.init(jax.random.key(0), tokens)
  >>> logits = model.apply(variables, tokens)          # float32 [4, 64, 256]
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn
from jaxtyping import Array, Float, Int

from flashmesh.train.data import VOCAB

POSITIONS = ("learned", "rotary")
LAYERNORM_TYPES = ("layernorm", "rmsnorm")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The model's shape.

    layers: number of TransformerLayers.
    hidden: model width H.
    seq: the longest sequence T (learned positions are this long).
    heads: attention heads; None means hidden // 64 (64-wide heads).
    mlp_hidden: the MLP's inner width; None means 4 * hidden.
    positions: 'learned' (an embedding added to the tokens') or 'rotary' (the layers' RoPE).
    tied: the output projection is the token embedding's transpose (else its own kernel).
    layernorm_type: 'layernorm' or 'rmsnorm', for the layers and the final norm.
    dropout: hidden and attention dropout rate of the layers (0 for these short runs).
    """

    layers: int = 4
    hidden: int = 768
    seq: int = 512
    heads: int | None = None
    mlp_hidden: int | None = None
    positions: str = "learned"
    tied: bool = True
    layernorm_type: str = "layernorm"
    dropout: float = 0.0

    def __post_init__(self):
        for name in ("layers", "hidden", "seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.heads is None and self.hidden % 64:
            raise ValueError(f"hidden={self.hidden} must be a multiple of 64 when heads is None "
                             "(64-wide heads); pass heads explicitly")
        if self.heads is not None and (not isinstance(self.heads, int) or self.heads < 1
                                       or self.hidden % self.heads):
            raise ValueError(f"heads={self.heads!r} must be a positive int dividing hidden={self.hidden}")
        if self.mlp_hidden is not None and (not isinstance(self.mlp_hidden, int) or self.mlp_hidden < 1):
            raise ValueError(f"mlp_hidden must be a positive int or None, got {self.mlp_hidden!r}")
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {self.positions!r}")
        if self.layernorm_type not in LAYERNORM_TYPES:
            raise ValueError(f"layernorm_type must be one of {LAYERNORM_TYPES}, got {self.layernorm_type!r}")
        if not isinstance(self.tied, bool):
            raise ValueError(f"tied must be a bool, got {self.tied!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def num_heads(self) -> int:
        return self.heads if self.heads is not None else self.hidden // 64

    @property
    def mlp_width(self) -> int:
        return self.mlp_hidden if self.mlp_hidden is not None else 4 * self.hidden

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), num_heads=self.num_heads, mlp_width=self.mlp_width)


class ByteEmbed(nn.Embed):
    """`nn.Embed` (same parameter, same `attend`) whose lookup is a one-hot GEMM: for 16-bit
    dtypes (the GPT's bf16) the same values (one nonzero term per output element; a float32
    GEMM at a GPU's default precision may round the table to TF32), but its gradient is the GEMM onehotᵀ dx
    where the gather's is a scatter-add of every token into 256 rows, which a GPU serialises
    on the repeated rows (46 ms of a 70 ms training step on the H200, probe_train.py,
    2026-12-02)."""

    def __call__(self, inputs):
        table = self.embedding.astype(self.dtype)
        return jax.nn.one_hot(inputs, self.num_embeddings, dtype=self.dtype) @ table


class GPT(nn.Module):
    """Decoder-only byte-level GPT (see the module docstring).

    Attributes:
      config: the model's shape (GPTConfig).
    """

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: Int[Array, "B T"], deterministic: bool = True) -> Float[Array, "B T V"]:
        """Next-byte logits, float32 [B, T, 256], for int tokens [B, T] (T <= config.seq).

        deterministic: no dropout (evaluation); training passes False and an rng named 'dropout'.
        """
        from flashmesh.te import flax as te_flax  # at call time: the layers live in flashmesh.te

        c = self.config
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be an int array [B, T], got {tokens.dtype} {tokens.shape}")
        if tokens.shape[1] > c.seq:
            raise ValueError(f"tokens are {tokens.shape[1]} long; config.seq={c.seq} is the longest")
        init = nn.initializers.normal(stddev=0.02)
        embed = ByteEmbed(VOCAB, c.hidden, embedding_init=init, dtype=jnp.bfloat16,
                          param_dtype=jnp.float32, name="embed")
        x = embed(tokens)  # bf16 [B, T, H]
        if c.positions == "learned":
            where = nn.Embed(c.seq, c.hidden, embedding_init=init, dtype=jnp.bfloat16,
                             param_dtype=jnp.float32, name="positions")
            x = x + where(jnp.arange(tokens.shape[1]))[None]
        for i in range(c.layers):
            x = te_flax.TransformerLayer(
                hidden_size=c.hidden, mlp_hidden_size=c.mlp_width, num_attention_heads=c.num_heads,
                layernorm_type=c.layernorm_type, hidden_dropout=c.dropout, attention_dropout=c.dropout,
                mlp_activations=("gelu",), self_attn_mask_type="causal", enable_relative_embedding=False,
                enable_rotary_pos_emb=c.positions == "rotary", use_bias=False, dtype=jnp.float32,
                scale_attn_logits=True, scaled_query_init=False,  # GPT's 1/sqrt(d) logits, not T5's
                transpose_batch_sequence=False, name=f"layer_{i}")(x, deterministic=deterministic)
        x = te_flax.LayerNorm(layernorm_type=c.layernorm_type, dtype=jnp.float32, name="final_norm")(x)
        if c.tied:
            logits = embed.attend(x)  # bf16 x @ embedding^T
        else:
            logits = te_flax.DenseGeneral(features=VOCAB, use_bias=False, dtype=jnp.float32, name="head")(x)
        return logits.astype(jnp.float32)


def next_byte_loss(logits: Float[Array, "B T V"], targets: Int[Array, "B T"]) -> Float[Array, ""]:
    """Mean cross-entropy (nats per byte) of the targets under the logits, in float32."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {logits.shape} must be targets {targets.shape} + (vocab,)")
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return -jnp.mean(picked)


def count_params(params) -> int:
    """Number of scalars in a parameter tree."""
    return int(sum(x.size for x in jax.tree.leaves(params)))
