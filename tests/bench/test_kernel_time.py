"""Device kernel time from a profiler trace: the sum over GPU stream lines, None without one."""

from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import pytest

from flashmesh.bench import kernel_time, timing


def _plane(name, lines):
    return NS(name=name, lines=[NS(name=n, events=[NS(duration_ns=d, name=f"k{d:g}") for d in ds])
                                for n, ds in lines])


def test_sums_the_stream_lines_of_gpu_planes_only():
    planes = [_plane("/host:CPU", [("Stream #1", [1e9])]),
              _plane("/device:GPU:0", [("XLA Ops", [5e6]), ("Stream #13(Compute)", [1e6, 2.5e6]),
                                       ("Stream #14(MemcpyD2D)", [0.5e6])]),
              _plane("/device:GPU:1", [("Stream #13", [4e6])])]
    assert kernel_time.stream_kernel_ns(planes) == pytest.approx(8e6)


def test_per_kernel_totals_longest_first():
    planes = [_plane("/device:GPU:0", [("XLA Ops", [5e6]), ("Stream #13", [1e6, 2.5e6, 1e6])]),
              _plane("/host:CPU", [("Stream #1", [9e9])])]
    totals = kernel_time.stream_kernels_ns(planes)
    assert list(totals.items()) == [("k2.5e+06", 2.5e6), ("k1e+06#0", 1e6), ("k1e+06#1", 1e6)]
    assert kernel_time.stream_kernels_ns(planes, calls=2)["k1e+06"] == 2e6  # once per call
    assert kernel_time.stream_kernels_ns([_plane("/host:CPU", [("Stream #1", [1e6])])]) == {}


def test_a_name_launched_twice_per_call_is_split_by_launch_order():
    events = [NS(name="entry", start_ns=t, duration_ns=d) for t, d in
              ((0, 5.0), (10, 1.0), (20, 6.0), (30, 2.0))]  # two calls: (5, 1), (6, 2)
    planes = [NS(name="/device:GPU:0", lines=[NS(name="Stream #7", events=events)])]
    assert kernel_time.stream_kernels_ns(planes, calls=2) == {"entry#0": 11.0, "entry#1": 3.0}
    assert kernel_time.stream_kernels_ns(planes, calls=4) == {"entry": 14.0}


def test_none_without_a_gpu_stream_line():
    assert kernel_time.stream_kernel_ns([_plane("/host:CPU", [("python", [1e6])])]) is None
    assert kernel_time.stream_kernel_ns([_plane("/device:GPU:0", [("XLA Ops", [1e6])])]) is None
    assert kernel_time.stream_kernel_ns([_plane("/device:GPU:0", [("Stream #13", [])])]) is None


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="a CPU trace has no device plane")
def test_a_cpu_trace_gives_none_and_timing_keeps_its_other_fields():
    f = jax.jit(lambda x: jnp.sin(x) @ x).lower(jnp.ones((64, 64))).compile()
    assert kernel_time.kernel_ms(f, (jnp.ones((64, 64)),), calls=2) is None
    t = timing.time_interleaved([(f, (jnp.ones((64, 64)),))], warmup=1, iters=3, rounds=1, kernel_time=True)[0]
    assert t.kernel_ms is None and t.median_ms > 0 and t.back_to_back_ms > 0


def test_a_failing_profiler_gives_none_with_a_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no CUPTI")

    monkeypatch.setattr(jax.profiler, "trace", broken)
    with pytest.warns(UserWarning, match="no CUPTI"):
        assert kernel_time.kernel_ms(lambda x: x, (jnp.ones(3),), calls=1) is None


def test_calls_must_be_positive():
    with pytest.raises(ValueError, match="calls=0"):
        kernel_time.kernel_ms(lambda: None, (), calls=0)


@pytest.mark.gpu
def test_gpu_kernel_time_of_a_matmul_is_positive_and_below_its_wall_time():
    x = jnp.ones((4096, 4096), jnp.bfloat16)
    f = jax.jit(lambda x: x @ x).lower(x).compile()
    t = timing.time_interleaved([(f, (x,))], warmup=2, iters=10, rounds=1, kernel_time=True)[0]
    assert t.kernel_ms is not None and 0 < t.kernel_ms <= t.median_ms * 1.05, (t.kernel_ms, t.median_ms)
