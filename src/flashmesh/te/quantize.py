"""TransformerEngine's `te.autocast(enabled, recipe, mesh_resource)` (its
`transformer_engine.jax.quantize`).

Two things at once, as in TransformerEngine:
* FP8: with `enabled=True` the block's flashmesh modules run their GEMMs in FP8 under `recipe`
  (None means DelayedScaling(), TE's default); `init` inside the block creates the modules'
  `fp8_metas` state (`flashmesh.quantization`).
* `mesh_resource` (a `flashmesh.te.sharding.MeshResource`) is current in the block; the
  context-parallel mapping of `fused_attn` / `DotProductAttention` reads its axes:

    with jax.set_mesh(mesh), te.autocast(mesh_resource=MeshResource(cp_resource="cp")):
        loss, grads = grad_fn(qkv, seq_desc, dout)

`fp8_autocast(enabled, fp8_recipe, mesh_resource)` is TE's older name.
"""

from __future__ import annotations

import contextlib

from flashmesh.quantization.autocast import autocast as fp8_block
from flax.core import FrozenDict

from flashmesh.quantization.state import COLLECTION, update_fp8_metas
from flashmesh.te.sharding import MeshResource, global_shard_guard

__all__ = ["NVTE_FP8_COLLECTION_NAME", "autocast", "fp8_autocast", "update_collections"]

NVTE_FP8_COLLECTION_NAME = COLLECTION  # TE's name of the collection: "fp8_metas"


@contextlib.contextmanager
def autocast(enabled: bool = False, recipe=None, mesh_resource: MeshResource | None = None):
    """Context manager: FP8 (`enabled`, `recipe`) and `mesh_resource` for the block.

    Args:
      enabled: run the block's GEMMs in FP8.
      recipe: the FP8 recipe (flashmesh.te.recipe); None means DelayedScaling(). Unused while
        `enabled=False`, as in TransformerEngine.
      mesh_resource: a MeshResource, or None for none (an outer one is hidden in the block).

    Example:
      >>> with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=16)):
      ...     variables = model.init(key, x)
    """
    with fp8_block(enabled=enabled, recipe=recipe), global_shard_guard(mesh_resource):
        yield


def fp8_autocast(enabled: bool = False, fp8_recipe=None, mesh_resource: MeshResource | None = None):
    """TransformerEngine's deprecated name of `autocast`."""
    return autocast(enabled=enabled, recipe=fp8_recipe, mesh_resource=mesh_resource)


def update_collections(new: dict, original: dict) -> dict:
    """TE's helper: `original` with each collection of `new` written over it (a FrozenDict stays
    one). `fp8_metas` is merged by `flashmesh.quantization.update_fp8_metas`, so a quantiser the
    step did not use keeps its old state instead of taking a cotangent that means nothing.

      >>> other_vars = update_collections(other_grads, other_vars)   # TE's training loop"""
    out = dict(original)
    for name, collection in new.items():
        if name == COLLECTION and COLLECTION in out:
            out = update_fp8_metas(out, {COLLECTION: collection})
        else:
            out[name] = collection
    return FrozenDict(out) if isinstance(original, FrozenDict) else out
