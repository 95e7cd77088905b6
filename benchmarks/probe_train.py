"""Diagnosis only (numbers are claimed from `flashmesh train`'s report): one training step of
`flashmesh train`'s model at its default size (or `--small`), built by the loop's own
functions (`train.loop.make_train_step`), per precision: compile time, the time per step of 20
steps back to back and of synchronised steps, then (`--profile DIR`) 5 steps traced with
jax.profiler into DIR and where their GPU time goes (`trace_table.profile_table`). `--only bf16` / `--only fp8` runs one;
`--hlo DIR` writes each compiled step's HLO text (gzipped) into DIR.

2026-12-02: the H200 ran `flashmesh train`'s bf16 steps at about 110 ms each, far more than
their ~6 TFLOP of GEMMs need; this probe is there to say where the time goes.
"""
import gzip
import sys
import tempfile
import time

import jax
import numpy as np

from flashmesh.train import data, gpt, loop
from trace_table import profile_table


def _option(name):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


def run(precision: str, corpus) -> None:
    small = "--small" in sys.argv
    model_config = gpt.GPTConfig(layers=2, hidden=128, seq=64) if small else gpt.GPTConfig()
    config = loop.TrainConfig(batch=8 if small else 64)
    model, fp8 = gpt.GPT(model_config), precision == "fp8"
    rng = np.random.default_rng(0)
    tx = loop.optimizer(config)
    with loop.precision_context(precision, config):
        x, y = data.sample_batch(corpus.train, rng, config.batch, model_config.seq)
        variables = loop.check_collections(jax.jit(
            lambda k, x: model.init({"params": k}, x, deterministic=True))(jax.random.key(0), x), fp8)
        opt_state = tx.init(variables["params"])
        t0 = time.perf_counter()
        step = jax.jit(loop.make_train_step(model, tx, fp8), donate_argnums=(0, 1)).lower(
            variables, opt_state, x, y, jax.random.key(1)).compile()
        print(f"{precision}: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
        if _option("--hlo"):  # the compiled step, gzipped
            with gzip.open(f"{_option('--hlo')}/train_step_{precision}.hlo.txt.gz", "wt") as out:
                out.write(step.as_text())
        batches = [data.sample_batch(corpus.train, rng, config.batch, model_config.seq) for _ in range(5)]

        def steps(n, sync):
            nonlocal variables, opt_state
            times = []
            for i in range(n):
                t = time.perf_counter()
                variables, opt_state, loss = step(variables, opt_state, *batches[i % 5], jax.random.key(i))
                if sync:
                    jax.block_until_ready(loss)
                    times.append(time.perf_counter() - t)
            jax.block_until_ready((variables, loss))
            return times

        steps(5, True)
        synced = sorted(steps(20, True))
        t0 = time.perf_counter()
        steps(20, False)
        b2b = (time.perf_counter() - t0) / 20
        print(f"{precision}: median {synced[10] * 1e3:.2f} ms, back-to-back {b2b * 1e3:.2f} ms per step "
              f"({config.batch} x {model_config.seq} tokens)", flush=True)
        if _option("--profile"):
            trace_dir = tempfile.mkdtemp(dir=_option("--profile"))
            with jax.profiler.trace(trace_dir):
                steps(5, False)
            print(profile_table(trace_dir, 5), flush=True)


corpus = data.load_corpus()
for precision in (_option("--only") or ",".join(loop.PRECISIONS)).split(","):
    if precision not in loop.PRECISIONS:
        raise ValueError(f"--only: expected names from {loop.PRECISIONS}, got {precision!r}")
    print(f"--- {precision} {time.strftime('%H:%M:%S')}", flush=True)
    run(precision, corpus)
