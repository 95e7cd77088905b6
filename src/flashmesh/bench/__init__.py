"""Benchmarks: the `flashmesh bench` command, and the timing tools it uses, for your own code.

    from flashmesh.bench import speedometer, time_fn
    speedometer(model.apply, variables, (q, k, v), dout)   # tutorials' fwd+bwd timing
    time_fn(fn, *args).median_ms                           # any callable, as the command times it
    time_interleaved([(f, args), (g, args)])               # several, in alternating rounds

Plotting and reporting are imported only when a run needs them.
"""

from flashmesh.bench.flops import attention_flops, visible_pairs
from flashmesh.bench.shapes import Shape
from flashmesh.bench.speedometer import speedometer
from flashmesh.bench.timing import Timing, time_fn, time_interleaved

__all__ = ["speedometer", "time_fn", "time_interleaved", "Timing", "Shape", "attention_flops", "visible_pairs"]
