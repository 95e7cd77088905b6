"""`flashmesh bench --preset layer`: the getting-started guide's decoder layer (reference/004).

Shape legend (a `shapes.LayerShape`): B batch, T sequence, H hidden, F FFN width, N heads,
D = H // N; M = B * T tokens.

Every variant of `layer_models.VARIANTS` is one row, measured one after another:

1. built at the shape and initialised as the guide does (FP8 rows inside `te.autocast` with the
   guide's DelayedScaling recipe, so the `fp8_metas` collection exists); its parameters are
   moved by noise (`layer_checks.perturbed`), so that no zero bias is trivially right; an FP8
   row takes its bf16 twin's parameters (keeping its own FP8 state), so both run on the same;
2. one training step compiled: `jit(value_and_grad)` of <layer(x), dy> over the variables and
   the input with dropout on (`deterministic=False`, as the guide times it); for FP8 rows the
   step then writes the `fp8_metas` cotangent over the state
   (`flashmesh.quantization.update_fp8_metas`), as a training loop does;
3. warmed up with the variables and the dropout key threaded from step to step; an FP8 row
   whose state did not change over the warm-up is wrong (the state update is broken);
4. checked with dropout off (`layer_checks.py`), on the first CHECK_TOKENS tokens of the first
   batch row (the same parameters and code; the full size costs minutes per row on a GPU):
   output, dx and every parameter gradient
   against the float32 reference on the row's own parameters; FP8 rows (with the state the
   warm-up left) against their bf16 twin. A wrong row is reported and not timed; one that
   cannot be checked (its twin failed, an unknown parameter layout) is timed as unchecked;
5. timed: the median of `iters` steps, each ended by `jax.block_until_ready`, then `iters`
   steps back to back with one synchronisation at the end (their mean);
6. FP8 rows: the state update alone, `jit(update_fp8_metas)` over the `fp8_metas` pytree and
   its cotangent (median), and its share of the step.

A row that fails at any point records why (`runner.classify`) and the sweep goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from flashmesh.bench import flops, layer_checks, layer_models, runner, timing
from flashmesh.bench.implementations import DTYPES
from flashmesh.bench.shapes import LayerShape, Preset

CHECK_TOKENS = 512
FLOP_FORMULA = (
    "FLOPs per step = GEMMs + attention. GEMMs: 3 x 2 x M x K x N per dense layer (forward, "
    "dgrad, wgrad; M = B*T): QKV H->3H, out H->H, FFN1 H->F, FFN2 F->H. Attention (causal): "
    "3.5 x 2 x B x N x pairs x 2D with pairs = T(T+1)/2. The plain-Flax structure has no "
    "H->H out projection; instead Flax's attention re-projects q, k, v (H->Q each, Q = H/N) "
    "and out (Q->H) and attends over N heads of Q/N")
TIMING_TEXT = ("one training step per row: jit(value_and_grad) over the variables and the input "
               "(FP8 state written back each step), warmed up, then the median of steps each ended by "
               "jax.block_until_ready; 'back to back' is the mean of as many steps with one "
               "synchronisation at the end; rows are timed one after another")


def layer_flops(shape: LayerShape, family: str) -> float:
    """FLOPs of one fwd+bwd step (FLOP_FORMULA)."""
    B, T, H, F, N = shape.B, shape.T, shape.hidden, shape.ffn, shape.heads
    M, pairs = B * T, flops.visible_pairs_rectangle(T, T, (-1, 0))
    gemm = lambda K, Nout: 3 * 2 * M * K * Nout
    if family == "te":
        return float(gemm(H, 3 * H) + gemm(H, H) + gemm(H, F) + gemm(F, H)
                     + 3.5 * 2 * B * N * pairs * 2 * (H // N))
    if family == "flax_mha":
        Q = H // N
        return float(gemm(H, 3 * H) + 3 * gemm(H, Q) + gemm(Q, H) + gemm(H, F) + gemm(F, H)
                     + 3.5 * 2 * B * N * pairs * 2 * (Q // N))
    raise ValueError(f"family={family!r} must be 'te' or 'flax_mha'")


@dataclasses.dataclass(frozen=True)
class LayerResult:
    """One row. error: the worst relative L2 error (out_error, dx_error, dparams_error; the
    worst parameter gradient named in worst_param) against checked_against; f32_error: an FP8
    row's against the float32 reference. ms: median synchronised step; ms_back_to_back: mean
    of steps with one synchronisation; enqueue_ms: the host's time per step to issue them (the
    back-to-back step is host-bound where the two are close). fp8_update_ms: the isolated state update (median of
    synchronised calls); fp8_update_ms_back_to_back: the same issued back to back, and its
    fp8_update_share of ms_back_to_back. speedup: the plain-Flax row's ms_back_to_back over this row's."""

    group: str
    shape: LayerShape
    label: str
    description: str
    dtype: str
    status: str
    reason: str = ""
    mode: str = "fwdbwd"
    fp8: bool = False
    ms: float | None = None
    ms_min: float | None = None
    iters: int | None = None
    ms_back_to_back: float | None = None
    enqueue_ms: float | None = None
    compile_s: float | None = None
    flops: float | None = None
    tflops: float | None = None
    memory_bytes: int | None = None
    error: float | None = None
    out_error: float | None = None
    dx_error: float | None = None
    dparams_error: float | None = None
    worst_param: str = ""
    tolerance: float | None = None
    checked_against: str = ""
    f32_error: float | None = None
    fp8_update_ms: float | None = None
    fp8_update_ms_back_to_back: float | None = None
    fp8_update_share: float | None = None
    fp8_state_arrays: int | None = None
    fp8_state_bytes: int | None = None
    speedup: float | None = None
    detail: str = ""

    @property
    def timed(self) -> bool:
        return self.status in runner.TIMED and self.ms is not None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"], d["shape_spec"] = self.shape.name, self.shape.to_dict()
        return d


# -- one row --------------------------------------------------------------------------------------
def _promotion(variant: layer_models.Variant):
    """flax.linen mixes bf16 inputs with float32 parameters: JAX's standard promotion (the
    default the guide runs under), whatever the caller set; other rows keep the caller's."""
    return jax.numpy_dtype_promotion("standard") if variant.standard_promotion else contextlib.nullcontext()


def training_step(model: layer_models.Model) -> Callable:
    """jit: (variables, x, dy, key) -> (state', key', loss, d variables, dx), state' the
    collections the step writes (the FP8 state; {} for a bf16 row). The parameters stay out
    of the outputs: returned unchanged without donation, XLA would copy them every step (0.2 to
    0.4 ms at the guide's size, 2026-12-02 profile), work no training step does."""
    def loss(variables, x, dy, key):
        y = model.apply(variables, x, deterministic=False, rngs={"dropout": key})
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

    from flashmesh.quantization import written_state

    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1))

    def step(variables, x, dy, key):
        key, sub = jax.random.split(key)
        with model.autocast():
            value, (dvars, dx) = value_and_grad(variables, x, dy, sub)
        return written_state(variables, dvars), key, value, dvars, dx

    return jax.jit(step)


def _outputs(model: layer_models.Model, variables, x, dy):
    """(y, d params, dx) with dropout off, under the row's autocast; the FP8 state is held
    fixed (it is not differentiated here)."""
    rest = {k: v for k, v in variables.items() if k != "params"}

    def fn(params, x):
        return model.apply({**rest, "params": params}, x, deterministic=True, rngs={})

    with _promotion(model.variant), model.autocast():  # autocast also while jit traces
        return layer_checks.grads_fn(fn)(variables["params"], x, dy)


class Shared:
    """What the rows of one shape share: the inputs, the yardstick of the tolerances, and the
    checked bf16 rows (parameters, outputs, reference) that an FP8 row is compared with."""

    def __init__(self, shape: LayerShape, config: runner.RunConfig, platform: str):
        self.shape, self.config, self.platform = shape, config, platform
        self.x, self.dy = _draw(config.seed, (shape.B, shape.T, shape.hidden), DTYPES[config.dtype])
        # The numerics check runs on the first CHECK_TOKENS tokens of the first batch row: the
        # same parameters and code, at a fraction of the compile and run time of the full size.
        self.check_x, self.check_dy = self.x[:1, :CHECK_TOKENS], self.dy[:1, :CHECK_TOKENS]
        self.checked: dict[str, dict] = {}
        self._yardsticks: dict[str, float] = {}

    def yardstick(self, family: str) -> float:
        """What the plain layer of a row's structure loses in the run's dtype: the TE structure
        for every row; for `flax_mha` rows the worse of it and the Flax structure's."""
        if family not in self._yardsticks:
            args = (self.shape, self.check_x, self.check_dy, self.config.seed + 1)
            te_error = self._yardsticks.get("te") or layer_checks.plain_low_precision_error(*args)
            self._yardsticks["te"] = te_error
            if family == "flax_mha":
                self._yardsticks[family] = max(te_error, layer_checks.plain_flax_low_precision_error(*args))
        return self._yardsticks[family]

    def init(self, model: layer_models.Model):
        with _promotion(model.variant), model.autocast():
            return jax.jit(model.init)(jax.random.key(self.config.seed + 2), self.x)

    def check(self, model: layer_models.Model, variables) -> dict:
        """A bf16 (non-FP8) row against its float32 reference; kept for an FP8 twin."""
        name, shape = model.variant.name, self.shape
        got = _outputs(model, variables, self.check_x, self.check_dy)
        if model.variant.family == "flax_mha":
            run = layer_checks.flax_reference(shape.hidden, shape.ffn, shape.heads)
            mapping, label = (lambda p: layer_checks.to_flax(name, p)), "the guide's plain Flax layer, float32"
        else:
            run = layer_checks.te_reference(shape.heads, layer_checks.attention_scale(model, shape))
            mapping = lambda p: layer_checks.to_canonical(name, p, shape)
            label = "plain-JAX float32 layer (einsum attention)"
        entry = dict(params=variables["params"], outputs=got, mapping=mapping, label=label)
        entry["reference"] = layer_checks.reference_outputs(run, mapping(variables["params"]), self.check_x,
                                                              self.check_dy)
        if any(v.bf16_twin == name for v in layer_models.VARIANTS.values()):
            self.checked[name] = entry
        return entry

    def twin(self, name: str) -> dict:
        """The checked bf16 row `name` (built, initialised and checked here if it did not run)."""
        if name not in self.checked:
            model = layer_models.build(name, self.shape, DTYPES[self.config.dtype], self.platform)
            self.check(model, layer_checks.perturbed(self.init(model), self.config.seed + 3))
        return self.checked[name]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _draw(seed, shape, dtype):
    """x and dy: standard normal in float32, then cast (one compiled call)."""
    kx, kdy = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kx, shape, jnp.float32).astype(dtype),
            jax.random.normal(kdy, shape, jnp.float32).astype(dtype))


def _verdict(c: dict, tolerance: float, against: str, **extra) -> dict:
    return dict(extra, tolerance=tolerance, checked_against=against, error=c["error"], out_error=c["out"],
                dx_error=c["dx"], dparams_error=c["dparams"], worst_param=c["worst_param"])


def _check(model: layer_models.Model, variables, shared: Shared) -> dict:
    """The row's check fields: error, its parts, the tolerance and what it was checked against."""
    variant = model.variant
    if not variant.fp8:
        entry = shared.check(model, variables)
        y, dp, dx = entry["outputs"]
        tolerance = (layer_checks.TOLERANCE_FACTOR * shared.yardstick(variant.family)
                     + layer_checks.TOLERANCE_FLOOR)
        return _verdict(layer_checks.compare((y, entry["mapping"](dp), dx), entry["reference"]), tolerance,
                        entry["label"])
    twin = shared.twin(variant.bf16_twin)
    got = _outputs(model, variables, shared.check_x, shared.check_dy)
    f32 = layer_checks.compare((got[0], twin["mapping"](got[1]), got[2]), twin["reference"])["error"]
    return _verdict(layer_checks.compare(got, twin["outputs"]), layer_checks.FP8_TOLERANCE,
                    f"{variant.bf16_twin} ({shared.config.dtype}) on the same parameters", f32_error=f32)


def _variables(model: layer_models.Model, shared: Shared):
    """The row's initialised variables with perturbed parameters; an FP8 row takes its bf16
    twin's parameters (and keeps its own fp8_metas), so that the two are compared on the same."""
    variables = shared.init(model)
    if not model.variant.fp8:
        return layer_checks.perturbed(variables, shared.config.seed + 3)
    if "fp8_metas" not in variables:
        raise RuntimeError("FP8 init created no fp8_metas collection")
    try:
        params = shared.twin(model.variant.bf16_twin)["params"]
    except Exception as e:  # the FP8 row still runs, with its own parameters, unchecked
        raise layer_checks.Unchecked(f"its bf16 twin {model.variant.bf16_twin} failed: "
                                     f"{runner.classify(e)[1]}") from e
    if jax.tree.structure(params) != jax.tree.structure(variables["params"]) or any(
            a.shape != b.shape for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(variables["params"]))):
        raise layer_checks.ParameterLayoutError(f"the FP8 row's parameters are not laid out as its bf16 twin "
                                                f"{model.variant.bf16_twin}'s")
    return {**variables, "params": params}


def _run_steps(compiled, variables, key, x, dy, n: int, sync_each: bool):
    """n steps threading (variables, key): (variables, key, per-step ms, or with sync_each False
    [total ms, ms the host took to issue them])."""
    times, out = [], None
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        out = compiled(variables, x, dy, key)
        variables, key = {**variables, **out[0]}, out[1]
        if sync_each:
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t) * 1e3)
    issued = (time.perf_counter() - t0) * 1e3
    jax.block_until_ready(out)
    return variables, key, times if sync_each else [(time.perf_counter() - t0) * 1e3, issued]


def _state_changed(before, after) -> bool:
    """Whether any array of the FP8 state differs (compared on the host: it is small)."""
    return any(bool(np.any(np.asarray(a) != np.asarray(b)))
               for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


def measure(name: str, shared: Shared, group: str = "layer") -> LayerResult:
    """One row, start to end (see the module docstring); failures become the row's status."""
    variant, shape, config = layer_models.VARIANTS[name], shared.shape, shared.config
    row = dict(group=group, shape=shape, label=name, description=variant.description, dtype=config.dtype,
               fp8=variant.fp8, flops=layer_flops(shape, variant.family))
    try:
        x, dy, key = shared.x, shared.dy, jax.random.key(config.seed + 4)
        model = layer_models.build(name, shape, DTYPES[config.dtype], shared.platform)
        row["detail"] = model.detail
        try:
            variables = _variables(model, shared)
        except layer_checks.Unchecked as e:  # the FP8 row still runs, unchecked
            unchecked = f"unchecked: {e}"
            variables = layer_checks.perturbed(shared.init(model), config.seed + 3)
        else:
            unchecked = ""
        with _promotion(variant):
            compiled, row["compile_s"] = timing.compile_fn(training_step(model), variables, x, dy, key)
        row["memory_bytes"] = timing.memory_bytes(compiled)
        initial_state = variables.get("fp8_metas")
        variables, key, _ = _run_steps(compiled, variables, key, x, dy, max(config.warmup, 2), True)
        if variant.fp8 and not _state_changed(initial_state, variables["fp8_metas"]):
            return LayerResult(**row, status=runner.WRONG, reason="the FP8 state did not change over the "
                               "warm-up steps: the fp8_metas cotangent is not written back")
        if unchecked:
            row.update(status=runner.UNCHECKED, reason=unchecked)
        else:
            try:
                row.update(_check(model, variables, shared))
            except layer_checks.Unchecked as e:
                row.update(status=runner.UNCHECKED, reason=f"unchecked: {e}")
            else:
                if not row["error"] <= row["tolerance"]:
                    return LayerResult(**row, status=runner.WRONG, reason=(
                        f"error {row['error']:.2e} > tolerance {row['tolerance']:.1e} against "
                        f"{row['checked_against']}"))
                row.update(status=runner.OK)
        variables, key, probe = _run_steps(compiled, variables, key, x, dy, 1, True)
        n = config.iters if config.max_seconds is None else min(
            config.iters, max(3, int(config.max_seconds * 1e3 / max(probe[0], 1e-6))))
        variables, key, times = _run_steps(compiled, variables, key, x, dy, n, True)
        variables, key, total = _run_steps(compiled, variables, key, x, dy, n, False)
        ms = statistics.median(times)
        row.update(ms=ms, ms_min=min(times), iters=n, ms_back_to_back=total[0] / n, enqueue_ms=total[1] / n,
                   tflops=flops.tflops_per_s(row["flops"], ms))
        if variant.fp8:
            row.update(_update_timing(compiled, variables, key, x, dy, config, ms, total[0] / n))
        return LayerResult(**row)
    except Exception as e:  # a failing row is a row, never a crash of the sweep
        status, reason = runner.classify(e)
        return LayerResult(**{k: v for k, v in row.items() if k not in ("status", "reason")},
                           status=status, reason=reason)


def _update_timing(compiled, variables, key, x, dy, config, step_ms: float, step_b2b_ms: float) -> dict:
    """The FP8 state update alone over the fp8_metas pytree (and its cotangent from a step):
    the median of single calls (each synchronised: mostly dispatch for so small a program) and
    the mean of calls issued back to back, each on the state the last one left, with one
    synchronisation (what it adds to a step that runs it); the share is the latter's of the
    step's back-to-back time."""
    from flashmesh.quantization import update_fp8_metas

    dvars = compiled(variables, x, dy, key)[3]
    state, cotangent = {"fp8_metas": variables["fp8_metas"]}, {"fp8_metas": dvars["fp8_metas"]}
    update = jax.jit(update_fp8_metas)
    t = timing.time_fn(update, state, cotangent, warmup=config.warmup,
                       iters=config.iters, max_seconds=config.max_seconds)
    n = max(config.iters, 20)
    jax.block_until_ready(update(state, cotangent))
    start = time.perf_counter()
    for _ in range(n):
        state = update(state, cotangent)
    jax.block_until_ready(state)
    b2b = (time.perf_counter() - start) * 1e3 / n
    leaves = jax.tree.leaves(state)
    return dict(fp8_update_ms=t.median_ms, fp8_update_ms_back_to_back=b2b,
                fp8_update_share=b2b / step_b2b_ms,
                fp8_state_arrays=len(leaves), fp8_state_bytes=int(sum(a.nbytes for a in leaves)))


# -- the run --------------------------------------------------------------------------------------
def plan_size(plan: Preset) -> int:
    """Rows the run measures."""
    return sum(len(g.shapes) * len(g.implementations) for g in plan.groups)


def finish(rows: list[LayerResult]) -> list[LayerResult]:
    """Speed-up against the plain-Flax row of the same shape (back-to-back steps)."""
    base = {r.shape.name: r.ms_back_to_back for r in rows if r.label == "flax" and r.timed}
    return [dataclasses.replace(r, speedup=base[r.shape.name] / r.ms_back_to_back)
            if r.timed and r.shape.name in base else r for r in rows]


def run(plan: Preset, config: runner.RunConfig = runner.RunConfig(),
        on_result: Callable[[LayerResult], None] | None = None) -> list[LayerResult]:
    """Measure every row of the layer preset; `on_result` sees each row once measured."""
    platform = runner.platform()
    results: list[LayerResult] = []
    steps = plan_size(plan) + len(plan.shapes())  # each shape's yardstick is a step of the bar
    with runner._progress(config.progress, steps) as advance:
        for group in plan.groups:
            for shape in group.shapes:
                shared = Shared(shape, config, platform)
                advance(f"{shape.name} · {config.dtype} yardstick")
                try:
                    _ = shared.yardstick("te")  # computed once here, under its own progress step
                except Exception:  # not fatal: each row that needs it tries again and says why
                    pass
                mine = []
                for name in group.implementations:
                    advance(f"{shape.name} · {name}")
                    mine.append(measure(name, shared, group.name))
                    if on_result is not None:
                        on_result(mine[-1])
                    gc.collect()
                del shared
                results += finish(mine)
    return results
