"""`speedometer`: time a jitted forward+backward of any Flax module, as the tutorials do.

The reference tutorials time their layers with `quickstart_jax_utils.speedometer`; this is the
same measurement under the same name and arguments, so a tutorial runs with only its import
line changed (`from flashmesh.bench import speedometer`). One step is

    loss = vdot(apply_fn(variables, input, **forward_kwargs, rngs=...), output_grad)
    value_and_grad(loss, argnums=(variables, input))

jitted once, run `warmup_iters` times, then `timing_iters` times back to back; it prints
"Mean time: X ms" (the tutorials' line) and returns X. Unlike the original it waits for the
device before reading the clock at both ends, so the mean is the work, not the dispatch.
Under FP8 autocast each step also writes the FP8 state's new value (the `fp8_metas`
gradients) over the variables, which the next step uses, as a training loop does.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp


def _autocast(autocast_kwargs: dict | None):
    """flashmesh.te.autocast(**kwargs) when FP8 autocast is asked for, else a no-op."""
    if not autocast_kwargs or not autocast_kwargs.get("enabled", False):
        return contextlib.nullcontext()
    from flashmesh.te import autocast  # imported only when asked for

    return autocast(**autocast_kwargs)


def _value_and_grad(model_apply_fn: Callable, forward_kwargs: dict | None, autocast_kwargs: dict | None):
    forward_kwargs = dict(forward_kwargs or {})

    def loss_fn(variables, inp, grad_target, rngs):
        with _autocast(autocast_kwargs):
            out = model_apply_fn(variables, inp, **forward_kwargs, rngs=rngs)
        # vdot with the output gradient: its gradient is exactly the VJP with output_grad.
        return jnp.vdot(out, grad_target.astype(out.dtype)).astype(jnp.float32)

    return jax.value_and_grad(loss_fn, argnums=(0, 1))


def create_train_step_fn(model_apply_fn: Callable, forward_kwargs: dict | None = None,
                         autocast_kwargs: dict | None = None) -> Callable:
    """A jitted step (variables, input, output_grad, rngs) -> (loss, (variable_grads, input_grads))."""
    return jax.jit(_value_and_grad(model_apply_fn, forward_kwargs, autocast_kwargs))


def create_fp8_train_step_fn(model_apply_fn: Callable, forward_kwargs: dict | None = None,
                             autocast_kwargs: dict | None = None) -> Callable:
    """The step of a training loop under FP8 autocast (a Python function around a jitted
    step, so not itself lowerable with `.lower()`): (variables, input,
    output_grad, rngs) -> (new_variables, loss, (variable_grads, input_grads)), where new_variables has the
    `fp8_metas` gradients written over the FP8 state (TransformerEngine's convention: the
    state's new value comes back as its cotangent; `flashmesh.quantization.update_fp8_metas`)."""
    from flashmesh.quantization import written_state

    value_and_grad = _value_and_grad(model_apply_fn, forward_kwargs, autocast_kwargs)

    def state_step(variables, inp, grad_target, rngs):
        loss, grads = value_and_grad(variables, inp, grad_target, rngs)
        return written_state(variables, grads[0]), loss, grads

    # The parameters come back outside the jitted step (written_state says why).
    jitted = jax.jit(state_step)

    def step(variables, inp, grad_target, rngs):
        state, loss, grads = jitted(variables, inp, grad_target, rngs)
        return {**variables, **state}, loss, grads

    return step


# Steps of a call that names none (set_default_iterations changes them, e.g. for CPU runs).
DEFAULT_ITERATIONS = {"timing_iters": 20, "warmup_iters": 10}


def set_default_iterations(timing_iters: int, warmup_iters: int) -> None:
    """The timed and warm-up steps of every later `speedometer` call that names none; a
    tutorial run at a small size (`--small`) asks for few without changing its calls."""
    _check_iterations(timing_iters, warmup_iters)
    DEFAULT_ITERATIONS.update(timing_iters=timing_iters, warmup_iters=warmup_iters)


def _check_iterations(timing_iters: int, warmup_iters: int) -> None:
    if timing_iters < 1 or warmup_iters < 0:
        raise ValueError(f"timing_iters={timing_iters} must be >= 1 and warmup_iters={warmup_iters} >= 0")


def speedometer(
    model_apply_fn: Callable,
    variables: Any,
    input: Any,
    output_grad: jax.Array,
    model_init_fn: Callable | None = None,
    forward_kwargs: dict | None = None,
    autocast_kwargs: dict | None = None,
    timing_iters: int | None = None,
    warmup_iters: int | None = None,
    rngs: dict[str, jax.Array] | None = None,
    dropout_key: jax.Array | None = None,
    fp8_autocast_kwargs: dict | None = None,
) -> float:
    """Mean milliseconds of one jitted forward+backward step of a Flax module; prints them.

    Args:
      model_apply_fn: the module's `apply` (or any `f(variables, input, **kw)`).
      variables: its variables (gradients are taken with respect to them and to `input`).
      input: the input array or pytree (e.g. a (q, k, v) tuple).
      output_grad: the gradient of the loss with respect to the output (same shape).
      model_init_fn: `init` to re-create the variables under `autocast_kwargs` (FP8 recipes
        keep scaling state in the variables), called as model_init_fn(key, input, **forward_kwargs).
      forward_kwargs: extra keyword arguments of the forward call (e.g. deterministic=False,
        sequence_descriptor=...).
      autocast_kwargs (alias fp8_autocast_kwargs): arguments of `flashmesh.te.autocast`. With
        enabled=True every step also writes the `fp8_metas` gradients over the FP8 state
        (`create_fp8_train_step_fn`) and the next step runs with the new state, so the timed
        steps include the state update.
      timing_iters, warmup_iters: timed and untimed steps (default: DEFAULT_ITERATIONS, 20 and 10).
      rngs: rng streams for `apply` (a fresh split per step); default {"dropout": dropout_key}.
      dropout_key: key of the default dropout stream (default jax.random.key(0)).

    Example:
      >>> speedometer(model.apply, variables, (q, k, v), dout, timing_iters=20, warmup_iters=10)
      Mean time: <mean milliseconds per timed step> ms
    """
    timing_iters = DEFAULT_ITERATIONS["timing_iters"] if timing_iters is None else timing_iters
    warmup_iters = DEFAULT_ITERATIONS["warmup_iters"] if warmup_iters is None else warmup_iters
    _check_iterations(timing_iters, warmup_iters)
    autocast_kwargs = autocast_kwargs if autocast_kwargs is not None else fp8_autocast_kwargs
    fp8 = bool(autocast_kwargs and autocast_kwargs.get("enabled", False))
    if rngs is None:
        rngs = {"dropout": dropout_key if dropout_key is not None else jax.random.key(0)}
    if model_init_fn is not None and fp8:
        with _autocast(autocast_kwargs):
            variables = model_init_fn(jax.random.key(0), input, **(forward_kwargs or {}))
    if fp8:  # each step writes the FP8 state's new value over it, as a training step does
        fp8_step = create_fp8_train_step_fn(model_apply_fn, forward_kwargs, autocast_kwargs)

        def step(variables, *args):
            variables, *result = fp8_step(variables, *args)
            return variables, result
    else:
        grad_step = create_train_step_fn(model_apply_fn, forward_kwargs, autocast_kwargs)

        def step(variables, *args):
            return variables, grad_step(variables, *args)

    def next_rngs(rngs):
        split = {name: jax.random.split(key) for name, key in rngs.items()}
        return {n: s[0] for n, s in split.items()}, {n: s[1] for n, s in split.items()}

    result = None
    for _ in range(warmup_iters):
        rngs, step_rngs = next_rngs(rngs)
        variables, result = step(variables, input, output_grad, step_rngs)
    jax.block_until_ready((result, variables, rngs))
    start = time.perf_counter()
    for _ in range(timing_iters):
        rngs, step_rngs = next_rngs(rngs)
        variables, result = step(variables, input, output_grad, step_rngs)
    jax.block_until_ready((result, variables))
    mean_ms = (time.perf_counter() - start) * 1e3 / timing_iters
    print(f"Mean time: {mean_ms} ms")
    return mean_ms
