"""Test-wide strictness (style.md, 12): strict dtype promotion, rank promotion errors, and
8 fake CPU devices for the context-parallel tests. Set before any backend initialises.

Off a GPU, XLA's CPU back end compiles at LLVM optimisation level 1: the suite's programs are
tiny, so compiling is most of its time, and level 1 takes about a fifth off the whole run (13
to 11 minutes on 2 cores). Level 0 would take a third, but it leaves out the floating-point
contraction the FP8 kernel's byte-for-byte check is calibrated on (test_fp8_mlp's
test_kernel_equals_xla_in_fp8 then fails); level 1 keeps every check as it is. A flag already
in XLA_FLAGS wins; with a GPU (nvidia-smi, as with-venv decides) the flags are left alone."""

import os
import shutil

if shutil.which("nvidia-smi") is None and "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=1".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_num_cpu_devices", 8)


def on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda")


def pytest_collection_modifyitems(config, items):
    if on_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def inexact_jnp(monkeypatch):
    """`inexact_jnp(module, name, rel)`: `module`'s jnp with `jnp.<name>` off by a factor
    (1 + rel), the rest jax.numpy's (a stand-in for a device whose float32 log is inexact: a
    TPU's misses by ~3e-5 relative)."""
    import types

    import jax.numpy as jnp

    def make(module, name: str, rel: float):
        stand_in = types.SimpleNamespace(**{n: getattr(jnp, n) for n in dir(jnp) if not n.startswith("__")})
        exact = getattr(jnp, name)
        setattr(stand_in, name, lambda *a: exact(*a) * (1.0 + rel))
        monkeypatch.setattr(module, "jnp", stand_in)

    return make
