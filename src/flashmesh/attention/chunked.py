"""The `chunked` backend: blockwise online softmax in pure JAX, with its own backward pass.

Algorithm: FlashAttention-2 (Dao, 2023), written with XLA operations instead of a kernel.
Queries and keys are cut into tiles of (block_q, block_kv). The forward pass keeps, per query
row, a running maximum m, a running denominator l and an unnormalised output acc, and folds in
one key tile at a time:

    m' = max(m, rowmax(s)),  l' = e^(m - m') l + rowsum(e^(s - m')),  acc' = e^(m - m') acc + e^(s - m') v

and ends with out = acc / l, lse = m + log(l). The residuals are q, k, v, (bias, sink), out and
lse; the backward pass (`chunked_vjp.py`) recomputes each tile's probabilities p = e^(s - lse)
from them. No [T, S] matrix ever exists (except the user's own bias and its gradient), so
memory grows linearly with the sequence.

Schedule (`chunked_tiles.py`). A step pairs a set of distinct query blocks with one key block
each and runs as one batched matmul; only the loop over steps is sequential. `masks.block_map`
classifies tiles as EMPTY (never computed), FULL (no mask arithmetic) or PARTIAL (masked). A
static map (no segments, implicit positions) is turned at trace time into tables of exactly the
non-empty tiles, so a causal mask costs half of a full one and a window of width w costs about
w / block_kv + 1 tiles per query block, whatever T is; a dynamic map (segments, explicit
positions) bounds each query block's key range and selects the mask per step with `lax.cond`.

Sink terms (off-by-one, learnable) start the running state at m = sink logit, l = 1; dropout
asks `masks.dropout_keep` for each tile, so it drops exactly the elements the reference drops.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from flashmesh.attention import chunked_vjp, masks, varying
from flashmesh.attention.chunked_tiles import Step, Tiles
from flashmesh.attention.registry import current_platform
from flashmesh.attention.spec import EMPTY_ROW_LSE, AttentionInputs, AttentionSpec, reproducible_reason


# --------------------------------------------------------------------------------------------
# Block sizes
# --------------------------------------------------------------------------------------------

# Per platform: the tile edge for unbounded masks. GPUs want large batched matmuls and few
# sequential steps; on CPU, smaller tiles keep the per-step working set in cache. On an H200,
# the tiles of this rule (2048, or 1024 where the budget below caps them) beat fixed 512-wide
# ones on every non-windowed anchor shape, fwd and fwd+bwd: compare the chunked rows of
# benchmarks/results/2026-11-30-nvidia-h200-anchors-2 (this rule) and -anchors (512).
BASE_BLOCK = {"gpu": 2048, "tpu": 512, "cpu": 256}
# A step holds float32 logits for its query blocks against one key tile each: tiles shrink (to
# no less than MIN_CAPPED_BLOCK) until all query blocks fit in this many bytes; past that, a
# step takes only as many query blocks (lanes) as fit.
STEP_LOGITS_BYTES = 4 * 2**30
MIN_CAPPED_BLOCK = 512
# Narrow windows: tiles about as large as the window's wider side, but no smaller than this.
MIN_BAND_BLOCK = 64
# A sequence longer than this is cut into at least two tiles, so no step holds all of its logits
# (codelab_te_2048, T=2048: one 2048 tile planned as much memory as the naive baseline); a
# shorter one stays one tile, the fewest kernels where per-call overhead dominates.
MIN_SPLIT_BLOCK = 512


def _next_pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes: block_q query rows by block_kv key columns; at most `lanes` query blocks
    per step (None: all of them)."""

    block_q: int
    block_kv: int
    lanes: int | None = None

    def __post_init__(self):
        for name in ("block_q", "block_kv", "lanes"):
            value = getattr(self, name)
            if name == "lanes" and value is None:
                continue
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @classmethod
    def default_for(cls, spec: AttentionSpec, platform: str) -> "BlockSizes":
        """Square tiles of BASE_BLOCK[platform] (256 elsewhere), halved while they cover the
        longer sequence whole (down to MIN_SPLIT_BLOCK) and while one step's logits would pass
        STEP_LOGITS_BYTES, then as many lanes as fit it; for a window bounded on both
        sides (e.g. the causal sliding window (128, 0)), tiles of the window's wider side
        rounded up to a power of two (at least MIN_BAND_BLOCK): a query block then meets about
        two key blocks, and smaller tiles waste less of them.
        """
        block = BASE_BLOCK.get(platform, 256)
        left, right = spec.window
        if left >= 0 and right >= 0:
            block = min(block, max(MIN_BAND_BLOCK, _next_pow2(max(left, right))))
        while block > MIN_SPLIT_BLOCK and block >= max(spec.q_len, spec.kv_len):
            block //= 2
        per_column = 4 * spec.batch * spec.num_heads * _next_pow2(spec.q_len)
        while block > MIN_CAPPED_BLOCK and block * per_column > STEP_LOGITS_BYTES:
            block //= 2
        lanes = None
        if block * per_column > STEP_LOGITS_BYTES:
            lanes = max(1, STEP_LOGITS_BYTES // (4 * spec.batch * spec.num_heads * block * block))
        return cls(block, block, lanes).fitted(spec)

    def fitted(self, spec: AttentionSpec) -> "BlockSizes":
        """Never larger than the sequence: a 7-token query is one tile of 7 rows."""
        return BlockSizes(min(self.block_q, spec.q_len), min(self.block_kv, spec.kv_len), self.lanes)


def unsupported_reason(spec: AttentionSpec, platform: str, *, automatic: bool = False) -> str | None:
    """None: the chunked backend runs every call the spec can describe, on every platform,
    except reproducible=True on a GPU: its backward adds the
    lanes' key-tile (and bias) gradients by scatter-adds whose indices can repeat, which a GPU
    sums by atomics in a varying order."""
    del automatic
    return reproducible_reason(spec, "chunked's backward (scatter-adds)") if platform == "gpu" else None


# --------------------------------------------------------------------------------------------
# Public entry point and custom VJP
# --------------------------------------------------------------------------------------------

def attention(inputs: AttentionInputs, spec: AttentionSpec, *,
              block_sizes: BlockSizes | None = None) -> tuple[jax.Array, jax.Array]:
    """Returns (out [B, T, N, Dv] in q's dtype, lse [B, N, T] float32, float64 for float64 q).

    `block_sizes` overrides `BlockSizes.default_for(spec, platform)` (tests use small tiles so
    that several tiles and ragged tails are exercised).
    """
    if block_sizes is None:
        block_sizes = BlockSizes.default_for(spec, current_platform())
    inputs = masks.without_padding(inputs)
    blocks = block_sizes.fitted(spec)
    aux = dataclasses.replace(inputs, q=None, k=None, v=None, bias=None, sink=None)  # integers only
    # Under shard_map, the differentiable inputs enter the custom VJP varying along every manual
    # axis any input varies along: its backward then returns gradients of their types, and
    # JAX's own transpose of that cast sums the gradient of a replicated input over the axes.
    diff = varying.like((inputs.q, inputs.k, inputs.v, inputs.bias, inputs.sink), varying.varying_axes(inputs))
    return _chunked(spec, blocks, *diff, aux)


def backward_with_stats(inputs: AttentionInputs, spec: AttentionSpec, out, lse, g_out, g_lse, *,
                        block_sizes: BlockSizes | None = None):
    """(dq, dk, dv, dbias) of this call's keys under a softmax whose statistics come from outside:
    out [B, T, N, Dv] and lse [B, N, T] are the results over a *larger* key set that contains
    these keys, g_out and g_lse their cotangents. FlashAttention's backward needs nothing else
    (p = e^(s - lse), delta = g_out . out - g_lse), so a context-parallel ring gets each hop's
    gradients without re-running the hop's forward. Vanilla softmax only (a sink is folded in
    after the merge)."""
    if spec.softmax != "vanilla":
        raise NotImplementedError(f"backward_with_stats takes vanilla softmax, got {spec.softmax!r}")
    if block_sizes is None:
        block_sizes = BlockSizes.default_for(spec, current_platform())
    blocks = block_sizes.fitted(spec)
    inputs = masks.without_padding(inputs)
    aux = dataclasses.replace(inputs, q=None, k=None, v=None, bias=None, sink=None)
    diff = varying.like((inputs.q, inputs.k, inputs.v, inputs.bias), varying.varying_axes(inputs, out, lse, g_out))
    tiles = _tiles(spec, blocks, *diff[:3], diff[3], None, aux)
    dq, dk, dv, dbias, _ = chunked_vjp.backward(tiles, out, lse, g_out, g_lse)
    return dq, dk, dv, dbias


def _tiles(spec, blocks: BlockSizes, q, k, v, bias, sink, aux) -> Tiles:
    return Tiles(spec, blocks.block_q, blocks.block_kv, q, k, v, bias, sink, aux, blocks.lanes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked(spec, blocks, q, k, v, bias, sink, aux):
    return _forward(_tiles(spec, blocks, q, k, v, bias, sink, aux))


def _chunked_fwd(spec, blocks, q, k, v, bias, sink, aux):
    out, lse = _forward(_tiles(spec, blocks, q, k, v, bias, sink, aux))
    return (out, lse), (q, k, v, bias, sink, aux, out, lse)


def _chunked_bwd(spec, blocks, residuals, cotangents):
    q, k, v, bias, sink, aux, out, lse = residuals
    g_out, g_lse = cotangents
    tiles = _tiles(spec, blocks, q, k, v, bias, sink, aux)
    dq, dk, dv, dbias, dsink = chunked_vjp.backward(tiles, out, lse, g_out, g_lse)
    return dq, dk, dv, dbias, dsink, None  # aux: segment ids, positions, seed (integers)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def _forward(tiles: Tiles) -> tuple[jax.Array, jax.Array]:
    ct = tiles.ct
    shape = tiles.row_shape
    if tiles.sink_logit is None:  # vanilla: nothing seen yet
        m0 = jnp.full(shape, -jnp.inf, ct)
        l0 = jnp.zeros(shape, ct)
    else:  # the sink is one more softmax term with logit c and no value: m = c, l = e^(c - c)
        m0 = jnp.broadcast_to(tiles.sink_logit, shape)
        l0 = jnp.ones(shape, ct)
    acc0 = jnp.zeros(shape + (tiles.v_dim,), ct)

    def step_fn(step, carry):
        m, l, acc = (tiles.q_tiles(x, step) for x in carry)
        m, l, acc = _forward_tile(tiles, step, m, l, acc)
        return tuple(tiles.put_q_tiles(x, step, new) for x, new in zip(carry, (m, l, acc)))

    m, l, acc = tiles.run(step_fn, (m0, l0, acc0))
    empty = l == 0  # only possible for vanilla softmax: the row saw no key
    safe_l = jnp.where(empty, 1.0, l)
    lse = jnp.where(empty, EMPTY_ROW_LSE, _finite(m) + _log_as_exp_sees_it(safe_l))
    out = acc / safe_l[..., None]  # acc is exactly 0 on empty rows
    return tiles.merge_q(out).astype(tiles.q_dtype), tiles.merge_rows(lse)


def _log_as_exp_sees_it(l: jax.Array) -> jax.Array:
    """log(l) for l >= 1, corrected once so that e^(result) gives back l as this device's exp
    computes it: y + (l e^-y - 1), log(1 + x) ~ x. The backward recomputes p = e^(s - lse),
    which sums to 1 over a row only if lse and exp agree; a TPU's float32 log misses by up to
    ~3e-5 relative, and its gradients were ~30x the plain computation's error without this
    (benchmarks/results/2026-12-08-tpu-v5e-tests, run 3). Where log is exact it moves y by an
    ulp or so."""
    y = jnp.log(l)
    return y + (l * jnp.exp(-y) - 1.0)


def _finite(m: jax.Array) -> jax.Array:
    """The running max with -inf (nothing seen yet) replaced by 0, so e^(s - m) never sees
    -inf - -inf = NaN."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def _forward_tile(tiles: Tiles, step: Step, m, l, acc):
    """One online-softmax update of the active query blocks' (m, l, acc) by their key tiles."""
    s, _ = tiles.logits(step)  # [B, K, A, G, bq, bk]
    # The very first step of a vanilla softmax starts from nothing (m = -inf, l = 0, acc = 0):
    # no rescaling, fewer operations (what a one-tile call is made of).
    fresh = step.first and tiles.sink_logit is None
    m_new = jnp.max(s, axis=-1) if fresh else jnp.maximum(m, jnp.max(s, axis=-1))
    shift = _finite(m_new)
    p = jnp.exp(s - shift[..., None])
    l_tile = jnp.sum(p, axis=-1)
    # Dropout acts on the normalised probabilities, so it changes acc but not l.
    p = tiles.dropout(tiles.dropout_keep(step), p)
    kv = tiles.kv_sub(step)
    pv = jnp.einsum(f"bkagqs,bk{kv}sh->bkagqh", p.astype(tiles.mm_dtype), tiles.kv_tiles(tiles.v, step),
                    preferred_element_type=tiles.ct)
    if fresh:
        return m_new, l_tile, pv
    alpha = jnp.exp(m - shift)  # rescales what was accumulated under the old max (0 at first)
    return m_new, alpha * l + l_tile, alpha[..., None] * acc + pv
