"""`SequenceDescriptor`: which tokens belong together, in any of the three forms users have.

* `from_seqlens(seqlens)`: padding; row b holds one sequence of seqlens[b] tokens, then padding.
* `from_seqlens_and_offsets(seqlens, offsets)`: packed rows; segment m of row b occupies
  [offsets[b, m], offsets[b, m] + seqlens[b, m]); entries with a negative offset or length are
  unused slots (cuDNN's convention pads with -1).
* `from_segment_ids_and_pos(segment_ids, segment_pos=None)`: packed rows given per token;
  ids are 1-based, 0 is padding; positions (default: offset from the segment's start) drive
  causal and window masks inside each segment.

Each argument is one integer array (self-attention: queries and keys share it) or a (q, kv)
pair; other dtypes are refused rather than truncated.

A bottom-right mask shifts every segment's query positions by (kv length - q length), so each
segment's diagonal ends at its last query and key, whatever the form. For segment ids a
segment's length is the number of its tokens in the row, and the shift is only defined for
canonical positions (offsets from the segment's start, derived or given): positions the user
chose are taken to encode the alignment themselves, so a bottom-right mask refuses them.

`api.py` turns every form into segment ids + positions, the one mask form backends see.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np


def _ints(x, name: str) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):  # a cast would truncate 2.7 to 2 silently
        raise ValueError(f"{name} must be an integer array, got dtype {x.dtype}")
    return x.astype(jnp.int32)


def _pair(x, name: str):
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"{name} must be one array or a (q, kv) pair, got {len(x)} items")
        return _ints(x[0], f"q {name}"), _ints(x[1], f"kv {name}")
    x = _ints(x, name)
    return x, x


def _same_batch(name: str, q, kv) -> None:
    if q.shape[0] != kv.shape[0]:
        raise ValueError(f"{name} batch sizes differ: q {q.shape}, kv {kv.shape}")


def _check_disjoint(name: str, lens, offs) -> None:
    """Packed segments of one row must not share tokens (checked when the arrays are known)."""
    lens_c, offs_c = concrete(lens), concrete(offs)
    if lens_c is None or offs_c is None:
        return
    for row_lens, row_offs in zip(lens_c, offs_c):
        used = (row_lens > 0) & (row_offs >= 0)
        starts, ends = row_offs[used], row_offs[used] + row_lens[used]
        order = np.argsort(starts)
        if (starts[order][1:] < ends[order][:-1]).any():
            raise ValueError(f"{name} segments overlap: offsets {row_offs.tolist()} with "
                             f"seqlens {row_lens.tolist()}")


def concrete(x) -> np.ndarray | None:
    """The value of x when it is known at trace time, else None (under jit)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _runs(ids, xp=jnp):
    """For ids [B, L]: each token's offset from the start of its run of equal ids, and
    whether it starts a run (xp=np computes it on concrete arrays, even under a trace)."""
    L = ids.shape[1]
    idx = xp.arange(L, dtype=xp.int32)[None]
    starts = xp.concatenate([xp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    marked = xp.where(starts, idx, 0)
    cummax = np.maximum.accumulate if xp is np else jax.lax.cummax
    run_start = cummax(marked, axis=1)
    return idx - run_start, starts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SequenceDescriptor:
    """Sequence structure of a batch; build it with one of the `from_*` constructors."""

    q_seqlens: jax.Array | None = None
    kv_seqlens: jax.Array | None = None
    q_offsets: jax.Array | None = None
    kv_offsets: jax.Array | None = None
    q_segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    q_positions: jax.Array | None = None
    kv_positions: jax.Array | None = None
    kind: Literal["seqlens", "seqlens_offsets", "segment_ids"] = dataclasses.field(
        default="seqlens", metadata=dict(static=True))
    max_segments: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    positions_canonical: bool = dataclasses.field(default=True, metadata=dict(static=True))

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def from_seqlens(cls, seqlens) -> "SequenceDescriptor":
        q, kv = _pair(seqlens, "seqlens")
        _same_batch("seqlens", q, kv)
        for name, x in (("q seqlens", q), ("kv seqlens", kv)):
            if x.ndim != 1:
                raise ValueError(f"{name} must have shape [B], got {x.shape}")
            c = concrete(x)
            if c is not None and (c < 0).any():
                raise ValueError(f"{name} must be >= 0, got min {c.min()}")
        return cls(q_seqlens=q, kv_seqlens=kv, kind="seqlens", max_segments=1)

    @classmethod
    def from_seqlens_and_offsets(cls, seqlens, seq_offsets) -> "SequenceDescriptor":
        """Packed rows: seqlens [B, M] and seq_offsets [B, M] or [B, M+1] (TE's names; each one
        array or a (q, kv) pair)."""
        q_len, kv_len = _pair(seqlens, "seqlens")
        q_off, kv_off = _pair(seq_offsets, "seq_offsets")
        _same_batch("seqlens", q_len, kv_len)
        _same_batch("offsets", q_off, kv_off)
        for name, lens, off in (("q", q_len, q_off), ("kv", kv_len, kv_off)):
            if lens.ndim != 2:
                raise ValueError(f"{name} seqlens must have shape [B, M], got {lens.shape}")
            if off.ndim != 2 or off.shape[0] != lens.shape[0] or off.shape[1] not in (
                    lens.shape[1], lens.shape[1] + 1):
                raise ValueError(f"{name} offsets must have shape [B, M] or [B, M+1] with "
                                 f"seqlens {lens.shape}, got {off.shape}")
            _check_disjoint(name, lens, off[:, :lens.shape[1]])
        return cls(q_seqlens=q_len, kv_seqlens=kv_len, q_offsets=q_off[:, :q_len.shape[1]],
                   kv_offsets=kv_off[:, :kv_len.shape[1]], kind="seqlens_offsets",
                   max_segments=int(max(q_len.shape[1], kv_len.shape[1])))

    @classmethod
    def from_segment_ids_and_pos(cls, segment_ids, segment_pos=None, *,
                                 max_segments: int | None = None) -> "SequenceDescriptor":
        """Packed rows given per token: segment_ids [B, L] (1-based, 0 = padding) and optional
        segment_pos [B, L] (default: each token's offset from its segment's start).

        Under a bottom-right mask each segment's query positions move by (kv length - q
        length), lengths counted in tokens per id, exactly as the seqlens and offsets forms do.
        That needs canonical positions (derived, or given equal to the derived ones on concrete
        arrays); other positions are taken to encode the alignment themselves and a
        bottom-right mask refuses them with a ValueError (use a top-left mask with them).
        max_segments: a static bound on segments per row, needed by cuDNN when ids are traced.
        """
        q_ids, kv_ids = _pair(segment_ids, "segment_ids")
        for name, x in (("q segment_ids", q_ids), ("kv segment_ids", kv_ids)):
            if x.ndim != 2:
                raise ValueError(f"{name} must have shape [B, L], got {x.shape}")
            c = concrete(x)
            if c is not None and (c < 0).any():
                raise ValueError(f"{name} must be >= 0 (0 = padding), got min {c.min()}")
        if q_ids.shape[0] != kv_ids.shape[0]:
            raise ValueError(f"segment_ids batch sizes differ: q {q_ids.shape}, kv {kv_ids.shape}")
        canonical = True
        q_pos = kv_pos = None
        if segment_pos is not None:
            q_pos, kv_pos = _pair(segment_pos, "segment_pos")
            for name, pos, ids in (("q", q_pos, q_ids), ("kv", kv_pos, kv_ids)):
                if pos.shape != ids.shape:
                    raise ValueError(f"{name} segment_pos shape {pos.shape} must equal its "
                                     f"segment_ids shape {ids.shape}")
            canonical = not any(_position_mismatch(side, ids, pos) for side, ids, pos in (
                ("q", q_ids, q_pos), ("kv", kv_ids, kv_pos)))
        if max_segments is None:
            counts = [concrete(jnp.sum(_runs(x)[1] & (x != 0), axis=1)) for x in (q_ids, kv_ids)]
            if all(c is not None for c in counts):
                max_segments = int(max(c.max(initial=0) for c in counts))
        return cls(q_segment_ids=q_ids, kv_segment_ids=kv_ids, q_positions=q_pos,
                   kv_positions=kv_pos, kind="segment_ids", max_segments=max_segments,
                   positions_canonical=canonical)

    # -- normalisation ------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        x = self.q_seqlens if self.q_seqlens is not None else self.q_segment_ids
        return x.shape[0]

    def to_segments(self, q_len: int, kv_len: int, bottom_right: bool):
        """Segment ids and positions: (q_ids [B,T], kv_ids [B,S], q_pos, kv_pos), positions
        None when they are the implicit 0..T-1 / 0..S-1."""
        if self.kind == "segment_ids":
            return self._from_ids(q_len, kv_len, bottom_right)
        q_idx = jnp.arange(q_len, dtype=jnp.int32)[None]
        kv_idx = jnp.arange(kv_len, dtype=jnp.int32)[None]
        if self.kind == "seqlens":
            self._check_lengths(self.q_seqlens, q_len, "q seqlens")
            self._check_lengths(self.kv_seqlens, kv_len, "kv seqlens")
            q_ids = (q_idx < self.q_seqlens[:, None]).astype(jnp.int32)
            kv_ids = (kv_idx < self.kv_seqlens[:, None]).astype(jnp.int32)
            q_pos = None
            if bottom_right:
                q_pos = q_idx + (self.kv_seqlens - self.q_seqlens)[:, None]
            return q_ids, kv_ids, q_pos, (None if q_pos is None else jnp.broadcast_to(kv_idx, kv_ids.shape))
        q_ids, q_pos = self._packed(q_idx, self.q_seqlens, self.q_offsets, q_len, "q")
        kv_ids, kv_pos = self._packed(kv_idx, self.kv_seqlens, self.kv_offsets, kv_len, "kv")
        if bottom_right:
            shift = jnp.concatenate([jnp.zeros_like(self.kv_seqlens[:, :1]),
                                     jnp.maximum(self.kv_seqlens, 0) - jnp.maximum(self.q_seqlens, 0)], axis=1)
            q_pos = q_pos + jnp.take_along_axis(shift, q_ids, axis=1)
        return q_ids, kv_ids, q_pos, kv_pos

    @staticmethod
    def _check_lengths(lens, length, name):
        c = concrete(lens)
        if c is not None and (c > length).any():
            raise ValueError(f"{name} must be <= the sequence length {length}, got max {c.max()}")

    @staticmethod
    def _packed(idx, lens, offs, length, name):
        lens_c, offs_c = concrete(lens), concrete(offs)
        if lens_c is not None and offs_c is not None:
            used = (lens_c > 0) & (offs_c >= 0)
            end = np.where(used, offs_c + lens_c, 0)
            if (end > length).any():
                raise ValueError(f"{name} offsets + seqlens must be <= the sequence length "
                                 f"{length}, got {end.max()}")
        used = (lens > 0) & (offs >= 0)  # [B, M]
        inside = used[:, :, None] & (idx[:, None, :] >= offs[:, :, None]) & (
            idx[:, None, :] < (offs + lens)[:, :, None])  # [B, M, L]
        m = jnp.arange(1, lens.shape[1] + 1, dtype=jnp.int32)[None, :, None]
        ids = jnp.max(jnp.where(inside, m, 0), axis=1)
        start = jnp.max(jnp.where(inside, offs[:, :, None], 0), axis=1)
        return ids, jnp.where(ids > 0, idx - start, 0)

    def _from_ids(self, q_len, kv_len, bottom_right):
        for name, ids, length in (("q", self.q_segment_ids, q_len), ("kv", self.kv_segment_ids, kv_len)):
            if ids.shape[1] != length:
                raise ValueError(f"{name} segment_ids length {ids.shape[1]} must equal the "
                                 f"sequence length {length}")
        q_ids, kv_ids = self.q_segment_ids, self.kv_segment_ids
        if self.q_positions is None:
            q_pos, kv_pos = _runs(q_ids)[0], _runs(kv_ids)[0]
        else:
            q_pos, kv_pos = self.q_positions, self.kv_positions
        if bottom_right:
            if not self.positions_canonical:
                why = (_position_mismatch("q", q_ids, q_pos)
                       or _position_mismatch("kv", kv_ids, kv_pos) or "other positions")
                raise ValueError(f"a bottom-right mask shifts each segment's diagonal, so "
                                 f"segment_pos must be offsets from each segment's start, got "
                                 f"{why}; pass segment_pos=None, or encode the alignment in it "
                                 "and use a top-left mask")
            shift = _count(kv_ids, q_ids) - _count(q_ids, q_ids)  # kv length - q length
            q_pos = q_pos + jnp.where(q_ids > 0, shift, 0)
        return q_ids, kv_ids, q_pos, kv_pos


def _count(pool: jax.Array, ids: jax.Array) -> jax.Array:
    """For ids [B, L]: how many entries of the same row of pool [B, P] equal each one (by
    sorting, so never a [B, L, P] comparison)."""
    def row(pool, ids):
        return jnp.searchsorted(pool, ids, side="right") - jnp.searchsorted(pool, ids, side="left")
    return jax.vmap(row)(jnp.sort(pool, axis=1), ids)


def _position_mismatch(side: str, ids, pos) -> str | None:
    """Why `pos` is not provably each token's offset from its segment's start, or None when it
    is (provable only on concrete arrays; padding tokens may hold any position)."""
    ids_c, pos_c = concrete(ids), concrete(pos)
    if ids_c is None or pos_c is None:
        return f"traced {side} segment_pos (not provably offsets)"
    canon = _runs(ids_c, np)[0]
    bad = np.argwhere((pos_c != canon) & (ids_c != 0))
    if not len(bad):
        return None
    b, i = bad[0]
    return f"{side} segment_pos[{b}, {i}] = {pos_c[b, i]} where the offset is {canon[b, i]}"
