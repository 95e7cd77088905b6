"""The normalised form of one attention call: a frozen static spec and a pytree of arrays.

`api.py` builds both from the user's options; every backend receives exactly these and never
re-parses user options (one layout, `[B, T, N, H]`, and one mask form, segment ids + positions).

Shape legend (jax.nn's): B batch, T query length, S key/value length, N query heads,
K key/value heads, H head dim (Dqk for queries and keys, Dv for values).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

Softmax = Literal["vanilla", "off_by_one", "learnable"]
SOFTMAX_TYPES: tuple[str, ...] = ("vanilla", "off_by_one", "learnable")

# Log-sum-exp reported for a query row that sees no key under vanilla softmax. Finite on purpose:
# merging two partial results with lse = logaddexp(a, b) stays NaN-free when both are empty.
EMPTY_ROW_LSE = -1e30


def reproducible_reason(spec: "AttentionSpec", what: str) -> str | None:
    """Why `what` (GPU ops that XLA's determinism guide lists as run non-deterministically:
    scatters, multi-head attention) cannot promise spec.reproducible, or None if not asked."""
    if spec.reproducible:
        return (f"reproducible=True: {what} may sum in a varying order on a GPU (XLA's "
                "determinism guide lists scatters and attention among its non-deterministic ops)")
    return None


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Everything static about one call. Hashable, so it can key jit caches and block maps.

    window: (left, right) in positions, -1 = unbounded; causal is folded in as right = 0.
    bottom_right: the diagonal of causal/window masks when T != S and no positions are given;
      query i sits at position i + (S - T) instead of i.
    segments: None, "padding" (each row one segment from position 0, then padding), or
      "packed" (several segments per row; ids 1-based, 0 = padding).
    max_segments: an upper bound on segments per row when known (cuDNN needs it statically).
    positions_canonical: positions equal the token's offset from its segment's start (plus the
      bottom-right shift), so backends that derive positions themselves give the same mask.
    return_lse: whether the caller wants the log-sum-exp. When False, a backend may return a
      placeholder in its place for calls that are not differentiated (cuDNN then runs its
      inference kernel, as jax.nn does).
    context_step: one step of a context-parallel call (parallel/steps.py), run inside
      shard_map: dropout numbers the keys by the inputs' kv_index (the step's global key
      numbers) instead of 0..S-1, so a backend that derives key numbers from its tile offsets
      cannot run its dropout.
    reproducible: the caller asked for bit-identical results run to run (the same inputs,
      device and compiled program): backends pick reductions in a fixed order or refuse.
    """

    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    qk_dim: int
    v_dim: int
    dtype: str
    scale: float
    window: tuple[int, int] = (-1, -1)
    bottom_right: bool = False
    softmax: Softmax = "vanilla"
    logits_soft_cap: float | None = None
    dropout_rate: float = 0.0
    bias_shape: tuple[int, ...] | None = None
    segments: Literal["padding", "packed"] | None = None
    max_segments: int | None = None
    positions_canonical: bool = True
    return_lse: bool = True
    context_step: bool = False
    reproducible: bool = False

    @property
    def causal(self) -> bool:
        return self.window[1] == 0

    @property
    def has_window(self) -> bool:
        return self.window != (-1, -1)

    @property
    def has_bias(self) -> bool:
        return self.bias_shape is not None

    @property
    def has_dropout(self) -> bool:
        return self.dropout_rate > 0.0

    @property
    def q_elements(self) -> int:
        """Elements of q, B * T * N * Dqk (the size bounds on kernels' indexing are in these)."""
        return self.batch * self.q_len * self.num_heads * self.qk_dim

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 = MHA, N = MQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def diagonal_offset(self) -> int:
        """Position of query 0 when positions are implicit."""
        return self.kv_len - self.q_len if self.bottom_right else 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """The arrays of one call, in the one layout every backend sees.

    q: [B, T, N, Dqk]; k: [B, S, K, Dqk]; v: [B, S, K, Dv]
    bias: broadcastable to [B, N, T, S] (each of B, N may be 1), added after scaling.
    sink: [N] float32 logits of the learnable-softmax sink (None otherwise).
    q_segment_ids: [B, T] int32, kv_segment_ids: [B, S] int32 (0 = padding) or None.
    q_positions: [B, T] int32, kv_positions: [B, S] int32, or None (implicit 0..T-1 plus the
      diagonal offset, and 0..S-1).
    dropout_seed: [2] uint32 or None.
    q_index: [T] int32, kv_index: [S] int32, head_index: [N] int32, or None (0..T-1, 0..S-1,
      0..N-1): the token and head numbers the dropout hash sees. Context parallelism passes a
      shard's global numbers, so its dropout drops exactly what one device drops.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    bias: jax.Array | None = None
    sink: jax.Array | None = None
    q_segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    q_positions: jax.Array | None = None
    kv_positions: jax.Array | None = None
    dropout_seed: jax.Array | None = None
    q_index: jax.Array | None = None
    kv_index: jax.Array | None = None
    head_index: jax.Array | None = None


def compute_dtype(dtype) -> jnp.dtype:
    """Float32 arithmetic for low-precision inputs, float64 stays float64."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)
