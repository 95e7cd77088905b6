"""Fused attention: one call, several implementations, one semantics (see `api.attention`)."""

from flashmesh.attention.api import attention, explain, normalize
from flashmesh.attention.registry import IMPLEMENTATIONS, Explanation
from flashmesh.attention.sequence import SequenceDescriptor
from flashmesh.attention.spec import AttentionInputs, AttentionSpec

__all__ = ["attention", "explain", "normalize", "IMPLEMENTATIONS", "Explanation",
           "SequenceDescriptor", "AttentionInputs", "AttentionSpec"]
