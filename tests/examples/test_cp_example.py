"""The ported context-parallel tutorial (examples/context_parallel_attention.py) runs end to end
on 4 fake CPU devices at its --small size, and both of its context-parallel cases (Ring with
stripe 1, AllGather with its stripe) compute what its single-device fused_attn computes."""

import pathlib
import runpy
import sys

import jax
import numpy as np
import pytest

import flashmesh.te.attention as te_attention

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="--small is the CPU path; on GPUs run the example itself")


def _close(got, want, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err), err.shape)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2,
                               err_msg=f"{what}: worst element at {worst}")


def test_context_parallel_tutorial_runs_small(monkeypatch, capsys):
    script = EXAMPLES / "context_parallel_attention.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--small"])
    calls = []  # the native context-parallel calls the tutorial's fused_attn makes

    def spy(*arrays, **options):
        calls.append({k: options[k] for k in ("axis", "strategy", "order", "stripe_size")})
        return native(*arrays, **options)

    native = te_attention.context_parallel_attention
    monkeypatch.setattr(te_attention, "context_parallel_attention", spy)
    ns = runpy.run_path(str(script), run_name="__main__")
    printed = capsys.readouterr().out

    assert (ns["batch"], ns["seq"], ns["num_query_heads"], ns["num_kv_heads"], ns["head_dim"]) == (
        1, 256, 8, 2, 32)
    assert "skipped" not in printed
    assert printed.count("Mean time: ") == 3
    assert "Single-GPU THD GQA + SWA:" in printed
    assert "THD CP Ring stripe_size=1:" in printed
    assert f"THD CP AllGather stripe_size={ns['ag_stripe_size']}:" in printed
    assert printed.count("Speedup vs single GPU: ") == 2
    ring = dict(axis="cp", strategy="ring", order="striped", stripe_size=1)
    gather = dict(axis="cp", strategy="all_gather", order="striped", stripe_size=ns["ag_stripe_size"])
    assert calls == [ring, gather], calls  # traced once each; the single-device one is not CP

    # The tutorial's own pieces: one device against each context-parallel case.
    CPStrategy = ns["CPStrategy"]
    q, k, v, dout = ns["q"], ns["k"], ns["v"], ns["dout"]
    want_out = ns["run_reference_attention"]()
    want_loss, want_grads = ns["_single_gpu_grad_fn"]()((q, k, v), ns["sequence_descriptor"], dout)
    padding = np.asarray(ns["segment_ids"]) == 0
    for strategy, stripe in ((CPStrategy.RING, ns["ring_stripe_size"]),
                             (CPStrategy.ALL_GATHER, ns["ag_stripe_size"])):
        got = ns["run_context_parallel_case"](strategy, stripe)
        name = f"{strategy.name} stripe {stripe}"
        assert got["output"].shape == want_out.shape and got["output"].dtype == want_out.dtype
        _close(got["output"], want_out, f"{name} output")
        assert not np.asarray(got["output"], np.float32)[padding].any(), "padded rows must be 0"
        _close(got["loss"] / want_loss, 1.0, f"{name} loss")
        for i, (g, w) in enumerate(zip(got["grads"], want_grads)):
            _close(ns["inverse_reorder_from_context_parallel"](g, stripe), w, f"{name} grad {i}")
