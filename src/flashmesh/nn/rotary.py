"""Rotary position embeddings (RoPE), as TransformerEngine's `rotary_pos_emb` defines them.

Each pair of coordinates (a, b) of a head vector is rotated by the angle pos / timescale_j:

    a' = a cos - b sin,    b' = b cos + a sin,
    timescale_j = min * (max / min) ** (2 j / H),   j = 0 .. H/2 - 1,

with (min, max) = `rotary_pos_emb_windows` (default (1, 10000), the usual base 10000).
Which coordinates form pair j is the group method (TE's `rotary_pos_emb_group_method`):

* "consecutive" (TE's default): pair j is (x[2j], x[2j+1]), interleaved (GPT-J, Mesh-TF).
* "alternate": pair j is (x[j], x[j + H/2]), the two halves (GPT-NeoX, Llama's "rotate half").

TransformerEngine's code does exactly this (`consecutive_impl` multiplies by the timescales
repeated twice and swaps neighbours with signs -, +; `alternate_impl` splits the last axis in
halves). Positions default to 0 .. T-1; pass them to rotate a decode step at its place in the
cache, or packed sequences at their offsets. The angles are computed in float32 and the
result is cast back to x's dtype.

Shapes: x [B, T, ..., H] (or [T, B, ..., H] with `transpose_batch_sequence`), positions
[T] or [B, T] (or [T, B]), H even.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = ["rotary_pos_emb", "apply_rotary", "rotary_angles", "timescales",
           "canonical_group_method", "GROUP_METHODS"]

GROUP_METHODS = ("consecutive", "alternate")


def canonical_group_method(group_method: str) -> str:
    """'consecutive' or 'alternate' from any case, '-' or '_' spelling (as TE accepts)."""
    name = group_method.lower().strip().replace("-", "").replace("_", "") if isinstance(
        group_method, str) else group_method
    if name not in GROUP_METHODS:
        raise ValueError(f"rotary_pos_emb_group_method={group_method!r} must be one of "
                         f"{list(GROUP_METHODS)}")
    return name


def timescales(head_dim: int, windows: tuple[float, float] = (1, 10000)) -> Float[Array, "H/2"]:
    """float32 [H/2]: min * (max / min) ** (2 j / H) for pair j."""
    if not (isinstance(head_dim, int) and head_dim > 0 and head_dim % 2 == 0):
        raise ValueError(f"rotary embeddings need an even head dim, got {head_dim!r}")
    if len(windows) != 2 or not (windows[0] > 0 and windows[1] > 0):
        raise ValueError(f"rotary_pos_emb_windows must be (min, max) positive timescales, "
                         f"got {windows!r}")
    low, high = float(windows[0]), float(windows[1])
    fraction = 2.0 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim
    return low * (high / low) ** fraction


def rotary_angles(positions: Int[Array, "..."], head_dim: int,
                  windows: tuple[float, float] = (1, 10000)) -> Float[Array, "... H/2"]:
    """float32 [..., H/2]: the angle pos / timescale_j of every position and pair."""
    positions = jnp.asarray(positions)
    scales = timescales(head_dim, windows).reshape((1,) * positions.ndim + (head_dim // 2,))
    return positions.astype(jnp.float32)[..., None] / scales


def apply_rotary(x: Float[Array, "... H"], angles: Float[Array, "... H/2"],
                 group_method: str = "consecutive") -> Float[Array, "... H"]:
    """Rotates the pairs of x's last axis by `angles`, of x's rank, broadcast against
    x[..., :H/2]."""
    method = canonical_group_method(group_method)
    H = x.shape[-1]
    if H % 2:
        raise ValueError(f"rotary embeddings need an even head dim, got x.shape[-1]={H}")
    if angles.ndim != x.ndim or angles.shape[-1] != H // 2:
        raise ValueError(f"angles shape {angles.shape} must have x's rank {x.ndim} and last "
                         f"axis H/2 = {H // 2}")
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    xf = x.astype(jnp.float32)
    if method == "alternate":
        a, b = xf[..., :H // 2], xf[..., H // 2:]
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    else:
        pairs = xf.reshape(*x.shape[:-1], H // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    return out.astype(x.dtype)


def rotary_pos_emb(x: Float[Array, "B T ... H"], windows: tuple[float, float] = (1, 10000), *,
                   group_method: str = "consecutive",
                   positions: Int[Array, "#B T"] | None = None,
                   transpose_batch_sequence: bool = False) -> Float[Array, "B T ... H"]:
    """TransformerEngine's `rotary_pos_emb(x, windows, transpose_batch_sequence, group_method)`
    with optional positions.

    Args:
      x: [B, T, ..., H] ([T, B, ..., H] when transpose_batch_sequence), typically [B, T, N, H].
      windows: (min, max) timescales, TE's `rotary_pos_emb_windows`.
      group_method: "consecutive" (pairs (2j, 2j+1)) or "alternate" (pairs (j, j + H/2)).
      positions: integer [T] or [B, T] ([T] or [T, B] when transposed); default 0 .. T-1.
      transpose_batch_sequence: x is sequence-major.

    Returns x rotated, in x's dtype.

    Example:
      >>> q = jax.random.normal(jax.random.key(0), (2, 16, 4, 32))
      >>> rotary_pos_emb(q, (1, 10000), group_method="alternate").shape
      (2, 16, 4, 32)
    """
    if x.ndim < 3:
        raise ValueError(f"x must be [B, T, ..., H] (rank >= 3), got shape {x.shape}")
    seq_dim, batch_dim = (0, 1) if transpose_batch_sequence else (1, 0)
    T = x.shape[seq_dim]
    if positions is None:
        positions = jnp.arange(T, dtype=jnp.int32)
    positions = jnp.asarray(positions)
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions must be an integer array, got dtype {positions.dtype}")
    if positions.ndim == 1:
        if positions.shape[0] != T:
            raise ValueError(f"positions shape {positions.shape} must be ({T},)")
        positions = jnp.expand_dims(positions, batch_dim)  # [1, T] or [T, 1]
    elif positions.ndim == 2:
        want = (x.shape[0], x.shape[1])
        if positions.shape[seq_dim] != T or positions.shape[batch_dim] not in (1, want[batch_dim]):
            raise ValueError(f"positions shape {positions.shape} must be {want} (or 1 for batch)")
    else:
        raise ValueError(f"positions must be [T] or [B, T], got shape {positions.shape}")
    angles = rotary_angles(positions, x.shape[-1], windows)  # [B|1, T, H/2] (or [T, B|1, ...])
    angles = angles.reshape(angles.shape[:2] + (1,) * (x.ndim - 3) + angles.shape[-1:])
    return apply_rotary(x, angles, group_method)
