"""Test-wide strictness (style.md, 12): strict dtype promotion, rank promotion errors, and
8 fake CPU devices for the context-parallel tests. Set before any backend initialises."""

import jax
import pytest

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
