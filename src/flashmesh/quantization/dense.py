"""`dense(x, kernel, state, recipe)`: y = x @ kernel with FP8 GEMMs forward and backward.

x [M, K] and kernel [K, N] (a module flattens its contracted and kept axes to these). Three
GEMMs, each in the only form XLA lowers to a fast cuBLASLt FP8 call on Hopper
(`__cublas$lt$matmul$f8`; research/fp8_layer.md §3.2): both operands contiguous along the
contracted axis ("TN"), y and dx in the activations' dtype (bf16), DEFAULT precision (fast
accumulation, as TransformerEngine's JAX GEMMs):

    forward  y  = (xq [M,K]) . (kqT [N,K])      xq, kq in the forward format (e4m3)
    dgrad    dx = (gq [M,N]) . (kq  [K,N])      gq in the backward format (e5m2 for HYBRID)
    wgrad    dw = (xqT [K,M]) . (gqT [N,M])     in the kernel's dtype (float32 parameters: a
                                                float32 output, faster than bf16 + convert)

The quantised x is saved transposed (xqT, one byte per element) and the kernel in both
layouts, so nothing is re-quantised in the backward. Each tensor's two layouts and its amax
come from `layouts.quantize_both`: one Pallas cast-transpose kernel on a lone CUDA device, XLA's
quantise fusion and a uint32-word transpose elsewhere (XLA's own transpose of a one-byte array
ran at about 0.6 TB/s on the H200). Each result is multiplied by the two operands' inverse
scales in the output dtype, which cuBLASLt takes as its alpha.

State (DelayedScaling): {"x": (scale, history), "kernel": ..., "grad": ...}; the updated state
is returned as the cotangent of `state` (TE's convention, see `flashmesh.quantization.state`).
Float8CurrentScaling takes state=None and scales each tensor by its own amax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from flashmesh.attention.varying import summed_like
from flashmesh.quantization import combine, layouts, normalized, scaling
from flashmesh.quantization import parts as quantize_parts
from flashmesh.quantization.recipe import DelayedScaling, Float8CurrentScaling

__all__ = ["dense", "dense_parts", "gemm", "quantized_pair", "updated_state", "TN"]

TN = (((1,), (1,)), ((), ()))  # contract axis 1 of both operands: A [M, K], B [N, K]


def gemm(a, b, inv_scale, out_dtype, out_sharding=None):
    """a . b^T (both contiguous along K), rescaled, in out_dtype.

    bf16 results come straight out of the GEMM (the fast form; the scalar rescale becomes
    cuBLASLt's alpha, rounded to bf16: a 0.2% scale error at most, far below FP8's). f16 and
    f32 results are accumulated and rescaled in float32 first: a raw product of two FP8 values
    (448 x 57344) already overflows float16."""
    acc = jnp.bfloat16 if out_dtype == jnp.bfloat16 else jnp.float32
    y = lax.dot_general(a, b, TN, precision=lax.Precision.DEFAULT, preferred_element_type=acc,
                        out_sharding=out_sharding)
    return (y * inv_scale.astype(acc).reshape(())).astype(out_dtype)


def _shardings(x_like, kernel_like, x_transposed: bool = False) -> dict:
    """The three GEMMs' output shardings {"y", "dx", "dw"} where the mesh shards in types
    (Explicit axes), else None each. Each GEMM contracts an axis that may be sharded (a
    row-parallel kernel's K, a column-parallel one's N, the data axis M of the wgrad), and JAX
    does not guess where the sum goes: y takes x's rows and the kernel's columns, dx x's
    sharding, dw the kernel's (replicated over the activations' mesh if only they are typed); a
    mesh axis both x's rows and the kernel's columns use stays with the rows.
    x_like may be x or x saved transposed (x_transposed); kernel_like the kernel or kq."""
    def spec(a, transposed=False):
        if not layouts.typed_sharding(a):
            return (None, None)
        pair = (tuple(jax.typeof(a).sharding.spec) + (None, None))[:2]
        return pair[::-1] if transposed else pair

    typed_x, typed_k = layouts.typed_sharding(x_like), layouts.typed_sharding(kernel_like)
    if not (typed_x or typed_k):
        return dict(y=None, dx=None, dw=None)
    mesh = jax.typeof(x_like if typed_x else kernel_like).sharding.mesh
    xs, ks = spec(x_like, x_transposed), spec(kernel_like)
    return dict(y=jax.sharding.NamedSharding(mesh, jax.P(xs[0], _without(ks[1], xs[0]))),
                dx=jax.sharding.NamedSharding(mesh, jax.P(*xs)) if typed_x else None,
                dw=jax.typeof(kernel_like).sharding if typed_k else jax.sharding.NamedSharding(mesh, jax.P()))


def _without(entry, other):
    """PartitionSpec entry `entry` less the mesh axes `other` uses (one axis shards one dim)."""
    def axes(e):
        return () if e is None else (e,) if isinstance(e, str) else tuple(e)
    kept = tuple(a for a in axes(entry) if a not in axes(other))
    return None if not kept else kept[0] if len(kept) == 1 else kept


def quantized_pair(t, state, name, fp8_max, dtype, recipe, source=None):
    """(q, q.T, scale, amax) of one tensor: the stored scale (delayed scaling; the amax comes
    out of the quantising pass) or the tensor's own (current scaling: its amax first). source:
    a `normalized.Normalization` that t is the LayerNorm output of, quantised from its input
    on a lone CUDA device (t's value is then not read by the quantisation)."""
    def both(scale):
        if source is None:
            return layouts.quantize_both(t, scale, dtype)
        return normalized.quantize_both(source, t, scale, dtype)

    (q, qT, amax_now), scale = _scaled(both, lambda: scaling.amax(t), state, name, fp8_max, recipe)
    return q, qT, scale, amax_now


def _scaled(quantize, amax_of, state, name, fp8_max, recipe):
    """(quantize(scale), scale): the stored scale (delayed scaling; quantize's third result is
    the amax) or the one amax_of() gives (current scaling, whose amax then replaces the third)."""
    if isinstance(recipe, DelayedScaling):
        scale = combine.to_float32(state[name][0])
        return quantize(scale), scale
    amax_now = amax_of()  # XLA fuses the producer (a LayerNorm's output) into this reduction
    scale = scaling.current_scale(amax_now, fp8_max, recipe)
    out = quantize(scale)
    return (*out[:2], amax_now, *out[3:]), scale


def updated_state(state, amaxes, maxes, recipe):
    """The updated state in the state's own (combining) dtypes: its cotangent."""
    if not isinstance(recipe, DelayedScaling):
        return None
    return {name: scaling.update_state(scale, history, amaxes[name], maxes[name], recipe)
            for name, (scale, history) in state.items()}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def dense(x: jax.Array, kernel: jax.Array, state, recipe: DelayedScaling | Float8CurrentScaling,
          source: normalized.Normalization | None = None):
    """x [M, K] @ kernel [K, N] -> [M, N] in x's dtype, FP8 GEMMs (see the module docstring).
    source: where x is a LayerNorm's output, what it is made of (`normalized.Normalization`
    over [M, K]): on a lone CUDA device x is then quantised from the LayerNorm's input and never
    written; source gets no gradient (x's gradient reaches it through the LayerNorm)."""
    return _forward(x, kernel, state, recipe, source)[0]


def _forward(x, kernel, state, recipe, source=None):
    fmt = recipe.fp8_format
    xq, xqT, sx, ax = quantized_pair(x, state, "x", fmt.max_fwd, fmt.forward_dtype, recipe, source)
    kq, kqT, sk, ak = quantized_pair(kernel, state, "kernel", fmt.max_fwd, fmt.forward_dtype, recipe)
    # Both layouts come from one quantisation. Without the barrier XLA re-read the float32
    # kernel for the [N, K] copy, and for the fused QKV kernel ([H, 3, H]) it chose a layout
    # that sent the dgrad to a Triton GEMM with a transpose inside (gemm_fusion_dot_general.24
    # in benchmarks/results/2026-12-02-nvidia-h200-layer/profile/ba2dd47-transformer_layer_fp8.hlo.txt.gz).
    kq, kqT = lax.optimization_barrier((kq, kqT))
    y = gemm(xq, kqT, (1.0 / sx) * (1.0 / sk), x.dtype, _shardings(x, kernel)["y"])
    # A zero-size array carries the kernel's dtype (dw is returned in it).
    return y, (xqT, kq, sx, sk, ax, ak, state, jnp.zeros((0,), kernel.dtype))


def _backward(recipe, residuals, g):
    fmt = recipe.fp8_format
    gq, gqT, sg, ag = quantized_pair(g, residuals[6], "grad", fmt.max_bwd, fmt.backward_dtype, recipe)
    return (*_gradients(recipe, residuals, gq, gqT, sg, ag, g.dtype), None)  # the source's comes through x's


def _gradients(recipe, residuals, gq, gqT, sg, ag, g_dtype):
    """(dx, dkernel, the state's cotangent) from the quantised gradient of y (both layouts)."""
    xqT, kq, sx, sk, ax, ak, state, k_like = residuals
    fmt = recipe.fp8_format
    shardings = _shardings(xqT, kq, x_transposed=True)
    dx = gemm(gq, kq, (1.0 / sg) * (1.0 / sk), g_dtype, shardings["dx"])  # g has y's dtype, which is x's
    # dw straight in the kernel's dtype: a float32 GEMM output ran faster than bf16 and its
    # convert (0.714 against 0.806 ms for FC1's [4096, 16384] over 8192 tokens on the H200,
    # still cuBLASLt's FP8 call; benchmarks/results/2026-12-03-nvidia-h200-layernorm/).
    dw = gemm(xqT, gqT, (1.0 / sx) * (1.0 / sg), k_like.dtype, shardings["dw"])
    dx, dw = summed_like(dx, xqT), summed_like(dw, kq)
    maxes = {"x": fmt.max_fwd, "kernel": fmt.max_fwd, "grad": fmt.max_bwd}
    new = updated_state(state, {"x": ax, "kernel": ak, "grad": ag}, maxes, recipe)
    return dx, dw, new


dense.defvjp(_forward, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def dense_parts(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, state,
                recipe: DelayedScaling | Float8CurrentScaling, parts: int,
                source: normalized.Normalization | None = None) -> tuple[jax.Array, ...]:
    """`dense(x, kernel, state, recipe, source)` (+ bias [N], added in x's dtype) returned as
    `parts` arrays [M, N / parts], its column blocks in order (a fused QKV projection's q, k
    and v). Their gradients are quantised where they lie (`parts.quantize_parts`: on a lone CUDA
    device one kernel, which also sums the bias gradient) instead of being packed into [M, N]
    first. The values and the gradients of x, kernel and the state are those of `dense`, the
    bias add and the split, bit for bit; the bias gradient is the float32 sum of the parts'
    gradients (autodiff's transpose of the bias add sums them in y's dtype, bf16: it differs
    from this by that rounding)."""
    return _parts_forward(x, kernel, bias, state, recipe, parts, source)[0]


def _parts_forward(x, kernel, bias, state, recipe, parts, source=None):
    if parts < 1 or kernel.shape[1] % parts:
        raise ValueError(f"parts={parts} must divide the kernel's {kernel.shape[1]} output columns")
    if bias is not None and tuple(bias.shape) != (kernel.shape[1],):
        raise ValueError(f"bias.shape={bias.shape} must be ({kernel.shape[1]},)")
    y, residuals = _forward(x, kernel, state, recipe, source)
    if bias is not None:
        y = y + bias.reshape(1, -1).astype(y.dtype)
    b_like = None if bias is None else bias[:0]  # its dtype, and where it varies in shard_map
    return tuple(jnp.split(y, parts, axis=1)), (residuals, b_like)


def _parts_backward(recipe, parts, saved, gs):
    residuals, b_like = saved
    state, fmt = residuals[6], recipe.fp8_format

    def quantize(scale):
        return quantize_parts.quantize_parts(gs, scale, fmt.backward_dtype)

    def amax_of():  # one reduction over the devices for all the parts
        return scaling.reduce_amax(jnp.max(jnp.stack([scaling.local_amax(g) for g in gs])), gs)

    (gq, gqT, ag, sums), sg = _scaled(quantize, amax_of, state, "grad", fmt.max_bwd, recipe)
    dx, dw, new = _gradients(recipe, residuals, gq, gqT, sg, ag, gs[0].dtype)
    dbias = None if b_like is None else summed_like(sums.astype(b_like.dtype), b_like)
    return dx, dw, dbias, new, None


dense_parts.defvjp(_parts_forward, _parts_backward)
