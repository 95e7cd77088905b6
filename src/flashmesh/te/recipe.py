"""TransformerEngine's `transformer_engine.common.recipe` names: flashmesh's FP8 recipes.

    from transformer_engine.common.recipe import Format, DelayedScaling
        ->  from flashmesh.te.recipe import Format, DelayedScaling
"""

from flashmesh.quantization.recipe import (DelayedScaling, Float8CurrentScaling, Format, MMParams,
                                           MXFP8BlockScaling, NVFP4BlockScaling, Recipe)

__all__ = ["Format", "MMParams", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
           "NVFP4BlockScaling", "Recipe"]
