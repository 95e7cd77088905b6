"""Diagnosis only: where a traced run's GPU time goes (`profile_table`), shared by the probes
(`probe_layer.py`, `probe_train.py`): per category (GEMM, attention, other kernels), the
timeline's span, busy time and overlap (`timeline`), then the longest XLA ops and kernels, per
step; and where the host's time goes while it enqueues them (`host_table`: the host threads'
trace events by self time, for a step whose host enqueue nears its GPU time)."""
import collections
import glob
import re

GEMM = re.compile(r"gemm|xmma|nvjet|cutlass|cublas|matmul", re.I)
ATTENTION = re.compile(r"mosaic|fmha|cudnn|flash|attention", re.I)


def profile_table(trace_dir: str, steps: int, top: int = 25) -> str:
    """Per-step GPU time of a jax.profiler trace, by category and by op / kernel name."""
    from jax.profiler import ProfileData

    from flashmesh.bench.kernel_time import STREAM_LINE_PREFIX, device_lines

    files = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))
    if not files:
        return f"no trace under {trace_dir}"
    ops, kernels = collections.Counter(), collections.Counter()
    intervals = collections.defaultdict(list)  # stream line -> [(start_ns, end_ns)]
    for line in device_lines(ProfileData.from_file(files[-1]).planes):
        into = ops if line.name == "XLA Ops" else kernels if line.name.startswith(STREAM_LINE_PREFIX) else None
        if into is not None:
            for event in line.events:
                into[event.name] += event.duration_ns / 1e6 / steps
                if into is kernels:
                    intervals[line.name].append((event.start_ns, event.start_ns + event.duration_ns,
                                                 event.name))
    if not kernels:
        return "no GPU kernels in the trace (not a GPU run?)"
    total = sum(kernels.values())
    cats = collections.Counter()
    for name, ms in kernels.items():
        cats["GEMM" if GEMM.search(name) else "attention" if ATTENTION.search(name) else "other"] += ms
    lines = [f"GPU kernel time per step: {total:.3f} ms; "
             + ", ".join(f"{c} {ms:.3f} ms ({100 * ms / total:.1f}%)" for c, ms in cats.most_common()),
             timeline(intervals, steps)]
    for title, table in (("XLA ops", ops), ("kernels", kernels)):
        lines.append(f"longest {title} (ms per step):")
        lines += [f"  {ms:8.3f}  {name[:150]}" for name, ms in table.most_common(top)]
    return "\n".join(lines)


def host_table(trace_dir: str, steps: int, top: int = 25) -> str:
    """Per step, the host threads' trace events (the "/host:CPU" plane: Python's dispatch, XLA's
    thunks, CUDA driver calls where the profiler records them) by self time (an event's
    duration less that of the events nested in it on the same thread), then by inclusive time:
    where a slow enqueue spends its time."""
    from jax.profiler import ProfileData

    files = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))
    if not files:
        return f"no trace under {trace_dir}"
    own, inclusive, threads = self_times(
        line for plane in ProfileData.from_file(files[-1]).planes if plane.name == "/host:CPU"
        for line in plane.lines)
    if not inclusive:
        return "no host events in the trace"
    lines = [f"host threads with events: {threads}; per step, by self time (ms):"]
    lines += [f"  {ns / 1e6 / steps:8.3f}  {name[:150]}" for name, ns in own.most_common(top)]
    lines.append("by inclusive time (ms per step; nested events counted in each):")
    lines += [f"  {ns / 1e6 / steps:8.3f}  {name[:150]}" for name, ns in inclusive.most_common(top)]
    return "\n".join(lines)


def self_times(lines):
    """(self ns per event name, inclusive ns per name, number of lines with events) over trace
    lines whose events nest in time on each line (a thread's scopes)."""
    own, inclusive, count = collections.Counter(), collections.Counter(), 0
    for line in lines:
        events = sorted(((e.start_ns, -e.duration_ns, e.name) for e in line.events))
        count += bool(events)
        stack = []  # [end_ns, name] of the open scopes
        for start, neg, name in events:
            duration = -neg
            while stack and stack[-1][0] <= start:
                stack.pop()
            if stack:
                own[stack[-1][1]] -= min(duration, stack[-1][0] - start)
            own[name] += duration
            inclusive[name] += duration
            stack.append([start + duration, name])
    return own, inclusive, count


def busy_ns(intervals) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, None
    for start, end, *_ in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + (end - start), end
        elif end > reach:
            total, reach = total + (end - reach), end
    return total


def timeline(intervals: dict, steps: int, gaps: int = 12) -> str:
    """Per step: the span from the first kernel's start to the last one's end, the time some
    kernel runs (busy), the kernel sum's excess over it (overlap: kernels running at once, on
    one stream line or several) and the span's idle part; then the `gaps` longest idle gaps of
    the whole trace (µs), each with the kernels that end before and start after it, and the idle
    time in gaps under 1, of 1-5, 5-20 and over 20 µs per step."""
    every = sorted(iv for ivs in intervals.values() for iv in ivs)
    if not every:
        return "timeline: no kernels"
    span = (max(iv[1] for iv in every) - every[0][0]) / 1e6 / steps
    busy = busy_ns(every) / 1e6 / steps
    overlap = sum(iv[1] - iv[0] for iv in every) / 1e6 / steps - busy
    found, reach, before = [], every[0][1], every[0][2]
    for start, end, name in every[1:]:
        if start > reach:
            found.append((start - reach, before, name))
        if end > reach:
            reach, before = end, name
    buckets = collections.Counter()
    for ns, _, _ in found:
        us = ns / 1e3
        buckets["<1" if us < 1 else "1-5" if us < 5 else "5-20" if us < 20 else ">20"] += ns / 1e6 / steps
    lines = [f"timeline per step: span {span:.3f} ms, busy {busy:.3f}, idle {span - busy:.3f}, "
             f"overlap {overlap:.3f} (kernel lines: {len(intervals)}, gaps {len(found) / steps:.0f}); "
             "idle per step in gaps of " + ", ".join(f"{k} us {buckets[k]:.3f} ms" for k in ("<1", "1-5", "5-20", ">20"))]
    for ns, a, b in sorted(found, reverse=True)[:gaps]:
        lines.append(f"  gap {ns / 1e3:8.1f} us  after {a[:60]}  before {b[:60]}")
    return "\n".join(lines)
