"""What `flashmesh tune` does with one shape's candidates, forward or backward: check each
against the expected result, time those that pass together, and pick the fastest.

Example:
    >>> rows = measure(configs, make_fn, (q, k, v), error_of, fields=config_fields,
    ...                tolerance=2e-2, interpret=False, config=run_config, label="full_4k")
    >>> summary(rows)["best"]
"""

from __future__ import annotations

import json
import math
import time
import warnings
from typing import Callable, Sequence

import jax

from flashmesh.bench import runner, timing


def measure(candidates: Sequence, make_fn: Callable, args: tuple, error_of: Callable, *, fields: Callable,
            tolerance: float, interpret: bool, config: runner.RunConfig, label: str,
            advance: Callable[[str], None] = lambda text: None) -> list[dict]:
    """One row per candidate: {"config": fields(c), "status", "error", "compile_s", "ms",
    "ms_back_to_back"} (a candidate that fails or errs above `tolerance` keeps its status and
    reason and is not timed). make_fn(c) is the call of candidate c on `args`; error_of(outputs)
    its error. The interpreter runs eagerly (under jit its warpgroup threads wait on XLA's
    callback threads) and is timed by one call each: the plumbing, not a speed."""
    rows, ready = [], []
    for candidate in candidates:
        advance(f"{label}: {candidate}")
        row = dict(config=fields(candidate))
        fn = make_fn(candidate)
        try:
            compiled, row["compile_s"] = (fn, None) if interpret else timing.compile_fn(jax.jit(fn), *args)
            row["error"] = error_of(compiled(*args))
        except Exception as e:  # a candidate that cannot run is a row, never a crash
            status, reason = runner.classify(e)
            rows.append(dict(row, status=status, reason=reason))
            continue
        row["status"] = runner.OK if row["error"] <= tolerance else runner.WRONG
        rows.append(row)
        if row["status"] == runner.OK:
            ready.append((row, compiled))
    if ready and interpret:
        for row, fn in ready:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            row.update(ms=(time.perf_counter() - t0) * 1e3, ms_back_to_back=(time.perf_counter() - t0) * 1e3)
    elif ready:
        timings = timing.time_interleaved([(c, args) for _, c in ready], warmup=config.warmup,
                                          iters=config.iters, rounds=config.rounds)
        for (row, _), t in zip(ready, timings):
            row.update(ms=t.median_ms, ms_back_to_back=t.back_to_back_ms)
    return rows


def summary(rows: list[dict]) -> dict:
    """{"rows", "best" (the fastest row's config by the back-to-back time, or None),
    "best_ms_back_to_back", "default_ms_back_to_back" (rows[0]'s: today's config)}."""
    best = min((r for r in rows if "ms_back_to_back" in r), key=lambda r: r["ms_back_to_back"], default=None)
    return dict(rows=rows, best=None if best is None else best["config"],
                best_ms_back_to_back=None if best is None else best["ms_back_to_back"],
                default_ms_back_to_back=rows[0].get("ms_back_to_back") if rows else None)


def table_entry(entries: list[dict], shape: str, key: dict) -> dict:
    """The entry of a tuned shape in a table list: the one naming it as anchor, else the sm90
    one with the same key, else a new one appended."""
    entry = next((e for e in entries if e.get("anchor") == shape), None) or next(
        (e for e in entries if e["device"] == "sm90" and e["key"] == key), None)
    if entry is None:
        entry = dict(anchor=shape, device="sm90", key=key)
        entries.append(entry)
    return entry


def unshared(results: list[dict], command: str):
    """The results with a best config, less any whose table key an earlier result of the same
    run has (the later would shadow the earlier's entry): those are skipped with a warning."""
    written = {}  # key (as json) -> the shape of this run that wrote it
    for res in results:
        if res["best"] is None:
            continue
        key_text = json.dumps(res["key"], sort_keys=True)
        if key_text in written:
            warnings.warn(f"{command}: {res['shape']} has the table key of {written[key_text]} "
                          f"({res['key']}); its result is not written", stacklevel=3)
            continue
        written[key_text] = res["shape"]
        yield res


def table_key(spec) -> dict:
    """The table key of a call, for the forward's entries and the backward's alike: head dims,
    mask kind, group size, dtypes, for a window its width bound (the smallest power of two
    >= the width), and the length bucket of max(T, S): (P / 2, P] for the smallest power of two
    P >= it (without it a short shape's entry, more specific by its group field, took the calls
    of every length: 2026-12-03, codelab_te_2048's tiles over causal_8k_h32_d64's)."""
    from flashmesh.attention.pallas_mosaic_gpu_table import mask_kind

    key = dict(qk_dim=spec.qk_dim, v_dim=spec.v_dim, mask=mask_kind(spec), group=spec.group_size)
    left, right = spec.window
    if key["mask"] == "window" and min(left, right) >= 0:
        key["max_window"] = 2 ** math.ceil(math.log2(left + right + 1))
    top = 2 ** math.ceil(math.log2(max(spec.q_len, spec.kv_len, 1)))
    key.update(min_len=top // 2 + 1, max_len=top)
    key["dtypes"] = ["bfloat16", "float16"]
    return key
