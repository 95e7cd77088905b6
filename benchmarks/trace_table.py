"""Diagnosis only: where a traced run's GPU time goes (`profile_table`), shared by the probes
(`probe_layer.py`, `probe_train.py`): per category (GEMM, attention, other kernels), then the
longest XLA ops and kernels, per step."""
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
    for line in device_lines(ProfileData.from_file(files[-1]).planes):
        into = ops if line.name == "XLA Ops" else kernels if line.name.startswith(STREAM_LINE_PREFIX) else None
        if into is not None:
            for event in line.events:
                into[event.name] += event.duration_ns / 1e6 / steps
    if not kernels:
        return "no GPU kernels in the trace (not a GPU run?)"
    total = sum(kernels.values())
    cats = collections.Counter()
    for name, ms in kernels.items():
        cats["GEMM" if GEMM.search(name) else "attention" if ATTENTION.search(name) else "other"] += ms
    lines = [f"GPU kernel time per step: {total:.3f} ms; "
             + ", ".join(f"{c} {ms:.3f} ms ({100 * ms / total:.1f}%)" for c, ms in cats.most_common())]
    for title, table in (("XLA ops", ops), ("kernels", kernels)):
        lines.append(f"longest {title} (ms per step):")
        lines += [f"  {ms:8.3f}  {name[:150]}" for name, ms in table.most_common(top)]
    return "\n".join(lines)
