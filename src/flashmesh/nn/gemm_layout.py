"""How `dense_general` lays an N-D contraction out as one 2-D GEMM [M, K] @ [K, N].

Without shardings in the types this is a plain flatten: x [lead..., K...] -> [M, K], kernel
[K..., N...] -> [K, N], y [M, N] -> [lead..., N...]. On a mesh with Explicit axes JAX checks
every reshape and contraction: merging axes is allowed only where the sharded ones come first
(a fused QKV kernel [E, 3, F@model] cannot become [E, 3F]), and a GEMM that contracts a
sharded axis (a row-parallel kernel) must be told where its output lies. `Layout.of` then
orders each group of axes (x's leading ones, the contracted ones, the kernel's outputs) with
the sharded axes first, gives every reshape and the GEMM its output sharding, and puts the
axes back in order after the GEMM; the order costs a transpose only where a sharded axis is
not already first in its group. The GEMM's output is sharded as x's rows and the kernel's
columns, less any mesh axis both use (x's keeps it), and summed over the contracted axes'.
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


def _sharded_first(group: tuple[int, ...], *specs) -> tuple[int, ...]:
    """The dimensions of `group`, those sharded in any of `specs` first, each part in order."""
    sharded = [d for d in group if any(s[d] for s in specs)]
    return tuple(sharded) + tuple(d for d in group if d not in sharded)


class Layout(NamedTuple):
    """The 2-D form of one contraction (see the module docstring). mesh None: no typed sharding,
    the plain flatten; else the orders and the mesh axes of each dimension."""

    lead: tuple[int, ...]        # x's leading shape
    out: tuple[int, ...]         # the kernel's output shape
    mesh: object = None
    x_order: tuple[int, ...] = ()
    k_order: tuple[int, ...] = ()
    x_spec: tuple = ()           # mesh axes per dimension of x, in x_order
    k_spec: tuple = ()           # ... of the kernel, in k_order
    y_spec: tuple = ()           # ... of y [lead..., out...] in the GEMM's order

    @classmethod
    def of(cls, x, kernel, n_contract: int) -> "Layout":
        lead_n = x.ndim - n_contract
        lead, out = tuple(x.shape[:lead_n]), tuple(kernel.shape[n_contract:])
        typed = [a for a in (x, kernel) if layouts.typed_sharding(a)]
        if not typed:
            return cls(lead, out)
        xs, ks = _spec(x, x.ndim), _spec(kernel, kernel.ndim)
        # x's contracted dim lead_n + i is the kernel's dim i: one order for both
        contract = _sharded_first(tuple(range(n_contract)), xs[lead_n:], ks[:n_contract])
        x_order = _sharded_first(tuple(range(lead_n)), xs) + tuple(lead_n + i for i in contract)
        k_order = contract + _sharded_first(tuple(range(n_contract, kernel.ndim)), ks)
        x_spec, k_spec = tuple(xs[d] for d in x_order), tuple(ks[d] for d in k_order)
        used = {a for s in x_spec[:lead_n] for a in s}
        y_spec = x_spec[:lead_n] + tuple(tuple(a for a in s if a not in used)
                                         for s in k_spec[n_contract:])
        return cls(lead, out, jax.typeof(typed[0]).sharding.mesh, x_order, k_order, x_spec,
                   k_spec, y_spec)

    def _sharding(self, specs):
        return jax.sharding.NamedSharding(self.mesh, jax.P(*(_entry(s) for s in specs)))

    def _merged(self, specs, *groups):
        """The sharding of `specs` with each group of dimensions (ranges) merged into one."""
        return self._sharding([sum((specs[d] for d in g), ()) for g in groups])

    def x2(self, x):
        """x as [M, K]."""
        k_dim = math.prod(x.shape[len(self.lead):])
        if self.mesh is None:
            return x.reshape(-1, k_dim)
        n = len(self.lead)
        return jax.lax.reshape(jnp.transpose(x, self.x_order), (math.prod(self.lead), k_dim),
                               out_sharding=self._merged(self.x_spec, range(n), range(n, x.ndim)))

    def k2(self, kernel):
        """The kernel as [K, N]."""
        n_dim = math.prod(self.out)
        k_dim = math.prod(kernel.shape[:kernel.ndim - len(self.out)])
        if self.mesh is None:
            return kernel.reshape(k_dim, n_dim)
        n = kernel.ndim - len(self.out)
        return jax.lax.reshape(jnp.transpose(kernel, self.k_order), (k_dim, n_dim),
                               out_sharding=self._merged(self.k_spec, range(n), range(n, kernel.ndim)))

    def bias2(self, bias):
        """bias [N...] as [1, N], in the kernel's column order and sharded as y's columns."""
        if self.mesh is None:
            return bias.reshape(1, -1)
        n = len(self.k_order) - len(self.out)
        order = tuple(d - n for d in self.k_order[n:])
        spec = _spec(bias, bias.ndim)
        b2 = jax.lax.reshape(jnp.transpose(bias, order), (1, math.prod(self.out)),
                             out_sharding=self._merged([spec[d] for d in order], (), range(len(order))))
        # as y's columns lie (a bias sharded over the rows' mesh axis is gathered)
        return jax.sharding.reshard(b2, self._merged(self.y_spec, (), range(len(self.lead), len(self.y_spec))))

    def y2_sharding(self):
        """Where the GEMM's output [M, N] lies (None without typed sharding)."""
        if self.mesh is None:
            return None
        n = len(self.lead)
        return self._merged(self.y_spec, range(n), range(n, len(self.y_spec)))

    def y(self, y2):
        """The GEMM's output [M, N] as [lead..., out...] in the original order."""
        if self.mesh is None:
            return y2.reshape(*self.lead, *self.out)
        n, n_contract = len(self.lead), len(self.k_order) - len(self.out)
        lead = tuple(self.lead[d] for d in self.x_order[:n])
        out_dims = tuple(d - n_contract for d in self.k_order[n_contract:])
        y = jax.lax.reshape(y2, (*lead, *(self.out[d] for d in out_dims)),
                            out_sharding=self._sharding(self.y_spec))
        # back to x's and the kernel's order
        order = tuple(self.x_order[:n]) + tuple(n + d for d in out_dims)
        return jnp.transpose(y, tuple(order.index(i) for i in range(len(order))))
