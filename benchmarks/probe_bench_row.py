"""Diagnosis only (numbers are claimed from `flashmesh bench --preset layer`): why a layer row's
back-to-back step in the bench is slower than the same layer's in `probe_layer.py`.

For each row named (`--only`, default transformer_layer,transformer_layer_fp8) at the guide's
size, on the variables `measure` makes: each training-step form named by `--steps` (default all)
compiled, then timed back to back as `measure` times it (the state and key threaded), the forms
alternated over two rounds. The forms differ in one thing each from the bench's step:
  bench  `bench.layer.training_step` as it stands (value_and_grad of a loss);
  sum32  value_and_grad of sum(f32(y) * f32(dy)), key split inside, full d variables returned;
  vdot   the same with the loss vdot(y, dy) in the layer's dtype;
  vjp    jax.vjp of the layer, pulled back with dy (no loss);
  probe  `probe_layer.py`'s step before 2026-12-03: vdot loss discarded, key an argument,
         parameter gradients returned.
Finding (H200, 2026-12-03, benchmarks/results/2026-12-03-nvidia-h200-bench-gap): vjp and probe
are faster than the bench only because their layer output is dead: XLA drops the last
projection's forward GEMM. The bench's step (loss returned) is the honest one.
`--profile DIR` traces 5 steps of each and prints its kernel time by category, XLA op and
kernel. `--small`: the bench's tiny layer (a CPU check of this script)."""
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from trace_table import profile_table

from flashmesh.bench import layer, layer_models, runner, shapes, timing
from flashmesh.quantization import written_state


def _option(name, default=None):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def _loss_step(model, loss_of):
    def step(variables, x, dy, key):
        key, sub = jax.random.split(key)

        def loss(v, x):
            return loss_of(model.apply(v, x, deterministic=False, rngs={"dropout": sub}), dy)
        with model.autocast():
            value, (dvars, dx) = jax.value_and_grad(loss, argnums=(0, 1))(variables, x)
        return written_state(variables, dvars), key, value, dvars, dx
    return step


def _vjp_step(model):
    def step(variables, x, dy, key):
        key, sub = jax.random.split(key)
        with model.autocast():
            _, pull = jax.vjp(lambda v, x: model.apply(v, x, deterministic=False, rngs={"dropout": sub}),
                              variables, x)
            dvars, dx = pull(dy)
        return written_state(variables, dvars), key, dvars, dx
    return step


def _probe_step(model):
    def step(v, x, dy, key):
        def loss(v, x):
            y = model.apply(v, x, deterministic=False, rngs={"dropout": key})
            return jnp.vdot(y, dy).astype(jnp.float32)
        with model.autocast():
            _, (gv, gx) = jax.value_and_grad(loss, argnums=(0, 1))(v, x)
        return written_state(v, gv), jax.random.fold_in(key, 1), gv["params"], gx
    return step


FORMS = {
    "bench": layer.training_step,
    "sum32": lambda m: jax.jit(_loss_step(m, lambda y, dy: jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)))),
    "vdot": lambda m: jax.jit(_loss_step(m, lambda y, dy: jnp.vdot(y, dy).astype(jnp.float32))),
    "vjp": lambda m: jax.jit(_vjp_step(m)),
    "probe": lambda m: jax.jit(_probe_step(m)),
}


def trace(label, run_steps):
    trace_dir = tempfile.mkdtemp(dir=_option("--profile"))
    with jax.profiler.trace(trace_dir):
        run_steps(5)
    print(f"{label}:\n{profile_table(trace_dir, 5)}", flush=True)


def main():
    names = _option("--only", "transformer_layer,transformer_layer_fp8").split(",")
    forms = _option("--steps", ",".join(FORMS)).split(",")
    config = runner.RunConfig(dtype="bf16", warmup=3, iters=20, progress=False)
    shape = shapes.LAYER_TINY if "--small" in sys.argv else shapes.LAYER_GUIDE
    shared = layer.Shared(shape, config, jax.default_backend())
    x, dy = shared.x, shared.dy
    for name in names:
        print(f"--- {name} {time.strftime('%H:%M:%S')}", flush=True)
        model = layer_models.build(name, shared.shape, jnp.bfloat16, jax.default_backend())
        state = {"v": layer._variables(model, shared), "k": jax.random.key(7)}
        with layer._promotion(layer_models.VARIANTS[name]):
            compiled = {}
            for form in forms:
                t0 = time.perf_counter()
                compiled[form], _ = timing.compile_fn(FORMS[form](model), state["v"], x, dy, state["k"])
                print(f"{form}: compiled in {time.perf_counter() - t0:.1f} s, "
                      f"{timing.memory_bytes(compiled[form]) / 2**30:.2f} GiB", flush=True)

            def steps(form, n, sync=False):
                state["v"], state["k"], total = layer._run_steps(compiled[form], state["v"], state["k"], x, dy,
                                                                 n, sync)
                return sum(total) / n
            for form in forms:
                steps(form, 3, True)
            for round_ in range(2):
                for form in forms:
                    print(f"round {round_}: {form} {steps(form, 20):.3f} ms back to back", flush=True)
            if _option("--profile"):
                for form in forms:
                    trace(f"{name} {form}", lambda n: steps(form, n))


if __name__ == "__main__":
    main()
