"""Logical partitioning of the modules' parameters, in TransformerEngine's form.

Every parameter of `flashmesh.nn` is declared as `flax.linen.with_logical_partitioning` makes
it: `init` returns it boxed (`flax.linen.LogicallyPartitioned`) with its logical axis names,
`nn.get_partition_spec(variables)` reads them, and `nn.logical_to_mesh_sharding(specs, mesh,
rules)` turns them into shardings; `apply` unboxes it (adding a sharding constraint where
logical axis rules and a mesh are active, as Flax does). TransformerEngine's Flax modules
do the same (transformer_engine/jax/flax/module.py), and TransformerLayer / MultiHeadAttention
name their weights' axes with TE's logical names below, which `te.flax.extend_logical_axis_rules`
maps to the axes of the current `MeshResource`.

`nn.scan` over these modules needs `metadata_params={nn.PARTITION_NAME: <name or None>}`, as
for any boxed parameter. `nn.unbox(variables)` gives the plain arrays.

Example:
    >>> variables = te_flax.TransformerLayer(...).init(key, x)
    >>> specs = nn.get_partition_spec(variables)          # PartitionSpec('nvte_w_fsdp', ...)
    >>> with jax.set_mesh(mesh), te.autocast(mesh_resource=te.sharding.MeshResource(tp_resource="model")):
    ...     rules = te_flax.extend_logical_axis_rules(())    # needs the mesh in effect
    >>> shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from flax import linen as nn

__all__ = ["param", "BATCH_AXES", "SEQLEN_AXES", "SEQLEN_TP_AXES", "SEQLEN_CP_AXES", "HEAD_AXES",
           "HIDDEN_AXES", "HIDDEN_TP_AXES", "JOINED_AXES", "W_NO_SHARD_AXES", "W_FSDP_AXES",
           "W_TP_AXES", "W_JOINED_AXES"]

# TransformerEngine's logical axis names (transformer_engine.jax.sharding)
BATCH_AXES = "nvte_batch"
SEQLEN_AXES = "nvte_seqlen"
SEQLEN_TP_AXES = "nvte_seqlen_tp"
SEQLEN_CP_AXES = "nvte_seqlen_cp"
HEAD_AXES = "nvte_head"
HIDDEN_AXES = "nvte_hidden"
HIDDEN_TP_AXES = "nvte_hidden_tp"
JOINED_AXES = "nvte_joined"
W_NO_SHARD_AXES = "nvte_w_no_shard"
W_FSDP_AXES = "nvte_w_fsdp"
W_TP_AXES = "nvte_w_tp"
W_JOINED_AXES = "nvte_w_joined"


def param(module: nn.Module, name: str, init: Callable, shape: Sequence[int], dtype: Any,
          axes: Sequence[str | None]):
    """Declare parameter `name` on `module`, boxed with its logical axis names (`axes`; () for
    none, as TE's default kernel_axes); returns the unboxed array."""
    axes = tuple(axes)
    if axes and len(axes) != len(shape):
        raise ValueError(f"{name}'s logical axes {axes} must name each of its {len(shape)} "
                         f"dimensions (shape {tuple(shape)}) or be empty")
    return module.param(name, nn.with_logical_partitioning(init, axes), tuple(shape), dtype)
