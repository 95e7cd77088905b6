"""TransformerEngine's `te.autocast(enabled, recipe, mesh_resource)` (its `transformer_engine.jax.
quantize`), without FP8 for now.

What it does today: installs `mesh_resource` (a `flashmesh.te.sharding.MeshResource`) for the
block, which the context-parallel mapping of `fused_attn` / `DotProductAttention` reads for
its sequence, batch and head axes. TransformerEngine's tutorials use it that way:

    with jax.set_mesh(mesh), te.autocast(mesh_resource=MeshResource(cp_resource="cp")):
        loss, grads = grad_fn(qkv, seq_desc, dout)

FP8 (`enabled=True`) is not implemented yet and raises NotImplementedError at the call, so
no block ever runs believing it is quantised. `recipe` only matters when enabled, as in
TransformerEngine, so it is accepted and unused while `enabled=False`.
"""

from __future__ import annotations

from flashmesh.te.sharding import MeshResource, global_shard_guard

__all__ = ["autocast"]

FP8_TODO = ("FP8 autocast (enabled=True) is not yet available in flashmesh: flashmesh.te.autocast "
            "only installs mesh_resource for now")


def autocast(enabled: bool = False, recipe=None, mesh_resource: MeshResource | None = None):
    """Context manager: `mesh_resource` is the current MeshResource inside the block.

    Args:
      enabled: FP8 quantisation; True raises NotImplementedError (not yet available).
      recipe: the FP8 recipe; unused while `enabled=False` (as in TransformerEngine).
      mesh_resource: a MeshResource, or None for none (an outer one is hidden in the block).

    Example:
      >>> with te.autocast(mesh_resource=MeshResource(cp_resource="cp")):
      ...     ...
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled must be a bool, got {enabled!r}")
    if enabled:
        raise NotImplementedError(FP8_TODO)
    return global_shard_guard(mesh_resource)
