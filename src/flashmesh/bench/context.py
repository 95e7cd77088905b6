"""`flashmesh bench --preset cp`: context parallelism against one device (reference/003).

The workload is TransformerEngine's CP tutorial (`shapes.cp`): packed documents with padding,
GQA, a causal sliding window, scaled to the platform. Shape legend: B batch, T sequence, N query
heads, K key/value heads, H head dim; cp ranks along the mesh axis "cp".

Group `strategies` (two or more devices; cp = every device of `jax.devices()`), per mode (fwd,
fwdbwd):

* `one_device`: `flashmesh.attention(implementation=None)` on the global arrays on device 0,
  built, compiled and checked against the float32 reference exactly as every bench row
  (`runner.prepare`);
* one row per strategy x order: `context_parallel_attention` on q, k, v, do, segment ids and
  positions stored in the order (`reorder_for_context_parallel`) and sharded over "cp". Each is
  compiled, run once and compared with the one-device outputs (out; dq, dk, dv), brought into
  the same order and sharding, before it is timed; a row that fails says why and is not timed.

The rows of one mode are then timed together in interleaved rounds (`timing.time_interleaved`),
the one-device row among them. Reported: the median ms, the speed-up over one device, TFLOP/s
of the whole call (`flops.py`; every device together), the memory per device from the compiled
memory analysis (arguments + outputs + temporaries of one device's program) and its fraction of
one device's.

Group `emulated_ranks` (one device, and always on a CPU): `context_ranks.py`.

What needs no timing (the planner, each order's balance and K/V volume, explain's choice) is in
`context_facts.py`; the report in `context_report.py`.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from flashmesh.bench import checks, flops, runner, timing
from flashmesh.bench.context_facts import AXIS, choice, descriptor, segment_arrays, step_implementation
from flashmesh.bench.implementations import Candidate
from flashmesh.bench.shapes import ONE_DEVICE, CpRow, Group, Preset, Shape
from flashmesh.parallel import layouts
from flashmesh.parallel.context import context_parallel_attention
FAKE_CPU_DEVICES = 4


@dataclasses.dataclass(frozen=True)
class CPResult:
    """One row of the cp report.

    label: "one_device", "ring/dual_chunk", "rank 2 · steps", "sum · steps", ...
    kind: "one_device", "cp", "rank" or "sum".
    speedup: the one-device row's ms over this row's (same group and mode).
    memory_bytes: per device, from the compiled memory analysis; memory_fraction: of the
      one-device row's.
    ratio: for a sum row, the sum of the ranks' ms over the one-device call with the steps'
      implementation; verdict says whether it is within 10%.
    """

    group: str
    shape: Shape
    label: str
    kind: str
    mode: str
    dtype: str
    status: str
    reason: str = ""
    cp: int | None = None
    strategy: str | None = None
    order: str | None = None
    stripe_size: int | None = None
    rank: int | None = None
    implementation: str | None = None
    ms: float | None = None
    ms_min: float | None = None
    iters: int | None = None
    compile_s: float | None = None
    flops: float | None = None
    tflops: float | None = None
    speedup: float | None = None
    memory_bytes: int | None = None
    memory_fraction: float | None = None
    error: float | None = None
    rel_l2_error: float | None = None
    tolerance: float | None = None
    checked_against: str = ""
    ratio: float | None = None
    verdict: str = ""
    detail: str = ""

    @property
    def timed(self) -> bool:
        return self.status in runner.TIMED and self.ms is not None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"] = self.shape.name
        d["shape_spec"] = self.shape.to_dict()
        return d


@dataclasses.dataclass
class Ready:
    """A row that compiled and was checked, waiting to be timed."""

    fields: dict
    compiled: jax.stages.Compiled
    args: tuple


# -- devices and inputs ------------------------------------------------------------------------
def use_fake_cpu_devices(n: int = FAKE_CPU_DEVICES) -> bool:
    """Ask for `n` CPU devices (a CPU run then has a mesh), unless the user chose a count
    (XLA_FLAGS=--xla_force_host_platform_device_count=N or jax_num_cpu_devices) or a backend
    already started (then set XLA_FLAGS before python starts). On a GPU machine it only adds
    CPU devices nobody uses. Returns whether it asked."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return False
    if jax.config.jax_num_cpu_devices not in (-1, None):
        return False
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # a backend is already running: the devices are what they are
        return False
    return True


def one_device_row(group: str, shape: Shape, mode: str, state, config, name: str = "flashmesh"):
    """`flashmesh.attention` on the global arrays (the bench's `flashmesh` or `flashmesh:<impl>`
    row, checked against the float32 reference): (`Ready` with a CPResult's fields, its outputs
    [out] or [out, dq, dk, dv]) or (a failed CPResult, None)."""
    candidate = Candidate.parse(name)
    row = runner.prepare(group, shape, candidate, mode, state, config, runner.platform())
    impl = name.partition(":")[2] or None
    fields = dict(group=group, shape=shape, label=ONE_DEVICE if impl is None else f"{ONE_DEVICE}:{impl}",
                  kind="one_device", mode=mode, dtype=config.dtype, cp=1, implementation=impl)
    if isinstance(row, runner.Result):
        return CPResult(**fields, status=row.status, reason=row.reason, flops=row.flops,
                        error=row.error, tolerance=row.tolerance, checked_against=row.checked_against), None
    f = row.fields
    detail = f.get("detail") or ""
    if impl is None and detail.startswith("chose "):
        fields["implementation"] = detail.removeprefix("chose ")
    fields.update(status=f["status"], reason=f["reason"], flops=f["flops"], compile_s=f["compile_s"],
                  error=f.get("error"), rel_l2_error=f.get("rel_l2_error"), tolerance=f.get("tolerance"),
                  checked_against=f.get("checked_against", ""), detail=detail,
                  memory_bytes=timing.memory_bytes(row.compiled))
    return Ready(fields, row.compiled, row.args), row.compiled(*row.args)


class OneDevice:
    """The inputs and one-device rows of a run. With `share` (both groups run: a CPU), a row is
    built once per (shape, mode, implementation) and each group times it again in its own
    rounds; otherwise nothing is kept beyond the group that asked (a GPU's memory)."""

    def __init__(self, config: runner.RunConfig, budget: float, share: bool):
        self.config, self.budget, self.share = config, budget, share
        self.states: dict[str, runner._ShapeState] = {}
        self.rows: dict[tuple, tuple] = {}

    def state(self, shape: Shape) -> runner._ShapeState:
        if shape.name not in self.states:
            if not self.share:
                self.states.clear()
            state = runner._ShapeState(shape, self.config, self.budget)
            # runner.make_inputs' arrays, drawn in one compiled call instead of op by op.
            dtype = self.config.dtype
            draw = jax.jit(runner.make_inputs, static_argnums=(0, 1, 2))
            state.inputs[dtype] = draw(shape, dtype, self.config.seed)
            self.states[shape.name] = state
        return self.states[shape.name]

    def row(self, group: str, shape: Shape, mode: str, name: str = "flashmesh"):
        """`one_device_row` for this group (built once per run when shared)."""
        key = (shape.name, mode, name)
        built = self.rows.get(key) if self.share else None
        if built is None:
            built = one_device_row(group, shape, mode, self.state(shape), self.config, name)
            if self.share:
                self.rows[key] = built
        row, outs = built
        row = (Ready(dict(row.fields, group=group), row.compiled, row.args) if isinstance(row, Ready)
               else dataclasses.replace(row, group=group))
        return row, outs


def baselines(group: str, shape: Shape, mode: str, one: OneDevice, step_impl: str | None):
    """The one-device rows of a mode and what the other rows are checked against.

    Returns (rows, outputs, label): the automatic one-device row, and, when the steps run
    another implementation, the one-device row with that one too; the outputs the other rows
    are compared with are the latter's (the same backend on the whole problem), else the
    automatic row's. Both one-device rows are checked against the float32 reference (on a slice
    where it does not fit); their full outputs are also compared with each other, and the
    verdict of the second says how far apart they are.
    """
    base, outputs = one.row(group, shape, mode)
    rows, label = [base], ONE_DEVICE
    auto = base.fields.get("implementation") if isinstance(base, Ready) else None
    if step_impl is None or auto == step_impl:
        return rows, outputs, label
    same, same_outputs = one.row(group, shape, mode, f"flashmesh:{step_impl}")
    rows.append(same)
    if same_outputs is None:
        return rows, outputs, label
    if outputs is not None:
        error, _ = checks.compare(outputs, same_outputs)
        tol = checks.TOLERANCE[same.fields["dtype"]]
        same.fields["verdict"] = (f"{ONE_DEVICE} ({auto}) and {step_impl} differ by {error:.1e}" +
                                  (f" > tolerance {tol:.0e}: they disagree" if not error <= tol else ""))
    return rows, same_outputs, f"{ONE_DEVICE}:{step_impl}"


# -- the strategies group ----------------------------------------------------------------------
def _cp_call(shape: Shape, mesh: Mesh, row: CpRow, mode: str):
    """The jitted row: fwd -> [out]; fwdbwd -> [out, dq, dk, dv], all in the stored order."""
    def attend(q, k, v, ids, pos):
        return context_parallel_attention(q, k, v, mesh=mesh, axis=AXIS, strategy=row.strategy,
                                          order=row.order, stripe_size=row.stripe_size, mask=shape.mask,
                                          window=shape.window, segments=descriptor(shape, ids, pos))

    if mode == "fwd":
        return jax.jit(lambda q, k, v, ids, pos: [attend(q, k, v, ids, pos)])

    def fwdbwd(q, k, v, ids, pos, do):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, ids, pos), q, k, v)
        return [out, *vjp(do)]

    return jax.jit(fwdbwd)


class _Stored:
    """Inputs and one-device outputs of one order, reordered and sharded over the mesh (shared
    by the strategies of that order; each tensor's sequence axis is 1)."""

    def __init__(self, mesh: Mesh, cp: int, row: CpRow):
        self.mesh, self.cp, self.row = mesh, cp, row
        self.tensors = NamedSharding(mesh, P(None, AXIS, None, None))
        self.tokens = NamedSharding(mesh, P(None, AXIS))

    def reorder(self, x, sharding):
        if x is None:
            return None
        return jax.device_put(layouts.reorder_for_context_parallel(jnp.asarray(x), self.row.order, self.cp, 1,
                                                           self.row.stripe_size), sharding)

    def inputs(self, q, k, v, do, ids, pos):
        t, s = self.tensors, self.tokens
        return (self.reorder(q, t), self.reorder(k, t), self.reorder(v, t), self.reorder(ids, s),
                self.reorder(pos, s), self.reorder(do, t))


def _order_key(row: CpRow):
    return (row.order, row.stripe_size)


def _run_strategies(group: Group, config: runner.RunConfig, one: OneDevice, advance,
                    on_result) -> list[CPResult]:
    shape = group.shapes[0]
    devices = jax.devices()
    cp = len(devices)
    mesh = Mesh(np.asarray(devices), (AXIS,))
    rows = [CpRow.parse(label) for label in group.implementations if label != ONE_DEVICE]
    auto = {}
    for key in dict.fromkeys(_order_key(r) for r in rows):
        try:
            auto[key] = choice(shape, config.dtype, cp, CpRow("ring", *key)).strategy
        except Exception:  # explain failing is a fact recorded by `facts`, not a row
            auto[key] = None
    ids, pos = segment_arrays(shape)
    q, k, v, _, do = one.state(shape).get_inputs(config.dtype)
    stored = {key: _Stored(mesh, cp, CpRow("ring", *key)) for key in auto}
    cached_inputs = {}
    try:
        step_impl = step_implementation(shape, config.dtype, cp)
    except Exception:  # no second baseline then; the rows still run and say why they fail
        step_impl = None
    results = []
    for mode in group.modes:
        advance(f"{shape.name} · {ONE_DEVICE} · {mode}")
        pending: list[Ready | CPResult]
        pending, ref, against = baselines(group.name, shape, mode, one, step_impl)
        refs = {}
        for row in rows:
            advance(f"{shape.name} · {row.label} · {mode}")
            key = _order_key(row)
            fields = dict(group=group.name, shape=shape, label=row.label, kind="cp", mode=mode,
                          dtype=config.dtype, cp=cp, strategy=row.strategy, order=row.order,
                          stripe_size=row.stripe_size, flops=flops.attention_flops(shape, mode),
                          tolerance=checks.TOLERANCE[config.dtype],
                          detail="auto's choice" if auto.get(key) == row.strategy else "")
            try:
                if key not in cached_inputs:
                    cached_inputs[key] = stored[key].inputs(q, k, v, do, ids, pos)
                args = cached_inputs[key][:5] if mode == "fwd" else cached_inputs[key]
                compiled, compile_s = timing.compile_fn(_cp_call(shape, mesh, row, mode), *args)
                fields.update(compile_s=compile_s, memory_bytes=timing.memory_bytes(compiled))
                if ref is None:
                    pending.append(Ready(dict(fields, status=runner.UNCHECKED,
                                              reason="unchecked: the one-device row failed"), compiled, args))
                    continue
                if key not in refs:
                    refs[key] = [stored[key].reorder(x, stored[key].tensors) for x in ref]
                got = compiled(*args)
                fields["error"], fields["rel_l2_error"] = checks.compare(got, refs[key])
                fields["checked_against"] = against
                del got
                pending.append(checked(fields, against, compiled, args))
            except Exception as e:  # a failing row is a row, never a crash of the sweep
                status, reason = runner.classify(e)
                pending.append(CPResult(**fields, status=status, reason=reason))
        del ref, refs
        done = finish(time_rows(pending, config))
        for r in done:
            if on_result is not None:
                on_result(r)
        results += done
        gc.collect()
    return results


# -- timing and the derived columns -------------------------------------------------------------
def checked(fields: dict, against: str, compiled, args):
    """A row whose error is known: Ready to be timed, or a WRONG result that is never timed."""
    if not fields["error"] <= fields["tolerance"]:
        return CPResult(**fields, status=runner.WRONG, reason=f"error {fields['error']:.2e} > tolerance "
                                                              f"{fields['tolerance']:.0e} against {against}")
    return Ready(dict(fields, status=runner.OK), compiled, args)


def time_rows(pending: list, config: runner.RunConfig) -> list[CPResult]:
    """Rows in order: the `Ready` ones timed together in interleaved rounds (each row alone if
    a call fails, so that only the failing one says why), failures as they are."""
    ready = [r for r in pending if isinstance(r, Ready)]
    timed = iter(_time_together(ready, config) if ready else [])
    return [next(timed) if isinstance(r, Ready) else r for r in pending]


def _time_together(ready: list[Ready], config: runner.RunConfig) -> list[CPResult]:
    try:
        timings = timing.time_interleaved([(r.compiled, r.args) for r in ready], warmup=config.warmup,
                                          iters=config.iters, rounds=config.rounds,
                                          max_seconds=config.max_seconds)
    except Exception as e:  # a failing row is a row, never a crash of the sweep
        if len(ready) > 1:
            return [result for r in ready for result in _time_together([r], config)]
        status, reason = runner.classify(e)
        return [CPResult(**dict(ready[0].fields, status=status, reason=reason))]
    out = []
    for r, t in zip(ready, timings):
        f = dict(r.fields, ms=t.median_ms, ms_min=t.min_ms, iters=t.iters)
        f["tflops"] = flops.tflops_per_s(f["flops"], t.median_ms) if f.get("flops") else None
        out.append(CPResult(**f))
    return out


def finish(rows: list[CPResult]) -> list[CPResult]:
    """Speed-up and memory fraction against the one-device row (implementation=None)."""
    base = next((r for r in rows if r.label == ONE_DEVICE), None)
    if base is None:
        return rows
    out = []
    for r in rows:
        up = base.ms / r.ms if base.timed and r.timed and r.kind in ("cp", "one_device", "sum") else None
        mem = (r.memory_bytes / base.memory_bytes if r.memory_bytes and base.memory_bytes
               and r.kind in ("cp", "one_device", "rank") else None)
        out.append(dataclasses.replace(r, speedup=up, memory_fraction=mem))
    return out


# -- the run -------------------------------------------------------------------------------------
def plan_size(plan: Preset) -> int:
    """Rows the run measures (derived sum rows not counted)."""
    from flashmesh.bench import context_ranks  # it builds on this module

    size = 0
    for g in plan.groups:
        size += len(g.modes) * (len(g.implementations) if g.name == "strategies"
                                else context_ranks.rows_per_mode(g))
    return size


def run(plan: Preset, config: runner.RunConfig = runner.RunConfig(),
        on_result: Callable[[CPResult], None] | None = None) -> list[CPResult]:
    """Measure every group of the cp preset; `on_result` sees each row once its mode is timed."""
    from flashmesh.bench import context_ranks

    budget = config.reference_budget_bytes or runner.default_reference_budget()
    one = OneDevice(config, budget, share=len(plan.groups) > 1)
    results: list[CPResult] = []
    with runner._progress(config.progress, plan_size(plan)) as advance:
        for group in plan.groups:
            if group.name == "strategies":
                results += _run_strategies(group, config, one, advance, on_result)
            elif group.name == "emulated_ranks":
                results += context_ranks.run_group(group, config, one, advance, on_result)
            else:
                raise ValueError(f"group {group.name!r} is not a group of the cp preset")
    return results
