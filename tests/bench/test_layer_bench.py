"""`flashmesh bench --preset layer` on CPU: the tiny layer end to end (files written, every row
checked against its reference and timed, or saying why), the parameter maps of every variant,
the FLOP count, failures as rows, and the speedometer's FP8 state threading."""

import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashmesh.bench import cli, layer, layer_checks, layer_models, runner, shapes

# Rows run end to end (the GPU test runs them all): both references (Flax and plain JAX), FP8
# with its bf16 twin (whose check covers TransformerLayer's parameter map, the most involved),
# the hand-written layer. Each row costs several compilations, so CI runs these three.
ROWS = ("flax", "transformer_layer_fp8", "jax_cudnn")
# XLA's CPU back end at its lowest optimisation: at these sizes compiling is nearly all the run.
FAST_CPU_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    env = dict(os.environ, XLA_FLAGS=FAST_CPU_COMPILE, JAX_PLATFORMS="cpu",
               JAX_NUMPY_DTYPE_PROMOTION="strict", JAX_NUMPY_RANK_PROMOTION="raise")
    argv = [sys.executable, "-m", "flashmesh", "bench", "--preset", "layer", "--quick", "--dtype", "f32",
            "--iters", "3", "--warmup", "1", "--no-progress", "--out", str(out), "--implementations",
            ",".join(ROWS)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (directory,) = out.iterdir()
    return directory


def test_rows_are_checked_then_timed(run_dir):
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-[a-z0-9-]+-layer", run_dir.name)
    data = json.loads((run_dir / "results.json").read_text())
    meta, rows = data["meta"], data["rows"]
    assert "--preset layer" in meta["command"] and "3 x 2 x M x K x N" in meta["flop_formula"]
    assert [r["label"] for r in rows] == list(ROWS)
    for r in rows:
        assert r["status"] == "ok", r  # every row runs on a CPU
        assert r["ms"] > 0 and r["ms_back_to_back"] > 0 and r["tflops"] > 0 and r["memory_bytes"] > 0
        assert 0 < r["enqueue_ms"] <= r["ms_back_to_back"]
        assert r["error"] <= r["tolerance"] and r["checked_against"]
        family = layer_models.VARIANTS[r["label"]].family
        assert r["flops"] == layer.layer_flops(shapes.LAYER_TINY, family)
        if r["fp8"]:
            # Quantised for real (not bf16 in disguise), but close to the twin, state updated.
            assert 1e-3 < r["error"] < layer_checks.FP8_TOLERANCE, r
            assert r["checked_against"].startswith(r["label"].removesuffix("_fp8"))
            assert 1e-3 < r["f32_error"] < layer_checks.FP8_TOLERANCE
            assert r["fp8_update_ms"] > 0 and r["fp8_update_ms_back_to_back"] > 0 and 0 < r["fp8_update_share"] and r["fp8_state_arrays"] > 0
        else:  # float32 on a CPU: every map is exact, so the rows agree to rounding
            assert r["error"] < 1e-4, r
            assert r["fp8_update_ms"] is None
    assert rows[0]["speedup"] == 1.0 and all(r["speedup"] > 0 for r in rows)
    assert [g["met"] for g in data["goals"]] == [None, None, None]  # goals are for the guide's size


def test_report_links_its_plot(run_dir):
    text = (run_dir / "report.md").read_text()
    assert "| variant | ms | back to back | host enqueue |" in text
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert links == ["layer_step_ms.png"]
    assert (run_dir / links[0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Goals" in text and "TransformerLayer bf16 <= 14.5 ms" in text and "relative L2" in text


def test_flops_of_the_guide_layer():
    B, T, H, F, N = 4, 2048, 4096, 16384, 32
    gemms = 3 * 2 * B * T * (H * 3 * H + H * H + H * F + F * H)
    attention = 3.5 * 2 * B * N * (T * (T + 1) // 2) * 2 * (H // N)
    assert layer.layer_flops(shapes.LAYER_GUIDE, "te") == gemms + attention
    assert layer.layer_flops(shapes.LAYER_GUIDE, "te") / 1e12 == pytest.approx(10.38, abs=0.01)  # fp8_layer.md 4
    Q = H // N  # Flax's attention: q, k, v H -> Q, out Q -> H, N heads of Q / N; no H -> H dense
    flax = 3 * 2 * B * T * (H * 3 * H + 3 * H * Q + Q * H + H * F + F * H) + 3.5 * 2 * B * N * (
        T * (T + 1) // 2) * 2 * (Q // N)
    assert layer.layer_flops(shapes.LAYER_GUIDE, "flax_mha") == flax


def test_plan():
    parser = cli.build_parser()
    plan = cli.make_plan(parser.parse_args(["bench", "--preset", "layer"]), "gpu")
    assert plan.kind == "layer" and plan.shapes() == [shapes.LAYER_GUIDE]
    assert plan.groups[0].implementations == shapes.LAYER_VARIANTS == tuple(layer_models.VARIANTS)
    assert cli.make_plan(parser.parse_args(["bench", "--preset", "layer", "--quick"]), "gpu").shapes() == [
        shapes.LAYER_TINY]
    picked = cli.make_plan(parser.parse_args(["bench", "--preset", "layer", "--implementations", "flax,jax_cudnn"]),
                           "cpu")
    assert picked.groups[0].implementations == ("flax", "jax_cudnn")
    with pytest.raises(ValueError, match="not rows of the layer preset"):
        cli.make_plan(parser.parse_args(["bench", "--preset", "layer", "--implementations", "xla"]), "cpu")
    with pytest.raises(ValueError, match="fwdbwd only"):
        cli.make_plan(parser.parse_args(["bench", "--preset", "layer", "--modes", "fwd"]), "cpu")


def test_the_flax_yardstick_runs_in_bf16_under_strict_promotion():
    """The flax rows' yardstick in bf16 (the GPU run's dtype; the end-to-end CPU run is f32):
    flax.linen's LayerNorm promotes bf16 with float32, which strict promotion (this suite's)
    refuses, so the yardstick sets the guide's standard promotion itself. It loses more than
    nothing and less than bf16's worst."""
    shape = shapes.LAYER_TINY
    x = jax.random.normal(jax.random.key(0), (1, 16, shape.hidden), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(1), x.shape, jnp.float32).astype(jnp.bfloat16)
    assert jax.config.jax_numpy_dtype_promotion == "strict"
    error = layer_checks.plain_flax_low_precision_error(shape, x, dy, 0)
    assert 1e-4 < error < 0.1


def _shapes(tree):
    return jax.tree.map(lambda a: a.shape, tree)


@pytest.mark.parametrize("name", [n for n, v in layer_models.VARIANTS.items() if not v.fp8])
def test_every_variant_maps_onto_its_reference(name):
    """Traced only (jax.eval_shape, nothing compiles): each map yields the reference's tree."""
    shape = shapes.LAYER_TINY
    model = layer_models.build(name, shape, jnp.float32, "cpu")
    x = jax.ShapeDtypeStruct((shape.B, shape.T, shape.hidden), jnp.float32)
    with jax.numpy_dtype_promotion("standard"), model.autocast():
        params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    if model.variant.family == "flax_mha":
        want = jax.eval_shape(layer_models.FlaxTransformerLayer(shape.hidden, shape.ffn, shape.heads).init,
                              jax.random.key(0), x)["params"]
        got = jax.eval_shape(lambda p: layer_checks.to_flax(name, p), params)
    else:
        want = jax.eval_shape(lambda k: layer_models.init_jax_layer(k, shape.hidden, shape.ffn, jnp.float32),
                              jax.random.key(0))
        got = jax.eval_shape(lambda p: layer_checks.to_canonical(name, p, shape), params)
    assert _shapes(got) == _shapes(want)


@pytest.mark.parametrize("name", [n for n, v in layer_models.VARIANTS.items() if v.fp8 and v.recipe == "guide"])
def test_fp8_variants_have_their_twins_parameters(name):
    shape, variant = shapes.LAYER_TINY, layer_models.VARIANTS[name]
    x = jax.ShapeDtypeStruct((shape.B, shape.T, shape.hidden), jnp.float32)
    trees = []
    for n in (name, variant.bf16_twin):
        model = layer_models.build(n, shape, jnp.float32, "cpu")
        with model.autocast():
            trees.append(jax.eval_shape(model.init, jax.random.key(0), x))
    assert "fp8_metas" in trees[0] and "fp8_metas" not in trees[1]
    assert _shapes(trees[0]["params"]) == _shapes(trees[1]["params"])


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the refusal off a GPU")
def test_the_fp8_attention_row_is_refused_off_a_gpu_with_the_reason():
    shared = layer.Shared(shapes.LAYER_TINY, runner.RunConfig(dtype="bf16", progress=False), "cpu")
    row = layer.measure("transformer_layer_fp8_attention", shared)
    assert row.status == runner.UNSUPPORTED and "FP8 attention" in row.reason and "CUDA" in row.reason


def test_a_failing_row_records_why(monkeypatch):
    shared = layer.Shared(shapes.LAYER_TINY, runner.RunConfig(dtype="f32", progress=False), "cpu")

    def refuse(name, *args):
        raise NotImplementedError(f"{name} cannot run here")

    monkeypatch.setattr(layer_models, "build", refuse)
    row = layer.measure("te_fused", shared)
    assert row.status == runner.UNSUPPORTED and row.reason == "te_fused cannot run here"
    assert row.ms is None and row.flops == layer.layer_flops(shapes.LAYER_TINY, "te")
    monkeypatch.setattr(layer_models, "build", lambda *a: 1 / 0)
    row = layer.measure("flax", shared)
    assert row.status == runner.ERROR and row.reason.startswith("ZeroDivisionError")


def test_an_fp8_row_whose_twin_fails_is_timed_unchecked(monkeypatch):
    config = runner.RunConfig(dtype="f32", warmup=1, iters=2, progress=False)
    shared = layer.Shared(shapes.LAYER_TINY, config, "cpu")

    def broken(name):
        raise RuntimeError(f"{name} is broken")

    monkeypatch.setattr(shared, "twin", broken)
    row = layer.measure("te_unfused_fp8", shared)
    assert row.status == runner.UNCHECKED and row.ms > 0 and row.fp8_update_ms > 0
    assert row.reason == "unchecked: its bf16 twin te_unfused failed: RuntimeError: te_unfused is broken"
    assert row.error is None


def test_compare_floors_gradients_that_are_zero_in_exact_arithmetic():
    rng = np.random.default_rng(0)
    y, dx = rng.standard_normal((2, 8)), rng.standard_normal((2, 8))
    want = {"kernel": rng.standard_normal((8, 8)), "key_bias": np.zeros(8)}
    noisy = {"kernel": want["kernel"] * (1 + 1e-3), "key_bias": np.full(8, 1e-9)}
    c = layer_checks.compare((y, noisy, dx), (y, want, dx))
    assert c["out"] == c["dx"] == 0.0 and c["dparams"] == pytest.approx(1e-3, rel=1e-6)
    assert c["worst_param"] == "['kernel']"  # the zero gradient's noise is measured, not divided by 0
    wrong = {"kernel": want["kernel"].T, "key_bias": np.zeros(8)}
    assert layer_checks.compare((y, wrong, dx), (y, want, dx))["error"] > 0.5
    assert math.isnan(layer_checks.compare((y * np.nan, want, dx), (y, want, dx))["error"])


def test_training_step_returns_the_state_it_writes_not_the_parameters():
    """Parameters returned unchanged from a jitted step without donation are copied by XLA every
    step (0.2-0.4 ms at the guide's size), work no training step does: the bench's step returns
    only what it writes, the FP8 state (a bf16 row: nothing, the same code without the update)."""
    shape = shapes.LAYER_TINY
    model = layer_models.build("transformer_layer_fp8", shape, jnp.float32, "cpu")
    x = jnp.ones((shape.B, shape.T, shape.hidden), jnp.float32)
    with model.autocast():
        variables = model.init(jax.random.key(0), x)
    out = jax.eval_shape(layer.training_step(model), variables, x, x, jax.random.key(1))
    assert set(out[0]) == {"fp8_metas"}


def test_speedometer_threads_the_fp8_state(capsys):
    import flashmesh.te as te
    import flashmesh.te.flax as te_flax
    from flashmesh.bench.speedometer import create_fp8_train_step_fn, speedometer
    from flashmesh.te.recipe import DelayedScaling

    cast = {"enabled": True, "recipe": DelayedScaling(amax_history_len=4)}
    model = te_flax.DenseGeneral(features=16)
    kx, kdy = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (4, 32), jnp.float32)
    dy = jax.random.normal(kdy, (4, 16), jnp.float32)
    with te.autocast(**cast):
        variables = model.init(jax.random.key(1), x)
    new, loss, (grads, dx) = create_fp8_train_step_fn(model.apply, {}, cast)(variables, x, dy, {})
    assert bool(jnp.isfinite(loss)) and dx.shape == x.shape
    # The new state is the state's cotangent (every quantiser ran), the parameters are untouched.
    cotangents = dict(jax.tree_util.tree_flatten_with_path(grads["fp8_metas"])[0])
    state = jax.tree_util.tree_flatten_with_path(new["fp8_metas"])[0]
    assert state and {p for p, _ in state} == set(cotangents)
    for path, value in state:
        np.testing.assert_array_equal(np.asarray(value), np.asarray(cotangents[path], np.float32))
    histories = [v for p, v in state if "amax_history" in jax.tree_util.keystr(p)]
    assert histories and all(float(jnp.max(h)) > 0 for h in histories)  # this step's amax landed
    assert jax.tree.all(jax.tree.map(lambda a, b: a is b, new["params"], variables["params"]))  # not copied
    ms = speedometer(model.apply, variables, x, dy, autocast_kwargs=cast, timing_iters=2, warmup_iters=1)
    assert ms > 0 and capsys.readouterr().out.startswith("Mean time: ")


@pytest.mark.gpu
def test_every_row_on_a_gpu():
    """The tiny layer in bf16 on a GPU: cuDNN attention in the hand-written row, the FP8 rows on
    the GPU's FP8 path, every row checked and timed."""
    results = layer.run(shapes.layer("gpu", quick=True),
                        runner.RunConfig(dtype="bf16", warmup=1, iters=3, progress=False))
    assert [r.label for r in results] == list(shapes.LAYER_VARIANTS)
    for r in results:
        if r.label == "transformer_layer_fp8_attention":  # the tiny layer's heads are 16 wide
            assert r.status == runner.UNSUPPORTED and "head dim 16" in r.reason, (r.label, r.reason)
            continue
        assert r.status == runner.OK and r.ms > 0, (r.label, r.reason)
    assert next(r for r in results if r.label == "jax_cudnn").detail == "attention: cudnn"
