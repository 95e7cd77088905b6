"""The one registry of implementations, automatic selection, and `explain`.

Each implementation is a module with two functions:

    unsupported_reason(spec, platform, *, automatic=False) -> str | None
    attention(inputs, spec) -> (out [B, T, N, Dv], lse [B, N, T])

and optionally `describe(spec) -> str`: what a call it runs gets (e.g. its kernel tiles),
shown by `explain`.

`unsupported_reason` says, early and in words, why a call cannot run (None = it can); with
`automatic=True` an implementation may also decline calls it runs poorly (the reference
declines huge logits). Naming an implementation runs exactly that one or raises
`NotImplementedError` with its reason; nothing falls back silently.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

import jax

from flashmesh.attention.spec import AttentionSpec


@dataclasses.dataclass(frozen=True)
class Implementation:
    """notes: what holds for every call it runs and a user should know (shown by `explain`)."""

    name: str
    module_name: str
    description: str
    notes: str | None = None

    @property
    def module(self) -> ModuleType:
        return importlib.import_module(self.module_name)

    def unsupported_reason(self, spec: AttentionSpec, platform: str, automatic: bool = False) -> str | None:
        return self.module.unsupported_reason(spec, platform, automatic=automatic)


# A custom VJP gives reverse-mode derivatives of any order (grad, grad of grad, jacrev) but no
# forward mode: JAX cannot push a tangent through it. `implementation=None` moves from the
# reference to chunked as calls grow, so forward mode is only certain with "reference".
REVERSE_MODE_ONLY = ("reverse-mode autodiff only (a custom VJP): jax.jvp, jacfwd and hessian "
                     "raise; use implementation='reference' for forward mode")

IMPLEMENTATIONS: dict[str, Implementation] = {
    impl.name: impl for impl in (
        Implementation("cudnn", "flashmesh.attention.cudnn",
                       "cuDNN fused attention through JAX (NVIDIA GPUs)", REVERSE_MODE_ONLY),
        Implementation("pallas_mosaic_gpu", "flashmesh.attention.pallas_mosaic_gpu",
                       "flashmesh's own Hopper kernels in Pallas Mosaic GPU (forward and backward)",
                       "first-order reverse-mode autodiff only (a custom VJP over kernels): jax.jvp, "
                       "jacfwd, hessian and grad of grad raise"),
        Implementation("chunked", "flashmesh.attention.chunked",
                       "blockwise online softmax in JAX, linear memory, any device", REVERSE_MODE_ONLY),
        Implementation("reference", "flashmesh.attention.reference",
                       "einsum over the full logits matrix, every feature"),
    )
}

# Automatic choice: the first implementation in this order that accepts the call.
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    # pallas_mosaic_gpu (its GPU-marked suite passed on the H200, 2026-12-01) comes first and
    # passes over, to cuDNN, the calls cuDNN runs as fast or faster, and what no GPU has checked
    # yet (its automatic_reason).
    "gpu": ("pallas_mosaic_gpu", "cudnn", "chunked", "reference"),
    "cpu": ("reference", "chunked"),
}
DEFAULT_ORDER = ("chunked", "reference")


def current_platform() -> str:
    """'gpu', 'cpu' or 'tpu': the platform of JAX's default backend."""
    backend = jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


def get(name: str) -> Implementation:
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={name!r} must be one of {sorted(IMPLEMENTATIONS)} or None")
    return IMPLEMENTATIONS[name]


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    reason: str | None  # why it cannot run when named; None = it can
    declines: str | None = None  # why automatic selection passes over it although it can run


@dataclasses.dataclass(frozen=True)
class Explanation:
    """For one call: each implementation, whether it can run the call and why not."""

    platform: str
    spec: AttentionSpec
    rows: tuple[Row, ...]
    chosen: str | None
    fp8: str | None = None  # under autocast with fp8_dpa: what FP8 attention does with the call
    requested: str | None = None  # implementation= of the call (chosen if it can run, else None)

    def available(self) -> list[str]:
        return [row.name for row in self.rows if row.reason is None]

    def reason(self, name: str) -> str | None:
        return next(row.reason for row in self.rows if row.name == name)

    def __str__(self) -> str:
        if self.requested is not None:
            head = (f"runs {self.chosen!r} (requested)" if self.chosen else
                    f"implementation={self.requested!r} cannot run this call (NotImplementedError)")
        else:
            head = f"runs {self.chosen!r}" if self.chosen else "no implementation can run this call"
        lines = [f"flashmesh.attention on {self.platform}: {head}"]
        for row in self.rows:
            if row.reason is not None:
                mark, text = "-", row.reason
            elif row.name == self.chosen:
                mark, text = "*", "ok (requested)" if self.requested else "ok (chosen)"
            else:
                mark, text = "+", "ok" + (f"; not chosen automatically: {row.declines}" if row.declines else "")
            if row.reason is None and IMPLEMENTATIONS[row.name].notes:
                text += f"; {IMPLEMENTATIONS[row.name].notes}"
            if row.reason is None and hasattr(IMPLEMENTATIONS[row.name].module, "describe"):
                text += f"; {IMPLEMENTATIONS[row.name].module.describe(self.spec)}"
            lines.append(f"  {mark} {row.name:17s} {text}")
        if self.fp8 is not None:
            lines.append(f"  FP8 attention (autocast, fp8_dpa=True): {self.fp8}")
        return "\n".join(lines)


def explain_spec(spec: AttentionSpec, platform: str | None = None,
                 requested: str | None = None) -> Explanation:
    """Every implementation's verdict on the call; chosen: the automatic choice, or with
    `requested` (a call's implementation=) that one where it can run, else None."""
    platform = platform or current_platform()
    if requested is not None:
        get(requested)  # ValueError for a name that is not registered
    order = AUTO_ORDER.get(platform, DEFAULT_ORDER)
    rows = []
    for name, impl in IMPLEMENTATIONS.items():
        reason = impl.unsupported_reason(spec, platform)
        declines = None
        if reason is None:
            declines = impl.unsupported_reason(spec, platform, True) if name in order else (
                f"not in the automatic order for {platform}")
        rows.append(Row(name, reason, declines))
    by_name = {row.name: row for row in rows}
    if requested is not None:
        chosen = requested if by_name[requested].reason is None else None
    else:
        chosen = next((n for n in order if by_name[n].reason is None and by_name[n].declines is None), None)
    return Explanation(platform, spec, tuple(rows), chosen, requested=requested)


def select(spec: AttentionSpec, implementation: str | None) -> Implementation:
    """The implementation that runs this call, or NotImplementedError with every reason."""
    platform = current_platform()
    if implementation is not None:
        impl = get(implementation)
        reason = impl.unsupported_reason(spec, platform)
        if reason is not None:
            raise NotImplementedError(f"implementation={implementation!r} cannot run this call on "
                                      f"{platform}: {reason}")
        return impl
    explanation = explain_spec(spec, platform)
    if explanation.chosen is None:
        raise NotImplementedError(str(explanation))
    return IMPLEMENTATIONS[explanation.chosen]
