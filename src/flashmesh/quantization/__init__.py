"""FP8 training: recipes, `autocast`, the `fp8_metas` state and FP8 GEMMs.

    with flashmesh.quantization.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=16)):
        variables = model.init(key, x)                       # creates fp8_metas
        loss, grads = jax.value_and_grad(loss_fn)(variables, x)
    variables = update_fp8_metas(variables, grads)           # the state's new value

`flashmesh.te.autocast` is the same context under TransformerEngine's name (it also installs a
MeshResource). The Flax modules of `flashmesh.nn` quantise their GEMMs inside it.
"""

from flashmesh.quantization.autocast import active_recipe, autocast
from flashmesh.quantization.dense import dense, dense_parts
from flashmesh.quantization.recipe import (DelayedScaling, Float8CurrentScaling, Format, MMParams,
                                           MXFP8BlockScaling, NVFP4BlockScaling)
from flashmesh.quantization.state import (COLLECTION, accumulate_gradients, combine_by_max,
                                          update_fp8_metas, written_state)

__all__ = ["autocast", "active_recipe", "dense", "dense_parts", "DelayedScaling", "Float8CurrentScaling",
           "Format", "MMParams", "MXFP8BlockScaling", "NVFP4BlockScaling", "COLLECTION",
           "accumulate_gradients", "combine_by_max", "update_fp8_metas", "written_state"]
