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
import enum

from flashmesh.quantization.autocast import autocast as fp8_block
from flax.core import FrozenDict

from flashmesh.quantization.state import COLLECTION, update_fp8_metas
from flashmesh.te.sharding import MeshResource, global_shard_guard

__all__ = ["NVTE_FP8_COLLECTION_NAME", "ScalingMode", "autocast", "fp8_autocast", "is_fp8_available",
           "update_collections"]

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


class ScalingMode(enum.Enum):
    """TE's scaling modes (transformer_engine.jax.quantize.ScalingMode), for `is_fp8_available`."""

    NO_SCALING = "no_scaling"
    DELAYED_TENSOR_SCALING = "delayed_tensor_scaling"
    CURRENT_TENSOR_SCALING = "current_tensor_scaling"
    MXFP8_1D_SCALING = "mxfp8_1d_scaling"
    NVFP4_1D_SCALING = "nvfp4_1d_scaling"
    NVFP4_2D_SCALING = "nvfp4_2d_scaling"


def is_fp8_available(scaling_mode: ScalingMode = ScalingMode.DELAYED_TENSOR_SCALING,
                     gpu_id=None) -> tuple[bool, str]:
    """(whether flashmesh runs `scaling_mode` here, the reason when not), TE's signature.

    Per-tensor scaling (delayed, current) runs on every platform: FP8 GEMMs on GPUs of compute
    capability 8.9+, XLA's emulation (the same numerics) elsewhere, CPU included, where TE
    would answer False. The block-scaled modes answer False with the reason the recipes give
    (they need Blackwell, and flashmesh does not implement them yet). gpu_id is accepted and
    ignored (JAX's devices decide)."""
    from flashmesh.quantization.autocast import check_supported
    from flashmesh.quantization.recipe import MXFP8BlockScaling, NVFP4BlockScaling

    if not isinstance(scaling_mode, ScalingMode):
        raise ValueError(f"scaling_mode must be a ScalingMode, got {scaling_mode!r}")
    recipe = {ScalingMode.MXFP8_1D_SCALING: MXFP8BlockScaling,
              ScalingMode.NVFP4_1D_SCALING: NVFP4BlockScaling,
              ScalingMode.NVFP4_2D_SCALING: NVFP4BlockScaling}.get(scaling_mode)
    if recipe is None:
        return True, ""
    try:
        check_supported(recipe())
    except NotImplementedError as e:
        return False, str(e)
    return True, ""
