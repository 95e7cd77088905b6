"""Diagnosis only: why a row's back-to-back time exceeds its kernel time.

The 2026-12-05 anchors (d128, fwd+bwd) read ~0.4 ms more back to back than the sum of the device's
kernels for flashmesh, FA3 and tokamax (causal_8k_h32_d128: 4.165 against 3.741 ms) but 0.03 ms
for cuDNN. Two explanations give different cures: idle time between kernels (launches the host
issues late, a synchronisation inside the call) or kernels that run slower when the GPU is kept
busy longer (clocks lowered under sustained power) than in the profiler's five calls.

For each shape and implementation, with the bench's own fwd+bwd step (`runner._step`) and inputs:
back to back (20 calls, three rounds alternated over the implementations), then one trace of
20 calls back to back read by `trace_table.profile_table` (kernel sum, span, busy, idle and the
longest gaps, per call) beside the bench's 5-call kernel time; then back to back over runs of
5, 20 and 80 calls, SM clocks and power sampled by nvidia-smi meanwhile. Idle time in the trace
explains the gap as launches; a per-call time that grows with the run's length, as clocks.

    PYTHONPATH=src:benchmarks python3 benchmarks/probe_gap.py [--impls a,b,...] [--mode fwdbwd] SHAPE ...
"""
import argparse
import subprocess
import tempfile

import jax
import numpy as np

from flashmesh.bench import cli, implementations, runner, shapes, timing
from flashmesh.bench.kernel_time import kernel_ms
from trace_table import profile_table

CALLS = 20
RUN_LENGTHS = (5, 20, 80)  # per-call time rising with the run's length points at clocks
IMPLS = "cudnn,flashmesh:pallas_mosaic_gpu,fa3"


def named(names: list[str], platform: str) -> list[shapes.Shape]:
    """The anchors preset's shapes of these names (the bench's --shapes lookup and its error)."""
    return [s for group in cli._find_shapes(names, [shapes.anchors(platform)]) for s in group.shapes]


class Clocks:
    """nvidia-smi sampling SM clock (MHz) and power (W) every 20 ms while the block runs."""

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                 "-lms", "20"], stdout=subprocess.PIPE, text=True)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc):
        self.samples = []
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate()
            for line in out.splitlines():
                try:
                    self.samples.append(tuple(float(x) for x in line.split(",")))
                except ValueError:
                    pass

    def __str__(self):
        if not self.samples:
            return "clocks: not sampled"
        sm, watts = np.array(self.samples).T
        return (f"clocks: SM {sm.min():.0f}-{sm.max():.0f} MHz (median {np.median(sm):.0f}), "
                f"power median {np.median(watts):.0f} W, max {watts.max():.0f} W, {len(sm)} samples")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="+")
    p.add_argument("--impls", default=IMPLS)
    p.add_argument("--mode", default="fwdbwd", choices=("fwd", "fwdbwd"))
    args = p.parse_args()
    platform = runner.platform()
    for shape in named(args.shapes, platform):
        q, k, v, seg, do = runner.make_inputs(shape, "bf16", 0)
        call_args = (q, k, v, seg) if args.mode == "fwd" else (q, k, v, seg, do)
        rows = {}
        for label in args.impls.split(","):
            impl = implementations.get(label)
            try:
                with impl.tracing():
                    fn = impl.build(shape, "bf16", platform)
                    compiled, _ = timing.compile_fn(runner._step(fn, args.mode), *call_args)
                jax.block_until_ready(compiled(*call_args))
                rows[label] = compiled
            except Exception as e:  # a probe: say so and go on
                print(f"{shape.name} {label}: cannot run ({type(e).__name__}: {str(e)[:200]})", flush=True)
        b2b = {label: [] for label in rows}
        for _ in range(3):
            for label, compiled in rows.items():
                b2b[label].append(timing.back_to_back(compiled, call_args, CALLS))
        for label, compiled in rows.items():
            with tempfile.TemporaryDirectory() as trace_dir:
                with jax.profiler.trace(trace_dir):
                    jax.block_until_ready([compiled(*call_args) for _ in range(CALLS)])
                table = profile_table(trace_dir, CALLS, top=8)
            five = kernel_ms(compiled, call_args, 5)
            with Clocks() as clocks:  # sampled over the untraced runs
                by_n = {n: timing.back_to_back(compiled, call_args, n) for n in RUN_LENGTHS}
            print(f"== {shape.name} {args.mode} {label}: back to back "
                  f"{' '.join(f'{t:.3f}' for t in b2b[label])} ms (min {min(b2b[label]):.3f}); "
                  f"kernel time of 5 calls {five if five is None else round(five, 3)} ms; {clocks}; "
                  "per call by run length: " + ", ".join(f"{n} calls {t:.3f}" for n, t in by_n.items()),
                  flush=True)
            print(f"   {CALLS} calls traced: " + table.replace("\n", "\n   "), flush=True)


if __name__ == "__main__":
    main()
