"""TransformerEngine's `transformer_engine.jax.flax.transformer.DotProductAttention`.

Same fields and call signature; the module owns what a Flax module must (the learnable sink
parameter, the dropout rng stream) and hands everything else to `flashmesh.te.attention`'s
`fused_attn` mapping, which makes one `flashmesh.attention` call. There is no separate
"unfused" path: flashmesh picks its fastest implementation for the call, and every
configuration runs somewhere.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from flashmesh.nn import partitioning
# TE's module path for these (transformer_engine/jax/flax/transformer.py), the same classes
from flashmesh.nn.multihead import MultiHeadAttention  # noqa: F401
from flashmesh.nn.relative import RelativePositionBiases  # noqa: F401
from flashmesh.nn.transformer import TransformerLayer, TransformerLayerType  # noqa: F401
from flashmesh.te.attention import (AttnBiasType, AttnSoftmaxType, QKVLayout,
                                    SequenceDescriptor, call_native, canonicalize,
                                    check_no_score_mod)
from flashmesh.te.context_parallel import context_parallel


def _heads(layout: QKVLayout, query, key) -> tuple[int, int, int]:
    """(N query heads, K key/value heads, Dqk) of the call's arrays in any layout."""
    kv = query if layout.is_qkvpacked() else key
    return query.shape[-2], kv.shape[-2], query.shape[-1]


class DotProductAttention(nn.Module):
    """Scaled dot-product attention over already-projected heads (TransformerEngine's fields).

    Attributes:
      head_dim: per-head dimension of queries and keys (Dqk; values may differ, MLA).
      num_attention_heads: query heads N.
      num_gqa_groups: key/value heads K (None = N; 1 = MQA).
      attention_dropout: dropout rate on the attention probabilities.
      attn_mask_type: 'no_mask', 'padding', 'causal', 'padding_causal',
        'causal_bottom_right', 'padding_causal_bottom_right' (or an AttnMaskType).
      attn_bias_type: None (post-scale when a bias is passed), 'no_bias', 'pre_scale_bias',
        'post_scale_bias'.
      dtype: deprecated in TransformerEngine; if set it must equal the inputs' dtype.
      dropout_rng_name: the rng stream dropout draws from (`apply(..., rngs={name: key})`).
        Inside `shard_map` the key folds in the shard's index over the mesh axes the inputs
        are sharded on, TransformerEngine's per-device seed (`te.attention.per_shard_key`).
      float32_logits: accepted for compatibility; logits are always computed in float32.
      qkv_layout: 'bshd_bshd_bshd', 'bs3hd' (query is [b, s, 3, h, d]), 'bshd_bs2hd' (key is
        [b, s, 2, h, d]) or the packed-sequence 't3hd', 'thd_t2hd', 'thd_thd_thd'.
      scale_factor: logit scale, default 1 / sqrt(head dim of the queries).
      transpose_batch_sequence: inputs are [s, b, ...] instead of [b, s, ...].
      window_size: (left, right) sliding window, -1 unbounded, None = none.
      max_segments_per_seq: bound on packed sequences per THD row.
      context_parallel_axis: mesh axis the sequence is sharded over ("": the current
        MeshResource's cp_resource); with size > 1 in the ambient mesh (`jax.set_mesh`) the
        call is `flashmesh.context_parallel_attention` on global, sequence-sharded arrays.
      context_parallel_strategy: 'DEFAULT' (flashmesh's cost model chooses), 'ALL_GATHER'
        (or 'ALLGATHER') or 'RING', any case, or a CPStrategy.
      context_parallel_causal_load_balanced: the inputs (and the descriptor's ids and
        positions) were reordered by `reorder_causal_load_balancing` with DualChunkSwap.
        As in TransformerEngine there is no stripe_size field, so THD layouts, which are
        balanced by Striped, need `fused_attn` for that (ValueError here).
      context_checkpoint_name: remat name of the output.
      softmax_type: 'vanilla', 'off_by_one' or 'learnable' (creates the float32 parameter
        "softmax_offset" [1, N, 1, 1], initialised to 0, which gets a gradient).
      score_mod, score_mod_bprop: not supported (NotImplementedError).
      reproducible: flashmesh's, not TE's: bit-identical outputs and gradients run to run
        (`flashmesh.attention(reproducible=True)`).

    Call: `module(query, key, value, sequence_descriptor=None, bias=None, *, deterministic=False)`
    returns [b, s, N, Dv] (or [s, b, N, Dv]) in the query dtype; padding mask types and THD
    layouts need `sequence_descriptor`.
    """

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: int | None = None
    attention_dropout: float = 0.0
    attn_mask_type: Any = "causal"
    attn_bias_type: Any = None
    dtype: Any = None
    dropout_rng_name: str = "dropout"
    float32_logits: bool = False
    qkv_layout: Any = "bshd_bshd_bshd"
    scale_factor: float | None = None
    transpose_batch_sequence: bool = False
    window_size: tuple[int, int] | None = None
    max_segments_per_seq: int = 1
    context_parallel_causal_load_balanced: bool = False
    context_parallel_axis: str = ""
    context_parallel_strategy: Any = "DEFAULT"
    context_checkpoint_name: str = "context"
    softmax_type: Any = "vanilla"
    score_mod: Callable | None = None
    score_mod_bprop: Callable | None = None
    reproducible: bool = False

    def _check_shapes(self, layout: QKVLayout, query, key) -> None:
        N, K, Dqk = _heads(layout, query, key)
        if N != self.num_attention_heads:
            raise ValueError(f"query has {N} heads but num_attention_heads={self.num_attention_heads}")
        if self.num_gqa_groups is not None and K != self.num_gqa_groups:
            raise ValueError(f"key/value have {K} heads but num_gqa_groups={self.num_gqa_groups}")
        if Dqk != self.head_dim:
            raise ValueError(f"query head dim is {Dqk} but head_dim={self.head_dim}")
        if self.dtype is not None and jnp.dtype(self.dtype) != query.dtype:
            raise ValueError(f"dtype={jnp.dtype(self.dtype).name} (deprecated) must match the "
                             f"inputs' dtype {query.dtype}")

    @nn.compact
    def __call__(self, query: jax.Array, key: jax.Array | None = None,
                 value: jax.Array | None = None,
                 sequence_descriptor: SequenceDescriptor | None = None,
                 bias: jax.Array | None = None, *, deterministic: bool = False,
                 mask: SequenceDescriptor | None = None, score_mod_tensors=None,
                 score_mod_bprop_tensors=None) -> jax.Array:
        """query/key/value as `qkv_layout` says (the packed operand in `query` or `key`, the
        others ignored); `mask` is TransformerEngine's deprecated name for the descriptor."""
        check_no_score_mod(score_mod=self.score_mod, score_mod_bprop=self.score_mod_bprop,
                            score_mod_tensors=score_mod_tensors,
                            score_mod_bprop_tensors=score_mod_bprop_tensors)
        if mask is not None:
            if sequence_descriptor is not None:
                raise ValueError("sequence_descriptor and mask cannot both be given")
            sequence_descriptor = mask
        layout = canonicalize(QKVLayout, self.qkv_layout, "qkv_layout")
        self._check_shapes(layout, query, key)
        # TransformerEngine's module has no stripe_size: load balanced means DualChunkSwap.
        cp = context_parallel(self.context_parallel_strategy,
                              self.context_parallel_causal_load_balanced,
                              self.context_parallel_axis, None, layout)
        if self.attn_bias_type is None:
            bias_type = AttnBiasType.NO_BIAS if bias is None else AttnBiasType.POST_SCALE_BIAS
        else:
            bias_type = canonicalize(AttnBiasType, self.attn_bias_type, "attn_bias_type")
        if bias is not None:
            bias = bias.astype(query.dtype)
        softmax = canonicalize(AttnSoftmaxType, self.softmax_type, "softmax_type")

        softmax_offset = None
        if softmax == AttnSoftmaxType.LEARNABLE_SOFTMAX:
            softmax_offset = partitioning.param(self, "softmax_offset", nn.initializers.zeros,
                                                (1, self.num_attention_heads, 1, 1), jnp.float32,
                                                (None, partitioning.HEAD_AXES, None, None))
        seed = None
        if not deterministic and self.attention_dropout > 0.0:
            seed = self.make_rng(self.dropout_rng_name)
        scale = self.scale_factor if self.scale_factor is not None else query.shape[-1] ** -0.5

        qkv = (query, key, value)[:layout.num_arrays]
        return call_native(
            qkv, bias, sequence_descriptor, seed, sequence_major=self.transpose_batch_sequence,
            context_checkpoint_name=self.context_checkpoint_name, attn_bias_type=bias_type,
            attn_mask_type=self.attn_mask_type, qkv_layout=layout, softmax_type=softmax,
            scaling_factor=scale, dropout_probability=self.attention_dropout,
            is_training=not deterministic, max_segments_per_seq=self.max_segments_per_seq,
            window_size=self.window_size, softmax_offset=softmax_offset, context_parallel=cp,
            module=self, reproducible=self.reproducible)


def extend_logical_axis_rules(rules):
    """`rules` (Flax logical axis rules: (logical name, mesh axis or None) pairs) followed by TE's
    logical names mapped to the current MeshResource's mesh axes
    (`te.sharding.get_sharding_map_logic_axis_to_mesh_axis`; none without a mesh), the names
    TransformerLayer and MultiHeadAttention give their weights. A name both in `rules` and in
    TE's map must map to the same axis there (ValueError otherwise), as TE asserts.

    Example:
        >>> resource = MeshResource(dp_resource="data", tp_resource="model")
        >>> with jax.set_mesh(mesh), te.autocast(mesh_resource=resource):
        ...     rules = extend_logical_axis_rules(())
        ...     shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    """
    from flashmesh.te.sharding import get_sharding_map_logic_axis_to_mesh_axis

    given: dict[str, list] = {}
    for item in rules:
        if len(item) != 2 or not isinstance(item[0], str) or not (item[1] is None or isinstance(item[1], str)):
            raise ValueError(f"each rule must be (logical axis name, mesh axis name or None), got {item!r}")
        given.setdefault(item[0], []).append(item[1])
    extended = list(rules)
    for name, axis in get_sharding_map_logic_axis_to_mesh_axis().items():
        if name in given:
            if given[name] != [axis]:
                raise ValueError(f"rules map {name!r} to {given[name]}, TE's rules to {axis!r}")
        else:
            extended.append((name, axis))
    return tuple(extended)
