"""TransformerEngine-compatible names, so its JAX tutorials run with only the imports changed.

    import transformer_engine.jax as te                  ->  import flashmesh.te as te
    from transformer_engine.jax.attention import ...     ->  from flashmesh.te.attention import ...
    import transformer_engine.jax.flax as te_flax        ->  import flashmesh.te.flax as te_flax
    from transformer_engine.jax.sharding import ...      ->  from flashmesh.te.sharding import ...
    from transformer_engine.common.recipe import ...     ->  from flashmesh.te.recipe import ...

Everything here is a thin mapping onto flashmesh's native API (`flashmesh.attention`,
`flashmesh.context_parallel_attention`, `flashmesh.nn`, `flashmesh.quantization`), never a
second implementation. `te.autocast` turns on FP8 and installs a `MeshResource`.
"""

import importlib

from flashmesh.te import activation, attention, quantize, recipe, sharding
from flashmesh.te.quantize import NVTE_FP8_COLLECTION_NAME, autocast, fp8_autocast, update_collections
from flashmesh.te.sharding import MeshResource

__all__ = ["activation", "attention", "flax", "quantize", "recipe", "sharding", "autocast",
           "fp8_autocast", "update_collections", "MeshResource", "NVTE_FP8_COLLECTION_NAME"]


def __getattr__(name):
    # `te.flax` is imported on first use: flashmesh.nn's modules import flashmesh.te.attention,
    # and flashmesh.te.flax re-exports flashmesh.nn, so an eager import here would be a cycle.
    if name == "flax":
        return importlib.import_module("flashmesh.te.flax")
    raise AttributeError(f"module 'flashmesh.te' has no attribute {name!r}")
