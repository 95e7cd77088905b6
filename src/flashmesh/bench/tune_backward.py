"""`flashmesh tune --backward`: measure the Hopper backward kernels' tile configurations
(`pallas_mosaic_gpu_sm90_bwd`) on this GPU and write the fastest into the table's
`backward_entries` (`attention/pallas_mosaic_gpu_configs.json`).

Shape legend as `shapes.Shape` (B, T, S, N, K, Dqk, Dv).

Per shape: `chunked`'s out and lse (what the backward kernels take from a forward), a random
output cotangent, and `chunked`'s gradients as the check. Each candidate `BackwardBlockSizes` of `candidates(spec)`
(the config the call gets today first, then a small grid: the two-kernel form over its query /
key steps and stages, each config followed by its twin with the other `delta_in_dq`, today's config
also with the other `overlap` and `persistent_dq` (and under a bounded window `wg_ranges`), third
and fourth the fused form on each warpgroup's own tiles under a bounded window, else the fused
form by columns with and without `overlap`, then the fused form over its query step and stages, each fused one also
staggered and with dQ split by columns, the fused ones without columns only where columns do
not fit) is compiled, run once and checked (the largest relative L2 error of dq, dk, dv <=
the forward's tolerance; a wrong or failing candidate is reported and never chosen), then all are timed
together in interleaved rounds; the fastest by the back-to-back figure wins. Fused candidates
are not bit-reproducible; a call under reproducible=True skips a fused entry (`default_for`).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp

from flashmesh.attention import chunked
from flashmesh.attention import pallas_mosaic_gpu_sm90_bwd as bwd
from flashmesh.attention.spec import AttentionInputs
from flashmesh.bench import runner, tune_measure

GRID = dict(  # the candidate grid; invalid combinations (SMEM, registers) are dropped
    block_q=(64, 128),
    block_q_dq=(128, 256),
    block_kv_dq=(64, 128),
    num_stages=(3, 2),
)


def config_fields(bs: bwd.BackwardBlockSizes) -> dict:
    """The fields of a config that differ from BackwardBlockSizes' defaults (a table entry)."""
    default = bwd.BackwardBlockSizes()
    return {name: value for name, value in vars(bs).items() if getattr(default, name) != value}


def candidates(spec, limit: int | None = None) -> list[bwd.BackwardBlockSizes]:
    """Valid backward configs for this call, the one it gets today first."""
    window = ("wg_ranges",) if spec.window[0] >= 0 else ()
    twins = _with_twins(bwd.default_for(spec), spec, ("overlap", "delta_in_dq", "persistent_dq",
                                                      *window))
    # third and fourth: under a bounded window the fused form on each warpgroup's own tiles
    # (five GEMMs a step instead of the two kernels' seven, never timed there before), else the
    # fused form by columns in FA3's order and its twin without `overlap`
    fused = [c for c in _window_fused(spec) or _columns_fused(spec) if c not in twins[:2]]
    found = twins[:2] + fused + [c for c in twins[2:] if c not in fused]
    grid = itertools.product((False, True), GRID["block_q"], GRID["block_q_dq"], GRID["block_kv_dq"],
                             GRID["num_stages"])
    for one_kernel, bq, bqdq, bkvdq, stages in grid:
        # the fused kernel has no dQ kernel: its dQ steps are not varied
        extra = [dict(fused_dq=True, stagger_q=stagger, dq_columns=columns)
                 for columns in (False, True) for stagger in (False, True)] if one_kernel else [
            dict(block_q_dq=bqdq, block_kv_dq=bkvdq)]
        for fields in extra:
            try:
                bs = bwd.BackwardBlockSizes(block_q=bq, num_stages=stages, **fields).validate_for(spec)
            except ValueError:
                continue
            if bs not in found and not _columns_fit(bs, spec):
                found += [c for c in _with_twins(bs, spec, ("delta_in_dq",)) if c not in found]
    return found[:limit]


def _window_fused(spec) -> list[bwd.BackwardBlockSizes]:
    """Under a bounded window, the fused backward with `wg_ranges` (dQ by reduce-adds, each
    warpgroup over the query tiles its own keys meet) and its `overlap` twin, where they fit;
    none otherwise (dq_columns, the fused form's usual split, makes every warpgroup take every
    step, so the grid below never pairs the fused form with wg_ranges)."""
    return _with_overlap_twin(spec, fused_dq=True, wg_ranges=True) if spec.window[0] >= 0 else []


def _columns_fused(spec) -> list[bwd.BackwardBlockSizes]:
    """Without a bounded window, the fused backward with dQ split by columns in FA3's order
    (`overlap`) and its twin without it, where they fit: the fastest d128 causal form measured
    (2.840 ms against 3.036 for two kernels, causal 8k, 2026-12-06-nvidia-h200-anchors), whose
    `overlap` twin sits deep in the grid below, past a short --max-candidates."""
    return _with_overlap_twin(spec, fused_dq=True, dq_columns=True, overlap=True)


def _with_overlap_twin(spec, **fields) -> list[bwd.BackwardBlockSizes]:
    """The config of these fields and its twin with the other `overlap`, where it fits the call."""
    try:
        bs = bwd.BackwardBlockSizes(**fields).validate_for(spec)
    except ValueError:
        return []
    return _with_twins(bs, spec, ("overlap",))


def _with_twins(bs: bwd.BackwardBlockSizes, spec, fields) -> list[bwd.BackwardBlockSizes]:
    """bs, then its twins with the other value of each boolean field in turn, where they fit
    the call (today's config: `overlap`, slower with two kernels on the H200, faster fused by
    columns, `delta_in_dq`, `persistent_dq`, for many short dQ tiles, and under a bounded
    window `wg_ranges`, a quarter of the steps at window 128 but at most one step per head
    under a plain causal mask; the grid's configs: `delta_in_dq`)."""
    found = [bs]
    for field in fields:
        for c in list(found):
            try:
                twin = dataclasses.replace(c, **{field: not getattr(c, field)}).validate_for(spec)
            except ValueError:
                continue
            found.append(twin)
    return found


def _columns_fit(bs: bwd.BackwardBlockSizes, spec) -> bool:
    """A fused config without dq_columns where the same tiles with it fit the call: left out,
    since on the H200 dQ by columns was faster on every shape timed (2026-12-02: d128 causal 8k
    3.03 against 3.25 ms, full 4k 3.37 against 4.80, B4 T2k causal 1.20 against 1.47)."""
    if not bs.fused_dq or bs.dq_columns or bs.num_compute_wgs != 2:
        return False
    try:
        dataclasses.replace(bs, dq_columns=True).validate_for(spec)
    except ValueError:
        return False
    return True


def tune_shape(shape, spec, config: runner.RunConfig, *, interpret: bool, limit: int | None, advance,
               rel, tolerance: float) -> dict:
    """Every backward candidate of one shape: {"shape", "rows": [...], "best": fields or None}."""
    q, k, v, _, _ = runner.make_inputs(shape, "bf16", config.seed)

    def reference(q, k, v):
        return chunked.attention(AttentionInputs(q=q, k=k, v=v), spec)

    (out, lse), vjp = jax.vjp(reference, q, k, v)  # the backward's inputs: chunked's out and lse
    do = jax.random.normal(jax.random.key(config.seed + 1), out.shape, jnp.float32).astype(out.dtype)
    want = vjp((do, jnp.zeros_like(lse)))
    rows = tune_measure.measure(
        candidates(spec, limit),
        lambda bs: lambda q, k, v, out, lse, do: bwd.backward_spec(
            q, k, v, out, lse, do, spec, block_sizes=bs, interpret=interpret)[:3],
        (q, k, v, out, lse, do), lambda got: max(rel(g, w) for g, w in zip(got, want)),
        fields=config_fields, tolerance=tolerance, interpret=interpret, config=config,
        label=f"{shape.name} backward", advance=advance)
    return dict(shape=shape.name, kernel="backward", key=tune_measure.table_key(spec), **tune_measure.summary(rows))


def write_entries(table: dict, results: list[dict], meta: dict) -> None:
    """Each shape's best backward config into `table["backward_entries"]` (by anchor name, else
    key; new entries appended with the result's key; an existing entry keeps its own). A result
    whose key another shape of the same run already wrote is skipped with a warning."""
    entries = table.setdefault("backward_entries", [])
    for res in tune_measure.unshared(results, "tune --backward"):
        # an existing entry keeps its key (a hand-written one may be narrower, e.g. max_len)
        entry = tune_measure.table_entry(entries, res["shape"], res["key"])
        entry.update(tuned=True, config=res["best"], source=(
            f"flashmesh tune --backward {meta['date']} on {meta['device']} (commit {meta['commit']}): "
            f"{res['best_ms_back_to_back']:.4f} ms back to back, best of {len(res['rows'])} candidates "
            f"(today's config: {res['default_ms_back_to_back'] or float('nan'):.4f})"))
