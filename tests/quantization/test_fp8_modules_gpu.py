"""FP8 through the modules: the compiled HLO holds only FP8 cuBLASLt GEMMs (GPU), FP8
attention under fp8_dpa (GPU; refused with its reason elsewhere), explain says which."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashmesh
import flashmesh.te as te
import flashmesh.te.flax as te_flax
from flashmesh.quantization import update_fp8_metas
from flashmesh.te.recipe import DelayedScaling, Float8CurrentScaling, Format

F8_GEMM = "__cublas$lt$matmul$f8"


def gemm_calls(hlo: str) -> dict[str, int]:
    """GEMMs in compiled HLO text by kind: FP8 cuBLASLt calls, other cuBLAS/cuBLASLt calls, and
    dots left in fusions (XLA's Triton GEMMs), split by whether both operands are FP8."""
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
    # Compiled HLO names a dot's operands without their types: look each name up where it is
    # defined (`%name = type[...]`; names are unique within a module).
    types = dict(re.findall(r"(%[\w.-]+) = (\w+)\[", hlo))
    dots = [[types.get(name, "?") for name in re.findall(r"%[\w.-]+", args)[:2]]
            for args in re.findall(r" dot\(([^)]*)\)", hlo)]
    f8 = lambda t: t.startswith("f8")
    return {
        "f8": sum(t == F8_GEMM for t in targets),
        "other_cublas": sum(t.startswith("__cublas") and t != F8_GEMM for t in targets),
        "f8_fused_dot": sum(len(d) == 2 and f8(d[0]) and f8(d[1]) for d in dots),
        "other_dot": sum(not (len(d) == 2 and f8(d[0]) and f8(d[1])) for d in dots),
    }


def _guide_layer(hidden=512, ffn=2048, heads=4):
    return te_flax.TransformerLayer(
        hidden_size=hidden, mlp_hidden_size=ffn, num_attention_heads=heads, mlp_activations=("gelu",),
        self_attn_mask_type="causal", layernorm_epsilon=1e-5, use_bias=True, intermediate_dropout=0.0,
        enable_relative_embedding=False, self_attn_bias_type="no_bias", hidden_dropout=0.0,
        attention_dropout=0.0)


def _compiled_step(module, x, recipe, call):
    with te.autocast(enabled=True, recipe=recipe):
        variables = module.init(jax.random.key(0), x, **call)

        def loss(v, x):
            y = module.apply(v, x, **call)
            y = y[0] if isinstance(y, tuple) else y
            # a random cotangent: with sum(y), XLA folds the backward GEMMs of the last dense
            # (a GEMM against a broadcast constant) into reductions
            dy = jax.random.normal(jax.random.key(7), y.shape, jnp.float32)
            return jnp.vdot(y.astype(jnp.float32), dy)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        text = step.lower(variables, x).compile().as_text()
    return variables, step, text


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=16), Float8CurrentScaling()],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("which", ["dense", "ln_mlp", "transformer_layer"])
def test_every_gemm_of_an_fp8_layer_is_an_fp8_cublaslt_call(recipe, which):
    x = jax.random.normal(jax.random.key(1), (2, 256, 512), jnp.bfloat16)
    module, call, dense_gemms = {
        "dense": (te_flax.DenseGeneral(features=1536), {}, 1),
        "ln_mlp": (te_flax.LayerNormMLP(intermediate_dim=2048, use_bias=True), {"deterministic": True}, 2),
        "transformer_layer": (_guide_layer(), {"deterministic": True}, 4),
    }[which]
    _, _, hlo = _compiled_step(module, x, recipe, call)
    calls = gemm_calls(hlo)
    # forward, dgrad, wgrad per dense, each with FP8 operands: XLA's autotuner may give a small
    # FP8 GEMM to Triton rather than cuBLASLt, but never a bf16 one
    gemm_lines = [line.strip()[:240] for line in hlo.splitlines() if " dot(" in line or "__cublas" in line]
    assert calls["f8"] + calls["f8_fused_dot"] == 3 * dense_gemms, (calls, gemm_lines)
    assert calls["other_cublas"] == 0 and calls["other_dot"] == 0, (calls, gemm_lines)


@pytest.mark.gpu
def test_guide_sized_fp8_gemms_are_cublaslt_fp8_calls():
    """At the guide's FFN size (M = 8192 tokens, 4096 -> 16384) the FP8 GEMMs are cuBLASLt's."""
    x = jax.random.normal(jax.random.key(1), (4, 2048, 4096), jnp.bfloat16)
    _, _, hlo = _compiled_step(te_flax.DenseGeneral(features=16384), x, DelayedScaling(amax_history_len=16), {})
    calls = gemm_calls(hlo)
    assert calls["f8"] == 3 and calls["other_cublas"] == 0 and calls["other_dot"] == 0, calls


@pytest.mark.gpu
def test_bf16_layer_has_no_fp8_gemm():
    x = jax.random.normal(jax.random.key(1), (2, 256, 512), jnp.bfloat16)
    module = te_flax.LayerNormMLP(intermediate_dim=2048)
    variables = module.init(jax.random.key(0), x, deterministic=True)
    step = jax.jit(jax.grad(lambda v: jnp.sum(module.apply(v, x, deterministic=True)[0].astype(jnp.float32))))
    assert gemm_calls(step.lower(variables).compile().as_text())["f8"] == 0


@pytest.mark.gpu
def test_fp8_attention_under_fp8_dpa_runs_cudnn_fp8_on_the_gpu():
    """The module under fp8_dpa runs cuDNN's FP8 attention: explain says so, the compiled call
    holds cuDNN's FP8 attention custom call, and the output is within FP8's error of the bf16
    module."""
    recipe = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=4, fp8_dpa=True)
    q = jax.random.normal(jax.random.key(0), (2, 256, 4, 128), jnp.bfloat16)
    module = te_flax.DotProductAttention(head_dim=128, num_attention_heads=4)  # TE: causal
    plain = module.apply(module.init(jax.random.key(0), q, q, q), q, q, q)
    with te.autocast(enabled=True, recipe=recipe):
        variables = module.init(jax.random.key(0), q, q, q)
        assert "runs cuDNN's FP8 attention" in str(flashmesh.explain(q, q, q, mask="causal"))
        step = jax.jit(lambda v: module.apply(v, q, q, q))
        hlo = step.lower(variables).compile().as_text()
        out = step(variables)
    assert "__cudnn$fmhaSoftmaxF8" in hlo, "no cuDNN FP8 attention call"
    rel = jnp.linalg.norm((out - plain).astype(jnp.float32)) / jnp.linalg.norm(plain.astype(jnp.float32))
    assert out.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(out))) and float(rel) < 0.1, float(rel)


def test_fp8_dpa_refuses_with_the_reason_and_explain_says_so():
    q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)   # head dim 64: FP8 training needs 128
    module = te_flax.DotProductAttention(head_dim=64, num_attention_heads=2)
    recipe = DelayedScaling(fp8_format=Format.E4M3, fp8_dpa=True)
    with te.autocast(enabled=True, recipe=recipe):
        with pytest.raises(NotImplementedError, match="FP8 attention"):
            module.init(jax.random.key(0), q, q, q)
        text = str(flashmesh.explain(q, q, q, mask="causal"))
    assert "FP8 attention (autocast, fp8_dpa=True): refused" in text
    # without fp8_dpa, FP8 autocast leaves attention in bf16 (TE's default)
    with te.autocast(enabled=True, recipe=DelayedScaling()):
        variables = module.init(jax.random.key(0), q, q, q)
        assert "fp8_metas" not in variables
        assert "FP8 attention" not in str(flashmesh.explain(q, q, q, mask="causal"))
