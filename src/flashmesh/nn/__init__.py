"""Flax (linen) modules built on flashmesh's attention."""

from flashmesh.nn.attention import DotProductAttention

__all__ = ["DotProductAttention"]
