"""Packed and sequence-major layouts are views of the one layout backends see, `[B, T, N, H]`.

THD layouts (`t3hd`, `thd_t2hd`, `thd_thd_thd`) are batch-major like BSHD, but each row packs
several sequences, so they require a segment descriptor (TransformerEngine's JAX convention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# layout -> (how q, k, v arrive, sequence-major?, packed rows?)
LAYOUTS: dict[str, tuple[str, bool, bool]] = {
    "bshd": ("separate", False, False),
    "bshd_bshd_bshd": ("separate", False, False),
    "sbhd": ("separate", True, False),
    "sbhd_sbhd_sbhd": ("separate", True, False),
    "bs3hd": ("qkv", False, False),
    "sb3hd": ("qkv", True, False),
    "bshd_bs2hd": ("kv", False, False),
    "sbhd_sb2hd": ("kv", True, False),
    "t3hd": ("qkv", False, True),
    "thd_t2hd": ("kv", False, True),
    "thd_thd_thd": ("separate", False, True),
}


def split(layout: str, q, k, v) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Separate q [B, T, N, Dqk], k [B, S, K, Dqk], v [B, S, K, Dv] from the layout's arrays."""
    packing, seq_major, _ = LAYOUTS[layout]
    if packing == "qkv":
        if k is not None or v is not None:
            raise ValueError(f"{layout=} packs q, k and v into the first argument; pass k=None, v=None")
        if q is None or q.ndim != 5 or q.shape[2] != 3:
            raise ValueError(f"{layout=} expects q of shape [B, S, 3, N, H], got "
                             f"{None if q is None else q.shape}")
        q, k, v = q[:, :, 0], q[:, :, 1], q[:, :, 2]
    elif packing == "kv":
        if v is not None:
            raise ValueError(f"{layout=} packs k and v into the second argument; pass v=None")
        if k is None or k.ndim != 5 or k.shape[2] != 2:
            raise ValueError(f"{layout=} expects k of shape [B, S, 2, K, H], got "
                             f"{None if k is None else k.shape}")
        k, v = k[:, :, 0], k[:, :, 1]
    elif q is None or k is None or v is None:
        raise ValueError(f"{layout=} takes separate q, k and v; got None for "
                         f"{[n for n, x in (('q', q), ('k', k), ('v', v)) if x is None]}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x is None or x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 ({'[S, B, N, H]' if seq_major else '[B, S, N, H]'}) "
                             f"in {layout=}, got {None if x is None else x.shape}")
    if seq_major:
        q, k, v = (jnp.swapaxes(x, 0, 1) for x in (q, k, v))
    return q, k, v


def restore(layout: str, out: jax.Array) -> jax.Array:
    """The output [B, T, N, Dv] in the layout's batch/sequence order."""
    return jnp.swapaxes(out, 0, 1) if LAYOUTS[layout][1] else out


def is_packed(layout: str) -> bool:
    return LAYOUTS[layout][2]
