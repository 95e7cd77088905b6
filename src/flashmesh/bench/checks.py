"""Numerics before numbers: every row is compared with flashmesh's float32 reference first.

The reference (`flashmesh.attention(..., implementation="reference")`, einsum over the full
logits, float32 inputs, matmul precision "highest") is the ground truth. When its logits do not
fit the memory budget, it runs on a *slice* that does, and the row is compared on exactly that
slice: the first batch rows, the first query heads (with their key/value heads), and the first
and last query rows (positions passed explicitly, so the mask is unchanged). Slicing is exact
for the forward output (rows and heads are independent) and for gradients too, because the
check run feeds the row an output gradient that is zero outside the slice: dK and dV then hold
only the slice's contributions, which is what the sliced reference computes.

Error: for each compared tensor (out; and dq, dk, dv for fwd+bwd), max |x - ref| / max |ref|;
the row's error is the worst tensor's. A NaN or inf is an infinite error.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flashmesh.bench.shapes import Shape, segment_ids_and_positions

# Largest normalised max error a row may show against the float32 reference. float32 allows
# TF32-class matmuls (XLA's default on NVIDIA GPUs), bf16 its 8-bit mantissa through softmax
# and two matmuls; wrong masks or stale tiles give errors of order 0.1-1.
TOLERANCE = {"f32": 5e-3, "f16": 1e-2, "bf16": 4e-2}

# Bytes per logit the reference holds at once: scores, exponentials and probabilities forward;
# about eight [B, N, T, S] float32 arrays with their gradients.
_BYTES_PER_LOGIT = {"fwd": 3 * 4, "fwdbwd": 8 * 4}


@dataclasses.dataclass(frozen=True)
class Slice:
    """What the reference computes: the *last* `batch` batch rows, query heads [0, heads) with
    key/value heads [0, kv_heads), and query rows [0, head_rows) + [T - tail_rows, T) (all rows
    if None). The last rows, because they sit at the largest offsets: an indexing bug shows there
    first (cuDNN's dq of tutorial 003's 64k workload was right for row 0 and wrong for row 1,
    which a check of row 0 passed)."""

    batch: int
    heads: int
    kv_heads: int
    head_rows: int | None = None
    tail_rows: int | None = None

    def batch_rows(self, B: int) -> slice:
        return slice(B - self.batch, B)

    def rows(self, T: int) -> np.ndarray | None:
        if self.head_rows is None:
            return None
        return np.concatenate([np.arange(self.head_rows), np.arange(T - self.tail_rows, T)]).astype(np.int32)

    def is_full(self, shape: Shape) -> bool:
        return (self.batch, self.heads, self.head_rows) == (shape.B, shape.N, None)

    def describe(self, shape: Shape) -> str:
        if self.is_full(shape):
            return "reference (float32)"
        parts = [f"last batch rows {self.batch}/{shape.B}", f"heads {self.heads}/{shape.N}"]
        if self.head_rows is not None:
            parts.append(f"query rows {self.head_rows + self.tail_rows}/{shape.T} (first and last)")
        return "reference (float32) on " + ", ".join(parts)


def choose_slice(shape: Shape, mode: str, budget_bytes: float) -> Slice | None:
    """The largest slice whose reference fits `budget_bytes` (None if not even 16 rows fit)."""
    per_logit = _BYTES_PER_LOGIT[mode]
    cost = lambda b, n, t: b * n * t * shape.S * per_logit
    group = shape.N // shape.K
    if cost(shape.B, shape.N, shape.T) <= budget_bytes:
        return Slice(shape.B, shape.N, shape.K)
    b = max(1, min(shape.B, int(budget_bytes // cost(1, shape.N, shape.T))))
    if cost(b, shape.N, shape.T) <= budget_bytes:
        return Slice(b, shape.N, shape.K)
    # Whole groups of query heads, then fewer heads of the first group.
    head_options = [g * group for g in range(shape.K, 0, -1)] + list(range(group - 1, 0, -1))
    for n in head_options:
        if cost(1, n, shape.T) <= budget_bytes:
            return Slice(1, n, max(1, n // group))
    rows = int(budget_bytes // cost(1, 1, 1)) // 2 * 2
    if rows < 16:
        return None
    return Slice(1, 1, 1, rows // 2, rows // 2)


def _reference_fn(shape: Shape, sl: Slice):
    """f(q, k, v, segment_ids) on the slice's arrays, running flashmesh's reference."""
    import flashmesh

    rows = sl.rows(shape.T)
    n_docs = max(shape.num_documents, 1)
    if rows is None:
        def f(q, k, v, segment_ids):
            segments = None
            if segment_ids is not None:
                segments = flashmesh.SequenceDescriptor.from_segment_ids_and_pos(segment_ids, max_segments=n_docs)
            return flashmesh.attention(q, k, v, mask=shape.mask, window=shape.window, segments=segments,
                                       implementation="reference")
        return f

    # Query rows are a subset: give every token its id and position explicitly, so the subset
    # sees exactly the keys it sees in the full problem.
    if shape.segments:
        ids, pos = segment_ids_and_positions(shape)
    else:
        ids, pos = np.ones(shape.T, np.int32), np.arange(shape.T, dtype=np.int32)
    offset = shape.S - shape.T if shape.bottom_right and not shape.segments else 0
    q_ids, q_pos = ids[rows], pos[rows] + offset
    kv_ids = ids if shape.segments else np.ones(shape.S, np.int32)
    kv_pos = pos if shape.segments else np.arange(shape.S, dtype=np.int32)
    mask = "causal" if shape.causal else "none"  # the diagonal is in the positions now

    def f(q, k, v, segment_ids):
        b = q.shape[0]
        tile = lambda x: jnp.broadcast_to(jnp.asarray(x)[None], (b, x.shape[0]))
        segments = flashmesh.SequenceDescriptor.from_segment_ids_and_pos(
            (tile(q_ids), tile(kv_ids)), (tile(q_pos), tile(kv_pos)), max_segments=n_docs)
        return flashmesh.attention(q, k, v, mask=mask, window=shape.window, segments=segments,
                                   implementation="reference")
    return f


def slice_outputs(sl: Slice, shape: Shape, out, grads=None):
    """The row's outputs restricted to the slice: [out] or [out, dq, dk, dv]."""
    rows = sl.rows(shape.T)
    b = sl.batch_rows(shape.B)
    take_q = lambda x: x[b, :, :sl.heads] if rows is None else x[b, rows, :sl.heads]
    take_kv = lambda x: x[b, :, :sl.kv_heads]
    result = [take_q(out)]
    if grads is not None:
        dq, dk, dv = grads
        result += [take_q(dq), take_kv(dk), take_kv(dv)]
    return result


def cotangent_for_check(sl: Slice, shape: Shape, do: jax.Array) -> jax.Array:
    """The output gradient with zeros outside the slice (see the module docstring)."""
    if sl.is_full(shape):
        return do
    keep = np.zeros(do.shape[:3], bool)
    rows = sl.rows(shape.T)
    keep[sl.batch_rows(shape.B), slice(None) if rows is None else rows, :sl.heads] = True
    return jnp.where(jnp.asarray(keep)[..., None], do, jnp.zeros((), do.dtype))


def reference_outputs(shape: Shape, sl: Slice, mode: str, q, k, v, segment_ids, do):
    """The float32 reference on the slice: [out] or [out, dq, dk, dv]."""
    rows = sl.rows(shape.T)
    f32 = lambda x: x.astype(jnp.float32)
    b = sl.batch_rows(shape.B)
    take_q = lambda x: x[b, :, :sl.heads] if rows is None else x[b, rows, :sl.heads]
    qs, dos = f32(take_q(q)), f32(take_q(do))
    ks, vs = f32(k[b, :, :sl.kv_heads]), f32(v[b, :, :sl.kv_heads])
    seg = None if segment_ids is None or rows is not None else segment_ids[b]
    f = _reference_fn(shape, sl)

    @jax.jit
    def run(qs, ks, vs, seg, dos):
        if mode == "fwd":
            return [f(qs, ks, vs, seg)]
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, seg), qs, ks, vs)
        return [out, *vjp(dos)]

    with jax.default_matmul_precision("highest"):  # no TF32 in the ground truth
        return run(qs, ks, vs, seg, dos)


def compare(outputs, references) -> tuple[float, float]:
    """(normalised max error, relative L2 error), each the worst over the tensors."""
    worst_max, worst_l2 = 0.0, 0.0
    for x, r in zip(outputs, references):
        x, r = x.astype(jnp.float32), r.astype(jnp.float32)
        if not bool(jnp.all(jnp.isfinite(x))):
            return float("inf"), float("inf")
        diff = x - r
        scale = float(jnp.max(jnp.abs(r)))
        worst_max = max(worst_max, float(jnp.max(jnp.abs(diff))) / max(scale, 1e-30))
        worst_l2 = max(worst_l2, float(jnp.linalg.norm(diff)) / max(float(jnp.linalg.norm(r)), 1e-30))
    return worst_max, worst_l2


def causal_check(shape: Shape, implementations=("flashmesh", "xla")) -> list[dict]:
    """The codelab's step 7: how much the causal mask changes the first and the last query's
    output (large at t=0, which then sees only itself; ~0 at t=T-1, which sees everything)."""
    from flashmesh.bench import implementations as impls
    from flashmesh.attention.registry import current_platform

    ks = jax.random.split(jax.random.key(7), 3)
    q, k, v = (jax.random.normal(key, (shape.B, shape.T, shape.N, shape.Dqk), jnp.float32) for key in ks)
    rows = []
    for name in implementations:
        try:
            impl = impls.get(name)
            full = impl.build(dataclasses.replace(shape, mask="none"), "f32", current_platform())
            causal = impl.build(dataclasses.replace(shape, mask="causal"), "f32", current_platform())
            with impl.tracing():
                a, c = jax.jit(full)(q, k, v), jax.jit(causal)(q, k, v)
            rows.append(dict(implementation=name,
                             first_position_diff=float(jnp.max(jnp.abs(c[:, 0] - a[:, 0]))),
                             last_position_diff=float(jnp.max(jnp.abs(c[:, -1] - a[:, -1])))))
        except Exception as e:  # recorded, never fatal
            first_line = (str(e).strip().splitlines() or [""])[0]
            rows.append(dict(implementation=name, error=f"{type(e).__name__}: {first_line}"))
    return rows
