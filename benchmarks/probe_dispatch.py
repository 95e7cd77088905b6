"""Diagnosis only (numbers are claimed from `flashmesh bench`): why a tiny row's back-to-back
time is far above its kernel time. For each implementation (labels as `flashmesh bench
--implementations`) on one shape (`--shape`, an anchor name; codelab_small by default): the
compiled forward's entry computation (its instructions by opcode: each fusion, custom call and
copy is a launch), then 500 calls issued back to back: the host's time to enqueue a call and
the time per call (a call is host-bound where the two are close).

    PYTHONPATH=src:benchmarks python3 benchmarks/probe_dispatch.py flashmesh:pallas_mosaic_gpu tokamax:mosaic
"""
import collections
import re
import sys
import time

import jax

from flashmesh.bench import implementations, runner
from flashmesh.bench.shapes import ANCHOR_SHAPES


def entry_ops(text: str) -> collections.Counter:
    """Opcodes of the optimised HLO's ENTRY computation (parameters, tuples and bitcasts aside)."""
    body = text[text.index("ENTRY"):]
    body = body[:body.index("\n}")]
    ops = collections.Counter()
    for m in re.finditer(r"=\s*[^=]*?\s([a-z][a-z0-9-]*)\(", body):
        if m.group(1) not in ("parameter", "tuple", "get-tuple-element", "bitcast", "constant"):
            ops[m.group(1)] += 1
    return ops


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    name = sys.argv[sys.argv.index("--shape") + 1] if "--shape" in sys.argv else "codelab_small"
    shape = next(s for s in ANCHOR_SHAPES if s.name == name)
    q, k, v, _, _ = runner.make_inputs(shape, "bf16", 0)
    for label in args or ["flashmesh:pallas_mosaic_gpu"]:
        impl = implementations.get(label.split("@")[0])
        with impl.tracing():
            f = jax.jit(impl.build(shape, "bf16", jax.default_backend()))
            compiled = f.lower(q, k, v).compile()
        ops = entry_ops(compiled.as_text())
        jax.block_until_ready(f(q, k, v))
        for _ in range(2):  # two rounds: the second is the figure
            n = 500
            t0 = time.perf_counter()
            for _ in range(n):
                out = f(q, k, v)
            enqueued = (time.perf_counter() - t0) / n
            jax.block_until_ready(out)
            per_call = (time.perf_counter() - t0) / n
        print(f"{shape.name} {label}: {per_call * 1e6:.1f} us a call back to back, host enqueue "
              f"{enqueued * 1e6:.1f} us; entry ops {dict(ops)}", flush=True)


if __name__ == "__main__":
    main()
