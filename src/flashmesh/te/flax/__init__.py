"""`transformer_engine.jax.flax` names: Flax modules mapped onto flashmesh."""

from flashmesh.te.flax.transformer import DotProductAttention

__all__ = ["DotProductAttention"]
