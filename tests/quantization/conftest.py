"""Fixtures shared by the quantization tests."""

import jax
import jax.numpy as jnp
import pytest

import flashmesh.te as te
import flashmesh.te.flax as te_flax
from flashmesh.te.recipe import DelayedScaling


@pytest.fixture(scope="session")
def fp8_layer_custom_calls():
    """How many custom calls of a kernel (by name) the compiled gradient step of a small
    guide-shaped FP8 TransformerLayer holds (fused QKV, GELU MLP, causal; delayed scaling): for
    the GPU tests that check the layer takes their kernels. Compiled once."""
    layer = te_flax.TransformerLayer(hidden_size=512, mlp_hidden_size=2048, num_attention_heads=4,
                                     mlp_activations=("gelu",), self_attn_mask_type="causal",
                                     use_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
                                     enable_relative_embedding=False)
    x = jax.random.normal(jax.random.key(1), (2, 256, 512), jnp.bfloat16)
    with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=16)):
        variables = layer.init(jax.random.key(0), x, deterministic=True)
        step = jax.jit(jax.grad(lambda v: jnp.sum(layer.apply(v, x, deterministic=True).astype(jnp.float32))))
        lines = step.lower(variables).compile().as_text().splitlines()
    return lambda name: sum(1 for line in lines if "custom-call(" in line and name in line)


@pytest.fixture
def export_for_h200(monkeypatch):
    """f's StableHLO exported for CUDA on this (CPU) machine with an H200's description, Pallas
    Triton kernels lowered (not compiled) to Triton IR: `export_for_h200(f, *shapes) -> text`.
    One device, so a kernel=None call's CUDA branch is the kernel."""
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200))
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    return lambda f, *args: jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(
        *args).mlir_module()
