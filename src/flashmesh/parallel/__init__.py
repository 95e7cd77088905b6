"""Context parallelism: one long sequence over a device mesh.

The call: `context.context_parallel_attention` (strategies `ring`, `gather.all_gather`,
`ulysses.all_to_all`, each step an ordinary attention call through `steps`), and its per-shard
form for use inside a user's own shard_map (`shard.context_parallel_shard`).

The pure planning layer (no collectives, plain numpy where it can be):
`layouts` (the sequence orders and their reorders), `schedule` (which shards meet, ring hops,
work per rank), `merge` (partial results combined through their log-sum-exps, the softmax sink
folded in once) and `planner` (token placement for packed batches).
"""

from flashmesh.parallel.context import Choice, context_parallel_attention
from flashmesh.parallel.context import explain as explain_context_parallel
from flashmesh.parallel.layouts import (global_token_index, inverse_reorder_for_context_parallel,
                                        reorder_for_context_parallel)
from flashmesh.parallel.merge import finalize_sink, merge_partials
from flashmesh.parallel.planner import Plan, plan_context_parallel
from flashmesh.parallel.schedule import Schedule, static_schedule
from flashmesh.parallel.shard import context_parallel_shard

__all__ = ["context_parallel_attention", "context_parallel_shard", "explain_context_parallel", "Choice",
           "reorder_for_context_parallel", "inverse_reorder_for_context_parallel",
           "global_token_index", "merge_partials", "finalize_sink", "Plan",
           "plan_context_parallel", "Schedule", "static_schedule"]
