"""TransformerEngine-compatible names, so its JAX tutorials run with only the imports changed.

    import transformer_engine.jax as te                  ->  import flashmesh.te as te
    from transformer_engine.jax.attention import ...     ->  from flashmesh.te.attention import ...
    from transformer_engine.jax.flax import ...          ->  from flashmesh.te.flax import ...
    from transformer_engine.jax.sharding import ...      ->  from flashmesh.te.sharding import ...

Everything here is a thin mapping onto flashmesh's native API (`flashmesh.attention`,
`flashmesh.context_parallel_attention`, `flashmesh.nn`), never a second implementation.
`te.autocast` installs a `MeshResource` for the context-parallel mapping; its FP8 part
(`enabled=True`) is not available yet and raises NotImplementedError.
"""

from flashmesh.te import attention, flax, quantize, sharding
from flashmesh.te.quantize import autocast
from flashmesh.te.sharding import MeshResource

__all__ = ["attention", "flax", "quantize", "sharding", "autocast", "MeshResource"]
