"""flashmesh: fused attention for JAX, fast on one NVIDIA GPU, correct everywhere JAX runs."""

from flashmesh.attention import (AttentionSpec, Explanation, SequenceDescriptor, attention,
                                 explain)

__version__ = "0.1.0"
__all__ = ["attention", "explain", "SequenceDescriptor", "AttentionSpec", "Explanation"]
