"""Where each token lives under context parallelism: the sequence orders and their reorders.

A context-parallel call shards the sequence axis of its (already reordered) arrays in equal,
contiguous pieces over `cp_size` ranks: rank r holds reordered positions [r*L, (r+1)*L), L =
seq_len / cp_size. The *order* says which original tokens those positions are:

* ``"contiguous"``: the identity; rank r holds original tokens [r*L, (r+1)*L).
* ``"dual_chunk"``: the sequence is cut into 2*cp chunks of c = seq_len / (2*cp) tokens and rank
  r holds chunks r and 2*cp-1-r, in that order (TransformerEngine's ``ReorderStrategy.
  DualChunkSwap``). Under a causal mask every rank then has the same work. For 16 tokens and
  cp=4: rank 0 [0 1 14 15], rank 1 [2 3 12 13], rank 2 [4 5 10 11], rank 3 [6 7 8 9].
  TE also demands an even cp; the definition needs no such thing, so odd cp is allowed here.
* ``"striped"``: stripes of `stripe_size` tokens (default 1) are dealt round-robin, so rank r
  holds stripes r, r+cp, r+2cp, ... (TE's ``ReorderStrategy.Striped``: reshape [seq/(cp*ss),
  cp, ss] and swap the first two axes). For 16 tokens, cp=4, ss=1: rank 0 [0 4 8 12].

`reorder_for_context_parallel` maps original order to the order's; its inverse maps back. Both
are pure reshapes/transposes (plus one flip for dual_chunk), so they are exact for every dtype,
ids and positions included, and cost no gather. `global_token_index` is the same map written as
an index array, which is what the schedule and the tests reason with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ORDERS: tuple[str, ...] = ("contiguous", "dual_chunk", "striped")


def check_order(order: str, cp_size: int, seq_len: int, stripe_size: int | None = None,
                *, length_name: str = "seq_len") -> int | None:
    """Validates an order's arguments; returns the stripe size to use (None unless striped).

    Raises a one-line ValueError naming the argument: an unknown order, cp_size < 1, a stripe
    size given with another order or not positive, or a length that the order cannot split
    evenly (contiguous needs a multiple of cp, dual_chunk of 2*cp, striped of stripe_size*cp).
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order=}")
    if isinstance(cp_size, bool) or not isinstance(cp_size, (int, np.integer)) or cp_size < 1:
        raise ValueError(f"cp_size must be an integer >= 1, got {cp_size=}")
    if stripe_size is not None:
        if order != "striped":
            raise ValueError(f"stripe_size applies only to order='striped', got {stripe_size=} "
                             f"with {order=}")
        if (isinstance(stripe_size, bool) or not isinstance(stripe_size, (int, np.integer))
                or stripe_size < 1):
            raise ValueError(f"stripe_size must be a positive integer, got {stripe_size=}")
    elif order == "striped":
        stripe_size = 1
    unit = {"contiguous": cp_size, "dual_chunk": 2 * cp_size}.get(order, (stripe_size or 0) * cp_size)
    if seq_len % unit:
        need = {"contiguous": "cp_size", "dual_chunk": "2 * cp_size"}.get(order, "stripe_size * cp_size")
        raise ValueError(f"{length_name}={seq_len} must be a multiple of {need}={unit} for {order=}")
    return None if order != "striped" else int(stripe_size)


def _permute(x, order: str, cp_size: int, seq_dim: int, stripe_size: int | None, inverse: bool):
    xp = jnp if isinstance(x, jax.Array) else np
    x = x if xp is jnp else np.asarray(x)
    if not -x.ndim <= seq_dim < x.ndim:
        raise ValueError(f"seq_dim={seq_dim} is out of range for x of shape {x.shape}")
    d = seq_dim % x.ndim
    stripe_size = check_order(order, cp_size, x.shape[d], stripe_size, length_name=f"x.shape[{d}]")
    if order == "contiguous" or cp_size == 1:
        return x
    head, L, tail = x.shape[:d], x.shape[d], x.shape[d + 1:]
    if order == "striped":
        # Original [L/(cp*ss), cp, ss] <-> reordered [cp, L/(cp*ss), ss]: one axis swap.
        n = L // (cp_size * stripe_size)
        src = (n, cp_size) if not inverse else (cp_size, n)
        y = xp.swapaxes(x.reshape(*head, *src, stripe_size, *tail), d, d + 1)
        return y.reshape(x.shape)
    # dual_chunk: original chunks viewed as [2 (halves), cp, c]; rank r takes chunk r of the first
    # half and chunk r of the *reversed* second half (= chunk 2cp-1-r), giving [cp, 2, c].
    c = L // (2 * cp_size)
    if not inverse:
        y = x.reshape(*head, 2, cp_size, c, *tail)
        first, second = y[(slice(None),) * d + (0,)], xp.flip(y[(slice(None),) * d + (1,)], axis=d)
        return xp.stack([first, second], axis=d + 1).reshape(x.shape)
    y = x.reshape(*head, cp_size, 2, c, *tail)
    first, second = y[(slice(None),) * (d + 1) + (0,)], y[(slice(None),) * (d + 1) + (1,)]
    return xp.stack([first, xp.flip(second, axis=d)], axis=d).reshape(x.shape)


def reorder_for_context_parallel(x, order: str, cp_size: int, seq_dim: int = 1,
                                 stripe_size: int | None = None):
    """Puts the sequence axis of `x` into `order`, ready to be sharded evenly over cp_size ranks.

    Args:
      x: a jax or numpy array of any dtype whose axis `seq_dim` is the sequence, e.g. q
        [B, T, N, H] (B batch, T sequence, N heads, H head dim), or segment ids / positions [B, T].
      order: "contiguous", "dual_chunk" or "striped" (see the module docstring).
      cp_size: the number of context-parallel ranks (>= 1).
      seq_dim: the sequence axis (negative counts from the end).
      stripe_size: tokens per stripe, striped only (default 1).

    Returns an array of x's type, shape and dtype: y with y[..., p, ...] = x[..., g[p], ...],
    g = global_token_index(order, cp_size, x.shape[seq_dim], stripe_size).

    Example: reorder_for_context_parallel(np.arange(8), "dual_chunk", 2, seq_dim=0)
      -> [0 1 6 7 2 3 4 5]  (rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2)
    """
    return _explicit_safe(_permute, x, order, cp_size, seq_dim, stripe_size, inverse=False)


def _explicit_safe(permute, x, *args, **kwargs):
    """permute(x, ...) also for an array sharded over Explicit mesh axes, whose reshapes would
    need their output sharding spelled out: the permutation runs in Auto mode and the result
    keeps x's sharding."""
    sharding = getattr(x, "sharding", None)
    explicit = isinstance(sharding, jax.sharding.NamedSharding) and any(
        t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types)
    if not explicit or isinstance(x, jax.core.Tracer):
        return permute(x, *args, **kwargs)
    return jax.sharding.auto_axes(lambda x: permute(x, *args, **kwargs), out_sharding=sharding)(x)


def inverse_reorder_for_context_parallel(x, order: str, cp_size: int, seq_dim: int = 1,
                                         stripe_size: int | None = None):
    """Undoes `reorder_for_context_parallel` (same arguments): back to the original order.

    Exact for every dtype: inverse_reorder(reorder(x)) == x bit for bit.
    """
    return _explicit_safe(_permute, x, order, cp_size, seq_dim, stripe_size, inverse=True)


def global_token_index(order: str, cp_size: int, seq_len: int,
                       stripe_size: int | None = None) -> np.ndarray:
    """int64 [seq_len]: for each position of the reordered sequence, its original token index.

    Rank r holds positions [r*L, (r+1)*L) (L = seq_len / cp_size), so
    global_token_index(...).reshape(cp_size, L)[r] are the original tokens of rank r.
    """
    check_order(order, cp_size, seq_len, stripe_size)
    return reorder_for_context_parallel(np.arange(seq_len, dtype=np.int64), order, cp_size, 0,
                                        stripe_size)


def reordered_token_index(order: str, cp_size: int, seq_len: int,
                          stripe_size: int | None = None) -> np.ndarray:
    """int64 [seq_len]: for each original token, its position in the reordered sequence (the
    inverse permutation of `global_token_index`)."""
    check_order(order, cp_size, seq_len, stripe_size)
    return inverse_reorder_for_context_parallel(np.arange(seq_len, dtype=np.int64), order,
                                                cp_size, 0, stripe_size)


def shard_token_indices(order: str, cp_size: int, seq_len: int,
                        stripe_size: int | None = None) -> np.ndarray:
    """int64 [cp_size, seq_len / cp_size]: row r lists the original tokens rank r holds, in the
    order it holds them."""
    return global_token_index(order, cp_size, seq_len, stripe_size).reshape(cp_size, -1)


def token_owner(order: str, cp_size: int, seq_len: int,
                stripe_size: int | None = None) -> np.ndarray:
    """int64 [seq_len]: for each original token, the rank that holds it."""
    return reordered_token_index(order, cp_size, seq_len, stripe_size) // (seq_len // cp_size)


def shard_runs(order: str, cp_size: int, seq_len: int,
               stripe_size: int | None = None) -> tuple[tuple[tuple[int, int], ...], ...]:
    """For each rank, its tokens as maximal runs of consecutive original indices, half-open
    (start, stop), in the order the rank holds them. Contiguous: one run per rank; dual_chunk:
    two (one for rank cp-1, whose chunks cp-1 and cp touch); striped: seq_len/(cp*ss) runs.
    """
    runs = []
    for idx in shard_token_indices(order, cp_size, seq_len, stripe_size):
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1
        starts = np.concatenate([[0], breaks])
        stops = np.concatenate([breaks, [idx.size]])
        runs.append(tuple((int(idx[a]), int(idx[b - 1]) + 1) for a, b in zip(starts, stops)))
    return tuple(runs)
