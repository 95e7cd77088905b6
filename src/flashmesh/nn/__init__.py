"""Flax (linen) modules: flashmesh's attention and the blocks of a transformer layer.

The layer blocks take TransformerEngine's field names and defaults (they are also
`flashmesh.te.flax`'s); under `flashmesh.quantization.autocast` their GEMMs run in FP8.
"""

from flashmesh.nn.attention import DotProductAttention
from flashmesh.nn.dense import DenseGeneral, LayerNormDenseGeneral, dense_general
from flashmesh.nn.dropout import Dropout, dropout
from flashmesh.nn.layernorm import LayerNorm, layernorm
from flashmesh.nn.mlp import LayerNormMLP, activation
from flashmesh.nn.multihead import MultiHeadAttention
from flashmesh.nn.relative import RelativePositionBiases
from flashmesh.nn.rotary import rotary_pos_emb
from flashmesh.nn.transformer import TransformerLayer, TransformerLayerType

__all__ = ["DotProductAttention", "DenseGeneral", "Dropout", "dropout", "LayerNormDenseGeneral",
           "LayerNorm", "LayerNormMLP", "activation", "dense_general", "layernorm", "MultiHeadAttention",
           "RelativePositionBiases", "TransformerLayer", "TransformerLayerType", "rotary_pos_emb"]
