"""The benchmark's GPU rows (run on the H200; skipped on CPU)."""

import dataclasses

import pytest

from flashmesh.bench import runner
from flashmesh.bench.implementations import Candidate
from flashmesh.bench.shapes import Shape

pytestmark = pytest.mark.gpu

CFG = runner.RunConfig(dtype="bf16", warmup=1, iters=3, progress=False)
CAUSAL = Shape("gpu_causal", B=2, T=1024, N=8, K=2, Dqk=64, mask="causal")


def measure(shape, label, mode):
    state = runner._ShapeState(shape, CFG, runner.default_reference_budget())
    return runner.measure("g", shape, Candidate.parse(label), mode, state, CFG, runner.platform())


@pytest.mark.parametrize("label", ["cudnn", "flashmesh", "flashmesh:cudnn", "flashmesh:chunked", "naive", "xla"])
@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_gpu_rows_run_and_match_the_reference(label, mode):
    r = measure(CAUSAL, label, mode)
    assert r.status == runner.OK, r.reason
    assert r.error <= r.tolerance and r.ms > 0 and r.tflops > 0


def test_automatic_choice_is_recorded():
    r = measure(CAUSAL, "flashmesh", "fwd")  # d64 causal self-attention: the kernels
    assert r.detail == "chose pallas_mosaic_gpu", r.detail
    r = measure(dataclasses.replace(CAUSAL, name="gpu_causal_d128", Dqk=128), "flashmesh", "fwd")
    assert r.detail == "chose cudnn", r.detail


def test_naive_out_of_memory_is_a_row():
    huge = dataclasses.replace(CAUSAL, name="huge", B=4, T=131072, N=8, K=8)  # 2 TB of logits
    r = measure(huge, "naive", "fwd")
    assert r.status == runner.OOM, (r.status, r.reason)
