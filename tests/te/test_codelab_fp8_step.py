"""The codelab's FP8 inspection step (reference/002, step 10) through flashmesh.te, at CPU size:
DotProductAttention initialised and applied under te.autocast with the codelab's DelayedScaling.
As in TransformerEngine's JAX stack, a recipe without fp8_dpa keeps attention in the inputs'
dtype, so the FP8-autocast output equals the bf16 one."""

import jax
import jax.numpy as jnp
import numpy as np

import flashmesh.te as te
import flashmesh.te.flax as te_flax
from flashmesh.te.recipe import DelayedScaling, Format


def test_codelab_fp8_inspection_cell_runs_through_flashmesh_te():
    BATCH, SEQ, NUM_HEADS, HEAD_DIM = 2, 64, 4, 32
    fp8_recipe = DelayedScaling(margin=0, fp8_format=Format.HYBRID, amax_history_len=1024,
                                amax_compute_algo="max")
    rk1, rk2, rk3 = jax.random.split(jax.random.key(9000), 3)
    q, k, v = (jax.random.normal(r, (BATCH, SEQ, NUM_HEADS, HEAD_DIM), dtype=jnp.bfloat16)
               for r in (rk1, rk2, rk3))
    attention = te_flax.DotProductAttention(head_dim=HEAD_DIM, num_attention_heads=NUM_HEADS,
                                            num_gqa_groups=NUM_HEADS, attn_mask_type="causal",
                                            transpose_batch_sequence=False)
    bf16_vars = attention.init(jax.random.key(0), q, k, v, deterministic=True)
    bf16_out = attention.apply(bf16_vars, q, k, v, deterministic=True)
    with te.autocast(enabled=True, recipe=fp8_recipe):
        fp8_vars = attention.init(jax.random.key(1), q, k, v, deterministic=True)
        fp8_out = attention.apply(fp8_vars, q, k, v, deterministic=True)
    assert fp8_out.dtype == bf16_out.dtype == jnp.bfloat16 and fp8_out.shape == q.shape
    np.testing.assert_array_equal(np.asarray(fp8_out, np.float32), np.asarray(bf16_out, np.float32))
