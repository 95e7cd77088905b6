"""The attention semantics written out by brute force, and the inputs the attention tests use.

Not a test module (pytest does not collect it). Three parts:

* An oracle in NumPy float64 written straight from design.md and the docstring of
  `flashmesh.attention`, one (batch, head, query) at a time: `visible` (which key each query
  sees) and `attention` (output and log-sum-exp). It shares no code with
  `flashmesh.attention.reference`, so it can validate the reference backend itself.
* The same formula in jax.numpy (`attention_jnp`), broadcast instead of looped, in any dtype:
  in float64 it gives the oracle's gradients by autodiff; in bfloat16 it is "the plain
  low-precision computation" of FlashAttention's tolerance rule.
* Input generators: random q/k/v, bias, sinks, and segment layouts of every descriptor form
  (seqlens, seqlens + offsets padded with -1, segment ids with and without positions), with
  padding and with rows that hold no segment at all; packing into the public layouts; and
  comparison helpers that print the worst element's coordinates on failure.

Shape legend: B batch, T query length, S key length, N query heads, K key/value heads,
Dqk / Dv head dims.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

import flashmesh
from flashmesh.attention.spec import EMPTY_ROW_LSE

# XLA options for the many small programs the tests compile on CPU: the LLVM back end's cheap
# settings cut compile time by about a third (the HLO passes, and so the numerics, are
# unchanged). CPU only: XLA's GPU back end does not support an optimization level below 2 (it
# logs an error and generates code in an unsupported configuration), and it has no use for
# the CPU's expensive-pass switch.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def jit(f):
    """jax.jit, with FAST_COMPILE when the program compiles for the CPU (the default backend)."""
    return jax.jit(f, compiler_options=FAST_COMPILE if jax.default_backend() == "cpu" else None)


# mask string -> (causal, bottom-right diagonal); "padding*" only says segments are required.
MASK_STRINGS = {
    "none": (False, False), "causal": (True, False), "causal_bottom_right": (True, True),
    "padding": (False, False), "padding_causal": (True, False),
    "padding_causal_bottom_right": (True, True),
}


# ----------------------------------------------------------------------------------------------
# Segments, in the three forms users give them
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Segments:
    """A segment layout in one of the user-facing forms, with the raw arrays (NumPy int).

    kind "seqlens": q / kv are [B] lengths (one sequence from position 0, then padding).
    kind "offsets": q / kv are ([B, M] lengths, [B, M] or [B, M+1] starts); slot m of the query
      row pairs with slot m of the key row; negative entries are unused slots.
    kind "ids": q / kv are ([B, L] ids, [B, L] positions or None); 0 is padding.
    """

    kind: str
    q: object
    kv: object

    def descriptor(self) -> flashmesh.SequenceDescriptor:
        SD = flashmesh.SequenceDescriptor
        if self.kind == "seqlens":
            return SD.from_seqlens(self._pair(self.q, self.kv))
        if self.kind == "offsets":
            return SD.from_seqlens_and_offsets(self._pair(self.q[0], self.kv[0]),
                                               self._pair(self.q[1], self.kv[1]))
        ids = self._pair(self.q[0], self.kv[0])
        pos = None if self.q[1] is None else self._pair(self.q[1], self.kv[1])
        return SD.from_segment_ids_and_pos(ids, pos)

    def _pair(self, a, b):
        # One array when queries and keys share the layout (self-attention), else a pair.
        if a is b or (np.shape(a) == np.shape(b) and np.array_equal(a, b)):
            return jnp.asarray(a, jnp.int32)
        return (jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))

    def tokens(self, T: int, S: int, bottom_right: bool):
        """Per-token segment id and position: (q_ids [B,T], kv_ids [B,S], q_pos, kv_pos)."""
        if self.kind == "seqlens":
            q_ids = (np.arange(T)[None] < np.asarray(self.q)[:, None]).astype(np.int64)
            kv_ids = (np.arange(S)[None] < np.asarray(self.kv)[:, None]).astype(np.int64)
            q_pos = np.broadcast_to(np.arange(T), q_ids.shape).copy()
            kv_pos = np.broadcast_to(np.arange(S), kv_ids.shape).copy()
            if bottom_right:  # each row's diagonal ends at its last real query and key
                q_pos += (np.asarray(self.kv) - np.asarray(self.q))[:, None]
            return q_ids, kv_ids, q_pos, kv_pos
        if self.kind == "offsets":
            q_lens, q_offs = (np.asarray(x) for x in self.q)
            kv_lens, kv_offs = (np.asarray(x) for x in self.kv)
            q_ids, q_pos = _slots_to_tokens(q_lens, q_offs, T)
            kv_ids, kv_pos = _slots_to_tokens(kv_lens, kv_offs, S)
            if bottom_right:  # segment m's diagonal ends at its last query and key
                for b in range(q_ids.shape[0]):
                    for i in range(T):
                        m = q_ids[b, i] - 1
                        if m >= 0:
                            q_pos[b, i] += max(kv_lens[b, m], 0) - max(q_lens[b, m], 0)
            return q_ids, kv_ids, q_pos, kv_pos
        q_ids, kv_ids = np.asarray(self.q[0]), np.asarray(self.kv[0])
        if self.q[1] is not None:
            q_pos, kv_pos = np.array(self.q[1]), np.asarray(self.kv[1])
        else:
            q_pos, kv_pos = run_offsets(q_ids), run_offsets(kv_ids)
        if bottom_right:  # segment m's diagonal ends at its last query and key (lengths by id)
            for ids, pos in ((q_ids, q_pos), (kv_ids, kv_pos)):
                if ((pos != run_offsets(ids)) & (ids > 0)).any():
                    raise ValueError("bottom-right shifts only canonical positions of segment ids")
            for b, i in zip(*np.nonzero(q_ids)):
                m = q_ids[b, i]
                q_pos[b, i] += (kv_ids[b] == m).sum() - (q_ids[b] == m).sum()
        return q_ids, kv_ids, q_pos, kv_pos


def _slots_to_tokens(lens, offs, L):
    B, M = lens.shape
    ids = np.zeros((B, L), np.int64)
    pos = np.zeros((B, L), np.int64)
    for b in range(B):
        for m in range(M):
            start, n = offs[b, m], lens[b, m]
            if start < 0 or n <= 0:
                continue  # an unused slot
            ids[b, start:start + n] = m + 1
            pos[b, start:start + n] = np.arange(n)
    return ids, pos


def run_offsets(ids) -> np.ndarray:
    """Each token's distance from the first token of its segment (its run of equal ids)."""
    ids = np.asarray(ids)
    pos = np.zeros(ids.shape, np.int64)
    for b in range(ids.shape[0]):
        for i in range(1, ids.shape[1]):
            pos[b, i] = pos[b, i - 1] + 1 if ids[b, i] == ids[b, i - 1] else 0
    return pos


# ----------------------------------------------------------------------------------------------
# The oracle
# ----------------------------------------------------------------------------------------------
def normalized_window(mask: str | None, window) -> tuple[int, int]:
    """The (left, right) window a call means: causal masks make right 0."""
    causal, _ = MASK_STRINGS["none" if mask is None else mask]
    left, right = (-1, -1) if window is None else window
    return (left, 0) if causal else (left, right)


def visible(B: int, T: int, S: int, *, mask="causal", window=None,
            segments: Segments | None = None) -> np.ndarray:
    """bool [B, T, S]: whether query i of row b sees key j.

    Query i sits at position i (i + S - T for a bottom-right diagonal) and sees the keys at
    positions [pos - left, pos + right] (-1 = unbounded) that share its segment; id 0 is
    padding. With segments, the positions are those of the segment layout.
    """
    _, bottom_right = MASK_STRINGS["none" if mask is None else mask]
    left, right = normalized_window(mask, window)
    if segments is None:
        q_ids, kv_ids = np.ones((B, T), np.int64), np.ones((B, S), np.int64)
        q_pos = np.broadcast_to(np.arange(T) + (S - T if bottom_right else 0), (B, T))
        kv_pos = np.broadcast_to(np.arange(S), (B, S))
    else:
        q_ids, kv_ids, q_pos, kv_pos = segments.tokens(T, S, bottom_right)
    out = np.zeros((B, T, S), bool)
    for b in range(B):
        for i in range(T):
            see = (kv_ids[b] == q_ids[b, i]) & (q_ids[b, i] != 0)
            dist = q_pos[b, i] - kv_pos[b]  # > 0: the key lies to the query's left
            if left >= 0:
                see &= dist <= left
            if right >= 0:
                see &= -dist <= right
            out[b, i] = see
    return out


def _extra_logit(softmax: str, sink, n: int):
    """The logit of the softmax denominator's extra term, or None."""
    if softmax == "vanilla":
        return None
    if softmax == "off_by_one":
        return 0.0  # + 1 = + exp(0)
    return float(sink[n])  # learnable: + exp(sink[n])


def attention(q, k, v, *, mask="causal", window=None, segments: Segments | None = None,
              bias=None, scale=None, softmax="vanilla", sink=None, logits_soft_cap=None,
              keep=None, dropout_rate=0.0):
    """(out [B, T, N, Dv], lse [B, N, T]) in float64, by brute force.

    keep: bool [B, N, T, S] (which probabilities survive dropout) or None for no dropout; the
    kept ones are scaled by 1 / keep_probability(dropout_rate).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, N, Dqk = q.shape
    S, K, Dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(Dqk) if scale is None else scale
    bias = None if bias is None else np.asarray(bias, np.float64)
    vis = visible(B, T, S, mask=mask, window=window, segments=segments)
    out = np.zeros((B, T, N, Dv))
    lse = np.zeros((B, N, T))
    for b in range(B):
        for n in range(N):
            h = n // (N // K)  # the key/value head this query head reads
            for i in range(T):
                s = scale * (k[b, :, h, :] @ q[b, i, n, :])  # [S]
                if bias is not None:
                    s = s + bias[b % bias.shape[0], n % bias.shape[1], i]
                if logits_soft_cap is not None:
                    s = logits_soft_cap * np.tanh(s / logits_soft_cap)
                seen = vis[b, i]
                extra = _extra_logit(softmax, sink, n)
                logits = list(s[seen]) + ([] if extra is None else [extra])
                if not logits:  # no key and no extra term: the row is empty
                    lse[b, n, i] = EMPTY_ROW_LSE
                    continue
                m = max(logits)
                denom = np.sum(np.exp(s[seen] - m)) + (0.0 if extra is None else np.exp(extra - m))
                p = np.zeros(S)
                p[seen] = np.exp(s[seen] - m) / denom
                if keep is not None:
                    p = np.where(keep[b, n, i], p / keep_probability(dropout_rate), 0.0)
                out[b, i, n] = p @ v[b, :, h, :]
                lse[b, n, i] = m + np.log(denom)
    return out, lse


def attention_jnp(q, k, v, vis, *, bias=None, scale=None, softmax="vanilla", sink=None,
                  logits_soft_cap=None, keep=None, dropout_rate=0.0):
    """The oracle's formula, broadcast in jax.numpy, computed entirely in q's dtype.

    vis: bool [B, T, S] from `visible`. Differentiable in q, k, v, bias and sink.
    """
    dt = q.dtype
    B, T, N, Dqk = q.shape
    K = k.shape[2]
    scale = 1.0 / math.sqrt(Dqk) if scale is None else scale
    k = jnp.repeat(k.astype(dt), N // K, axis=2)  # head n reads key/value head n // (N / K)
    v = jnp.repeat(v.astype(dt), N // K, axis=2)
    s = jnp.einsum("btnd,bsnd->bnts", q, k) * jnp.asarray(scale, dt)
    if bias is not None:
        s = s + bias.astype(dt)
    if logits_soft_cap is not None:
        c = jnp.asarray(logits_soft_cap, dt)
        s = c * jnp.tanh(s / c)
    s = jnp.where(jnp.asarray(vis)[:, None], s, -jnp.inf)
    if softmax == "vanilla":
        extra = None
    elif softmax == "off_by_one":
        extra = jnp.zeros((N,), dt)
    else:
        extra = sink.astype(dt)
    m = jnp.max(s, axis=-1)
    if extra is not None:
        m = jnp.maximum(m, extra[None, :, None])
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m)))
    e = jnp.exp(s - m[..., None])
    denom = jnp.sum(e, axis=-1)
    if extra is not None:
        denom = denom + jnp.exp(extra[None, :, None] - m)
    empty = denom == 0
    safe = jnp.where(empty, jnp.ones_like(denom), denom)
    p = e / safe[..., None]
    lse = jnp.where(empty, jnp.asarray(EMPTY_ROW_LSE, dt), m + jnp.log(safe))
    if keep is not None:
        p = jnp.where(jnp.asarray(keep), p / jnp.asarray(keep_probability(dropout_rate), dt),
                      jnp.zeros_like(p))
    out = jnp.einsum("bnts,bsnd->btnd", p, v)
    return out, lse


def keep_probability(rate: float) -> float:
    """The fraction dropout keeps, stated independently of the library: each decision reads 16
    bits of a hash, so the rate is rounded to a multiple of 1/65536."""
    return 1.0 - min(round(rate * 65536), 65535) / 65536


def dropout_keep_np(seed, rate: float, B: int, N: int, T: int, S: int) -> np.ndarray:
    """bool [B, N, T, S]: the attention dropout mask restated in numpy (unsigned 64-bit
    arithmetic reduced mod 2**32), independently of the library: three rounds of the lowbias32
    finaliser, per (batch, head), per query and per pair of keys (2m, 2m + 1), the pair's hash
    giving its low 16 bits to the even key and its high 16 bits to the odd one; an element is
    kept iff its 16 bits are >= round(rate * 65536) (at most 65535)."""
    m32 = 0xFFFFFFFF

    def mix(x):
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & m32
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B) & m32
        return x ^ (x >> 16)

    s0, s1 = (int(x) for x in np.asarray(seed, np.uint32))
    b, n, i, j = np.ix_(*(np.arange(x, dtype=np.uint64) for x in (B, N, T, S)))
    h = mix(np.uint64(s0) ^ mix((b * 0x9E3779B1 + n) & m32))
    h = mix(h ^ np.uint64(s1) ^ i)
    h = mix((h + (j >> 1) * 0x85EBCA77) & m32)
    bits = np.where(j & 1, h >> 16, h & 0xFFFF)
    return bits >= min(round(rate * 65536), 65535)


def dropout_keep_mask(seed, rate: float, B: int, N: int, T: int, S: int) -> np.ndarray:
    """bool [B, N, T, S]: the elements `flashmesh.attention.masks.dropout_keep` keeps."""
    from flashmesh.attention import masks
    b, n, i, j = np.ix_(np.arange(B), np.arange(N), np.arange(T), np.arange(S))
    return np.asarray(masks.dropout_keep(jnp.asarray(seed), rate, b, n, i, j))


# ----------------------------------------------------------------------------------------------
# Input generators
# ----------------------------------------------------------------------------------------------
def random_qkv(rng: np.random.Generator, B, T, S, N, K, Dqk, Dv, dtype=np.float32):
    """Standard normal q [B,T,N,Dqk], k [B,S,K,Dqk], v [B,S,K,Dv] (never zeros)."""
    q = rng.standard_normal((B, T, N, Dqk))
    k = rng.standard_normal((B, S, K, Dqk))
    v = rng.standard_normal((B, S, K, Dv))
    return tuple(x.astype(dtype) for x in (q, k, v))


BIAS_SHAPES = ("BNTS", "11TS", "B1TS", "1NTS")


def random_bias(rng, pattern: str, B, N, T, S, dtype=np.float32):
    """Bias of shape pattern "BNTS" / "11TS" / "B1TS" / "1NTS"."""
    shape = (B if pattern[0] == "B" else 1, N if pattern[1] == "N" else 1, T, S)
    return rng.standard_normal(shape).astype(dtype)


def random_sink(rng, N) -> np.ndarray:
    """Learnable-softmax sink logits [N] float32, around the size of typical logits."""
    return rng.normal(0.0, 1.0, (N,)).astype(np.float32)


def random_partition(rng, L: int, m: int):
    """m non-empty (start, length) pieces of [0, L) in order (fewer if L < m), with random
    padding gaps before, between and after them (often none)."""
    m = min(m, L)
    if m == 0:
        return []
    weights = np.array([0.5] + [1.5, 0.5] * m)  # gap, piece, gap, ..., piece, gap
    parts = rng.multinomial(L - m, weights / weights.sum())
    pieces, start = [], 0
    for r in range(m):
        start += int(parts[2 * r])
        n = 1 + int(parts[2 * r + 1])
        pieces.append((start, n))
        start += n
    return pieces


def seqlens_segments(rng, B, T, S, *, empty_row=False) -> Segments:
    """from_seqlens: row b holds one sequence of random length (0 for row 0 if empty_row)."""
    q = rng.integers(1, T + 1, size=B)
    kv = q.copy() if T == S else rng.integers(1, S + 1, size=B)
    if empty_row:
        q[0] = kv[0] = 0
    if B > 1:  # keep one full row, so that not every row is padded
        q[-1], kv[-1] = T, S
    return Segments("seqlens", q, kv)


def _slot_arrays(rows, M, plus_one: bool):
    B = len(rows)
    lens = -np.ones((B, M), np.int64)
    offs = -np.ones((B, M + plus_one), np.int64)
    for b, pieces in enumerate(rows):
        for m, (start, n) in enumerate(pieces):
            lens[b, m], offs[b, m] = n, start
    return lens, offs


def _paired_rows(rng, B, T, S, max_segments, empty_row):
    """Partitions of the query and key rows with the same number of segments per row
    (1..max_segments; none in row 0 if empty_row)."""
    q_rows, kv_rows = [], []
    for b in range(B):
        m = 0 if (empty_row and b == 0) else int(rng.integers(1, max_segments + 1))
        m = min(m, T, S)
        q_p = random_partition(rng, T, m)
        q_rows.append(q_p)
        kv_rows.append(q_p if T == S else random_partition(rng, S, m))
    return q_rows, kv_rows


def offsets_segments(rng, B, T, S, *, max_segments=3, empty_row=False,
                     cudnn_offsets=False) -> Segments:
    """from_seqlens_and_offsets: packed rows, unused slots -1; offsets [B, M] or (cuDNN's
    form) [B, M+1]."""
    q_rows, kv_rows = _paired_rows(rng, B, T, S, max_segments, empty_row)
    return Segments("offsets", _slot_arrays(q_rows, max_segments, cudnn_offsets),
                    _slot_arrays(kv_rows, max_segments, cudnn_offsets))


def ids_segments(rng, B, T, S, *, max_segments=3, empty_row=False,
                 positions: str | None = None) -> Segments:
    """from_segment_ids_and_pos: packed rows of ids 1..m (0 = padding).

    positions: None (derived), "canonical" (given, equal to the derived ones) or "shifted"
    (given; each query segment shifted right by a random amount, like a bottom-right diagonal
    with longer key segments).
    """
    q_rows, kv_rows = _paired_rows(rng, B, T, S, max_segments, empty_row)

    def ids_of(rows, L):
        ids = np.zeros((B, L), np.int64)
        for b, pieces in enumerate(rows):
            for m, (start, n) in enumerate(pieces):
                ids[b, start:start + n] = m + 1
        return ids

    q_ids, kv_ids = ids_of(q_rows, T), ids_of(kv_rows, S)
    if positions is None:
        return Segments("ids", (q_ids, None), (kv_ids, None))
    q_pos, kv_pos = run_offsets(q_ids), run_offsets(kv_ids)
    if positions == "shifted":
        shift = rng.integers(0, 4, size=(B, max_segments + 1))
        q_pos = q_pos + np.take_along_axis(shift, q_ids, axis=1)
    q_pos = np.where(q_ids > 0, q_pos, 0)
    return Segments("ids", (q_ids, q_pos), (kv_ids, kv_pos))


SEGMENT_RECIPES = {
    "seqlens": lambda rng, B, T, S: seqlens_segments(rng, B, T, S),
    "seqlens_empty_row": lambda rng, B, T, S: seqlens_segments(rng, B, T, S, empty_row=True),
    "offsets": lambda rng, B, T, S: offsets_segments(rng, B, T, S),
    "offsets_cudnn": lambda rng, B, T, S: offsets_segments(rng, B, T, S, cudnn_offsets=True),
    "offsets_empty_row": lambda rng, B, T, S: offsets_segments(rng, B, T, S, empty_row=True),
    "ids": lambda rng, B, T, S: ids_segments(rng, B, T, S),
    "ids_empty_row": lambda rng, B, T, S: ids_segments(rng, B, T, S, empty_row=True),
    "ids_pos": lambda rng, B, T, S: ids_segments(rng, B, T, S, positions="canonical"),
    "ids_pos_shifted": lambda rng, B, T, S: ids_segments(rng, B, T, S, positions="shifted"),
}


# ----------------------------------------------------------------------------------------------
# Layouts: pack separate [B, T, N, H] arrays into the forms `flashmesh.attention` accepts
# ----------------------------------------------------------------------------------------------
def pack(layout: str, q, k, v):
    """(q, k, v) arguments for `layout`; None for arguments the layout packs away."""
    seq_major = layout.startswith("sb")
    if seq_major:
        q, k, v = (jnp.swapaxes(x, 0, 1) for x in (q, k, v))
    if layout in ("bs3hd", "sb3hd", "t3hd"):
        return jnp.stack([q, k, v], axis=2), None, None
    if layout in ("bshd_bs2hd", "sbhd_sb2hd", "thd_t2hd"):
        return q, jnp.stack([k, v], axis=2), None
    return q, k, v


def unpack_grads(layout: str, grads):
    """Gradients of the packed arguments back to (dq, dk, dv) in [B, T, N, H]."""
    if layout in ("bs3hd", "sb3hd", "t3hd"):
        dq, dk, dv = grads[0][:, :, 0], grads[0][:, :, 1], grads[0][:, :, 2]
    elif layout in ("bshd_bs2hd", "sbhd_sb2hd", "thd_t2hd"):
        dq, dk, dv = grads[0], grads[1][:, :, 0], grads[1][:, :, 1]
    else:
        dq, dk, dv = grads[:3]
    if layout.startswith("sb"):
        dq, dk, dv = (jnp.swapaxes(x, 0, 1) for x in (dq, dk, dv))
    return dq, dk, dv


def unpack_out(layout: str, out):
    return jnp.swapaxes(out, 0, 1) if layout.startswith("sb") else out


# ----------------------------------------------------------------------------------------------
# Comparisons that say where they fail
# ----------------------------------------------------------------------------------------------
def _worst(actual, expected):
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shape {a.shape} != expected {e.shape}")
    for what, x in (("value", a), ("expected value", e)):  # a NaN in either would pass err > tol
        bad = ~np.isfinite(x)
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise AssertionError(f"non-finite {what} {x[idx]} at {idx} ({bad.sum()} in all)")
    err = np.abs(a - e)
    idx = tuple(int(i) for i in np.unravel_index(np.argmax(err), err.shape)) if err.size else ()
    return (float(err[idx]) if err.size else 0.0), idx, a, e


def assert_close(name: str, actual, expected, *, rtol: float = 1e-5, atol: float = 1e-6):
    """max |actual - expected| <= atol + rtol * max |expected|, else name the worst element."""
    err, idx, a, e = _worst(actual, expected)
    scale = float(np.max(np.abs(e))) if e.size else 0.0
    tol = atol + rtol * scale
    if err > tol:
        raise AssertionError(f"{name}: max |error| {err:.3g} > tol {tol:.3g} at {idx} "
                             f"(got {a[idx]!r}, expected {e[idx]!r}, max |expected| {scale:.3g})")


def assert_fa_rule(name: str, actual, expected, plain, *, noise: float = 2.0**-8, atol: float = 0.0):
    """FlashAttention's rule for low precision: the error against the float64 answer is at most
    twice the error of the plain low-precision computation, plus rounding noise
    (noise * max |expected|, half a bfloat16 ulp of the largest element by default, plus atol)."""
    err, idx, a, e = _worst(actual, expected)
    plain_err, plain_idx, _, _ = _worst(plain, expected)
    scale = float(np.max(np.abs(e))) if e.size else 0.0
    tol = 2.0 * plain_err + noise * max(scale, 1e-3) + atol
    if err > tol:
        raise AssertionError(f"{name}: max |error| {err:.3g} > 2 x plain low-precision error "
                             f"{plain_err:.3g} (at {plain_idx}) + noise = {tol:.3g}; worst at {idx} "
                             f"(got {a[idx]!r}, expected {e[idx]!r})")
