"""The helper module the TransformerEngine JAX tutorials import as `quickstart_jax_utils`.

`speedometer` is flashmesh's (a jitted forward+backward timing loop that prints
"Mean time: X ms"). `run_forward_backward` is the tutorial helper that the single-GPU attention
tutorial calls but its text does not show.
"""

import jax
import jax.numpy as jnp

from flashmesh.bench import speedometer

__all__ = ["speedometer", "run_forward_backward"]


def run_forward_backward(model, variables, input_qkv, output_grad, seq_desc=None):
    """One jitted forward+backward of `model` on the (q, k, v) tuple `input_qkv`.

    Returns (loss, grads): loss = <output, output_grad>, grads its gradients for q, k and v.
    `seq_desc`, when given, is passed as `sequence_descriptor` with dropout on
    (`deterministic=False`), as the tutorial's attention modules expect.
    """
    kwargs = {} if seq_desc is None else {"sequence_descriptor": seq_desc, "deterministic": False}

    def loss_fn(qkv):
        out = model.apply(variables, qkv, **kwargs)
        return jnp.vdot(out.astype(jnp.float32), output_grad.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss_fn))(input_qkv)
