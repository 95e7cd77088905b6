"""flashmesh: fused attention for JAX, fast on one NVIDIA GPU, correct everywhere JAX runs."""

from flashmesh.attention import (AttentionSpec, Explanation, SequenceDescriptor, attention,
                                 explain)
from flashmesh.parallel import (context_parallel_attention, context_parallel_shard, explain_context_parallel,
                                inverse_reorder_for_context_parallel, plan_context_parallel,
                                reorder_for_context_parallel)

__version__ = "0.1.0"
__all__ = ["attention", "explain", "SequenceDescriptor", "AttentionSpec", "Explanation",
           "context_parallel_attention", "context_parallel_shard", "explain_context_parallel", "reorder_for_context_parallel",
           "inverse_reorder_for_context_parallel", "plan_context_parallel"]
