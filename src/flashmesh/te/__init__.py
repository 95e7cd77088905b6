"""TransformerEngine-compatible names, so its JAX tutorials run with only the imports changed.

    import transformer_engine.jax as te                  ->  import flashmesh.te as te
    from transformer_engine.jax.attention import ...     ->  from flashmesh.te.attention import ...
    from transformer_engine.jax.flax import ...          ->  from flashmesh.te.flax import ...

Everything here is a thin mapping onto flashmesh's native API (`flashmesh.attention`,
`flashmesh.nn`), never a second implementation.
"""

from flashmesh.te import attention, flax

__all__ = ["attention", "flax"]
