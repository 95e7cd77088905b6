"""`MultiHeadAttention`: TransformerEngine's module (fields, defaults, parameter tree, call).

    [LayerNorm] -> Q, K, V projections -> [RoPE] -> flashmesh.attention -> output projection

Every projection is one of flashmesh.nn's dense modules (so FP8 autocast covers it); the
attention is one `flashmesh.attention` call made through `flashmesh.te.attention.call_native`,
the same mapping of TE's option names that `te.flax.DotProductAttention` uses.

Parameters (TE's names, boxed with TE's logical axes as `flashmesh.nn.partitioning` says;
the axes in parentheses, fsdp / joined / tp / no_shard standing for nvte_w_fsdp, ...):
  fuse_qkv_params and self-attention without GQA: qkv/{scale, ln_bias (no_shard),
    kernel [E, 3, N*H] (fsdp, joined, tp), bias [3, N*H] (joined, tp)};
  otherwise query/{scale, ln_bias, kernel [E, N*H] (fsdp, tp), bias (tp)}, then
    kv/kernel [E, 2, K*H] (fsdp, joined, tp) when fused, or key/ and value/ kernels
    [E, K*H] (fsdp, tp) when not; out/kernel [N*H, E] (tp, fsdp), out/bias (no_shard);
  softmax_type 'learnable': softmax_offset [1, N, 1, 1] (None, nvte_head, None, None), float32,
    directly under the module (TE nests it in DotProductAttention_0/_FusedDotProductAttention_0/).
Differences from TE a checkpoint or caller may meet: the second output (ln_out) is the
LayerNorm output only when return_layernorm_output=True (TE also returns it on its unfused
and GQA paths); no sharding constraints on the activations (TE adds them from the logical
axes); `positions` is [B, T] (or [T, B] with transpose_batch_sequence).

Masks. `mask` follows TE: a boolean [B, 1, T, S] array in which True means *masked out*, read
only for the padding types ('padding', 'padding_causal', ...) and ignored for 'no_mask' and
'causal', as TE documents. A padding mask becomes per-row sequence lengths (a query counts if
it sees any key, a key if any query sees it): `SequenceDescriptor.from_seqlens`, the form the
fused kernels take, exactly as TE's fused attention reads masks. So padding must trail each
sequence; when the mask is concrete (outside jit) any other pattern is refused with a
ValueError, under jit the rows of any other pattern come out NaN (never silently wrong: lengths
cannot express them, and a traced mask cannot raise). The causal part comes from the mask
type, so a mask may include it or not. A query that sees no key returns exactly 0 (zero
gradient). A padding type with mask=None means no padding. Other patterns: pass a bias.

Decode (`decode=True`). The first call (`init`) creates TE's 'cache' collection: cached_key,
cached_value [B, L, K, H] (the init input's length L, input dtype) and cache_index (int32).
Each later call appends its T new tokens at cache_index and attends over the cache: keys at
positions < cache_index + T, causally by absolute position for causal types, with the
window and padding mask applied as in the full pass; a bias of L rows is sliced to the new
tokens' rows. Unlike TE, rotary embeddings use the tokens' absolute positions (cache_index +
i; TE rotates each step at position 0), so decoding token by token equals the full causal
pass (and, unlike TE, causal types decode correctly without a padding mask); outputs
therefore differ from TE's in decode. The caller keeps cache_index + T <= L.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from flashmesh.attention.sequence import SequenceDescriptor, concrete
from flashmesh.nn import partitioning as P
from flashmesh.nn.dense import DenseGeneral, LayerNormDenseGeneral
from flashmesh.nn.rotary import canonical_group_method, rotary_pos_emb

__all__ = ["MultiHeadAttention", "padding_descriptor", "lora_scope"]


LORA_SCOPES = {"none": (), "all": ("qkv", "out", "mlp"), "qkv_proj": ("qkv",),
               "output_proj": ("out",), "mlp": ("mlp",), "exclude_qkv_proj": ("out", "mlp"),
               "exclude_output_proj": ("qkv", "mlp"), "exclude_mlp": ("qkv", "out")}


def lora_scope(scope: str | None) -> tuple[str, ...]:
    """TE's low_rank_adaptation_scope as the projections it adapts ('qkv', 'out', 'mlp')."""
    name = "none" if scope is None else scope.lower() if isinstance(scope, str) else scope
    if name not in LORA_SCOPES:
        raise ValueError(f"low_rank_adaptation_scope={scope!r} must be one of {list(LORA_SCOPES)}")
    return LORA_SCOPES[name]


def _te():
    """flashmesh.te.attention, imported at call time: the flashmesh.te package imports
    flashmesh.te.flax, which re-exports this module (an import-time cycle otherwise)."""
    from flashmesh.te import attention
    return attention


def _visible(mask, B: int, T: int, S: int) -> jax.Array:
    """bool [B, T, S], True where a query may see a key, from TE's mask (True = masked out)."""
    mask = jnp.asarray(mask)
    if mask.ndim != 4 or mask.shape[1] != 1 or any(
            m not in (1, n) for m, n in zip(mask.shape, (B, 1, T, S))):
        raise ValueError(f"mask shape {mask.shape} must be [B, 1, T, S] = [{B}, 1, {T}, {S}] "
                         "(1 broadcasts)")
    return jnp.broadcast_to(jnp.logical_not(mask.astype(jnp.bool_)), (B, 1, T, S))[:, 0]


def padding_descriptor(mask, B: int, T: int, S: int, *, causal: bool,
                       bottom_right: bool) -> SequenceDescriptor:
    """TE's padding mask [B, 1, T, S] (True = masked out) as per-row sequence lengths.

    q length: up to the last query that sees any key; kv length: up to the last key that any
    query sees (so a mask may include the causal part or not, in either alignment). On a concrete
    mask, checks that it is trailing padding (within the causal structure when `causal`);
    under jit `MultiHeadAttention` makes the rows of any other pattern NaN (`_padding`)."""
    return _padding(mask, B, T, S, causal=causal, bottom_right=bottom_right)[0]


def _padding(mask, B: int, T: int, S: int, *, causal: bool, bottom_right: bool):
    """(padding_descriptor's descriptor, bool [B]: rows whose traced mask is not trailing
    padding, or None for a concrete mask, checked here)."""
    visible = _visible(mask, B, T, S)

    def length(seen, n):  # one past the last position that sees (or is seen by) any: under a
        # bottom-right causal mask with T > S the first queries see nothing yet are in the sequence
        return jnp.max(jnp.where(seen, jnp.arange(1, n + 1, dtype=jnp.int32), 0), axis=1)

    q_lens, kv_lens = length(jnp.any(visible, axis=2), T), length(jnp.any(visible, axis=1), S)
    t, s = jnp.arange(T)[None, :, None], jnp.arange(S)[None, None, :]
    want = (t < q_lens[:, None, None]) & (s < kv_lens[:, None, None])
    if causal:
        shift = (kv_lens - q_lens)[:, None, None] if bottom_right else 0
        structure = s <= t + shift
        visible, want = visible & structure, want & structure
    descriptor = SequenceDescriptor.from_seqlens((q_lens, kv_lens))
    vis, wanted, ql, kl = concrete(visible), concrete(want), concrete(q_lens), concrete(kv_lens)
    if vis is None or wanted is None or ql is None or kl is None:
        return descriptor, jnp.any(visible != want, axis=(1, 2))
    bad = np.argwhere(vis != wanted)
    if len(bad):
        b, i, j = bad[0]
        raise ValueError(
            f"mask is not a trailing padding mask: row {b} has q length {ql[b]} and kv "
            f"length {kl[b]}, but query {i} / key {j} is {'visible' if vis[b, i, j] else 'masked'}; "
            "padding mask types take padding at the end of each sequence (as TE's fused "
            "attention does); express other patterns as a bias")
    return descriptor, None


def _decode_descriptor(mask, B: int, T: int, L: int, start) -> SequenceDescriptor:
    """New tokens at absolute positions start + i over a cache of L slots, start + T filled."""
    q_pos = jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))
    kv_pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    q_valid = jnp.ones((B, T), jnp.bool_)
    kv_valid = kv_pos < start + T
    if mask is not None:
        visible = _visible(mask, B, T, L)
        q_valid = jnp.any(visible, axis=2)
        kv_valid = kv_valid & jnp.any(visible, axis=1)
    return SequenceDescriptor.from_segment_ids_and_pos(
        (q_valid.astype(jnp.int32), kv_valid.astype(jnp.int32)), (q_pos, kv_pos))


class MultiHeadAttention(nn.Module):
    """Multi-head attention with its projections (TransformerEngine's `MultiHeadAttention`).

    Shapes: inputs_q [B, T, E], inputs_kv [B, S, E'] ([T, B, E] with transpose_batch_sequence);
    N = num_attention_heads query heads, K = num_gqa_groups key/value heads, H = head_dim.

    Attributes:
      head_dim, num_attention_heads, num_gqa_groups (None = N; 1 = MQA).
      attention_dropout, dropout_rng_name: dropout on the attention probabilities.
      input_layernorm, layernorm_type, layernorm_epsilon, zero_centered_gamma: the LayerNorm
        on inputs_q (fused into the query / qkv projection).
      return_layernorm_output: also return that LayerNorm's output (else None).
      kernel_init: None = variance_scaling(1, 'fan_in', 'normal'); Q, K, V kernels are drawn
        per [E, N*H] block; scaled_query_init divides the query block by sqrt(H).
      use_bias, bias_init: biases of every projection.
      attn_mask_type: 'no_mask', 'padding', 'causal', 'padding_causal' (or 'causal_padding'),
        'causal_bottom_right', 'padding_causal_bottom_right'; see the module docstring.
      attn_bias_type: None (post-scale when a bias is passed), 'no_bias', 'pre_scale_bias',
        'post_scale_bias'.
      enable_rotary_pos_emb, rotary_pos_emb_windows, rotary_pos_emb_group_method: RoPE on the
        projected queries and keys (`flashmesh.nn.rotary`).
      low_rank_adaptation_scope (see LORA_SCOPES), low_rank_adaptation_dim, _alpha: LoRA on
        the projections (flashmesh.nn.dense).
      dtype: the parameters' dtype (float32); computation follows the inputs' dtype.
      fuse_qkv_params: one fused qkv (self-attention) or kv (cross-attention, GQA) kernel.
      transpose_batch_sequence: inputs are [T, B, E] (None = False).
      enable_sequence_parallel: not supported (NotImplementedError).
      scale_attn_logits: scale the logits by 1/sqrt(H) (TE's default False: scale 1, the
        query kernel being scaled at init instead).
      float32_logits: accepted; flashmesh's logits are always float32.
      window_size: (left, right) sliding window, -1 unbounded; None = none.
      softmax_type: 'vanilla', 'off_by_one' or 'learnable'.
      score_mod, score_mod_bprop: not supported (NotImplementedError).
      reproducible: flashmesh's, not TE's: bit-identical outputs and gradients run to run
        (`flashmesh.attention(reproducible=True)`).

    Call: `(inputs_q, inputs_kv, mask=None, bias=None, *, decode=False, deterministic=False,
    positions=None) -> (out [B, T, E], ln_out or None)`; `inputs_kv is inputs_q` means
    self-attention; `positions` are the rotary positions of inputs_q's tokens.

    Example:
      >>> mha = MultiHeadAttention(head_dim=16, num_attention_heads=4, num_gqa_groups=2)
      >>> variables = mha.init(jax.random.key(0), x, x, deterministic=True)   # x [B, T, E]
      >>> out, _ = mha.apply(variables, x, x, deterministic=True)
    """

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: int | None = None
    attention_dropout: float = 0.0
    dropout_rng_name: str = "dropout"
    input_layernorm: bool = True
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    return_layernorm_output: bool = False
    zero_centered_gamma: bool = False
    kernel_init: Callable | None = None
    use_bias: bool = False
    bias_init: Callable = nn.initializers.zeros
    attn_mask_type: Any = "causal"
    attn_bias_type: Any = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: tuple[float, float] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    low_rank_adaptation_scope: str = "none"
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    dtype: Any = jnp.float32
    fuse_qkv_params: bool = True
    transpose_batch_sequence: bool | None = None
    enable_sequence_parallel: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    float32_logits: bool = False
    window_size: tuple[int, int] | None = None
    softmax_type: str = "vanilla"
    score_mod: Callable | None = None
    score_mod_bprop: Callable | None = None
    reproducible: bool = False
    # TE's deprecated fields, handled as TE handles them (DeprecationWarning each): num_heads and
    # dropout_rate set num_attention_heads and attention_dropout; apply_residual_connection_
    # post_layernorm and fuse_qkv only warn (their replacements are return_layernorm_output and
    # fuse_qkv_params); output_layernorm must stay None.
    num_heads: int | None = None
    dropout_rate: float | None = None
    output_layernorm: bool | None = None
    apply_residual_connection_post_layernorm: bool | None = None
    fuse_qkv: bool | None = None

    def __post_init__(self):
        for old, new in (("num_heads", "num_attention_heads"), ("dropout_rate", "attention_dropout")):
            if getattr(self, old) is not None:
                object.__setattr__(self, new, getattr(self, old))
                warnings.warn(f"MultiHeadAttention.{old} is deprecated (as in TE): use {new}",
                              DeprecationWarning, stacklevel=3)
        for old, new in (("apply_residual_connection_post_layernorm", "return_layernorm_output"),
                         ("fuse_qkv", "fuse_qkv_params")):
            if getattr(self, old) is not None:
                warnings.warn(f"MultiHeadAttention.{old} is deprecated and has no effect (as in TE): "
                              f"use {new}", DeprecationWarning, stacklevel=3)
        if self.output_layernorm is not None:
            raise ValueError("MultiHeadAttention.output_layernorm is deprecated (TE refuses it too): "
                             "use input_layernorm to choose whether a layernorm is applied")
        super().__post_init__()

    # -- projections ---------------------------------------------------------------------------
    def _init(self) -> Callable:
        return self.kernel_init or nn.initializers.variance_scaling(1.0, "fan_in", "normal")

    def _query_init(self, key, shape, dtype):
        scale = math.sqrt(self.head_dim) if self.scaled_query_init else 1.0
        return self._init()(key, shape, dtype) / jnp.asarray(scale, dtype)

    def _stacked_init(self, with_query: bool) -> Callable:
        """Kernel [E, n, F] drawn as n independent [E, F] blocks (q scaled, k, v), as TE."""
        def init(key, shape, dtype):
            keys = jax.random.split(key, shape[1])
            inits = ([self._query_init] if with_query else []) + [self._init()] * 2
            return jnp.stack([f(k, (shape[0], shape[2]), dtype) for f, k in zip(inits, keys)],
                             axis=1)
        return init

    def _lora(self, which: str) -> bool:
        return which in lora_scope(self.low_rank_adaptation_scope)

    def _dense(self, features, kernel_axes, bias_axes, name, kernel_init, lora="qkv"):
        return DenseGeneral(features=features, split_features=not isinstance(features, int),
                            kernel_init=kernel_init, kernel_axes=kernel_axes, use_bias=self.use_bias,
                            bias_init=self.bias_init, bias_axes=bias_axes,
                            enable_low_rank_adaptation=self._lora(lora),
                            low_rank_adaptation_dim=self.low_rank_adaptation_dim,
                            low_rank_adaptation_alpha=self.low_rank_adaptation_alpha,
                            dtype=self.dtype, name=name)

    def _ln_dense(self, features, kernel_axes, bias_axes, name, kernel_init, return_ln):
        return LayerNormDenseGeneral(
            features=features, split_features=not isinstance(features, int),
            enable_layernorm=self.input_layernorm,
            layernorm_type=self.layernorm_type, epsilon=self.layernorm_epsilon,
            zero_centered_gamma=self.zero_centered_gamma, scale_axes=(P.W_NO_SHARD_AXES,),
            ln_bias_axes=(P.W_NO_SHARD_AXES,), kernel_init=kernel_init, kernel_axes=kernel_axes,
            use_bias=self.use_bias, bias_init=self.bias_init, bias_axes=bias_axes,
            return_layernorm_output=return_ln, enable_low_rank_adaptation=self._lora("qkv"),
            low_rank_adaptation_dim=self.low_rank_adaptation_dim,
            low_rank_adaptation_alpha=self.low_rank_adaptation_alpha, dtype=self.dtype, name=name)

    def _project(self, inputs_q, inputs_kv, self_attention: bool):
        """q [.., N, H], k and v [.., K, H] in the inputs' layout, and the LayerNorm output."""
        N, K, H = self.num_attention_heads, self._kv_heads(), self.head_dim
        heads = lambda x, n: x.reshape(*x.shape[:2], n, H)
        if self.fuse_qkv_params and self_attention and N == K:
            qkv, ln_out = self._ln_dense((3, N * H), (P.W_FSDP_AXES, P.W_JOINED_AXES, P.W_TP_AXES),
                                         (P.W_JOINED_AXES, P.W_TP_AXES), "qkv", self._stacked_init(True),
                                         self.return_layernorm_output)(inputs_q)
            # q, k, v apart (split_features): their gradients reach the FP8 GEMM unpacked.
            q, k, v = checkpoint_name(qkv, "combined_qkv_proj")
            return heads(q, N), heads(k, K), heads(v, K), ln_out
        query, ln_out = self._ln_dense(N * H, (P.W_FSDP_AXES, P.W_TP_AXES), (P.W_TP_AXES,), "query",
                                       self._query_init,
                                       self.return_layernorm_output or self_attention)(inputs_q)
        kv_in = ln_out if self_attention else inputs_kv  # self-attention: K, V from the LN too
        ln_out = ln_out if self.return_layernorm_output else None
        if self.fuse_qkv_params:
            kv = self._dense((2, K * H), (P.W_FSDP_AXES, P.W_JOINED_AXES, P.W_TP_AXES),
                             (P.W_JOINED_AXES, P.W_TP_AXES), "kv", self._stacked_init(False))(kv_in)
            key, value = checkpoint_name(kv, "combined_kv_proj")
        else:
            key = self._dense(K * H, (P.W_FSDP_AXES, P.W_TP_AXES), (P.W_TP_AXES,), "key",
                              self._init())(kv_in)
            value = self._dense(K * H, (P.W_FSDP_AXES, P.W_TP_AXES), (P.W_TP_AXES,), "value",
                                self._init())(kv_in)
        return heads(query, N), heads(key, K), heads(value, K), ln_out

    def _kv_heads(self) -> int:
        return self.num_attention_heads if self.num_gqa_groups is None else self.num_gqa_groups

    # -- the call ------------------------------------------------------------------------------
    def _check(self, inputs_q, inputs_kv) -> None:
        te = _te()
        te.check_no_score_mod(score_mod=self.score_mod, score_mod_bprop=self.score_mod_bprop)
        if self.enable_sequence_parallel:
            raise NotImplementedError("enable_sequence_parallel: flashmesh applies no sequence-"
                                      "parallel sharding constraints; shard with logical-axis rules")
        N, K = self.num_attention_heads, self._kv_heads()
        if not (N > 0 and K > 0 and N % K == 0):
            raise ValueError(f"num_attention_heads={N} must be a positive multiple of "
                             f"num_gqa_groups={K}")
        if inputs_q.dtype != inputs_kv.dtype:
            raise ValueError(f"inputs_q dtype {inputs_q.dtype} must equal inputs_kv dtype "
                             f"{inputs_kv.dtype}")
        if inputs_q.ndim != 3 or inputs_kv.ndim != 3:
            raise ValueError(f"inputs must be [B, T, E], got {inputs_q.shape} and {inputs_kv.shape}")
        canonical_group_method(self.rotary_pos_emb_group_method)

    def _cache(self, k, v, seq_axis: int):
        """TE's 'cache' collection. At init: created (zeros), returns None. In a decode step:
        stores the new k, v at cache_index, advances it, returns (start, keys, values)."""
        initialized = self.has_variable("cache", "cached_key")
        cached_key = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
        cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if not initialized:
            return None
        T, L = k.shape[seq_axis], cached_key.value.shape[seq_axis]
        others = lambda shape: tuple(d for i, d in enumerate(shape) if i != seq_axis)
        if others(k.shape) != others(cached_key.value.shape) or T > L:
            raise ValueError(f"decode: new keys {k.shape} do not fit the cache "
                             f"{cached_key.value.shape} (same batch and heads, at most {L} tokens)")
        start = cache_index.value.astype(jnp.int32)
        for var, new in ((cached_key, k), (cached_value, v)):
            var.value = lax.dynamic_update_slice_in_dim(var.value, new.astype(var.value.dtype),
                                                        start, seq_axis)
        cache_index.value = start + T
        return start, cached_key.value, cached_value.value

    def _attend(self, te, q, k, v, bias, descriptor, mask_type, seq_major: bool,
                deterministic: bool) -> jax.Array:
        """One flashmesh.attention call through TE's option names (`call_native`)."""
        if self.attn_bias_type is None:
            bias_type = te.AttnBiasType.NO_BIAS if bias is None else te.AttnBiasType.POST_SCALE_BIAS
        else:
            bias_type = te.canonicalize(te.AttnBiasType, self.attn_bias_type, "attn_bias_type")
        if bias is not None:
            bias = jnp.asarray(bias).astype(q.dtype)  # as TE: the bias in the inputs' dtype
        softmax = te.canonicalize(te.AttnSoftmaxType, self.softmax_type, "softmax_type")
        offset = None
        if softmax == te.AttnSoftmaxType.LEARNABLE_SOFTMAX:
            offset = P.param(
                self, "softmax_offset", nn.initializers.zeros, (1, self.num_attention_heads, 1, 1),
                jnp.float32, (None, P.HEAD_AXES, None, None))
        seed = None
        if not deterministic and self.attention_dropout > 0.0:
            seed = self.make_rng(self.dropout_rng_name)
        scale = 1.0 / math.sqrt(self.head_dim) if self.scale_attn_logits else 1.0
        return te.call_native(
            (q, k, v), bias, descriptor, seed, sequence_major=seq_major,
            attn_bias_type=bias_type, attn_mask_type=mask_type,
            qkv_layout=te.QKVLayout.BSHD_BSHD_BSHD, softmax_type=softmax, scaling_factor=scale,
            dropout_probability=self.attention_dropout, is_training=not deterministic,
            window_size=self.window_size, softmax_offset=offset, module=self,
            reproducible=self.reproducible)

    @nn.compact
    def __call__(self, inputs_q: Float[Array, "B T E"], inputs_kv: Float[Array, "B S E2"],
                 mask: jax.Array | None = None, bias: Float[Array, "#B #N T S"] | None = None, *,
                 decode: bool = False, deterministic: bool = False,
                 positions: Int[Array, "#B T"] | None = None):
        """See the class docstring; `positions` (flashmesh's addition) places inputs_q's tokens
        for the rotary embedding: [T] or [B, T] (default 0 .. T-1, or cache_index + 0 .. T-1
        in a decode step); self-attention keys share them, cross-attention keys are 0 .. S-1."""
        self._check(inputs_q, inputs_kv)
        te = _te()
        seq_major = bool(self.transpose_batch_sequence)
        seq_axis, batch_axis = (0, 1) if seq_major else (1, 0)
        q, k, v, ln_out = self._project(inputs_q, inputs_kv, inputs_q is inputs_kv)
        B, T, S = q.shape[batch_axis], q.shape[seq_axis], k.shape[seq_axis]

        stepping = decode and self.has_variable("cache", "cached_key")
        if stepping:
            start = self.get_variable("cache", "cache_index").astype(jnp.int32)
            if positions is None:  # the new tokens' places in the cache
                positions = start + jnp.arange(T, dtype=jnp.int32)
        if self.enable_rotary_pos_emb:  # before the cache, which holds rotated keys (as TE)
            rope = dict(group_method=self.rotary_pos_emb_group_method,
                        transpose_batch_sequence=seq_major)
            q = rotary_pos_emb(q, self.rotary_pos_emb_windows, positions=positions, **rope)
            k = rotary_pos_emb(k, self.rotary_pos_emb_windows, **rope,
                               positions=positions if inputs_q is inputs_kv else None)
        if decode:  # init creates the cache; a step appends k, v and attends over all of it
            cached = self._cache(k, v, seq_axis)
            if stepping:
                _, k, v = cached
                S = k.shape[seq_axis]

        mask_type = te.canonicalize(te.AttnMaskType, self.attn_mask_type, "attn_mask_type")
        descriptor, not_trailing = None, None
        if stepping:
            descriptor = _decode_descriptor(mask if mask_type.is_padding() else None, B, T, S, start)
            # Absolute positions carry the causal diagonal: top-left over them is exact.
            mask_type = te.AttnMaskType("padding_causal" if mask_type.is_causal() else "padding")
            if bias is not None and bias.shape[-2] != T:
                if bias.shape[-2] != S:
                    raise ValueError(f"decode: bias rows {bias.shape[-2]} must be the new tokens' "
                                     f"{T} or the cache length {S}")
                bias = lax.dynamic_slice_in_dim(bias, start, T, axis=2)
        elif mask_type.is_padding():
            if mask is None:  # no padding: the same mask type without it
                mask_type = te.AttnMaskType(mask_type.value.removeprefix("padding").lstrip("_")
                                            or "none")
            else:
                descriptor, not_trailing = _padding(mask, B, T, S, causal=mask_type.is_causal(),
                                                    bottom_right=mask_type.is_bottom_right())

        out = self._attend(te, q, k, v, bias, descriptor, mask_type, seq_major, deterministic)
        if not_trailing is not None:  # a traced mask that lengths cannot express: NaN, not wrong
            rows = not_trailing[None, :] if seq_major else not_trailing[:, None]
            out = jnp.where(rows[..., None, None], jnp.nan, out)
        out = out.reshape(*out.shape[:2], -1)
        out = self._dense(inputs_q.shape[-1], (P.W_TP_AXES, P.W_FSDP_AXES), (P.W_NO_SHARD_AXES,), "out",
                          self._init(), lora="out")(out)
        return checkpoint_name(out, "out_proj"), ln_out
