"""`autocast(enabled, recipe)`: the block of code whose GEMMs (and, with `fp8_dpa`, attention)
run in FP8. The recipe is the only global state of quantisation (style.md, 15); the scales
themselves are Flax variables in the `fp8_metas` collection.

The recipe must be current both where a module is initialised (so `init` creates its
`fp8_metas` state) and where it is applied (traced): wrap the code that calls `init` and
`apply`, or the whole loss function, as TransformerEngine does.
"""

from __future__ import annotations

import contextlib

import jax
from jax._src import config as jax_config

from flashmesh.quantization.recipe import (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling,
                                           NVFP4BlockScaling, Recipe)

__all__ = ["autocast", "active_recipe", "check_supported"]

# A JAX config state included in jit's cache key: a function jitted once and called inside and
# outside autocast (or under two recipes) is traced once per recipe, never reusing the other's
# program. (Recipes are frozen dataclasses, so hashable.) jax has no public API for this yet.
_RECIPE = jax_config.string_or_object_state(
    "flashmesh_fp8_recipe", None, "the recipe of the innermost enabled flashmesh FP8 autocast",
    include_in_jit_key=True, include_in_trace_context=True)


def active_recipe() -> DelayedScaling | Float8CurrentScaling | None:
    """The recipe of the innermost enabled `autocast`, or None outside FP8 autocast."""
    return _RECIPE.value


def _compute_capability() -> float | None:
    """Compute capability of the first GPU JAX sees, or None without one."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return None
    cc = getattr(device, "compute_capability", None)
    return float(cc) if cc is not None else None


def check_supported(recipe: Recipe) -> None:
    """Raise NotImplementedError when `recipe` cannot run on the devices JAX uses here.

    Per-tensor FP8 (DelayedScaling, Float8CurrentScaling) runs everywhere: on GPUs of compute
    capability 8.9+ as FP8 GEMMs, on others (CPU included) through XLA's emulation, with the
    same numerics. The block-scaled recipes need Blackwell's block-scaled GEMMs."""
    if isinstance(recipe, (MXFP8BlockScaling, NVFP4BlockScaling)):
        cc = _compute_capability()
        if cc is None or cc < 10.0:
            where = f"compute capability {cc}" if cc is not None else jax.default_backend()
            raise NotImplementedError(f"{type(recipe).__name__} needs {recipe.needs}; this machine "
                                      f"runs {where}. Use DelayedScaling or Float8CurrentScaling")
        raise NotImplementedError(f"{type(recipe).__name__} is not implemented in flashmesh yet "
                                  f"(block-scaled GEMMs); use DelayedScaling or Float8CurrentScaling")
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise ValueError(f"recipe must be a flashmesh.quantization recipe (DelayedScaling, "
                         f"Float8CurrentScaling, ...), got {type(recipe).__name__}")


@contextlib.contextmanager
def autocast(enabled: bool = False, recipe: Recipe | None = None):
    """Run the block's flashmesh modules in FP8 with `recipe` (default DelayedScaling()).

    Args:
      enabled: FP8 on (True) or off (False: the block runs in the inputs' dtype, and an outer
        autocast is switched off inside it).
      recipe: the scaling recipe; None means DelayedScaling(), as in TransformerEngine.

    Example:
      >>> recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16)
      >>> with autocast(enabled=True, recipe=recipe):
      ...     variables = model.init(key, x)          # creates the fp8_metas collection
      ...     loss, grads = jax.value_and_grad(loss_fn)(variables, x)
      >>> variables = update_fp8_metas(variables, grads)   # the new scales and histories
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled must be a bool, got {enabled!r}")
    if enabled:
        recipe = DelayedScaling() if recipe is None else recipe
        check_supported(recipe)
    with _RECIPE(recipe if enabled else None):
        yield
