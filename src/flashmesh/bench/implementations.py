"""The rows of `flashmesh bench`: every attention implementation it can compare, by name.

Each entry builds, for one `Shape`, a function `f(q, k, v, segment_ids) -> out` (q [B, T, N,
Dqk], k [B, S, K, Dqk], v [B, S, K, Dv], segment_ids [B, T] int32 or None, out [B, T, N, Dv]
in q's dtype). Building raises `NotImplementedError` with the reason when the implementation
cannot run the shape on this device, and `ImportError` when it is not installed; the runner
turns both into rows. Nothing here falls back to another implementation.

Names (a label may add "@dtype", e.g. "xla@bf16", to fix the input dtype of that row):
  naive               plain JAX in float32: scores, softmax, weighted sum (the codelab's and
                      tutorial 000's baseline; it materialises the [B, N, T, S] logits)
  xla, cudnn          jax.nn.dot_product_attention(implementation="xla" | "cudnn")
  flashmesh           flashmesh.attention(implementation=None): what users get
  flashmesh:<name>    flashmesh.attention(implementation=<name>), e.g. flashmesh:chunked
  module              flashmesh.te.flax.DotProductAttention (the codelab's Flax module)
  fa3                 FlashAttention-3's JAX binding, flash_attn3_jax.flash_mha (optional peer)
  tokamax:mosaic, tokamax:triton   tokamax.dot_product_attention (optional peer)
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Callable

import jax
import jax.numpy as jnp

from flashmesh.bench.shapes import Shape

AttentionFn = Callable[..., jax.Array]

DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    kind: str  # "baseline", "jax", "flashmesh", "module" or "peer"
    description: str
    build: Callable[[Shape, str, str], AttentionFn]  # (shape, dtype name, platform) -> f

    def tracing(self) -> contextlib.AbstractContextManager:
        """The context to trace this implementation's functions in. Code that is not ours (jax.nn,
        peers) runs under standard dtype promotion, as its users call it: jax 0.11.2's jax.nn xla
        path mixes bf16 with float32 constants, which strict promotion rejects."""
        if self.kind in ("jax", "peer"):
            return jax.numpy_dtype_promotion("standard")
        return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One row's implementation and input dtype (None: the run's default dtype)."""

    name: str
    dtype: str | None = None

    @property
    def label(self) -> str:
        return self.name if self.dtype is None else f"{self.name}@{self.dtype}"

    @classmethod
    def parse(cls, label: str) -> "Candidate":
        name, _, dtype = label.partition("@")
        if not known(name):
            raise ValueError(f"implementation {name!r} must be one of {names()} (or flashmesh:<backend>)")
        if dtype and dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} in {label!r} must be one of {sorted(DTYPES)}")
        return cls(name, dtype or None)


def _window_bounds(shape: Shape) -> tuple[int, int]:
    """(left, right) with -1 replaced by a bound that covers every key (for APIs without -1)."""
    left, right = shape.effective_window
    big = shape.T + shape.S
    return (big if left < 0 else left, big if right < 0 else right)


# -- naive ----------------------------------------------------------------------------------------
def _visible(shape: Shape, segment_ids):
    """Boolean [B|1, T, S] mask of visible pairs, built from iotas (fused by XLA, never a constant)."""
    offset = shape.S - shape.T if shape.bottom_right else 0
    q_pos = jnp.arange(shape.T, dtype=jnp.int32)[None, :, None] + offset
    kv_pos = jnp.arange(shape.S, dtype=jnp.int32)[None, None, :]
    if segment_ids is not None:  # positions restart at each document
        idx = jnp.arange(shape.T, dtype=jnp.int32)[None]
        starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                                  segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
        pos = idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
        q_pos, kv_pos = pos[:, :, None], pos[:, None, :]
    left, right = shape.effective_window
    visible = jnp.ones((1, shape.T, shape.S), bool)
    if left >= 0:
        visible = visible & (kv_pos >= q_pos - left)
    if right >= 0:
        visible = visible & (kv_pos <= q_pos + right)
    if segment_ids is not None:
        visible = visible & (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids != 0)[:, :, None]
    return visible


def _naive(shape: Shape, dtype: str, platform: str) -> AttentionFn:
    masked = shape.causal or shape.window is not None or shape.segments is not None

    def naive(q, k, v, segment_ids=None):
        # The codelab's steps: scores = Q K^T * scale, softmax, weights @ V, in float32 with K/V
        # heads repeated for GQA (tutorial 000's baseline).
        f32 = jnp.float32
        rep = q.shape[2] // k.shape[2]
        kr = jnp.repeat(k.astype(f32), rep, axis=2)
        vr = jnp.repeat(v.astype(f32), rep, axis=2)
        scores = jnp.einsum("btnh,bsnh->bnts", q.astype(f32), kr) * (q.shape[-1] ** -0.5)
        if masked:
            visible = _visible(shape, segment_ids)[:, None]
            scores = jnp.where(visible, scores, jnp.finfo(f32).min)
        weights = jax.nn.softmax(scores, axis=-1)
        if masked:  # a query that sees no key (padding) gives 0, as flashmesh defines
            weights = jnp.where(jnp.any(visible, axis=-1, keepdims=True), weights, 0.0)
        return jnp.einsum("bnts,bsnh->btnh", weights, vr).astype(q.dtype)

    return naive


# -- jax.nn.dot_product_attention ------------------------------------------------------------------
def _refuse_beyond_jax_nn(shape: Shape, who: str) -> None:
    """jax.nn's signature (shared by tokamax) has no packed segments and a top-left causal mask."""
    if shape.segments is not None:
        raise NotImplementedError(f"{who} takes no packed segments (jax.nn's signature)")
    if shape.bottom_right and shape.T != shape.S:
        raise NotImplementedError(f"{who} has jax.nn's top-left causal mask; this shape asks "
                                  "bottom-right with T != S")


def _jax_nn(impl: str):
    def build(shape: Shape, dtype: str, platform: str) -> AttentionFn:
        if impl == "cudnn":
            if platform != "gpu":
                raise NotImplementedError(f"cuDNN needs an NVIDIA GPU; this run is on {platform}")
            if dtype not in ("bf16", "f16"):
                raise NotImplementedError(f"cuDNN fused attention takes bf16/f16 inputs, not {dtype}")
        _refuse_beyond_jax_nn(shape, "jax.nn.dot_product_attention")
        if shape.Dqk != shape.Dv:
            raise NotImplementedError(f"jax.nn.dot_product_attention needs Dqk == Dv, got "
                                      f"{shape.Dqk} and {shape.Dv}")
        window = _window_bounds(shape) if shape.window is not None else None

        def f(q, k, v, segment_ids=None):
            return jax.nn.dot_product_attention(q, k, v, is_causal=shape.causal,
                                                local_window_size=window, implementation=impl)

        return f

    return build


# -- flashmesh ---------------------------------------------------------------------------------------
def _flashmesh(backend: str | None):
    def build(shape: Shape, dtype: str, platform: str) -> AttentionFn:
        import flashmesh
        from flashmesh.attention import registry

        if backend is not None:
            # Import the backend module now, so a missing one is "not installed", not a crash.
            importlib.import_module(registry.get(backend).module_name)
        n_docs = shape.num_documents
        detail = f"chose {_automatic_choice(shape, dtype)}" if backend is None else ""

        def f(q, k, v, segment_ids=None):
            segments = None
            if segment_ids is not None:
                segments = flashmesh.SequenceDescriptor.from_segment_ids_and_pos(
                    segment_ids, max_segments=max(n_docs, 1))
            return flashmesh.attention(q, k, v, mask=shape.mask, window=shape.window,
                                       segments=segments, implementation=backend)

        f.detail = detail  # shown beside the row: which backend `implementation=None` runs
        return f

    return build


def _automatic_choice(shape: Shape, dtype: str) -> str | None:
    """The backend flashmesh.attention(implementation=None) picks for this shape (from explain)."""
    import flashmesh
    from flashmesh.bench.shapes import segment_ids_and_positions

    sds = lambda *dims: jax.ShapeDtypeStruct(dims, DTYPES[dtype])
    segments = None
    if shape.segments:
        ids = jnp.broadcast_to(jnp.asarray(segment_ids_and_positions(shape)[0])[None], (shape.B, shape.T))
        segments = flashmesh.SequenceDescriptor.from_segment_ids_and_pos(ids, max_segments=shape.num_documents)
    q = sds(shape.B, shape.T, shape.N, shape.Dqk)
    k, v = sds(shape.B, shape.S, shape.K, shape.Dqk), sds(shape.B, shape.S, shape.K, shape.Dv)
    explanation = flashmesh.explain(q, k, v, mask=shape.mask, window=shape.window, segments=segments)
    return explanation.chosen


def _module(shape: Shape, dtype: str, platform: str) -> AttentionFn:
    from flashmesh.te import flax as te_flax  # written alongside; missing -> "not installed"

    if shape.segments is not None:
        raise NotImplementedError("the module row runs BSHD inputs without packed segments")
    mask_type = {"none": "no_mask", "causal": "causal", "causal_bottom_right": "causal_bottom_right"}[shape.mask]
    options = dict(head_dim=shape.Dqk, num_attention_heads=shape.N, num_gqa_groups=shape.K,
                   attn_mask_type=mask_type, transpose_batch_sequence=False)
    if shape.window is not None:
        options["window_size"] = shape.window
    module = te_flax.DotProductAttention(**options)

    def f(q, k, v, segment_ids=None):
        # As the codelab: init once (no parameters), apply with deterministic=True.
        variables = module.init(jax.random.key(0), q, k, v, deterministic=True)
        return module.apply(variables, q, k, v, deterministic=True)

    return f


# -- optional peers --------------------------------------------------------------------------------
def _fa3(shape: Shape, dtype: str, platform: str) -> AttentionFn:
    import flash_attn3_jax as fa3  # optional peer

    if platform != "gpu":
        raise NotImplementedError(f"FlashAttention-3 needs an NVIDIA Hopper GPU; this run is on {platform}")
    if shape.segments is not None:
        raise NotImplementedError("flash_attn3_jax.flash_mha has no packed segments")
    if shape.causal and shape.T != shape.S and not shape.bottom_right:
        raise NotImplementedError("FlashAttention's causal mask is bottom-right aligned; this "
                                  "shape asks top-left with T != S")
    window = shape.effective_window if shape.window is not None else (-1, -1)

    def f(q, k, v, segment_ids=None):
        return fa3.flash_mha(q, k, v, is_causal=shape.causal, window_size=window)

    return f


def _tokamax(impl: str):
    def build(shape: Shape, dtype: str, platform: str) -> AttentionFn:
        import tokamax  # optional peer

        if platform != "gpu":
            raise NotImplementedError(f"tokamax's {impl} kernel needs a GPU; this run is on {platform}")
        _refuse_beyond_jax_nn(shape, f"tokamax ({impl})")
        window = _window_bounds(shape) if shape.window is not None else None

        def f(q, k, v, segment_ids=None):
            return tokamax.dot_product_attention(q, k, v, is_causal=shape.causal,
                                                 local_window_size=window, implementation=impl)

        return f

    return build


IMPLEMENTATIONS: dict[str, Implementation] = {impl.name: impl for impl in (
    Implementation("naive", "baseline", "plain JAX, float32, full logits matrix", _naive),
    Implementation("xla", "jax", "jax.nn.dot_product_attention(implementation='xla')", _jax_nn("xla")),
    Implementation("cudnn", "jax", "jax.nn.dot_product_attention(implementation='cudnn')", _jax_nn("cudnn")),
    Implementation("flashmesh", "flashmesh", "flashmesh.attention, automatic choice", _flashmesh(None)),
    Implementation("module", "module", "flashmesh.te.flax.DotProductAttention (Flax)", _module),
    Implementation("fa3", "peer", "FlashAttention-3, flash_attn3_jax.flash_mha", _fa3),
    Implementation("tokamax:mosaic", "peer", "tokamax.dot_product_attention(implementation='mosaic')",
                   _tokamax("mosaic")),
    Implementation("tokamax:triton", "peer", "tokamax.dot_product_attention(implementation='triton')",
                   _tokamax("triton")),
)}


def names() -> list[str]:
    from flashmesh.attention import registry

    return list(IMPLEMENTATIONS) + [f"flashmesh:{n}" for n in registry.IMPLEMENTATIONS]


def known(name: str) -> bool:
    if name in IMPLEMENTATIONS:
        return True
    from flashmesh.attention import registry

    return name.startswith("flashmesh:") and name.partition(":")[2] in registry.IMPLEMENTATIONS


def get(name: str) -> Implementation:
    if name in IMPLEMENTATIONS:
        return IMPLEMENTATIONS[name]
    if not known(name):
        raise ValueError(f"implementation {name!r} must be one of {names()}")
    backend = name.partition(":")[2]
    return Implementation(name, "flashmesh", f"flashmesh.attention(implementation={backend!r})",
                          _flashmesh(backend))


