"""TransformerEngine's `transformer_engine.jax.flax.module` path: the same classes as
`flashmesh.te.flax` (flashmesh.nn's modules, which take TE's fields)."""

from flashmesh.nn.dense import DenseGeneral, LayerNormDenseGeneral
from flashmesh.nn.layernorm import LayerNorm
from flashmesh.nn.mlp import LayerNormMLP

__all__ = ["DenseGeneral", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP"]
