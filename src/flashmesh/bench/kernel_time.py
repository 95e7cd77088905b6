"""Device kernel time of a compiled call, from a jax.profiler trace.

`kernel_ms(compiled, args)` runs the call a few times under `jax.profiler.trace` and sums the
durations of the GPU kernels (the events on the device planes' stream lines) per call: the time
the device spent computing, without the host's dispatch and the launch gaps that a synchronised
call's wall time includes. None where the trace has no GPU plane (a CPU run, or a profiler that
could not collect device activity, or failed, with a warning); the bench then shows no kernel
time rather than a guess, and the row keeps its other timings.

Kernels on different streams that overlap are each counted in full (XLA runs a call's compute
on one stream, so this is rare); memory copies and sets on those streams count as well.
"""

from __future__ import annotations

import glob
import tempfile
import warnings
from typing import Any, Callable, Iterable, Iterator

import jax

DEVICE_PLANE_PREFIX = "/device:GPU"
STREAM_LINE_PREFIX = "Stream"


def device_lines(planes: Iterable[Any]) -> Iterator[Any]:
    """The lines of a profile's GPU planes (jax.profiler.ProfileData's planes, or any objects
    with the same name / lines / events / duration_ns fields): "Stream #..." lines hold the
    kernels, "XLA Ops" the HLO ops."""
    for plane in planes:
        if plane.name.startswith(DEVICE_PLANE_PREFIX):
            yield from plane.lines


def stream_kernel_ns(planes: Iterable[Any]) -> float | None:
    """Total duration (ns) of the events on the stream lines of a profile's GPU planes; None
    when no such line holds an event."""
    durations = [event.duration_ns for line in device_lines(planes)
                 if line.name.startswith(STREAM_LINE_PREFIX) for event in line.events]
    return float(sum(durations)) if durations else None


def stream_kernels_ns(planes: Iterable[Any], calls: int = 1) -> dict[str, float]:
    """Total duration (ns) per kernel name of the events on the stream lines of a profile's
    GPU planes, longest first (empty when none). A name launched n > 1 times per call (of
    `calls`; e.g. two Pallas kernels both named by their entry point) is split by launch
    order within the call: "name#0", "name#1", ... (events ordered by start time)."""
    events = sorted(((getattr(event, "start_ns", 0), event.name, event.duration_ns)
                     for line in device_lines(planes) if line.name.startswith(STREAM_LINE_PREFIX)
                     for event in line.events), key=lambda e: e[0])
    counts: dict[str, int] = {}
    for _, name, _ in events:
        counts[name] = counts.get(name, 0) + 1
    seen: dict[str, int] = {}
    totals: dict[str, float] = {}
    for _, name, ns in events:
        per_call = counts[name] // calls if counts[name] % calls == 0 else 1
        label = name if per_call <= 1 else f"{name}#{seen.get(name, 0) % per_call}"
        seen[name] = seen.get(name, 0) + 1
        totals[label] = totals.get(label, 0.0) + ns
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def _traced_planes(compiled: Callable, args: tuple, calls: int):
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready([compiled(*args) for _ in range(calls)])
        files = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))
        return ProfileData.from_file(files[-1]).planes if files else []


def kernels_ms(compiled: Callable, args: tuple, calls: int = 5) -> dict[str, float]:
    """Milliseconds per call of each GPU kernel of `compiled(*args)` (by name, longest first),
    over `calls` calls under one trace: where a call's device time goes (a diagnosis; the
    profiler's figures run above untraced ones). Empty where the profiler gives none."""
    if calls < 1:
        raise ValueError(f"calls={calls} must be >= 1")
    return {name: ns / 1e6 / calls
            for name, ns in stream_kernels_ns(_traced_planes(compiled, args, calls), calls).items()}


def kernel_ms(compiled: Callable, args: tuple, calls: int = 5) -> float | None:
    """Milliseconds of device kernel time per call of `compiled(*args)`, over `calls` calls
    issued back to back under one trace; None where the profiler gives no device time."""
    if calls < 1:
        raise ValueError(f"calls={calls} must be >= 1")
    try:
        ns = stream_kernel_ns(_traced_planes(compiled, args, calls))
    except Exception as e:  # the profiler is an extra: a row is still timed without it
        warnings.warn(f"kernel time not measured: the profiler failed ({type(e).__name__}: {e})")
        return None
    return None if ns is None else ns / 1e6 / calls
