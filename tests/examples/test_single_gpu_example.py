"""The ported single-GPU tutorial (examples/single_gpu_attention.py) runs end to end on CPU at
its --small size, and its fused attention agrees with the tutorial's plain-JAX baseline."""

import pathlib
import runpy
import sys

import jax
import numpy as np

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def test_single_gpu_tutorial_runs_small(monkeypatch, capsys):
    script = EXAMPLES / "single_gpu_attention.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--small"])
    monkeypatch.syspath_prepend(str(EXAMPLES))  # its `import quickstart_jax_utils`
    ns = runpy.run_path(str(script), run_name="__main__")
    printed = capsys.readouterr().out

    assert (ns["batch"], ns["seq"], ns["num_query_heads"], ns["num_kv_heads"], ns["head_dim"]) == (
        1, 256, 8, 2, 32)
    assert printed.count("Mean time: ") == 2
    assert "Native JAX bf16 GQA + SWA:" in printed and "TE DotProductAttention GQA + SWA:" in printed
    assert "q/k head dim=128, v head dim=64" in printed
    assert "Output shape=(1, 256, 8, 64), dtype=bfloat16" in printed
    assert "Grad shapes=[(1, 256, 8, 128), (1, 256, 2, 128), (1, 256, 2, 64)]" in printed

    # GQA + sliding window (16, 0): the fused module computes what the baseline computes.
    out = ns["te_model"].apply(ns["te_vars"], ns["qkv"], sequence_descriptor=ns["sequence_descriptor"],
                               deterministic=False)
    ref = ns["baseline"].apply(ns["baseline_vars"], ns["qkv"])
    jax.block_until_ready((out, ref))
    assert out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               rtol=2e-2, atol=2e-2)
