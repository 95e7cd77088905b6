"""What the cp preset reports about its workload without timing anything.

For each (workload, cp) of a run: the planner's plan for the segment ids
(`plan_context_parallel`: order, balance, K/V volume), each order's exact work balance and K/V
volume (`schedule.pair_counts`, `kv_needed`: visible (query, key) pairs per rank, distinct key
tokens a rank's queries see on other ranks) and `explain`'s choice for strategy="auto" (on an
abstract mesh, so no devices are needed). Also the registry's choice for one ring step, which
the one-device baseline of the same backend is chosen by.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from flashmesh.attention import SequenceDescriptor, api, registry
from flashmesh.bench import runner
from flashmesh.bench.implementations import DTYPES
from flashmesh.bench.shapes import (CP_ORDERS as ORDERS, EMULATED_CP, ONE_DEVICE, CpRow, Preset, Shape,
                                    segment_ids_and_positions)
from flashmesh.parallel import layouts, plan_context_parallel, schedule, steps
from flashmesh.parallel.context import explain

AXIS = "cp"


def segment_arrays(shape: Shape) -> tuple[np.ndarray | None, np.ndarray | None]:
    """int32 segment ids and positions [B, T] of the workload (None, None without segments)."""
    if not shape.segments:
        return None, None
    ids, pos = segment_ids_and_positions(shape)
    return np.tile(ids, (shape.B, 1)), np.tile(pos, (shape.B, 1))


def descriptor(shape: Shape, ids, pos):
    """The SequenceDescriptor of ids and positions as stored (None without segments)."""
    if ids is None:
        return None
    return SequenceDescriptor.from_segment_ids_and_pos(ids, pos, max_segments=max(shape.num_documents, 1))


def step_implementation(shape: Shape, dtype: str, cp: int) -> str:
    """The registry's choice (implementation=None) for one ring step of the workload over cp
    ranks: what `steps.attend` runs there (on a GPU, packed documents go to chunked: a step's
    positions are explicit, which cuDNN refuses)."""
    sds = lambda *dims: jax.ShapeDtypeStruct(dims, DTYPES[dtype])  # noqa: E731
    ids, pos = segment_arrays(shape)
    specs = []
    jax.eval_shape(lambda q, k, v: specs.append(api.normalize(
        q, k, v, mask=shape.mask, window=shape.window, segments=descriptor(shape, ids, pos))[1]) or 0,
        sds(shape.B, shape.T, shape.N, shape.Dqk), sds(shape.B, shape.S, shape.K, shape.Dqk),
        sds(shape.B, shape.S, shape.K, shape.Dv))
    return registry.select(steps.step_spec(specs[0], shape.T // cp, shape.S // cp, None), None).name


# -- facts: planner, balance, K/V volume, auto's choice -----------------------------------------
def choice(shape: Shape, dtype: str, cp: int, row: CpRow, strategy: str = "auto"):
    """explain's Choice for the workload stored in this row's order over cp ranks (on an
    abstract mesh: no devices needed)."""
    ids, pos = segment_arrays(shape)
    stored = lambda x: None if x is None else jnp.asarray(  # noqa: E731
        layouts.reorder_for_context_parallel(x, row.order, cp, 1, row.stripe_size))
    sds = lambda *dims: jax.ShapeDtypeStruct(dims, DTYPES[dtype])  # noqa: E731
    q = sds(shape.B, shape.T, shape.N, shape.Dqk)
    k, v = sds(shape.B, shape.S, shape.K, shape.Dqk), sds(shape.B, shape.S, shape.K, shape.Dv)
    return explain(q, k, v, mesh=AbstractMesh((cp,), (AXIS,)), axis=AXIS, strategy=strategy,
                   order=row.order, stripe_size=row.stripe_size, mask=shape.mask, window=shape.window,
                   segments=descriptor(shape, stored(ids), stored(pos)))


def order_balance(shape: Shape, cp: int, row: CpRow) -> dict:
    """Exact visible pairs per rank, their balance (max / mean) and the K/V tokens each rank
    must receive from the others, when the workload is stored in this order."""
    ids, _ = segment_arrays(shape)
    if ids is None:
        ids = np.ones((shape.B, shape.T), np.int32)
    owner = np.broadcast_to(layouts.token_owner(row.order, cp, shape.T, row.stripe_size), ids.shape)
    kw = dict(window=shape.effective_window, q_positions=schedule.segment_positions(ids), q_segment_ids=ids)
    kw.update(kv_positions=kw["q_positions"], kv_segment_ids=ids)
    work = schedule.pair_counts(owner, owner, cp, **kw).sum(axis=1)
    kv = schedule.received_kv(schedule.kv_needed(owner, owner, cp, **kw))
    return dict(work_per_rank=work.tolist(), balance=float(work.max() / work.mean()) if work.sum() else 1.0,
                kv_received_per_rank=kv.tolist(), kv_received_total=int(kv.sum()))


def _guarded(fn: Callable, *args) -> dict:
    try:
        return fn(*args)
    except Exception as e:  # a fact that cannot be computed says why; the run goes on
        return dict(error=runner.classify(e)[1])


def _planner(shape: Shape, cp: int) -> dict:
    ids, _ = segment_arrays(shape)
    if ids is None:
        return dict(error="the workload has no segment ids to plan")
    plan = plan_context_parallel(ids, cp, window=shape.effective_window)
    return dict(order=plan.order, balance=plan.balance, kv_volume_per_rank=plan.kv_volume.tolist(),
                kv_volume_total=int(plan.kv_volume.sum()), contiguous_balance=plan.contiguous_balance,
                contiguous_kv_volume_total=int(plan.contiguous_kv_volume.sum()), describe=plan.describe())


def _choice(shape: Shape, dtype: str, cp: int, row: CpRow) -> dict:
    c = choice(shape, dtype, cp, row)
    return dict(strategy=c.strategy, reason=c.reason, hops=list(c.hops),
                received_bytes={k: int(v) for k, v in c.received.items()}, text=str(c))


def facts(plan: Preset, config: runner.RunConfig) -> dict:
    """For each (workload, cp) of the plan's groups: the planner's plan, each order's balance
    and K/V volume, and explain's choice for strategy="auto" (json-ready)."""
    entries = {}
    for group in plan.groups:
        shape = group.shapes[0]
        if group.name == "strategies":
            cp = jax.device_count()
            rows = [CpRow.parse(lab) for lab in group.implementations if lab != ONE_DEVICE]
        else:
            cp, rows = EMULATED_CP, [CpRow("ring", "contiguous")]
        entry = entries.setdefault((shape.name, cp), dict(shape=shape.name, cp=cp, groups=[], orders={},
                                                         planner=_guarded(_planner, shape, cp)))
        entry["groups"].append(group.name)
        for row in rows:
            label = row.label.partition("/")[2]
            if label not in entry["orders"]:
                entry["orders"][label] = dict(order=row.order, stripe_size=row.stripe_size,
                                              balance=_guarded(order_balance, shape, cp, row),
                                              auto=_guarded(_choice, shape, config.dtype, cp, row))
    for entry in entries.values():  # contiguous, dual_chunk, then striped by stripe size
        entry["orders"] = dict(sorted(entry["orders"].items(), key=lambda kv: (
            ORDERS.index(kv[1]["order"]), kv[1]["stripe_size"] or 0)))
    return dict(cp_workloads=list(entries.values()))
