"""flashmesh.train: the stdlib data, the GPT, the jitted step (FP8 state threaded), the report,
and the tiny `flashmesh train --tiny` run on CPU.

The tiny run trains in bf16 and in FP8 (delayed scaling through XLA's FP8 emulation on CPU).
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from flashmesh.te import flax as te_flax
from flashmesh.train import cli, data, gpt, loop, report


@pytest.fixture
def layers():
    """flashmesh.te.flax, whose TransformerLayer, LayerNorm and DenseGeneral the GPT builds on."""
    return te_flax


# -- data -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus():
    return data.load_corpus()


def test_corpus_is_the_stdlib_split_by_file(corpus):
    names = data.source_files()
    assert names == sorted(names) and "os.py" in names and "json/__init__.py" in names
    assert not any("site-packages" in n for n in names)
    assert set(corpus.train_files).isdisjoint(corpus.validation_files)
    assert sorted(corpus.train_files + corpus.validation_files) == names
    assert len(corpus.validation_files) == len(names) // 20
    assert list(corpus.validation_files) == names[19::20]
    root = data.stdlib_root()
    sizes = lambda files: sum((root / f).stat().st_size + 1 for f in files)  # noqa: E731  (+1: separator)
    assert corpus.train.size == sizes(corpus.train_files)
    assert corpus.validation.size == sizes(corpus.validation_files)
    first = (root / corpus.train_files[0]).read_bytes()
    assert corpus.train[:len(first)].tobytes() == first and corpus.train[len(first)] == data.SEPARATOR
    again = data.load_corpus()  # deterministic
    assert again.train_files == corpus.train_files and np.array_equal(again.validation, corpus.validation)


def test_split_and_windows_on_a_small_tree(tmp_path):
    for i in range(41):
        (tmp_path / f"m{i:02d}.py").write_bytes(bytes([65 + i % 26]) * (50 + i))
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "third.py").write_bytes(b"x" * 60)
    (tmp_path / "notes.txt").write_bytes(b"not python")
    corpus = data.load_corpus(tmp_path, validation_every=10)
    assert corpus.validation_files == ("m09.py", "m19.py", "m29.py", "m39.py")
    assert len(corpus.train_files) == 37
    # a window is seq + 1 consecutive bytes of the stream, targets shifted by one
    rng = np.random.default_rng(3)
    x, y = data.sample_batch(corpus.train, rng, batch=64, seq=40)
    assert x.shape == y.shape == (64, 40) and x.dtype == y.dtype == np.int32
    assert np.array_equal(x[:, 1:], y[:, :-1])
    assert x.min() >= 0 and max(x.max(), y.max()) < data.VOCAB
    stream = corpus.train.tobytes()
    for row in range(64):
        assert bytes(np.append(x[row], y[row, -1]).astype(np.uint8)) in stream
    # the same seed gives the same windows; another seed others
    again = data.sample_batch(corpus.train, np.random.default_rng(3), batch=64, seq=40)
    assert np.array_equal(again[0], x)
    assert not np.array_equal(data.sample_batch(corpus.train, np.random.default_rng(4), 64, 40)[0], x)
    # every start is reachable, the last one included, and none past it
    tiny = np.arange(6, dtype=np.uint8)
    starts = {int(data.sample_batch(tiny, rng, 200, 4)[0][b, 0]) for b in range(200)}
    assert starts == {0, 1}


def test_data_bad_input(tmp_path):
    with pytest.raises(ValueError, match="validation_every"):
        data.split_files(["a.py"], validation_every=1)
    (tmp_path / "a.py").write_bytes(b"abc")
    with pytest.raises(ValueError, match="both splits"):
        data.load_corpus(tmp_path)
    with pytest.raises(ValueError, match="seq \\+ 1"):
        data.sample_batch(np.zeros(4, np.uint8), np.random.default_rng(0), 1, 4)
    with pytest.raises(ValueError, match="batch"):
        data.sample_batch(np.zeros(9, np.uint8), np.random.default_rng(0), 0, 4)


# -- model and step -------------------------------------------------------------------------------------
def test_next_byte_loss_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 256)).astype(np.float32) * 3
    targets = rng.integers(0, 256, size=(3, 5)).astype(np.int32)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted.astype(np.float64)).sum(-1, keepdims=True))
    expected = -np.take_along_axis(logp, targets[..., None], -1).mean()
    np.testing.assert_allclose(float(gpt.next_byte_loss(jnp.asarray(logits), jnp.asarray(targets))),
                               expected, rtol=1e-6)


def test_gpt_is_causal_bf16_and_tied(layers):
    config = gpt.GPTConfig(layers=1, hidden=32, heads=2, seq=16)
    model = gpt.GPT(config)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 16)), jnp.int32)
    variables = jax.jit(model.init)(jax.random.key(0), tokens)
    assert set(variables["params"]) == {"embed", "positions", "layer_0", "final_norm"}
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(variables["params"]))
    run = jax.jit(lambda v, t: model.apply(v, t, capture_intermediates=True, mutable=["intermediates"]))
    logits, state = run(variables, tokens)
    assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
    seen = state["intermediates"]
    assert seen["layer_0"]["__call__"][0].dtype == jnp.bfloat16  # bf16 activations
    # the layer sees token + position embeddings, in bf16
    embedding, positions = variables["params"]["embed"]["embedding"], variables["params"]["positions"]["embedding"]
    np.testing.assert_array_equal(np.asarray(seen["embed"]["__call__"][0], np.float32),
                                  np.asarray(embedding[tokens].astype(jnp.bfloat16), np.float32))
    # tied: logits = final_norm(x) @ embedding^T (bf16 operands, so a bf16 rounding of the output)
    normed = np.asarray(seen["final_norm"]["__call__"][0], np.float32)
    want = normed @ np.asarray(embedding.astype(jnp.bfloat16), np.float32).T
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    assert positions.shape == (16, 32)
    changed, _ = run(variables, tokens.at[:, 10].set((tokens[:, 10] + 1) % 256))
    np.testing.assert_array_equal(np.asarray(changed[:, :10]), np.asarray(logits[:, :10]))  # causal
    assert not np.allclose(np.asarray(changed[:, 10:]), np.asarray(logits[:, 10:]))
    untied = gpt.GPT(gpt.GPTConfig(layers=1, hidden=32, heads=2, seq=16, tied=False))
    assert "head" in jax.eval_shape(untied.init, jax.random.key(0), tokens)["params"]
    with pytest.raises(ValueError, match="config.seq"):
        jax.eval_shape(model.apply, variables, jnp.zeros((1, 17), jnp.int32))
    with pytest.raises(ValueError, match="hidden=48 must be a multiple of 64"):
        gpt.GPTConfig(hidden=48)


class _FakeFP8Dense(nn.Module):
    """A dense whose 'fp8_metas' state is set, through its cotangent, to max|input| (TE's convention)."""

    features: int

    @nn.compact
    def __call__(self, x):
        amax = self.variable(loop.FP8_COLLECTION, "x_amax", lambda: jnp.zeros((), jnp.float32))
        return nn.Dense(self.features, dtype=x.dtype, param_dtype=jnp.float32)(_observe(x, amax.value))


@jax.custom_vjp
def _observe(x, amax):
    return x


def _observe_fwd(x, amax):
    return x, jnp.max(jnp.abs(x)).astype(jnp.float32)


def _observe_bwd(new_amax, g):
    return g, new_amax


_observe.defvjp(_observe_fwd, _observe_bwd)


class _TinyFP8Model(nn.Module):
    @nn.compact
    def __call__(self, tokens, deterministic=True):
        x = nn.Embed(256, 16, dtype=jnp.float32, param_dtype=jnp.float32, name="embed")(tokens)
        return _FakeFP8Dense(256, name="dense")(x)


def test_step_updates_params_by_the_optimizer_and_fp8_state_by_its_cotangent(monkeypatch):
    import sys
    import types

    import flashmesh

    fake = types.ModuleType("flashmesh.quantization")  # TE's rule: the cotangent is the new state
    fake.update_fp8_metas = lambda variables, grads: {**variables, loop.FP8_COLLECTION: grads[loop.FP8_COLLECTION]}
    monkeypatch.setitem(sys.modules, "flashmesh.quantization", fake)
    monkeypatch.setattr(flashmesh, "quantization", fake, raising=False)
    model, config = _TinyFP8Model(), loop.TrainConfig(steps=10, warmup=0, lr=1e-2)
    rng = np.random.default_rng(0)
    batches = [tuple(jnp.asarray(rng.integers(0, 256, (4, 8)), jnp.int32) for _ in range(2)) for _ in range(3)]
    variables = jax.jit(model.init)(jax.random.key(0), batches[0][0])
    loop.check_collections(variables, fp8=True)
    tx = loop.optimizer(config)
    step = jax.jit(loop.make_train_step(model, tx, fp8=True))

    @jax.jit
    def plain_step(params, opt_state, x, y):  # by hand: logits = embedding[x] @ kernel + bias
        def loss(p):
            dense = p["dense"]["Dense_0"]
            logits = p["embed"]["embedding"][x] @ dense["kernel"] + dense["bias"][None, None]
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = want_opt = tx.init(variables["params"])
    want = variables["params"]
    for x, y in batches:
        embedded = variables["params"]["embed"]["embedding"][x]
        variables, opt_state, loss = step(variables, opt_state, x, y, jax.random.key(1))
        want, want_opt, want_loss = plain_step(want, want_opt, x, y)
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
        for got, exp in zip(jax.tree.leaves(variables["params"]), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(exp), rtol=1e-5, atol=1e-7)
        # the FP8 state is the cotangent (max |input| of this step), never an optimizer update
        assert float(variables[loop.FP8_COLLECTION]["dense"]["x_amax"]) == float(jnp.max(jnp.abs(embedded))) > 0
    assert jax.tree.structure(opt_state) == jax.tree.structure(want_opt)  # the optimizer never saw fp8_metas
    with pytest.raises(ValueError, match="no 'fp8_metas'"):
        loop.check_collections({"params": want}, fp8=True)
    with pytest.raises(NotImplementedError, match="threads only"):
        loop.check_collections(dict(variables), fp8=False)
    boxed = {"params": jax.tree.map(lambda a: nn.LogicallyPartitioned(a, (None,) * a.ndim), want)}
    unboxed = loop.check_collections(boxed, fp8=False)  # the logical axes dropped, one device
    assert jax.tree.structure(unboxed) == jax.tree.structure({"params": want})


def test_optimizer_schedule_and_decay_mask():
    """With zero gradients AdamW's step is -lr(step) * weight_decay * p, on matrices only."""
    config = loop.TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1, weight_decay=0.1)
    tx = loop.optimizer(config)
    params = {"w": jnp.full((2, 2), 2.0), "b": jnp.full((2,), 2.0)}
    zeros = jax.tree.map(jnp.zeros_like, params)
    state = tx.init(params)
    update = jax.jit(tx.update)
    seen = []
    for _ in range(100):
        updates, state = update(zeros, state, params)
        seen.append(float(updates["w"][0, 0]) / (-0.1 * 2.0))
        assert float(jnp.abs(updates["b"]).max()) == 0.0
    lr = lambda s: s / 10 if s < 10 else 0.1 + 0.45 * (1 + math.cos(math.pi * (s - 10) / 90))  # noqa: E731
    np.testing.assert_allclose(seen, [lr(s) for s in range(100)], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="warmup"):
        loop.TrainConfig(steps=10, warmup=10)
    with pytest.raises(ValueError, match="precision"):
        loop.precision_context("fp16", config)


# -- report -----------------------------------------------------------------------------------------------
def _curves(precision, final):
    return loop.Curves(precision=precision, steps=(1, 2, 3, 4), train_loss=(5.0, 4.0, 3.0, 2.5),
                       val_steps=(0, 2, 4), val_loss=(5.5, 3.5, final), seconds=2.0, train_seconds=1.0,
                       compile_seconds=1.0, tokens_per_step=64, params=1000)


def test_compare_is_two_percent_of_bf16():
    check = report.compare([_curves("bf16", 2.0), _curves("fp8", 2.039)])
    assert check["passed"] and check["relative_difference"] == pytest.approx(0.0195)
    assert not report.compare([_curves("bf16", 2.0), _curves("fp8", 1.95)])["passed"]  # 2.5 % below
    assert not report.compare([_curves("bf16", 2.0), _curves("fp8", math.nan)])["passed"]
    assert report.compare([_curves("bf16", 2.0)]) is None


# -- the tiny run ---------------------------------------------------------------------------------------------
def test_tiny_run_writes_a_report_and_learns(layers, tmp_path, capsys):
    precisions = "bf16,fp8"
    argv = ["--tiny", "--precisions", precisions, "--out", str(tmp_path), "--no-progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out  # without the bar, a line per evaluation (what a log shows)
    assert "train bf16: compiled in" in out and "train bf16: step 20/20, train " in out, out
    (folder,) = tmp_path.iterdir()
    assert folder.name.endswith("-cpu-train-tiny")
    payload = json.loads((folder / "results.json").read_text())
    meta = payload["meta"]
    assert meta["commit"] and meta["device"] == "cpu" and meta["date"] in folder.name
    assert meta["model"]["layers"] == 2 and meta["model"]["hidden"] == 32 and meta["data"]["vocab"] == 256
    assert [r["precision"] for r in payload["rows"]] == precisions.split(",")
    for row in payload["rows"]:
        assert row["status"] == "ok" and len(row["train_loss"]) == 20 and row["val_steps"] == [0, 5, 10, 15, 20]
        assert row["val_loss"][-1] < row["val_loss"][0] - 0.5  # ln 256 = 5.55 at the start
        assert np.mean(row["train_loss"][-5:]) < np.mean(row["train_loss"][:5]) - 0.5
    text = (folder / "report.md").read_text()
    assert "![training and validation loss](loss.png)" in text and meta["commit"] in text
    assert "PASS" in text or "FAIL" in text
    assert (folder / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert payload["check"]["relative_difference"] >= 0


def test_cli_refuses_bad_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--tiny", "--precisions", "bf16,int4"])
    assert exit_info.value.code == 2 and "--precisions" in capsys.readouterr().err


# -- on a GPU ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_fp8_step_runs_cublaslt_fp8_gemms(layers):
    """The compiled FP8 step holds cuBLASLt FP8 GEMMs (not bf16 ones fed by a dequantise)."""
    model_config, config = gpt.GPTConfig(layers=2, hidden=256, seq=128), loop.TrainConfig(steps=10, warmup=0)
    model, tx = gpt.GPT(model_config), loop.optimizer(config)
    x = jnp.zeros((8, 128), jnp.int32)
    with loop.precision_context("fp8", config):
        variables = loop.check_collections(model.init(jax.random.key(0), x), fp8=True)
        opt_state = tx.init(variables["params"])
        compiled = jax.jit(loop.make_train_step(model, tx, fp8=True)).lower(
            variables, opt_state, x, x, jax.random.key(1)).compile()
    assert "__cublas$lt$matmul$f8" in compiled.as_text()


@pytest.mark.gpu
def test_short_gpu_run_fp8_within_two_percent_of_bf16(layers, corpus):
    model_config = gpt.GPTConfig(layers=4, hidden=256, seq=256)
    config = loop.TrainConfig(steps=300, batch=32, lr=1e-3, warmup=30, eval_every=100, eval_batches=4)
    curves = [loop.train(model_config, config, corpus, p, progress=False) for p in ("bf16", "fp8")]
    for c in curves:
        assert c.status == "ok" and c.final_val_loss < 2.5, (c.precision, c.val_loss)  # unigram: 3.25
    check = report.compare(curves)
    assert check["passed"], report.check_text(check)


def test_byte_embed_matches_a_gather_and_its_gradient():
    """ByteEmbed's one-hot GEMM gives nn.Embed's values and (to f32 rounding) its gradient."""
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (3, 50)), jnp.int32)
    table = jax.random.normal(jax.random.key(1), (256, 24), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (3, 50, 24), jnp.float32)
    kw = dict(num_embeddings=256, features=24, dtype=jnp.float32, param_dtype=jnp.float32)

    def loss(module, table):
        return jnp.sum(module.apply({"params": {"embedding": table}}, tokens) * w)

    got = jax.value_and_grad(lambda t: loss(gpt.ByteEmbed(**kw), t))(table)
    want = jax.value_and_grad(lambda t: loss(nn.Embed(**kw), t))(table)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(want[1])).max() > 1.0  # repeated tokens: summed rows
