"""time_fn and speedometer on tiny inputs and a tiny Flax module."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from flashmesh.bench import Timing, speedometer, time_fn, time_interleaved, timing


def test_time_fn_on_a_callable():
    x = jnp.ones((32, 32), jnp.float32)
    t = time_fn(lambda a: a @ a, x, warmup=1, iters=4)
    assert isinstance(t, Timing)
    assert t.iters == 4 and len(t.times_ms) == 4
    assert 0 < t.min_ms <= t.median_ms
    assert t.compile_s is not None and t.compile_s > 0
    assert t.memory_bytes is not None and t.memory_bytes >= 2 * x.nbytes  # argument + output


def test_time_fn_accepts_jitted_and_compiled():
    x = jnp.arange(8.0)
    jitted = jax.jit(lambda a: jnp.sin(a) * 2.0)
    assert time_fn(jitted, x, warmup=0, iters=2).iters == 2
    compiled = jitted.lower(x).compile()
    t = time_fn(compiled, x, warmup=0, iters=2)
    assert t.iters == 2 and t.compile_s == 0.0


def test_time_fn_caps_slow_rows_and_rejects_bad_counts():
    x = jnp.ones((4,))
    t = time_fn(lambda a: a + 1.0, x, warmup=0, iters=1000, max_seconds=0.0)
    assert t.iters == 3  # at least three, however slow
    with pytest.raises(ValueError, match="iters"):
        time_fn(lambda a: a, x, iters=0)


def test_time_interleaved_alternates_calls_in_rounds(monkeypatch):
    x = jnp.ones((4,))
    a, b = (jax.jit(f).lower(x).compile() for f in (lambda v: v + 1.0, lambda v: v * 2.0))
    order = []
    real = timing._timed_call
    monkeypatch.setattr(timing, "_timed_call", lambda c, args: order.append("ab"[c is b]) or real(c, args))
    ta, tb = time_interleaved([(a, (x,)), (b, (x,))], warmup=0, iters=7, rounds=3)
    assert ta.iters == tb.iters == 7
    # one untimed probe each, then rounds of 2, 2 and 3 calls of each in turn
    assert "".join(order) == "ab" + "aabb" + "aabb" + "aaabbb"
    with pytest.raises(ValueError, match="rounds"):
        time_interleaved([(a, (x,))], rounds=0)


def test_back_to_back_is_the_median_of_interleaved_batches(monkeypatch):
    x = jnp.ones((4,))
    a, b = (jax.jit(f).lower(x).compile() for f in (lambda v: v + 1.0, lambda v: v * 2.0))
    order, figures = [], {"a": iter([5.0, 1.0, 2.0]), "b": iter([3.0, 9.0, 4.0])}

    def fake(c, args, n):
        name = "ab"[c is b]
        order.append(name)
        assert n == 4
        return next(figures[name])

    monkeypatch.setattr(timing, "back_to_back", fake)
    ta, tb = time_interleaved([(a, (x,)), (b, (x,))], warmup=0, iters=4, rounds=2)
    assert "".join(order) == "ab" * timing.B2B_BATCHES  # batches alternate between the calls
    assert (ta.back_to_back_ms, tb.back_to_back_ms) == (2.0, 4.0)  # each call's median


class TinyAttention(nn.Module):
    """A plain-JAX attention layer with a projection and dropout, taking a (q, k, v) tuple."""

    features: int = 8
    dropout: float = 0.0  # a dropout rate > 0 compiles threefry, slow on a busy CPU

    @nn.compact
    def __call__(self, qkv, *, deterministic: bool = False):
        q, k, v = qkv
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5)
        p = nn.Dropout(self.dropout)(jax.nn.softmax(s, axis=-1), deterministic=deterministic)
        o = jnp.einsum("bhqk,bkhd->bqhd", p, v)
        return nn.DenseGeneral(self.features, axis=(-2, -1))(o)


def test_speedometer_times_a_flax_module(capsys):
    ks = jax.random.split(jax.random.key(0), 4)
    qkv = tuple(jax.random.normal(k, (2, 16, 2, 8), jnp.float32) for k in ks[:3])
    model = TinyAttention()
    variables = model.init(jax.random.key(1), qkv, deterministic=True)
    dout = jax.random.normal(ks[3], (2, 16, 8), jnp.float32)
    ms = speedometer(model_apply_fn=model.apply, variables=variables, input=qkv, output_grad=dout,
                     forward_kwargs={"deterministic": False}, timing_iters=3, warmup_iters=1)
    out = capsys.readouterr().out
    assert out.startswith("Mean time: ") and out.strip().endswith(" ms")
    assert ms > 0 and float(out.split()[2]) == pytest.approx(ms)


def test_speedometer_gradients_match_a_plain_vjp():
    from flashmesh.bench.speedometer import create_train_step_fn

    model = nn.Dense(3)
    x = jnp.ones((2, 4))
    variables = model.init(jax.random.key(0), x)
    dout = jnp.arange(6.0).reshape(2, 3)
    step = create_train_step_fn(model.apply)
    loss, (dvars, dx) = step(variables, x, dout, {"dropout": jax.random.key(0)})
    y, vjp = jax.vjp(model.apply, variables, x)
    want_vars, want_x = vjp(dout)
    assert float(loss) == pytest.approx(float(jnp.vdot(y, dout)))
    assert jnp.allclose(dx, want_x)
    assert jnp.allclose(dvars["params"]["kernel"], want_vars["params"]["kernel"])
