"""Shared by the Mosaic GPU kernel tests: the interpreter fixture, the relative-error check and
the sequence lengths a kernel launch sees."""

import jax
import jax.extend
import numpy as np
import pytest


@pytest.fixture
def interpreter():
    """Mosaic GPU's interpreter module (its race report); its global state is reset after the
    test, since the interpreter keeps it after a failed kernel."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc

    yield ipc
    ipc.reset_gpu_interpret_mode_state()


def rel_l2(name: str, actual, expected, tol: float) -> float:
    """The relative L2 error of actual against expected (finite, same shape), at most tol;
    a failure names the worst element."""
    a, e = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert a.shape == e.shape, (name, a.shape, e.shape)
    assert np.isfinite(a).all(), f"{name}: {np.sum(~np.isfinite(a))} non-finite elements"
    assert np.isfinite(e).all(), f"{name}: {np.sum(~np.isfinite(e))} non-finite expected elements"
    err = np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30)
    if err > tol:
        idx = np.unravel_index(np.argmax(np.abs(a - e)), a.shape)
        raise AssertionError(f"{name}: relative L2 error {err:.3g} > {tol:.3g}; worst at {idx}: "
                             f"got {a[idx]!r}, expected {e[idx]!r}")
    return float(err)


def kernel_lengths(f, *args) -> tuple[int, ...]:
    """The sequence lengths of the first Mosaic GPU kernel f launches: its q, k, v operands'
    and its output's (axis 1), read from f's jaxpr."""
    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "mpmd_map":  # a plgpu.kernel launch
                return eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                if (found := walk(sub)) is not None:
                    return found
        return None

    launch = walk(jax.make_jaxpr(f)(*args).jaxpr)
    return tuple(v.aval.shape[1] for v in launch.invars[:3]) + (launch.outvars[0].aval.shape[1],)
