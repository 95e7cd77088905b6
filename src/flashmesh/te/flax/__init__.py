"""`transformer_engine.jax.flax` names: flashmesh's Flax modules under TransformerEngine's
fields and defaults (the modules of `flashmesh.nn` use TE's field names themselves, so these
are the same classes; DotProductAttention maps TE's fields onto `flashmesh.attention`)."""

from flashmesh.nn.dense import DenseGeneral, LayerNormDenseGeneral
from flashmesh.nn.layernorm import LayerNorm
from flashmesh.nn.mlp import LayerNormMLP
from flashmesh.nn.multihead import MultiHeadAttention
from flashmesh.nn.relative import RelativePositionBiases
from flashmesh.nn.transformer import TransformerLayer, TransformerLayerType
from flashmesh.te.flax.transformer import DotProductAttention, extend_logical_axis_rules

__all__ = ["DenseGeneral", "DotProductAttention", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP",
           "MultiHeadAttention", "RelativePositionBiases", "TransformerLayer", "TransformerLayerType",
           "extend_logical_axis_rules"]
