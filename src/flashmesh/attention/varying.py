"""Manual-axis types under `shard_map`: loop carries that vary like the loop's inputs.

Inside `jax.shard_map` (with `check_vma`, the default) every value records the manual mesh axes
along which it differs between devices. A `scan`, `fori_loop` or `while_loop` requires its carry
to keep that type through the body, but an initial carry built from constants (`jnp.zeros`)
varies along no axis while the body mixes in q, k, v or segment ids that vary along some: the
loop is rejected. Backends build their initial carries through `like`, which marks them as
varying along every axis any of the call's inputs varies along. Outside `shard_map` (or without
manual axes) both functions are no-ops.
"""

from __future__ import annotations

import jax
from jax import lax


def _axes(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.11: the manual-axis type of the aval
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))  # the older and (possibly) later spelling


def varying_axes(*trees) -> tuple:
    """The manual axes along which any array leaf of `trees` varies, sorted by name."""
    axes = frozenset().union(*(_axes(x) for x in jax.tree.leaves(trees)))
    return tuple(sorted(axes, key=str))


def like(tree, axes: tuple):
    """Every leaf of `tree` marked as varying along `axes` (those it does not already)."""
    if not axes:
        return tree

    def cast(x):
        missing = tuple(a for a in axes if a not in _axes(x))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def summed_like(grad, primal_like):
    """Inside `shard_map`: a cotangent summed over the manual axes it varies along but its
    primal does not (a parameter replicated over the data axis gets every shard's gradient
    summed), what autodiff's transpose of the implicit broadcast does."""
    extra = tuple(a for a in varying_axes(grad) if a not in varying_axes(primal_like))
    return lax.psum(grad, extra) if extra else grad
