"""Rows: numerics are checked before timing (also on a slice of the reference), failures are
rows with reasons, and a wrong implementation is caught, never timed."""

import dataclasses

import pytest

from flashmesh.bench import checks, implementations, runner
from flashmesh.bench.implementations import Candidate
from flashmesh.bench.shapes import Group, Preset, Shape

CFG = runner.RunConfig(dtype="f32", warmup=0, iters=2, progress=False)
GQA_BR = Shape("gqa_br", B=2, T=48, S=64, N=4, K=2, Dqk=16, mask="causal_bottom_right")
PACKED = Shape("packed", B=1, T=40, N=2, K=1, Dqk=16, mask="causal", window=(6, 0), segments=(15, -5, 17))


def measure(shape, label, mode, budget=None):
    config = dataclasses.replace(CFG, reference_budget_bytes=budget)
    state = runner._ShapeState(shape, config, budget or 2**30)
    return runner.measure("g", shape, Candidate.parse(label), mode, state, config, runner.platform())


@pytest.mark.parametrize("shape", [GQA_BR, PACKED], ids=lambda s: s.name)
def test_rows_check_then_time(shape):
    r = measure(shape, "naive", "fwdbwd")
    assert r.status == runner.OK, r.reason
    assert r.checked_against == "reference (float32)"
    assert r.error < 1e-5 and r.ms > 0 and r.tflops > 0 and r.iters == 2


@pytest.mark.parametrize("budget, expect", [
    (2 * 48 * 64 * 32, "heads 2/4"),      # one batch row, one kv head's group of 2 query heads
    (18 * 64 * 32, "query rows 18/48"),  # one head, 9 first + 9 last query rows
])
def test_reference_on_a_slice(budget, expect):
    sl = checks.choose_slice(GQA_BR, "fwdbwd", budget)
    assert expect in sl.describe(GQA_BR)
    r = measure(GQA_BR, "naive", "fwdbwd", budget=budget)
    assert r.status == runner.OK and expect in r.checked_against
    assert r.error < 1e-5


def test_slice_rows_with_segments():
    budget = 20 * 40 * 32
    r = measure(PACKED, "naive", "fwdbwd", budget=budget)
    assert r.status == runner.OK and "query rows 20/40" in r.checked_against, r.reason
    assert r.error < 1e-5


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_jax_nn_rows_run_in_bf16_under_strict_promotion(mode):
    # The suite promotes strictly; jax.nn's xla path in bf16 does not, so the row must cope.
    causal = dataclasses.replace(GQA_BR, name="gqa_causal", S=48, mask="causal")
    r = measure(causal, "xla@bf16", mode)
    assert r.status == runner.OK, r.reason


def test_no_reference_means_unchecked():
    r = measure(GQA_BR, "naive", "fwd", budget=1)
    assert r.status == runner.UNCHECKED and "unchecked" in r.reason and r.ms is not None


def test_wrong_results_are_caught_not_timed(monkeypatch):
    # "naive" that forgets the mask: right on full attention, wrong on causal shapes.
    def build(shape, dtype, platform):
        return implementations._naive(dataclasses.replace(shape, mask="none", window=None), dtype, platform)

    broken = implementations.Implementation("broken", "baseline", "ignores the mask", build)
    monkeypatch.setitem(implementations.IMPLEMENTATIONS, "broken", broken)
    for budget in (None, 18 * 64 * 32):  # also when only a slice of the reference fits
        r = measure(GQA_BR, "broken", "fwd", budget=budget)
        assert r.status == runner.WRONG and r.ms is None and "tolerance" in r.reason


def test_failures_are_rows_with_reasons():
    r = measure(GQA_BR, "xla", "fwd")
    assert r.status == runner.UNSUPPORTED and "bottom-right" in r.reason
    r = measure(PACKED, "xla", "fwd")
    assert r.status == runner.UNSUPPORTED and "segments" in r.reason
    if runner.platform() != "gpu":
        r = measure(GQA_BR, "cudnn@bf16", "fwd")
        assert r.status == runner.UNSUPPORTED and "GPU" in r.reason
    r = measure(GQA_BR, "fa3", "fwd")
    assert r.status in (runner.NOT_INSTALLED, runner.UNSUPPORTED) and r.reason


def test_out_of_memory_is_a_row_and_larger_shapes_are_skipped(monkeypatch):
    def build(shape, dtype, platform):
        def f(q, k, v, seg=None):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 bytes")
        return f

    monkeypatch.setitem(implementations.IMPLEMENTATIONS, "hungry",
                        implementations.Implementation("hungry", "baseline", "always OOM", build))
    shapes = tuple(Shape(f"T{t}", B=1, T=t, N=1, K=1, Dqk=8) for t in (8, 16))
    preset = Preset("p", "", (Group("g", "g", shapes, ("hungry",), modes=("fwd",), sweep="T"),))
    rows = runner.run(preset, CFG)
    assert [r.status for r in rows] == [runner.OOM, runner.SKIPPED]
    assert "T8" in rows[1].reason


def test_rows_of_a_shape_and_mode_are_timed_together(monkeypatch):
    from flashmesh.bench import timing

    batches = []
    real = timing.time_interleaved
    monkeypatch.setattr(timing, "time_interleaved",
                        lambda calls, **kw: batches.append(len(calls)) or real(calls, **kw))
    group = Group("g", "g", (GQA_BR,), ("naive", "xla", "flashmesh:reference"), modes=("fwd", "fwdbwd"))
    rows = runner.run(Preset("p", "", (group,)), CFG)
    # xla refuses bottom-right causal: two rows per mode are timed, in one interleaved batch
    assert [r.status for r in rows] == [runner.OK, runner.UNSUPPORTED, runner.OK] * 2
    assert batches == [2, 2]


def test_a_row_failing_while_timed_fails_alone(monkeypatch):
    from flashmesh.bench import timing

    real = timing._timed_call
    seen = []

    def flaky(compiled, args):  # every call of the second row fails
        if compiled not in seen:
            seen.append(compiled)
        if len(seen) > 1 and compiled is seen[1]:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while timing")
        return real(compiled, args)

    monkeypatch.setattr(timing, "_timed_call", flaky)
    group = Group("g", "g", (GQA_BR,), ("naive", "flashmesh:reference"), modes=("fwd",))
    rows = runner.run(Preset("p", "", (group,)), CFG)
    assert [r.status for r in rows] == [runner.OK, runner.OOM]
    assert rows[1].error is not None and rows[1].ms is None


def test_candidate_labels():
    assert Candidate.parse("xla@bf16") == Candidate("xla", "bf16")
    assert Candidate.parse("flashmesh:reference").label == "flashmesh:reference"
    with pytest.raises(ValueError, match="implementation 'nope'"):
        Candidate.parse("nope")
    with pytest.raises(ValueError, match="dtype 'f8'"):
        Candidate.parse("xla@f8")


def test_a_slice_checks_the_last_batch_row(monkeypatch):
    """A row wrong only in its last batch row (as cuDNN's dq was on the 64k tutorial workload)
    is caught when the reference covers one batch row."""
    shape = dataclasses.replace(GQA_BR, name="gqa_br_b3", B=3)

    def build(shape, dtype, platform):
        fn = implementations._naive(shape, dtype, platform)
        def wrong_last_row(q, k, v, *rest):
            out = fn(q, k, v, *rest)
            return out.at[-1].multiply(2.0)
        return wrong_last_row

    broken = implementations.Implementation("last_row", "baseline", "wrong in the last batch row", build)
    monkeypatch.setitem(implementations.IMPLEMENTATIONS, "last_row", broken)
    sl = checks.choose_slice(shape, "fwd", 4 * 48 * 64 * 12)
    assert sl.batch == 1 and "last batch rows 1/3" in sl.describe(shape)
    r = measure(shape, "last_row", "fwd", budget=4 * 48 * 64 * 12)
    assert r.status == runner.WRONG, r.reason
