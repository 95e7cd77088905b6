"""`speedometer`: time a jitted forward+backward of any Flax module, as the tutorials do.

The reference tutorials time their layers with `quickstart_jax_utils.speedometer`; this is the
same measurement under the same name and arguments, so a tutorial runs with only its import
line changed (`from flashmesh.bench import speedometer`). One step is

    loss = vdot(apply_fn(variables, input, **forward_kwargs, rngs=...), output_grad)
    value_and_grad(loss, argnums=(variables, input))

jitted once, run `warmup_iters` times, then `timing_iters` times back to back; it prints
"Mean time: X ms" (the tutorials' line) and returns X. Unlike the original it waits for the
device before reading the clock at both ends, so the mean is the work, not the dispatch.
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


def create_train_step_fn(model_apply_fn: Callable, forward_kwargs: dict | None = None,
                         autocast_kwargs: dict | None = None) -> Callable:
    """A jitted step (variables, input, output_grad, rngs) -> (loss, (variable_grads, input_grads))."""
    forward_kwargs = dict(forward_kwargs or {})

    def loss_fn(variables, inp, grad_target, rngs):
        with _autocast(autocast_kwargs):
            out = model_apply_fn(variables, inp, **forward_kwargs, rngs=rngs)
        # vdot with the output gradient: its gradient is exactly the VJP with output_grad.
        return jnp.vdot(out, grad_target.astype(out.dtype)).astype(jnp.float32)

    return jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))


def speedometer(
    model_apply_fn: Callable,
    variables: Any,
    input: Any,
    output_grad: jax.Array,
    model_init_fn: Callable | None = None,
    forward_kwargs: dict | None = None,
    autocast_kwargs: dict | None = None,
    timing_iters: int = 20,
    warmup_iters: int = 10,
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
      autocast_kwargs (alias fp8_autocast_kwargs): arguments of `flashmesh.te.autocast`.
      timing_iters, warmup_iters: timed and untimed steps.
      rngs: rng streams for `apply` (a fresh split per step); default {"dropout": dropout_key}.
      dropout_key: key of the default dropout stream (default jax.random.key(0)).

    Example:
      >>> speedometer(model.apply, variables, (q, k, v), dout, timing_iters=20, warmup_iters=10)
      Mean time: <mean milliseconds per timed step> ms
    """
    if timing_iters < 1 or warmup_iters < 0:
        raise ValueError(f"timing_iters={timing_iters} must be >= 1 and warmup_iters={warmup_iters} >= 0")
    autocast_kwargs = autocast_kwargs if autocast_kwargs is not None else fp8_autocast_kwargs
    if rngs is None:
        rngs = {"dropout": dropout_key if dropout_key is not None else jax.random.key(0)}
    if model_init_fn is not None and autocast_kwargs and autocast_kwargs.get("enabled", False):
        with _autocast(autocast_kwargs):
            variables = model_init_fn(jax.random.key(0), input, **(forward_kwargs or {}))
    step = create_train_step_fn(model_apply_fn, forward_kwargs, autocast_kwargs)

    def next_rngs(rngs):
        split = {name: jax.random.split(key) for name, key in rngs.items()}
        return {n: s[0] for n, s in split.items()}, {n: s[1] for n, s in split.items()}

    result = None
    for _ in range(warmup_iters):
        rngs, step_rngs = next_rngs(rngs)
        result = step(variables, input, output_grad, step_rngs)
    jax.block_until_ready((result, rngs))
    start = time.perf_counter()
    for _ in range(timing_iters):
        rngs, step_rngs = next_rngs(rngs)
        result = step(variables, input, output_grad, step_rngs)
    jax.block_until_ready(result)
    mean_ms = (time.perf_counter() - start) * 1e3 / timing_iters
    print(f"Mean time: {mean_ms} ms")
    return mean_ms
