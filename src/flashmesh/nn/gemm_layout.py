"""How `dense_general` lays an N-D contraction out as one 2-D GEMM [M, K] @ [K, N].

Without shardings in the types this is a plain flatten: x [lead..., K...] -> [M, K], kernel
[K..., N...] -> [K, N], y [M, N] -> [lead..., N...]. On a mesh with Explicit axes JAX checks
every reshape and contraction, and `Layout.of` decides where each operand lies so that the GEMM
is one the partitioner computes without guessing:

* the contracted axes lie as x's do, and the kernel is resharded to match (an FSDP kernel
  sharded along K is gathered; a row-parallel kernel already matches x's heads);
* the kernel's columns keep their mesh axes except those x's contracted axes use;
* x's rows keep theirs except those the columns use (sequence-parallel rows [B, T@tp] are
  gathered before a column-parallel GEMM, as TransformerEngine's sequence parallelism does);
* y lies as (x's rows, the kernel's columns); where the contracted axes are sharded, JAX sums
  the partial products (the GEMM's output sharding leaves those axes out).

Operands that agree this way also avoid an XLA partitioner error: with x and the kernel sharded
differently along K (or a mesh axis on both x's rows and the kernel's columns) on a three-axis
mesh the gradients came out wrong (a review's search of random shardings, 2026-12-07).

Within each group of axes (x's leading ones, the contracted ones, the kernel's outputs) the
sharded ones go first, so every merge into the 2-D form keeps each shard's block contiguous (no
communication in the reshape); a transpose is the cost where a sharded axis is not already
first (a fused QKV kernel [E, 3, F@tp]: the kernel and y pass through [.., F, 3]).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from flashmesh.quantization import layouts

__all__ = ["Layout"]


def _axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(names: tuple[str, ...]):
    """A PartitionSpec entry for the mesh axes `names` (None, one name or a tuple)."""
    return None if not names else names[0] if len(names) == 1 else names


def _spec(a, ndim: int) -> tuple[tuple[str, ...], ...]:
    """a's mesh axes per dimension (all empty where a's type carries no sharding)."""
    if not layouts.typed_sharding(a):
        return ((),) * ndim
    spec = tuple(jax.typeof(a).sharding.spec) + (None,) * ndim
    return tuple(_axes(e) for e in spec[:ndim])


def _without(specs, used) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(a for a in s if a not in used) for s in specs)


def _sharded_first(group: tuple[int, ...], specs) -> tuple[int, ...]:
    """The dimensions of `group`, those sharded in `specs` first, each part in order."""
    sharded = [d for d in group if specs[d]]
    return tuple(sharded) + tuple(d for d in group if d not in sharded)


class Layout(NamedTuple):
    """The 2-D form of one contraction (see the module docstring). mesh None: no typed sharding,
    the plain flatten; else each operand's dimension order and mesh axes per dimension."""

    lead: tuple[int, ...]          # x's leading shape
    out: tuple[int, ...]           # the kernel's output shape
    n_contract: int
    mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh | None = None
    x_order: tuple[int, ...] = ()  # x's dimensions: leading ones, then contracted ones
    k_order: tuple[int, ...] = ()  # the kernel's: contracted ones (x's order), then outputs
    x_spec: tuple = ()             # mesh axes per dimension of x where the GEMM reads it
    k_spec: tuple = ()             # ... of the kernel
    y_spec: tuple = ()             # ... of y [lead..., out...] (x's and the kernel's dims)

    @classmethod
    def of(cls, x, kernel, n_contract: int) -> "Layout":
        lead_n = x.ndim - n_contract
        lead, out = tuple(x.shape[:lead_n]), tuple(kernel.shape[n_contract:])
        typed = [a for a in (x, kernel) if layouts.typed_sharding(a)]
        if not typed:
            return cls(lead, out, n_contract)
        xs, ks = _spec(x, x.ndim), _spec(kernel, kernel.ndim)
        contracted = xs[lead_n:]
        k_axes = {a for s in contracted for a in s}
        columns = _without(ks[n_contract:], k_axes)
        rows = _without(xs[:lead_n], {a for s in columns for a in s})
        x_spec, k_spec = rows + contracted, contracted + columns
        contract = _sharded_first(tuple(range(n_contract)), contracted)
        x_order = _sharded_first(tuple(range(lead_n)), rows) + tuple(lead_n + i for i in contract)
        k_order = contract + tuple(n_contract + d for d in _sharded_first(
            tuple(range(len(out))), columns))
        return cls(lead, out, n_contract, jax.typeof(typed[0]).sharding.mesh, x_order, k_order,
                   x_spec, k_spec, rows + columns)

    def _sharding(self, specs):
        return jax.sharding.NamedSharding(self.mesh, jax.P(*(_entry(s) for s in specs)))

    def _merged(self, specs, order, split: int):
        """The 2-D sharding of an operand whose dimensions `order` (its mesh axes `specs`) merge
        into [first `split` of them, the rest]."""
        return self._sharding([sum((specs[d] for d in order[:split]), ()),
                               sum((specs[d] for d in order[split:]), ())])

    def _two_d(self, a, specs, order, split: int):
        """a resharded to `specs` (no-op where it lies so), transposed to `order`, merged."""
        a = jax.sharding.reshard(a, self._sharding(specs))
        shape = (math.prod(a.shape[d] for d in order[:split]), math.prod(a.shape[d] for d in order[split:]))
        return jax.lax.reshape(jnp.transpose(a, order), shape,
                               out_sharding=self._merged(specs, order, split))

    def x2(self, x):
        """x as [M, K]."""
        if self.mesh is None:
            return x.reshape(-1, math.prod(x.shape[len(self.lead):]))
        return self._two_d(x, self.x_spec, self.x_order, len(self.lead))

    def k2(self, kernel):
        """The kernel as [K, N]."""
        if self.mesh is None:
            return kernel.reshape(math.prod(kernel.shape[:self.n_contract]), math.prod(self.out))
        return self._two_d(kernel, self.k_spec, self.k_order, self.n_contract)

    def _columns(self) -> tuple[int, ...]:
        """The kernel's output dimensions in the GEMM's column order (0-based)."""
        return tuple(d - self.n_contract for d in self.k_order[self.n_contract:])

    def bias2(self, bias):
        """bias [N...] as [1, N], in the kernel's column order and sharded as y's columns."""
        if self.mesh is None:
            return bias.reshape(1, -1)
        columns = self.k_spec[self.n_contract:]
        return self._two_d(bias[None], ((),) + columns, (0,) + tuple(1 + d for d in self._columns()), 1)

    def y2_sharding(self):
        """Where the GEMM's output [M, N] lies (None without typed sharding)."""
        if self.mesh is None:
            return None
        n = len(self.lead)
        order = self.x_order[:n] + tuple(n + d for d in self._columns())
        return self._merged(self.y_spec, order, n)

    def y(self, y2):
        """The GEMM's output [M, N] as [lead..., out...] in the original order."""
        if self.mesh is None:
            return y2.reshape(*self.lead, *self.out)
        n = len(self.lead)
        order = self.x_order[:n] + tuple(n + d for d in self._columns())
        shape = (*self.lead, *self.out)
        y = jax.lax.reshape(y2, tuple(shape[d] for d in order),
                            out_sharding=self._sharding([self.y_spec[d] for d in order]))
        return jnp.transpose(y, tuple(order.index(i) for i in range(len(order))))
