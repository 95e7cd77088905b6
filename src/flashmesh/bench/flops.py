"""FLOPs of attention, counting only the (query, key) pairs the mask lets through.

    pairs          = visible (query, key) pairs of one batch row and one head
    FLOPs(fwd)     = 2 * B * N * pairs * (Dqk + Dv)       (Q K^T: Dqk, P V: Dv; 2 per multiply-add)
    FLOPs(fwd+bwd) = 3.5 * FLOPs(fwd)                      (backward: 5 matmuls against 2)

Softmax, masking and scaling are not counted. A masked pair costs no useful work, so a kernel
that computes the whole matrix and throws half away gets no credit for the thrown-away half;
TFLOP/s are comparable across implementations and with FlashAttention's and the anchors'
numbers (same convention).

Pairs are counted exactly per query row (O(T) memory, never O(T * S)): row i at position
p = i + offset (offset = S - T for a bottom-right diagonal) sees keys
[max(0, p - left), min(S - 1, p + right)]. Packed documents count each document as its own
square with positions from 0.
"""

from __future__ import annotations

import numpy as np

from flashmesh.bench.shapes import Shape

FWD_FLOPS_FORMULA = "2 * B * N * pairs * (Dqk + Dv)"
FWDBWD_FACTOR = 3.5
FORMULA_TEXT = (f"FLOPs(fwd) = {FWD_FLOPS_FORMULA}, pairs = visible (query, key) pairs per batch row "
                f"and head; FLOPs(fwd+bwd) = {FWDBWD_FACTOR} x FLOPs(fwd)")


def visible_pairs_rectangle(T: int, S: int, window: tuple[int, int] = (-1, -1), offset: int = 0,
                            block: int = 1 << 20) -> int:
    """Visible pairs of a T x S matrix whose query i sits at position i + offset and key j at j,
    under window (left, right) (-1 unbounded). Exact, in blocks of `block` rows."""
    left, right = window
    total = 0
    for start in range(0, T, block):
        p = np.arange(start, min(T, start + block), dtype=np.int64) + offset
        lo = np.maximum(p - left, 0) if left >= 0 else np.zeros_like(p)
        hi = np.minimum(p + right, S - 1) if right >= 0 else np.full_like(p, S - 1)
        total += int(np.maximum(hi - lo + 1, 0).sum())
    return total


def visible_pairs(shape: Shape) -> int:
    """Visible (query, key) pairs of one batch row and one head of `shape`."""
    window = shape.effective_window
    if shape.segments:
        return sum(visible_pairs_rectangle(n, n, window) for n in shape.segments if n > 0)
    offset = shape.S - shape.T if shape.bottom_right else 0
    return visible_pairs_rectangle(shape.T, shape.S, window, offset)


def attention_flops(shape: Shape, mode: str) -> float:
    """FLOPs of one call in `mode` ("fwd" or "fwdbwd"), counting visible pairs only."""
    fwd = 2.0 * shape.B * shape.N * visible_pairs(shape) * (shape.Dqk + shape.Dv)
    if mode == "fwd":
        return fwd
    if mode == "fwdbwd":
        return FWDBWD_FACTOR * fwd
    raise ValueError(f"mode={mode!r} must be 'fwd' or 'fwdbwd'")


def tflops_per_s(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12
