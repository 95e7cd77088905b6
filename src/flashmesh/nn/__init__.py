"""Flax (linen) modules: flashmesh's attention and the blocks of a transformer layer.

The layer blocks take TransformerEngine's field names and defaults (they are also
`flashmesh.te.flax`'s); under `flashmesh.quantization.autocast` their GEMMs run in FP8.
"""

from flashmesh.nn.attention import DotProductAttention
from flashmesh.nn.dense import DenseGeneral, LayerNormDenseGeneral, dense_general
from flashmesh.nn.layernorm import LayerNorm, layernorm
from flashmesh.nn.mlp import LayerNormMLP, activation

__all__ = ["DotProductAttention", "DenseGeneral", "LayerNormDenseGeneral", "LayerNorm",
           "LayerNormMLP", "activation", "dense_general", "layernorm"]
