"""TransformerEngine's `transformer_engine.jax.sharding` names: which mesh axis does what.

`MeshResource` names the axes of the ambient mesh (the one `jax.set_mesh` installs) that each
kind of parallelism uses; `te.autocast(mesh_resource=...)` (or `global_shard_guard`) makes it
the current one. flashmesh reads it in one place: the context-parallel mapping of `fused_attn`
and `DotProductAttention` (`flashmesh.te.context_parallel`), which takes

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

__all__ = ["MeshResource", "global_shard_guard", "global_mesh_resource"]


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
