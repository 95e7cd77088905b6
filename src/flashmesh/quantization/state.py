"""The FP8 state as Flax variables: TransformerEngine's `fp8_metas` collection and its update.

Every FP8 GEMM of a module owns six float32 variables in the collection `fp8_metas`, named as
TransformerEngine names them (`generate_quantizer_set(postfix)`):

    x{p}_scale [1]       kernel{p}_scale [1]       grad{p}_scale [1]        (ones)
    x{p}_amax_history [L] kernel{p}_amax_history [L] grad{p}_amax_history [L] (zeros)

with p = "" for DenseGeneral and LayerNormDenseGeneral and "_0", "_1" for LayerNormMLP's two
GEMMs, L the recipe's amax_history_len. They exist only for DelayedScaling and are created by
`init` inside `autocast(enabled=True)`. A training step differentiates with respect to all
variables; the cotangent of `fp8_metas` *is* the updated state, and the step writes it over
the old one (`update_fp8_metas`), exactly as TransformerEngine's loops do:

    loss, grads = jax.value_and_grad(loss_fn)(variables, batch)   # inside autocast
    variables = update_fp8_metas(variables, grads)
    params = optimizer_update(variables["params"], grads["params"])
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from flashmesh.quantization import combine
from flashmesh.quantization.autocast import active_recipe
from flashmesh.quantization.recipe import DelayedScaling

__all__ = ["COLLECTION", "QUANTIZERS", "gemm_state", "declare", "update_fp8_metas", "written_state",
           "combine_by_max", "accumulate_gradients"]

COLLECTION = "fp8_metas"
QUANTIZERS = ("x", "kernel", "grad")


def gemm_state(module, postfix: str = ""):
    """(recipe, state) for one GEMM of `module` under the current autocast.

    Returns (None, None) outside FP8 autocast, (recipe, None) for current scaling, and for
    DelayedScaling (recipe, {"x": (scale, history), "kernel": ..., "grad": ...}) read from
    (or, in `init`, created in) `fp8_metas`, viewed in the combining dtypes so that several
    uses of the state combine by max / min (flashmesh.quantization.combine).

    Uses within one `apply` share the view. Uses across separate applies or iterations of a
    loop around `apply` (a `scan` over microbatches, `nn.scan` with broadcast state) each
    read the float32 variable, and autodiff adds their cotangents there: start such a loss
    with `combine_by_max(variables)` (or sum microbatch gradients by `accumulate_gradients`)."""
    recipe = active_recipe()
    if recipe is None or not isinstance(recipe, DelayedScaling):
        return recipe, None
    return recipe, declare(module, QUANTIZERS, postfix, recipe.amax_history_len)


def declare(module, names, postfix: str, length: int) -> dict:
    """{name: (scale, history)} for each of `names`: the variables `{name}{postfix}_scale` [1]
    (ones) and `{name}{postfix}_amax_history` [length] (zeros) of `module`'s `fp8_metas`
    (created in `init`), viewed in the combining dtypes (scales min, histories max). The GEMMs'
    state (`gemm_state`) and FP8 attention's (`quantization.attention.declare_state`) both."""
    # One view per variable per apply: a module called twice in one apply (shared weights)
    # then uses one combining-dtype value, so its two uses combine by max instead of meeting
    # at the float32 variable, where autodiff would add them.
    views = module.scope.root.__dict__.setdefault("_flashmesh_fp8_views", {})
    key = (tuple(module.scope.path), tuple(names), postfix)
    if key in views:
        return views[key]
    first = f"{names[0]}{postfix}_scale"
    if not module.is_initializing() and not module.has_variable(COLLECTION, first):
        raise ValueError(
            f"module {module.name or type(module).__name__!r} runs under FP8 autocast with "
            f"DelayedScaling but its variables have no '{COLLECTION}' state ({first}): create them "
            f"with init inside flashmesh.te.autocast(enabled=True, recipe=...) and pass them to apply")
    state = {}
    for q in names:
        scale = module.variable(COLLECTION, f"{q}{postfix}_scale", jnp.ones, (1,), jnp.float32).value
        history = module.variable(COLLECTION, f"{q}{postfix}_amax_history", jnp.zeros, (length,),
                                  jnp.float32).value
        if history.shape != (length,):
            raise ValueError(f"{q}{postfix}_amax_history has shape {history.shape}, but the recipe's "
                             f"amax_history_len={length}: initialise under the same recipe")
        state[q] = (combine.to_combining(scale, combine.fmin32),
                    combine.to_combining(history, combine.fmax32))
    views[key] = state
    return state


def _flat(tree) -> dict:
    return traverse_util.flatten_dict(dict(tree)) if tree else {}


def update_fp8_metas(variables: dict, grads: dict) -> dict:
    """`variables` with its `fp8_metas` replaced by the state's cotangent in `grads`.

    A quantiser whose state was not used by the differentiated step (its scale's cotangent is
    0 or not finite) keeps its old scale and history, so a module that did not run (or ran
    outside autocast) never has its state wiped. Other collections are returned unchanged."""
    if COLLECTION not in variables:
        return variables
    if COLLECTION not in grads:
        raise ValueError(f"grads has no '{COLLECTION}': differentiate with respect to all the "
                         f"variables (not only 'params') to get the FP8 state's update")
    old, new = _flat(variables[COLLECTION]), _flat(grads[COLLECTION])
    if old.keys() != new.keys():
        raise ValueError(f"grads['{COLLECTION}'] does not match variables['{COLLECTION}']: "
                         f"{sorted(set(old) ^ set(new))[:4]} differ")
    out, groups = {}, {}
    for path, value in old.items():
        prefix = path[-1].removesuffix("_scale").removesuffix("_amax_history")
        scale_path = path[:-1] + (f"{prefix}_scale",)
        history_path = path[:-1] + (f"{prefix}_amax_history",)
        if scale_path not in new:
            out[path] = combine.to_float32(new[path])
        elif path == scale_path:  # one quantiser: its scale and (where it has one) history
            history = history_path if history_path in new else None
            shapes = (value.shape, value.dtype, None if history is None else (old[history].shape, old[history].dtype))
            groups.setdefault(shapes, []).append((scale_path, history))
    for quantisers in groups.values():
        out.update(_kept_where_unused(old, new, quantisers))
    for path in old.keys() - out.keys():  # neither a scale nor its history: taken as it came
        out[path] = combine.to_float32(new[path])
    result = dict(variables)
    result[COLLECTION] = traverse_util.unflatten_dict(out)
    return result


def _kept_where_unused(old: dict, new: dict, quantisers: list) -> dict:
    """The new scale and history of each quantiser (same shapes and dtypes in one group), or
    its old ones where the step did not use it. Stacked, so that XLA runs the group as a few
    kernels instead of a few per quantiser (24 arrays on the guide's layer).

    Unused: a float32 state's cotangent is 0; a viewed state's history comes back as max's
    identity, -inf everywhere (its scale's view has resolved to the old scale)."""
    def stack(table, paths, f32=True):
        return jnp.stack([combine.to_float32(table[p]) if f32 else table[p] for p in paths])

    scales = [s for s, _ in quantisers]
    histories = [h for _, h in quantisers if h is not None]
    candidate = stack(new, scales)
    used = jnp.all(jnp.isfinite(candidate) & (candidate > 0), axis=tuple(range(1, candidate.ndim)))
    pairs = [(scales, candidate)]
    if histories:
        new_h = stack(new, histories)
        used = used & ~jnp.all(jnp.isneginf(new_h), axis=tuple(range(1, new_h.ndim)))
        pairs.append((histories, new_h))
    out = {}
    for paths, fresh in pairs:
        kept = stack(old, paths, f32=False)
        chosen = jnp.where(used.reshape((-1,) + (1,) * (kept.ndim - 1)), fresh.astype(kept.dtype), kept)
        out.update({p: chosen[i] for i, p in enumerate(paths)})
    return out


def written_state(variables: dict, grads: dict) -> dict:
    """What a training step writes besides the parameters: {"fp8_metas": the new state}
    (`update_fp8_metas`'s), or {} without FP8 state. A jitted step that returns this, and not
    all the variables, spares XLA a copy of the unchanged parameters (an output that is an
    undonated input is copied every step); merge it back with {**variables, **written}."""
    if COLLECTION not in variables:
        return {}
    return {COLLECTION: update_fp8_metas(variables, grads)[COLLECTION]}


def combine_by_max(variables: dict) -> dict:
    """`variables` with `fp8_metas` viewed in the combining dtypes (histories max, scales min).

    Call it at the top of a differentiated loss (`loss(combine_by_max(variables), ...)`) when
    one module's state is used several times in it (gradient accumulation inside the step,
    a module reused in a loop): the uses then combine as one pass over all of them would, not
    as a sum. The gradient comes back in float32 for `update_fp8_metas`."""
    if COLLECTION not in variables:
        return variables
    flat = _flat(variables[COLLECTION])
    viewed = {p: combine.to_combining(v, combine.fmin32 if p[-1].endswith("_scale") else combine.fmax32)
              for p, v in flat.items()}
    result = dict(variables)
    result[COLLECTION] = traverse_util.unflatten_dict(viewed)
    return result


def _combine(path, a, b):
    """Histories by max; scales by min over the valid ones (> 0 and finite: a state a
    microbatch did not use has cotangent 0 and must not win the min)."""
    if not path[-1].endswith("_scale"):
        return jnp.maximum(a, b)
    valid = lambda s: jnp.where((s > 0) & jnp.isfinite(s), s, jnp.inf)
    return jnp.minimum(valid(a), valid(b))


def accumulate_gradients(total: Any, new: Any) -> Any:
    """Sum of two steps' gradients (microbatches), with the FP8 state combined, not summed:
    amax histories by elementwise max, scales by min (the state one pass over both
    microbatches gives). `total` may be None for the first microbatch. Each microbatch's
    state is already a usable scale: one whose amax was 0 brings the old scale, which the min
    may keep for a step where one pass would take the other's; `combine_by_max` over the
    microbatches inside one loss combines before that and matches one pass exactly."""
    if total is None:
        return new
    out = {}
    for name in new:
        if name == COLLECTION:
            a, b = _flat(total[name]), _flat(new[name])
            out[name] = traverse_util.unflatten_dict({p: _combine(p, a[p], b[p]) for p in b})
        else:
            out[name] = jax.tree.map(jnp.add, total[name], new[name])
    return out
