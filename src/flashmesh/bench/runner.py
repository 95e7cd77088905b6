"""The measurement loop: for every shape x mode, check every implementation, then time them.

Each row: build the implementation for the shape (a refusal is a row), compile the jitted call
(forward: out; forward+backward: out and the gradients of q, k, v, so the forward is never
dead code), run it once and compare with the float32 reference (`checks.py`). The rows of one
shape and mode that match are then timed together, in interleaved rounds
(`timing.time_interleaved`), so that drift of the device hits all of them alike and their
ratios (flashmesh against raw cuDNN) are sharp. Every exception becomes a row with its reason
(unsupported, not installed, out of memory, error); nothing stops the sweep. An implementation
that ran out of memory is not tried again on larger shapes of the same group (the row says so).
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Callable

import jax
import jax.numpy as jnp

from flashmesh.bench import checks, flops, implementations, timing
from flashmesh.bench.implementations import DTYPES, Candidate
from flashmesh.bench.shapes import Group, Preset, Shape, segment_ids_and_positions

OK, UNCHECKED = "ok", "unchecked"
UNSUPPORTED, NOT_INSTALLED, OOM = "unsupported", "not installed", "out of memory"
WRONG, ERROR, SKIPPED = "wrong result", "error", "skipped"
TIMED = (OK, UNCHECKED)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """How rows are measured.

    dtype: input dtype of implementations named without "@dtype".
    warmup, iters: untimed and timed calls per row; max_seconds: time fewer calls (at least 3)
      when `iters` would take longer than this; rounds: the rows of one shape and mode take
      turns this many times (each time a share of their calls).
    reference_budget_bytes: memory the float32 reference may use (None: a quarter of the
      device's memory where known, else 2 GiB); beyond it the reference runs on a slice.
    """

    dtype: str = "bf16"
    warmup: int = 3
    iters: int = 20
    max_seconds: float | None = 10.0
    rounds: int = 5
    reference_budget_bytes: float | None = None
    seed: int = 2026
    progress: bool = True
    kernel_time: bool = True  # on a GPU, also the device kernel time of each row (profiler)


@dataclasses.dataclass(frozen=True)
class Result:
    """One row of the report."""

    group: str
    shape: Shape
    implementation: str
    label: str
    dtype: str
    mode: str
    status: str
    reason: str = ""
    ms: float | None = None
    ms_min: float | None = None
    ms_back_to_back: float | None = None  # per call of `iters` calls with one synchronisation
    ms_kernel: float | None = None  # device kernel time per call (profiler trace), where measured
    iters: int | None = None
    compile_s: float | None = None
    flops: float | None = None
    tflops: float | None = None
    memory_bytes: int | None = None
    device_peak_bytes: int | None = None
    error: float | None = None
    rel_l2_error: float | None = None
    tolerance: float | None = None
    checked_against: str = ""
    detail: str = ""  # e.g. which backend flashmesh's automatic choice ran

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"] = self.shape.name
        d["shape_spec"] = self.shape.to_dict()
        return d


def classify(e: BaseException) -> tuple[str, str]:
    """(status, one-line reason) of an exception raised by a row."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    reason = f"{type(e).__name__}: {first}"[:300]
    if isinstance(e, NotImplementedError):
        return UNSUPPORTED, first[:300] or type(e).__name__
    if isinstance(e, ImportError):
        return NOT_INSTALLED, reason
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return OOM, reason
    return ERROR, reason


def platform() -> str:
    from flashmesh.attention.registry import current_platform

    return current_platform()


def default_reference_budget() -> float:
    stats = timing.device_memory_stats()
    if stats and stats.get("bytes_limit"):
        return 0.25 * stats["bytes_limit"]
    return 2.0 * 2**30


def make_inputs(shape: Shape, dtype: str, seed: int):
    """q, k, v, segment_ids (or None), do: random normal inputs in `dtype` (drawn in float32)."""
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    dt = DTYPES[dtype]
    q = jax.random.normal(kq, (shape.B, shape.T, shape.N, shape.Dqk), jnp.float32).astype(dt)
    k = jax.random.normal(kk, (shape.B, shape.S, shape.K, shape.Dqk), jnp.float32).astype(dt)
    v = jax.random.normal(kv, (shape.B, shape.S, shape.K, shape.Dv), jnp.float32).astype(dt)
    do = jax.random.normal(kd, (shape.B, shape.T, shape.N, shape.Dv), jnp.float32).astype(dt)
    seg = None
    if shape.segments:
        ids, _ = segment_ids_and_positions(shape)
        seg = jnp.broadcast_to(jnp.asarray(ids)[None], (shape.B, shape.T))
    return q, k, v, seg, do


def _step(fn, mode: str):
    """The jitted call of a row: fwd -> [out]; fwdbwd -> [out, dq, dk, dv]."""
    if mode == "fwd":
        return jax.jit(lambda q, k, v, seg: [fn(q, k, v, seg)])

    def fwdbwd(q, k, v, seg, do):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
        return [out, *vjp(do)]

    return jax.jit(fwdbwd)


class _ShapeState:
    """Inputs and reference results of the shape being measured (freed when it is done)."""

    def __init__(self, shape: Shape, config: RunConfig, budget: float):
        self.shape, self.config, self.budget = shape, config, budget
        self.inputs: dict[str, tuple] = {}
        self.references: dict[tuple[str, str], tuple] = {}

    def get_inputs(self, dtype: str):
        if dtype not in self.inputs:
            self.inputs[dtype] = make_inputs(self.shape, dtype, self.config.seed)
        return self.inputs[dtype]

    def reference(self, dtype: str, mode: str):
        """(slice, outputs, description) or (None, None, why there is no reference).

        If the reference runs out of memory anyway (the budget is an estimate), it is retried
        on a slice a quarter the size, twice.
        """
        key = (dtype, mode)
        if key in self.references:
            return self.references[key]
        budget, why = self.budget, "the reference does not fit even on a slice"
        for _ in range(3):
            sl = checks.choose_slice(self.shape, mode, budget)
            if sl is None:
                break
            q, k, v, seg, do = self.get_inputs(dtype)
            try:
                outs = checks.reference_outputs(self.shape, sl, mode, q, k, v, seg, do)
            except Exception as e:  # the ground truth failing is reported, never fatal
                status, why = classify(e)
                why = f"the reference failed: {why}"
                if status != OOM:
                    break
                budget /= 4
                continue
            self.references[key] = (sl, outs, sl.describe(self.shape))
            return self.references[key]
        self.references[key] = (None, None, f"unchecked: {why}")
        return self.references[key]


@dataclasses.dataclass
class _Ready:
    """A row that compiled and was checked, waiting to be timed."""

    fields: dict  # the Result's fields so far, status and reason included
    compiled: jax.stages.Compiled
    args: tuple


def prepare(group: str, shape: Shape, candidate: Candidate, mode: str, state: _ShapeState,
            config: RunConfig, device_platform: str) -> Result | _Ready:
    """Build, compile and check one row: a `Result` if it failed, else the row ready to time."""
    dtype = candidate.dtype or config.dtype
    row = dict(group=group, shape=shape, implementation=candidate.name, label=candidate.label,
               dtype=dtype, mode=mode, flops=flops.attention_flops(shape, mode))
    try:
        impl = implementations.get(candidate.name)
        fn = impl.build(shape, dtype, device_platform)
        q, k, v, seg, do = state.get_inputs(dtype)
        args = (q, k, v, seg) if mode == "fwd" else (q, k, v, seg, do)
        with impl.tracing():
            compiled, compile_s = timing.compile_fn(_step(fn, mode), *args)

        sl, ref, checked_against = state.reference(dtype, mode)
        row.update(compile_s=compile_s, detail=getattr(fn, "detail", ""),
                   tolerance=checks.TOLERANCE[dtype], checked_against=checked_against)
        if sl is None:
            return _Ready(dict(row, status=UNCHECKED, reason=checked_against), compiled, args)
        check_args = args if mode == "fwd" else (q, k, v, seg, checks.cotangent_for_check(sl, shape, do))
        outs = compiled(*check_args)
        got = checks.slice_outputs(sl, shape, outs[0], outs[1:] if mode == "fwdbwd" else None)
        row["error"], row["rel_l2_error"] = checks.compare(got, ref)
        del outs, got
        if not row["error"] <= row["tolerance"]:
            return Result(**row, status=WRONG, reason=f"error {row['error']:.2e} > tolerance "
                          f"{row['tolerance']:.0e} against {checked_against}")
        return _Ready(dict(row, status=OK, reason=""), compiled, args)
    except Exception as e:  # a failing row is a row, never a crash of the sweep
        status, reason = classify(e)
        return Result(**row, status=status, reason=reason)


def time_rows(ready: list[_Ready], config: RunConfig) -> list[Result]:
    """Time rows of one shape and mode together, in `config.rounds` interleaved rounds. If a
    call fails, each row is timed alone, so that only the failing one says why."""
    try:
        timings = timing.time_interleaved([(r.compiled, r.args) for r in ready], warmup=config.warmup,
                                          iters=config.iters, rounds=config.rounds,
                                          max_seconds=config.max_seconds,
                                          kernel_time=config.kernel_time and jax.default_backend() == "gpu")
    except Exception as e:  # a failing row is a row, never a crash of the sweep
        if len(ready) > 1:
            return [result for r in ready for result in time_rows([r], config)]
        status, reason = classify(e)
        return [Result(**dict(ready[0].fields, status=status, reason=reason))]
    return [Result(**r.fields, ms=t.median_ms, ms_min=t.min_ms, ms_back_to_back=t.back_to_back_ms,
                   ms_kernel=t.kernel_ms, iters=t.iters,
                   tflops=flops.tflops_per_s(r.fields["flops"], t.median_ms),
                   memory_bytes=t.memory_bytes, device_peak_bytes=t.device_peak_bytes)
            for r, t in zip(ready, timings)]


def measure(group: str, shape: Shape, candidate: Candidate, mode: str, state: _ShapeState,
            config: RunConfig, device_platform: str) -> Result:
    """One row on its own: build, compile, check against the reference, then time."""
    row = prepare(group, shape, candidate, mode, state, config, device_platform)
    return row if isinstance(row, Result) else time_rows([row], config)[0]


def plan_size(preset: Preset) -> int:
    return sum(len(g.shapes) * len(g.modes) * len(g.implementations) for g in preset.groups)


def run(preset: Preset, config: RunConfig = RunConfig(),
        on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Measure every row of `preset`; `on_result` sees each row as soon as it is measured."""
    device_platform = platform()
    budget = config.reference_budget_bytes or default_reference_budget()
    results: list[Result] = []
    with _progress(config.progress, plan_size(preset)) as advance:
        for group in preset.groups:
            results += _run_group(group, config, budget, device_platform, advance, on_result)
    return results


def _run_group(group: Group, config, budget, device_platform, advance, on_result) -> list[Result]:
    results = []
    oom_at: dict[tuple[str, str], Shape] = {}  # (label, mode) -> the shape that ran out of memory
    candidates = [Candidate.parse(label) for label in group.implementations]
    for shape in group.shapes:
        state = _ShapeState(shape, config, budget)
        for mode in group.modes:
            rows: list[Result | _Ready] = []
            for candidate in candidates:
                advance(f"{shape.name} · {candidate.label} · {mode}")
                failed = oom_at.get((candidate.label, mode))
                if failed is not None and shape.logits_per_row >= failed.logits_per_row:
                    rows.append(Result(group.name, shape, candidate.name, candidate.label,
                                       candidate.dtype or config.dtype, mode, SKIPPED,
                                       reason=f"out of memory already at {failed.name}",
                                       flops=flops.attention_flops(shape, mode)))
                else:
                    rows.append(prepare(group.name, shape, candidate, mode, state, config, device_platform))
            ready = [r for r in rows if isinstance(r, _Ready)]
            timed = iter(time_rows(ready, config) if ready else [])
            for row in rows:
                result = next(timed) if isinstance(row, _Ready) else row
                if result.status == OOM:
                    oom_at[(result.label, mode)] = shape
                results.append(result)
                if on_result is not None:
                    on_result(result)
        del state
        gc.collect()
    return results


class _progress:
    """A rich progress bar over all rows (silent when disabled)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total, self.bar = enabled, total, None

    def __enter__(self):
        if not self.enabled:
            return lambda description: None
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn)

        self.bar = Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("{task.description}"), transient=True)
        self.bar.__enter__()
        task = self.bar.add_task("", total=self.total)
        first = [True]

        def advance(description: str):
            if not first[0]:
                self.bar.advance(task)
            first[0] = False
            self.bar.update(task, description=description)

        return advance

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)
        return False
