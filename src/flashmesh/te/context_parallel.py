"""TransformerEngine's context-parallel names, mapped onto `flashmesh.context_parallel_attention`.

`fused_attn`'s (and `DotProductAttention`'s) context-parallel arguments become the native
call's, with the current `MeshResource` (`te.autocast(mesh_resource=...)`) for what they leave
out:

    TransformerEngine                                   native context_parallel_attention
    context_parallel_axis ("" -> cp_resource)           axis
    CPStrategy.DEFAULT / ALL_GATHER / RING              strategy "auto" / "all_gather" / "ring"
    context_parallel_causal_load_balanced=False         order "contiguous"
      ... =True, stripe_size None (DualChunkSwap)       order "dual_chunk"
      ... =True, stripe_size n (Striped)                order "striped", stripe_size n
    MeshResource fsdp_resource if active, else dp       batch_axis
    MeshResource tpsp_resource if active, else tp       head_axis
    ReorderStrategy.DualChunkSwap / Striped             reorder order "dual_chunk" / "striped"

The call is context parallel when the axis is non-empty, a mesh is set (`jax.set_mesh`) and
the axis has size > 1 in it; otherwise it is the single-device call, as in TransformerEngine
(whose primitives fall back to the plain one on a cp axis of size 1). There a reorder over one
rank is the identity, so the load-balancing arguments describe nothing and are only checked.

Where TransformerEngine refuses and flashmesh computes (the native call keeps every option):
bias, dropout, learnable/off-by-one softmax, windows and padding masks on BSHD layouts, packed
QKV layouts, an odd cp size, and a BSHD layout reordered by `Striped` (stripe_size given).
DEFAULT lets flashmesh's cost model choose (TransformerEngine's DEFAULT runs the all-gather);
the result is the same. A THD layout marked load balanced without a stripe_size is refused,
as in TransformerEngine: its reorder is `Striped`, and the stripe size cannot be guessed.

NotImplementedError: a cp axis that is manual here (inside the user's own `shard_map`, where
the native call's global arrays are not available), and a batch sharded over both the dp and
the fsdp axis (the native call takes one batch axis).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from flashmesh.parallel import layouts
from flashmesh.te.enums import CPStrategy, QKVLayout, ReorderStrategy, canonicalize
from flashmesh.te.sharding import MeshResource, active_axis, current_mesh_resource, tensor_axis

__all__ = ["ContextParallel", "context_parallel", "reorder_causal_load_balancing",
           "inverse_reorder_causal_load_balancing", "STRATEGIES", "ORDERS"]

STRATEGIES = {CPStrategy.DEFAULT: "auto", CPStrategy.ALL_GATHER: "all_gather",
              CPStrategy.RING: "ring"}
ORDERS = {ReorderStrategy.DualChunkSwap: "dual_chunk", ReorderStrategy.Striped: "striped"}

# DotProductAttention's spellings of the strategy (any case).
STRATEGY_NAMES = {"DEFAULT": CPStrategy.DEFAULT, "ALL_GATHER": CPStrategy.ALL_GATHER,
                  "ALLGATHER": CPStrategy.ALL_GATHER, "RING": CPStrategy.RING}


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """The context-parallel arguments of one native call (see the module docstring)."""

    mesh: Any  # the ambient jax.sharding.AbstractMesh
    axis: str
    strategy: str
    order: str
    stripe_size: int | None
    batch_axis: str | None
    head_axis: str | None

    def options(self) -> dict[str, Any]:
        """Keyword arguments of `context_parallel_attention`."""
        return dict(mesh=self.mesh, axis=self.axis, strategy=self.strategy, order=self.order,
                    stripe_size=self.stripe_size, batch_axis=self.batch_axis,
                    head_axis=self.head_axis)


def canonicalize_strategy(strategy) -> CPStrategy:
    """A CPStrategy from itself or a name in any case ('ring', 'ALL_GATHER', 'allgather')."""
    if isinstance(strategy, str):
        if strategy.upper() not in STRATEGY_NAMES:
            raise ValueError(f"context_parallel_strategy={strategy!r} must be one of "
                             f"{sorted(STRATEGY_NAMES)} (any case)")
        return STRATEGY_NAMES[strategy.upper()]
    return canonicalize(CPStrategy, strategy, "context_parallel_strategy")


def _check_stripe_size(stripe_size) -> None:
    if stripe_size is not None and (isinstance(stripe_size, bool) or not isinstance(
            stripe_size, (int, np.integer)) or stripe_size < 1):
        raise ValueError(f"stripe_size must be a positive int or None, got {stripe_size!r}")


def order_of(load_balanced: bool, stripe_size: int | None, layout: QKVLayout
             ) -> tuple[str, int | None]:
    """The native (order, stripe_size) of TransformerEngine's load-balancing arguments."""
    if not load_balanced:
        # TransformerEngine wants a stripe_size for THD layouts even then; with the inputs in
        # their original order it describes no reorder.
        return "contiguous", None
    if stripe_size is not None:
        return "striped", int(stripe_size)
    if layout.is_thd():
        raise ValueError(f"context_parallel_causal_load_balanced=True with qkv_layout="
                         f"{layout.name} needs the stripe_size the inputs were reordered with "
                         "(THD layouts are balanced by ReorderStrategy.Striped)")
    return "dual_chunk", None


def _axis_in(mesh, axis: str, name: str) -> int:
    if axis not in mesh.axis_names:
        raise ValueError(f"{name}={axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    return mesh.shape[axis]


def _batch_and_head_axes(mesh, resource: MeshResource | None, cp_axis: str):
    if resource is None:
        return None, None
    dp, fsdp = (active_axis(mesh, resource, f) for f in ("dp_resource", "fsdp_resource"))
    if dp and fsdp and dp != fsdp:
        raise NotImplementedError(
            f"context parallelism with the batch sharded over both dp_resource={dp!r} and "
            f"fsdp_resource={fsdp!r}: flashmesh.context_parallel_attention takes one batch axis")
    batch_axis = fsdp or dp
    head_axis = tensor_axis(*(active_axis(mesh, resource, f) for f in ("tp_resource", "tpsp_resource")))
    for name, axis in (("batch", batch_axis), ("head", head_axis)):
        if axis == cp_axis:
            raise ValueError(f"the {name} axis {axis!r} of the MeshResource is also the context "
                             "parallel axis")
    return batch_axis, head_axis


def context_parallel(strategy, load_balanced, axis, stripe_size,
                     layout: QKVLayout) -> ContextParallel | None:
    """The native context-parallel arguments of TransformerEngine's, or None when the call
    runs on one device (see the module docstring for when)."""
    strategy = canonicalize_strategy(strategy)
    if not isinstance(load_balanced, (bool, np.bool_)):
        raise ValueError(f"context_parallel_causal_load_balanced must be a bool, got "
                         f"{load_balanced!r}")
    if not isinstance(axis, str):
        raise ValueError(f"context_parallel_axis must be a mesh axis name (str), got {axis!r}")
    _check_stripe_size(stripe_size)

    resource = current_mesh_resource()
    name = "context_parallel_axis"
    if not axis and resource is not None and resource.cp_resource:
        axis, name = resource.cp_resource, "MeshResource.cp_resource"
    mesh = jax.sharding.get_abstract_mesh()
    if not axis or mesh.empty:
        return None
    if _axis_in(mesh, axis, name) == 1:
        return None
    if axis in mesh.manual_axes:
        raise NotImplementedError(
            f"context parallelism over {name}={axis!r} inside shard_map (the axis is manual "
            "here): fused_attn's context-parallel path takes the global arrays; call it "
            "outside shard_map")
    order, stripe = order_of(bool(load_balanced), stripe_size, layout)
    batch_axis, head_axis = _batch_and_head_axes(mesh, resource, axis)
    return ContextParallel(mesh, axis, STRATEGIES[strategy], order, stripe, batch_axis, head_axis)


def _reorder_arguments(strategy, stripe_size) -> tuple[str, int | None]:
    if not isinstance(strategy, ReorderStrategy):
        raise ValueError(f"Unsupported strategy={strategy!r}: must be a ReorderStrategy")
    if strategy == ReorderStrategy.DualChunkSwap:
        if stripe_size is not None:
            raise ValueError(f"Incorrect value for CP dual chunk reordering {stripe_size=}. "
                             "stripe_size must be None")
        return "dual_chunk", None
    _check_stripe_size(stripe_size)
    return "striped", 1 if stripe_size is None else int(stripe_size)


def reorder_causal_load_balancing(tensor, strategy: ReorderStrategy, cp_size: int, seq_dim: int,
                                  stripe_size: int | None = None):
    """Reorders the sequence axis `seq_dim` of `tensor` so causal work is balanced over cp_size
    ranks (`flashmesh.parallel.layouts.reorder_for_context_parallel`).

    DualChunkSwap: 2*cp chunks, rank r holds chunks r and 2cp-1-r (stripe_size must be None).
    Striped: stripes of stripe_size tokens (None: 1) dealt round-robin, rank r holds stripes
    r, r+cp, ... Apply it to q, k, v and the segment ids and positions before sharding them.

    Example (16 tokens, cp_size=4): DualChunkSwap gives rank 0 [0 1 14 15], rank 1
    [2 3 12 13]; Striped with stripe_size=1 gives rank 0 [0 4 8 12].
    """
    order, stripe = _reorder_arguments(strategy, stripe_size)
    if order == "dual_chunk" and cp_size == 1:  # TransformerEngine: one rank, nothing to swap
        return tensor
    return layouts.reorder_for_context_parallel(tensor, order, cp_size, seq_dim, stripe)


def inverse_reorder_causal_load_balancing(tensor, strategy: ReorderStrategy, cp_size: int,
                                          seq_dim: int, stripe_size: int | None = None):
    """Undoes `reorder_causal_load_balancing` with the same arguments (outputs, gradients)."""
    order, stripe = _reorder_arguments(strategy, stripe_size)
    if order == "dual_chunk" and cp_size == 1:
        return tensor
    return layouts.inverse_reorder_for_context_parallel(tensor, order, cp_size, seq_dim, stripe)
