"""The Mosaic GPU kernels in a program over several devices: split over batch and heads.

XLA's SPMD partitioner cannot split a Pallas call: it runs the whole call on every device. Under
a mesh set for the program (`jax.set_mesh`, `with mesh:`) each kernel call (the forward, the
backward's kernels) runs on the shards of the batch and head axes instead, as cuDNN's call does
in JAX: on a mesh of Explicit axes by `jax.shard_map` over the axes q's type names, on Auto axes
(shardings chosen by the partitioner) by `custom_partitioning`, whose rule takes q's batch and
head sharding and lays every other operand out to match. A program sharded with no mesh set
runs the kernels whole on every device: keying the split on the device count instead would take
one device's programs on a host with several GPUs off the direct calls and the automatic choice
(2026-12-07). JAX cannot export (`jax.export`) a program over several devices that holds a
custom_partitioning (its Python callbacks do not serialise), as for cuDNN's call.
Under vmap the mapped axis folds into the batch (`_batchable`). Sequence and
head-dimension shardings are gathered (context parallelism is `flashmesh.parallel`'s). Heads
split only where the key/value heads split evenly with them (GQA groups stay whole); else only
the batch.

Every operand has a role naming its layout (`ROLES`). Results summed over batch or heads (the
sink's gradient; a bias gradient broadcast over them) are summed over those shards. Dropout
draws the same elements: its row hashes [B, N, T] are computed from global numbers before the
split.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.custom_batching
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from flashmesh.attention.spec import AttentionSpec

__all__ = ["ROLES", "multi_device", "run", "splits"]

# role -> which dims are batch (b) and heads (h, or hk for key/value heads); others never split
ROLES = {
    "q": ("b", None, "h", None),      # q, out, d_out, dq: [B, T, N, D]
    "kv": ("b", None, "hk", None),    # k, v, dk, dv: [B, S, K, D]
    "rows": ("b", "h", None),         # lse, d_lse, dropout row hashes: [B, N, T]
    "heads": ("h",),                  # sink, dsink: [N]
    "tokens": ("b", None),            # segment / position tables: [B, T] or [B, S]
    "bias": ("b", "h", None, None),   # bias, dbias: [B|1, N|1, T, S]
}


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _size(mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def splits(spec: AttentionSpec, mesh, q_spec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(batch mesh axes, head mesh axes) the call runs split over, from q's PartitionSpec: its
    batch and head entries where they divide B and both N and K."""
    q_spec = tuple(q_spec) + (None,) * 4
    b, h = _axes(q_spec[0]), _axes(q_spec[2])
    if b and spec.batch % _size(mesh, b):
        b = ()
    if h and (spec.num_heads % _size(mesh, h) or spec.num_kv_heads % _size(mesh, h)):
        h = ()
    return b, h


def _entry(axes):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _spec(role: str, shape, b, h) -> PartitionSpec:
    """Where an operand of this role and shape lies when the call splits over b and h (shape
    None: no dim of size 1, which only a bias's broadcast dims have)."""
    dims = []
    for kind, n in zip(ROLES[role], shape or (2,) * len(ROLES[role])):
        axes = b if kind == "b" else h if kind in ("h", "hk") else ()
        dims.append(_entry(axes) if n > 1 or role != "bias" else None)
    return PartitionSpec(*dims)


def _local(spec: AttentionSpec, mesh, b, h) -> AttentionSpec:
    """The spec of one shard's call."""
    nb, nh = _size(mesh, b), _size(mesh, h)
    bias = spec.bias_shape
    if bias is not None:
        bias = (bias[0] // nb if bias[0] > 1 else 1, bias[1] // nh if bias[1] > 1 else 1, *bias[2:])
    return dataclasses.replace(spec, batch=spec.batch // nb, num_heads=spec.num_heads // nh,
                               num_kv_heads=spec.num_kv_heads // nh, bias_shape=bias)


def _summed(outs, out_roles, b, h):
    """Sum the shards' partial results: the sink's gradient over the batch, a bias gradient over
    the batch or heads it is broadcast along."""
    done = []
    for x, role in zip(outs, out_roles):
        axes = ()
        if role == "heads":
            axes = b
        elif role == "bias":
            axes = (b if x.shape[0] == 1 else ()) + (h if x.shape[1] == 1 else ())
        done.append(lax.psum(x, axes) if axes else x)
    return tuple(done)


def multi_device() -> str | None:
    """'explicit' under a mesh of Explicit axes, 'auto' under a mesh of Auto axes over several
    devices (`jax.set_mesh`, or a legacy `with mesh:` block), None without one or inside
    shard_map."""
    from jax._src import mesh as mesh_lib

    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.manual_axes:
        return None
    if not mesh.empty and any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return "explicit"
    legacy = mesh_lib.thread_resources.env.physical_mesh
    if (not mesh.empty and mesh.size > 1) or (legacy is not None and legacy.size > 1):
        return "auto"
    return None


def run(fn: Callable, spec: AttentionSpec, arrays, in_roles, out_roles, *, split: bool = True):
    """fn(spec, *arrays) -> tuple of arrays, split over the batch and head shards of a
    multi-device program (the module docstring); fn itself on one device or with split=False
    (the kernels in Mosaic GPU's interpreter, which runs on one device: its simulated shared
    memory is one per process). arrays[0] is q (or an array laid out like it); None entries
    (absent optional operands) stay None."""
    present = tuple(i for i, a in enumerate(arrays) if a is not None)
    kind = multi_device() if split else None
    if len(out_roles) == 0 or kind is None:
        return fn(spec, *arrays)
    if in_roles[0] != "q" or 0 not in present:
        raise ValueError("the first operand must be q (role 'q')")
    roles = tuple(in_roles[i] for i in present)
    call = functools.partial(_call_present, fn, present, len(arrays))

    given = [arrays[i] for i in present]
    if kind == "explicit":
        return _shard_map(call, spec, given, roles, tuple(out_roles))
    return _batchable(call, spec, given, roles, tuple(out_roles))


def _batchable(call, spec, given, roles, out_roles):
    """The custom_partitioning form of the call, with a vmap rule: custom_partitioning has none.
    Under vmap the mapped axis is folded into the batch (batch-major, so each device's shard
    stays contiguous) and the folded call splits as before; where folding cannot express the
    mapped call (a mapped sink or bias, or a sink's or bias's gradient, which are per mapped
    element) the call runs whole, with the kernels' own batching, on every device."""
    partitioned = _partitioned(call, roles, out_roles)
    batchable = jax.custom_batching.custom_vmap(lambda *xs: partitioned(*xs, spec))

    @batchable.def_vmap
    def _(axis_size, in_batched, *xs):
        folded = _fold(spec, xs, in_batched, roles, out_roles, axis_size)
        if folded is None:
            outs = jax.vmap(lambda *xs: call(spec, *xs), in_axes=tuple(0 if b else None for b in in_batched),
                            axis_size=axis_size)(*xs)
        else:
            outs = tuple(_unfold(x, axis_size) for x in _batchable(call, *folded, roles, out_roles))
        return outs, (True,) * len(outs)

    return batchable(*given)


_FOLDABLE = ("q", "kv", "rows", "tokens")  # roles whose dim 0 is the batch


def _fold(spec, xs, in_batched, roles, out_roles, V):
    """(spec, operands) of the call over batch B * V, the mapped axis V folded in after B; None
    where that cannot express the mapped call."""
    if any(r not in ("q", "kv", "rows") for r in out_roles):
        return None
    folded = []
    for x, batched, role in zip(xs, in_batched, roles):
        if role in _FOLDABLE:
            if not batched:
                if role in ("q", "kv"):  # a shared q, k or v: folding would copy it V times
                    return None
                x = jnp.broadcast_to(x[None], (V,) + x.shape)  # small integer tables
            x = jnp.moveaxis(x, 0, 1)
            folded.append(x.reshape((x.shape[0] * V,) + x.shape[2:]))
        elif batched or (role == "bias" and x.shape[0] != 1):
            return None
        else:
            folded.append(x)  # an unmapped sink, or a bias broadcast over the batch
    return dataclasses.replace(spec, batch=spec.batch * V), folded


def _unfold(x, V):
    """A folded result [B * V, ...] as [V, B, ...]."""
    return jnp.moveaxis(x.reshape((x.shape[0] // V, V) + x.shape[1:]), 1, 0)


def _call_present(fn, present, n, local, *given):
    """fn(local, *arrays) with the given arrays at the positions `present`, None elsewhere."""
    full = [None] * n
    for i, x in zip(present, given):
        full[i] = x
    return tuple(fn(local, *full))


def _shard_map(call, spec, given, roles, out_roles):
    q_type = jax.typeof(given[0])
    mesh = q_type.sharding.mesh
    b, h = splits(spec, mesh, q_type.sharding.spec)
    local = _local(spec, mesh, b, h)
    in_specs = tuple(_spec(r, x.shape, b, h) for r, x in zip(roles, given))
    # a result's layout is its role's; a bias gradient has the bias's shape
    bias_shape = next((x.shape for r, x in zip(roles, given) if r == "bias"), None)
    out_specs = tuple(_spec(r, bias_shape if r == "bias" else None, b, h) for r in out_roles)
    given = [jax.sharding.reshard(x, s) for x, s in zip(given, in_specs)]
    body = lambda *xs: _summed(call(local, *xs), out_roles, b, h)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=set(b) | set(h), check_vma=False)(*given)


def _partitioned(call, roles, out_roles):
    """`call` as a custom_partitioning over the operands' roles (spec static, last)."""
    from jax.experimental.custom_partitioning import custom_partitioning

    n = len(roles)
    # under jit, the constants the call makes stay inside it (custom_partitioning takes none)
    jitted = jax.jit(call, static_argnums=0)
    cp = custom_partitioning(lambda *args: jitted(args[n], *args[:n]), static_argnums=(n,))

    def plan(spec, mesh, arg_shapes):
        sharding = arg_shapes[0].sharding
        q_spec = sharding.spec if isinstance(sharding, NamedSharding) else ()
        return splits(spec, mesh, q_spec)

    def shardings(mesh, shapes, role_list, b, h):
        return tuple(NamedSharding(mesh, _spec(r, s.shape, b, h)) for r, s in zip(role_list, shapes))

    def infer(spec, mesh, arg_shapes, result_shape):
        b, h = plan(spec, mesh, arg_shapes)
        return shardings(mesh, result_shape, out_roles, b, h)

    def partition(spec, mesh, arg_shapes, result_shape):
        b, h = plan(spec, mesh, arg_shapes)
        local = _local(spec, mesh, b, h)

        def lower(*xs):
            return _summed(jitted(local, *xs), out_roles, b, h)

        return (mesh, lower, shardings(mesh, result_shape, out_roles, b, h),
                shardings(mesh, arg_shapes, roles, b, h))

    def rule(spec, mesh, value_types, result_types):
        return _rule(roles, out_roles, value_types, result_types)

    cp.def_partition(infer_sharding_from_operands=infer, partition=partition, sharding_rule=rule)
    return cp


def _rule(roles, out_roles, value_types, result_types) -> str:
    """Shardy's rule: the batch, head and key/value-head dims share factors b, h, k (bias dims
    of size 1 and every other dim get factors of their own)."""
    counter = iter(range(10_000))

    def factors(role, shape):
        names = []
        for kind, size in zip(ROLES[role], shape):
            if kind is None or (role == "bias" and size == 1):
                names.append(f"u{next(counter)}")
            else:
                names.append({"b": "b", "h": "h", "hk": "k"}[kind])
        return " ".join(names)

    ins = ", ".join(factors(r, v.shape) for r, v in zip(roles, value_types))
    outs = ", ".join(factors(r, v.shape) for r, v in zip(out_roles, result_types))
    return f"{ins} -> {outs}"
