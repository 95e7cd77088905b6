"""JAX: Single-GPU Attention — the reference tutorial (shared/reference/000), run on flashmesh.

The tutorial's code, unchanged but for its import lines:

    from transformer_engine.jax.attention import SequenceDescriptor
    from transformer_engine.jax.flax import DotProductAttention
        ->  from flashmesh.te.attention import SequenceDescriptor
            from flashmesh.te.flax import DotProductAttention
    + from quickstart_jax_utils import run_forward_backward   (used, but not shown, by the text)

`quickstart_jax_utils` is examples/quickstart_jax_utils.py (flashmesh.bench's speedometer).
Two additions are marked "flashmesh:": `--small` shrinks the sizes so the whole tutorial runs
on a CPU in seconds (the test suite runs it that way), and the `__main__` block runs both parts.

    python examples/single_gpu_attention.py            # the tutorial's sizes (GPU)
    python examples/single_gpu_attention.py --small    # batch 1, seq 256, 8/2 heads, dim 32
"""

import sys

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

import quickstart_jax_utils as utils
from quickstart_jax_utils import run_forward_backward

from flashmesh.te.attention import SequenceDescriptor
from flashmesh.te.flax import DotProductAttention

batch, seq, num_query_heads, num_kv_heads, head_dim = 2, 4096, 128, 8, 128
window_size = (128, 0)
dtype = jnp.bfloat16
timing_iters = 20
warmup_iters = 10

if "--small" in sys.argv:  # flashmesh: a size that runs on a CPU (tests, laptops)
    batch, seq, num_query_heads, num_kv_heads, head_dim = 1, 256, 8, 2, 32
    window_size = (16, 0)
    timing_iters = 2
    warmup_iters = 1


def create_qkv_inputs(
    *,
    seed: int,
    kv_heads: int = num_kv_heads,
    qk_head_dim: int = head_dim,
    v_head_dim: int = head_dim,
):
    """Create separate BSHD query, key, value tensors and an output gradient."""

    q_key, k_key, v_key, dout_key = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(q_key, (batch, seq, num_query_heads, qk_head_dim)).astype(dtype)
    k = jax.random.normal(k_key, (batch, seq, kv_heads, qk_head_dim)).astype(dtype)
    v = jax.random.normal(v_key, (batch, seq, kv_heads, v_head_dim)).astype(dtype)
    dout = jax.random.normal(dout_key, (batch, seq, num_query_heads, v_head_dim)).astype(dtype)
    return q, k, v, dout


def create_full_sequence_descriptor():
    """Describe a BSHD batch with no padding."""

    seqlens = jnp.full((batch,), seq, dtype=jnp.int32)
    return SequenceDescriptor.from_seqlens(seqlens)


q, k, v, dout = create_qkv_inputs(seed=2026)
qkv = (q, k, v)
sequence_descriptor = create_full_sequence_descriptor()


def _repeat_kv_for_gqa(x, query_heads):
    """Repeat each KV head across its group of query heads."""

    repeats = query_heads // x.shape[2]
    return jnp.repeat(x, repeats, axis=2)


def _make_causal_swa_mask(q_len, kv_len, window: Optional[Tuple[int, int]]):
    """Create a boolean causal mask, optionally restricted to an SWA window."""

    q_pos = jnp.arange(q_len)[:, None]
    kv_pos = jnp.arange(kv_len)[None, :]

    if window is None:
        return kv_pos <= q_pos

    left, right = window
    allowed = kv_pos <= q_pos + right
    if left >= 0:
        allowed = allowed & (kv_pos >= q_pos - left)
    return allowed


class FlaxNativeGQAAttention(nn.Module):
    """Plain JAX/Flax GQA used as the bf16 baseline."""

    window_size: Optional[Tuple[int, int]] = None

    @nn.compact
    def __call__(self, qkv_tensors):
        query, key, value = qkv_tensors
        key = _repeat_kv_for_gqa(key, query.shape[2])
        value = _repeat_kv_for_gqa(value, query.shape[2])

        scale = query.shape[-1] ** -0.5
        scores = jnp.einsum(
            "bqhd,bkhd->bhqk",
            query.astype(jnp.float32),
            key.astype(jnp.float32),
        )
        scores *= scale

        mask = _make_causal_swa_mask(query.shape[1], key.shape[1], self.window_size)
        scores = jnp.where(mask[None, None, :, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, value.astype(jnp.float32))
        return out.astype(query.dtype)


baseline = FlaxNativeGQAAttention(window_size=window_size)
baseline_vars = baseline.init(jax.random.PRNGKey(2026), qkv)


class TEDotProductAttention(nn.Module):
    """Thin Flax wrapper around TE's DotProductAttention."""

    num_query_heads: int
    num_kv_heads: int
    qk_head_dim: int = head_dim
    attn_mask_type: str = "causal"
    qkv_layout: str = "bshd_bshd_bshd"
    window_size: Optional[Tuple[int, int]] = None

    @nn.compact
    def __call__(
        self,
        qkv_tensors,
        sequence_descriptor: Optional[SequenceDescriptor] = None,
        *,
        deterministic: bool = False,
    ):
        query, key, value = qkv_tensors
        return DotProductAttention(
            head_dim=self.qk_head_dim,
            num_attention_heads=self.num_query_heads,
            num_gqa_groups=self.num_kv_heads,
            attn_mask_type=self.attn_mask_type,
            qkv_layout=self.qkv_layout,
            attention_dropout=0.0,
            transpose_batch_sequence=False,
            window_size=self.window_size,
        )(
            query,
            key,
            value,
            sequence_descriptor=sequence_descriptor,
            deterministic=deterministic,
        )


te_model = TEDotProductAttention(
    num_query_heads=num_query_heads,
    num_kv_heads=num_kv_heads,
    window_size=window_size,
)
te_vars = te_model.init(
    jax.random.PRNGKey(2026),
    qkv,
    sequence_descriptor=sequence_descriptor,
    deterministic=False,
)


def run_single_gpu_bench():
    forward_kwargs = {
        "sequence_descriptor": sequence_descriptor,
        "deterministic": False,
    }

    print("Native JAX bf16 GQA + SWA:")
    utils.speedometer(
        model_apply_fn=baseline.apply,
        variables=baseline_vars,
        input=qkv,
        output_grad=dout,
        timing_iters=timing_iters,
        warmup_iters=warmup_iters,
    )

    print("\nTE DotProductAttention GQA + SWA:")
    utils.speedometer(
        model_apply_fn=te_model.apply,
        variables=te_vars,
        input=qkv,
        output_grad=dout,
        forward_kwargs=forward_kwargs,
        timing_iters=timing_iters,
        warmup_iters=warmup_iters,
    )


mla_head_dim_qk, mla_head_dim_v = 128, 64
mla_q, mla_k, mla_v, mla_dout = create_qkv_inputs(
    seed=2027,
    kv_heads=num_kv_heads,
    qk_head_dim=mla_head_dim_qk,
    v_head_dim=mla_head_dim_v,
)
mla_qkv = (mla_q, mla_k, mla_v)

mla_model = TEDotProductAttention(
    num_query_heads=num_query_heads,
    num_kv_heads=num_kv_heads,
    qk_head_dim=mla_head_dim_qk,
    window_size=None,
)
mla_vars = mla_model.init(
    jax.random.PRNGKey(4),
    mla_qkv,
    sequence_descriptor=sequence_descriptor,
    deterministic=False,
)


def run_mla_variant():
    out = mla_model.apply(
        mla_vars,
        mla_qkv,
        sequence_descriptor=sequence_descriptor,
        deterministic=False,
    )
    loss, grads = run_forward_backward(mla_model, mla_vars, mla_qkv, mla_dout, sequence_descriptor)
    jax.block_until_ready((out, loss, grads))
    print(
        "TE DeepSeek-style MLA head dimensions: "
        f"q/k head dim={mla_head_dim_qk}, v head dim={mla_head_dim_v}"
    )
    print(f"Output shape={tuple(out.shape)}, dtype={out.dtype}")
    print(f"Grad shapes={[tuple(grad.shape) for grad in grads]}")


if __name__ == "__main__":  # flashmesh: run both parts, as the tutorial's outputs show
    run_single_gpu_bench()
    print()
    run_mla_variant()
