"""TransformerEngine's `transformer_engine.jax.sharding` names: which mesh axis does what.

`MeshResource` names the axes of the ambient mesh (the one `jax.set_mesh` installs, or a
legacy `with mesh:` block's) that each kind of parallelism uses; `te.autocast(mesh_resource=...)`
(or `global_shard_guard`) makes it the current one. flashmesh reads it in two places:
`get_sharding_map_logic_axis_to_mesh_axis` (TE's logical axis names, which the modules' weights
carry, to mesh axes; `te.flax.extend_logical_axis_rules` appends it to Flax rules), and the
context-parallel mapping of `fused_attn` and `DotProductAttention`
(`flashmesh.te.context_parallel`), which takes

* the sequence axis from `cp_resource` when `context_parallel_axis` is "",
* the batch axis from `fsdp_resource` when that axis is active, else `dp_resource`,
* the head axis from `tpsp_resource` when that axis is active, else `tp_resource`,

as TransformerEngine's logical-axis rules do ("active": named, and of size > 1 in the mesh).
`pp_resource` and `ep_resource` are recorded but shard nothing that attention sees.

The current MeshResource is held in a `contextvars.ContextVar`, so nested guards restore the
outer one and threads do not see each other's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

from flashmesh.nn.partitioning import (BATCH_AXES, HEAD_AXES, HIDDEN_AXES, HIDDEN_TP_AXES, JOINED_AXES,
                                       SEQLEN_AXES, SEQLEN_CP_AXES, SEQLEN_TP_AXES, W_FSDP_AXES,
                                       W_JOINED_AXES, W_NO_SHARD_AXES, W_TP_AXES)

__all__ = ["MeshResource", "global_shard_guard", "global_mesh_resource",
           "get_sharding_map_logic_axis_to_mesh_axis", "BATCH_AXES", "SEQLEN_AXES", "SEQLEN_TP_AXES",
           "SEQLEN_CP_AXES", "HEAD_AXES", "HIDDEN_AXES", "HIDDEN_TP_AXES", "JOINED_AXES",
           "W_NO_SHARD_AXES", "W_FSDP_AXES", "W_TP_AXES", "W_JOINED_AXES"]


@dataclasses.dataclass(frozen=True)
class MeshResource:
    """Mesh axis names per kind of parallelism (None: not used).

    Attributes:
      dp_resource: data parallelism (batch sharding).
      tp_resource: tensor parallelism (hidden / head sharding).
      tpsp_resource: tensor sequence parallelism (hidden and sequence sharding).
      fsdp_resource: fully sharded data parallelism (batch and weight sharding).
      pp_resource: pipeline parallelism (layer sharding).
      cp_resource: context parallelism (sequence sharding inside attention).
      ep_resource: expert parallelism.

    Example:
      >>> mesh = jax.make_mesh((4,), ("cp",))
      >>> with jax.set_mesh(mesh), te.autocast(mesh_resource=MeshResource(cp_resource="cp")):
      ...     out = jax.jit(attention_fn)(q, k, v)   # fused_attn shards the sequence over "cp"
    """

    dp_resource: str | None = None
    tp_resource: str | None = None
    tpsp_resource: str | None = None
    fsdp_resource: str | None = None
    pp_resource: str | None = None
    cp_resource: str | None = None
    ep_resource: str | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{field.name} must be a mesh axis name (str) or None, "
                                 f"got {value!r}")


_CURRENT: contextvars.ContextVar[MeshResource | None] = contextvars.ContextVar(
    "flashmesh_te_mesh_resource", default=None)


@contextlib.contextmanager
def global_shard_guard(resource: MeshResource | None):
    """Makes `resource` the current MeshResource inside the block (None: none), restoring the
    previous one on exit."""
    if resource is not None and not isinstance(resource, MeshResource):
        raise ValueError(f"mesh_resource must be a MeshResource or None, got "
                         f"{type(resource).__name__}")
    token = _CURRENT.set(resource)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_mesh_resource() -> MeshResource | None:
    """The MeshResource of the innermost `global_shard_guard` / `te.autocast`, or None."""
    return _CURRENT.get()


def global_mesh_resource() -> MeshResource:
    """The current MeshResource; raises outside any `global_shard_guard` / `te.autocast(
    mesh_resource=...)`, as TransformerEngine does."""
    resource = _CURRENT.get()
    if resource is None:
        raise RuntimeError("no MeshResource is set: wrap the code in te.autocast(mesh_resource="
                           "MeshResource(...)) or global_shard_guard(MeshResource(...))")
    return resource


def current_mesh():
    """The mesh in effect: a legacy `with mesh:` block's, else `jax.set_mesh`'s (possibly empty)."""
    import jax
    from jax._src import mesh as mesh_lib

    physical = mesh_lib.thread_resources.env.physical_mesh
    if physical is not None and not physical.empty:
        return physical
    return jax.sharding.get_abstract_mesh()


def get_sharding_map_logic_axis_to_mesh_axis() -> dict[str, str | None]:
    """TE's logical axis names -> the current MeshResource's mesh axes, as TE maps them: the
    batch to fsdp where that axis is active (named, of size > 1) else dp; heads, the
    tensor-parallel hidden and weights' tp axis to tpsp where active else tp; weights' fsdp
    axis to fsdp; the sequence's tp / cp axes to tpsp / cp; the rest None. Without a
    MeshResource, MeshResource() (everything None), as TE's autocast installs. Empty when no
    mesh is in effect or every mesh axis is manual (inside shard_map), as TE's; an axis that
    is manual (a partly manual shard_map) maps to None, since a sharding constraint cannot name
    it. ValueError where tp and tpsp are both active, or the tp, tpsp or fsdp axis is not an
    axis of the mesh (TE asserts both)."""
    import jax

    mesh = current_mesh()
    if mesh.empty:
        return {}
    abstract = jax.sharding.get_abstract_mesh()
    manual = set() if abstract.empty else set(abstract.manual_axes)
    if manual and manual >= set(mesh.axis_names):
        return {}
    r = current_mesh_resource() or MeshResource()
    fsdp, tpsp = active_axis(mesh, r, "fsdp_resource"), active_axis(mesh, r, "tpsp_resource")
    tp = tensor_axis(active_axis(mesh, r, "tp_resource"), tpsp) or r.tp_resource
    table = {BATCH_AXES: fsdp or r.dp_resource,
             SEQLEN_AXES: None, SEQLEN_TP_AXES: r.tpsp_resource, SEQLEN_CP_AXES: r.cp_resource,
             HEAD_AXES: tp, HIDDEN_AXES: None, HIDDEN_TP_AXES: tp, JOINED_AXES: None,
             W_NO_SHARD_AXES: None, W_FSDP_AXES: r.fsdp_resource, W_TP_AXES: tp, W_JOINED_AXES: None}
    return {name: None if axis in manual else axis for name, axis in table.items()}


def active_axis(mesh, resource: MeshResource, field: str) -> str | None:
    """The axis `resource.<field>` names when it is an axis of `mesh` of size > 1 ("active"),
    None when unnamed or of size 1; ValueError when the mesh has no such axis."""
    axis = getattr(resource, field)
    if axis is None:
        return None
    if axis not in mesh.axis_names:
        raise ValueError(f"MeshResource.{field}={axis!r} is not an axis of the mesh "
                         f"{tuple(mesh.axis_names)}")
    return axis if dict(mesh.shape)[axis] > 1 else None


def tensor_axis(tp: str | None, tpsp: str | None) -> str | None:
    """The active tensor-parallel axis of the active tp and tpsp axes (tpsp first); ValueError
    when both are active and differ (tensor and tensor sequence parallelism exclude each
    other, as TE asserts)."""
    if tp and tpsp and tp != tpsp:
        raise ValueError(f"MeshResource: tp_resource={tp!r} and tpsp_resource={tpsp!r} cannot both "
                         "be active (tensor parallelism and tensor sequence parallelism exclude "
                         "each other)")
    return tpsp or tp
