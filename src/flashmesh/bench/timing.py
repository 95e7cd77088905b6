"""Timing any JAX callable the way `flashmesh bench` does.

`time_fn(fn, *args)`: compile once (ahead of time, so compilation and autotuning are never
timed), run `warmup` calls, then time `iters` calls one at a time, each ended by
`jax.block_until_ready` (JAX dispatches asynchronously; without the wait a loop times the
dispatch, not the work), and report the median (robust to the odd slow call).

`time_interleaved([(fn, args), ...])`: the same for several calls timed against each other in
rounds (each round calls each of them in turn), so that drift of clocks, temperature or other
load hits all of them alike: the ratio of two calls is then sharper than from back-to-back runs.

Memory: `memory_bytes` is XLA's buffer plan of the compiled call (arguments + outputs +
temporaries - aliased), exact for what the call allocates and comparable between rows.
`device_peak_bytes` is the device's high-water mark from `device.memory_stats()` (GPUs), a
process-wide maximum that JAX cannot reset: it bounds the row's peak from above and equals
it when the row set a new maximum. CPUs report no memory stats (None).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Sequence

import jax

from flashmesh.bench.kernel_time import kernel_ms


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float
    mean_ms: float
    min_ms: float
    iters: int
    compile_s: float | None
    memory_bytes: int | None
    device_peak_bytes: int | None
    times_ms: tuple[float, ...]
    back_to_back_ms: float | None = None  # per call, `iters` calls issued with one synchronisation
    kernel_ms: float | None = None  # device kernel time per call (profiler), where measured

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["times_ms"] = list(self.times_ms)
        return d


def compile_fn(fn: Callable, *args) -> tuple[jax.stages.Compiled, float]:
    """(compiled, seconds): `fn` jitted and compiled for these arguments."""
    if isinstance(fn, jax.stages.Compiled):
        return fn, 0.0
    t0 = time.perf_counter()
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    compiled = jitted.lower(*args).compile()
    return compiled, time.perf_counter() - t0


def memory_bytes(compiled: jax.stages.Compiled) -> int | None:
    """Bytes the compiled call needs on the device: arguments + outputs + temporaries - aliased."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # some backends do not implement it
        return None
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


def device_memory_stats(device: jax.Device | None = None) -> dict[str, Any] | None:
    """`device.memory_stats()` (bytes_in_use, peak_bytes_in_use, bytes_limit, ...) or None."""
    device = device or jax.devices()[0]
    try:
        return device.memory_stats()
    except Exception:
        return None


def device_peak_bytes(device: jax.Device | None = None) -> int | None:
    stats = device_memory_stats(device)
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return int(stats["peak_bytes_in_use"])


def time_fn(fn: Callable, *args, warmup: int = 3, iters: int = 20,
            max_seconds: float | None = None) -> Timing:
    """Time `fn(*args)`: jit + compile once, `warmup` calls, then the median of `iters` calls.

    fn: any JAX-traceable callable, a jitted function, or an already compiled one.
    max_seconds: if `iters` calls would take longer than this, time fewer (at least 3).
    Returns a `Timing` (milliseconds, compile seconds, memory; see the module docstring).

    Example:
      >>> t = time_fn(lambda x: x @ x, jnp.ones((512, 512)), iters=10)
      >>> t.median_ms
    """
    return time_interleaved([(fn, args)], warmup=warmup, iters=iters, rounds=1,
                            max_seconds=max_seconds)[0]


def _timed_call(compiled, args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return (time.perf_counter() - t0) * 1e3


B2B_BATCHES = 3  # back-to-back batches per call (interleaved), the median reported


def time_interleaved(calls: Sequence[tuple[Callable, tuple]], *, warmup: int = 3, iters: int = 20,
                     rounds: int = 5, max_seconds: float | None = None,
                     kernel_time: bool = False) -> list[Timing]:
    """Time several calls `fn(*args)` against each other: compile each, warm each up, then in
    each of `rounds` rounds call each one in turn (its share of `iters` calls, each ended by
    `jax.block_until_ready`). A `Timing` per call, in order, over all its rounds.

    max_seconds: per call; one that would take longer than this for `iters` calls gets fewer
    (at least 3, the untimed probe call telling how long one takes).
    kernel_time: also each call's device kernel time (`kernel_time.kernel_ms`, a profiler trace
    of a few calls), None where the profiler gives none.

    Example (is b's dispatch free? compare it with a on the same inputs):
      >>> ta, tb = time_interleaved([(a, (x,)), (b, (x,))])
      >>> tb.median_ms / ta.median_ms
    """
    if warmup < 0 or iters < 1 or rounds < 1:
        raise ValueError(f"warmup={warmup} must be >= 0, iters={iters} >= 1 and rounds={rounds} >= 1")
    compiled = [compile_fn(fn, *args) for fn, args in calls]
    counts = []
    for (c, _), (_, args) in zip(compiled, calls):
        for _ in range(warmup):
            jax.block_until_ready(c(*args))
        probe = _timed_call(c, args)  # untimed: also the warm-up a warmup=0 caller skipped
        n = iters if max_seconds is None else min(iters, max(3, int(max_seconds * 1e3 / max(probe, 1e-6))))
        counts.append(n)
    times: list[list[float]] = [[] for _ in calls]
    for r in range(rounds):
        for i, ((c, _), (_, args)) in enumerate(zip(compiled, calls)):
            share = counts[i] * (r + 1) // rounds - counts[i] * r // rounds
            times[i] += [_timed_call(c, args) for _ in range(share)]
    # Then each call's `iters` calls back to back, one synchronisation at the end: the host's
    # dispatch hides behind the device's work, so on rows near 1 ms this reads kernel speed
    # where a synchronised call's median adds the launch and wake-up latency. B2B_BATCHES such
    # batches per call, interleaved like the rounds, and their median: one batch read 8.2 ms
    # for a row whose synchronised median was 7.75 (H200, 2026-12-05), a disturbance no
    # single batch can be told from.
    batches: list[list[float]] = [[] for _ in calls]
    for _ in range(B2B_BATCHES):
        for i, ((c, _), (_, args), n) in enumerate(zip(compiled, calls, counts)):
            batches[i].append(back_to_back(c, args, n))
    b2bs = [float(statistics.median(b)) for b in batches]
    kernels = [kernel_ms(c, args, min(n, 5)) if kernel_time else None
               for (c, _), (_, args), n in zip(compiled, calls, counts)]
    return [Timing(median_ms=float(statistics.median(t)), mean_ms=float(statistics.fmean(t)),
                   min_ms=float(min(t)), iters=len(t), compile_s=compile_s,
                   memory_bytes=memory_bytes(c), device_peak_bytes=device_peak_bytes(),
                   times_ms=tuple(t), back_to_back_ms=b2b, kernel_ms=k)
            for (c, compile_s), t, b2b, k in zip(compiled, times, b2bs, kernels)]


def back_to_back(compiled, args, n: int) -> float:
    """Milliseconds per call of `n` calls issued back to back, one synchronisation at the end."""
    t0 = time.perf_counter()
    outs = [compiled(*args) for _ in range(n)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t0) * 1e3 / n
