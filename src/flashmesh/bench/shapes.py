"""What `flashmesh bench` measures: attention shapes, groups of them, and named presets.

A `Shape` is one attention problem (letters as jax.nn's legend: B batch, T query length,
S key length, N query heads, K key/value heads, Dqk and Dv head dims). A `Group` is a set of
shapes measured with the same implementations and modes, optionally a sweep along one axis
(plotted as latency against that axis). A `Preset` is a documented list of groups.

The presets are data: `codelab` reproduces the steps of the attention codelab
(`reference/002`), `anchors` the peer measurements of `anchors/RESULTS.md`, `small` is the
codelab at sizes a CPU runs in about a minute (the default without a GPU), `quick` is tiny
(tests, smoke checks). Sizes that only make sense on a GPU are chosen by `platform`.
`cp` is context parallelism on the CP tutorial's workload (`reference/003`): its rows are
strategies and sequence orders (`CpRow`), measured by `context.py`, not implementations.
`layer` is the getting-started guide's decoder layer (`reference/004`, a `LayerShape`): its rows
are the guide's variants of one layer (`layer_models.py`), measured by `layer.py`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MASKS = ("none", "causal", "causal_bottom_right")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention problem.

    mask: "none", "causal" (top-left diagonal: query i sees keys <= i) or
      "causal_bottom_right" (the diagonal ends at the last query and key; differs when T != S).
    window: (left, right) or None; query at position p sees keys in [p - left, p + right],
      -1 unbounded. With a causal mask right is 0.
    segments: packed documents of every batch row (self-attention only, T == S): a tuple of
      run lengths in order, positive = a document, negative = that many padding tokens; the
      rest of the row after the last run is padding. Tokens attend only inside their
      document; causal and window masks use positions counted from the document's start.
    """

    name: str
    B: int
    T: int
    N: int
    K: int
    Dqk: int
    S: int | None = None
    Dv: int | None = None
    mask: str = "none"
    window: tuple[int, int] | None = None
    segments: tuple[int, ...] | None = None
    note: str = ""

    def __post_init__(self):
        if self.S is None:
            object.__setattr__(self, "S", self.T)
        if self.Dv is None:
            object.__setattr__(self, "Dv", self.Dqk)
        if self.mask not in MASKS:
            raise ValueError(f"mask={self.mask!r} must be one of {MASKS}")
        if min(self.B, self.T, self.S, self.N, self.K, self.Dqk, self.Dv) <= 0:
            raise ValueError(f"shape {self.name!r} has a non-positive dimension")
        if self.N % self.K:
            raise ValueError(f"N={self.N} must be a multiple of K={self.K} in shape {self.name!r}")
        if self.window is not None:
            left, right = self.window
            if left < -1 or right < -1 or (self.causal and right > 0):
                raise ValueError(f"window={self.window} of shape {self.name!r} is invalid")
        if self.segments is not None:
            if self.T != self.S:
                raise ValueError(f"segments need T == S, got T={self.T}, S={self.S} in {self.name!r}")
            if sum(abs(n) for n in self.segments) > self.T or 0 in self.segments:
                raise ValueError(f"segments={self.segments} must be non-zero runs fitting T={self.T}")

    # -- derived --------------------------------------------------------------------------------
    @property
    def causal(self) -> bool:
        return self.mask != "none"

    @property
    def bottom_right(self) -> bool:
        return self.mask == "causal_bottom_right"

    @property
    def effective_window(self) -> tuple[int, int]:
        """(left, right) with causal folded in as right = 0; (-1, -1) = everything visible."""
        left, right = self.window if self.window is not None else (-1, -1)
        return (left, 0) if self.causal else (left, right)

    @property
    def num_documents(self) -> int:
        return sum(1 for n in self.segments if n > 0) if self.segments else 0

    @property
    def logits_per_row(self) -> int:
        """B * N * T * S: the size of the full logits matrix naive attention materialises."""
        return self.B * self.N * self.T * self.S

    def describe(self) -> str:
        parts = [f"B={self.B}", f"T={self.T}"] + ([f"S={self.S}"] if self.S != self.T else [])
        parts += [f"N={self.N}", f"K={self.K}"]
        parts += [f"D={self.Dqk}"] if self.Dqk == self.Dv else [f"Dqk={self.Dqk}", f"Dv={self.Dv}"]
        parts.append({"none": "full", "causal": "causal",
                      "causal_bottom_right": "causal (bottom-right)"}[self.mask])
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.segments:
            parts.append(f"{self.num_documents} docs")
        return ", ".join(parts)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def segment_ids_and_positions(shape: Shape) -> tuple[np.ndarray, np.ndarray]:
    """For a shape with segments: per-token document ids [T] (1-based, 0 = padding) and
    positions [T] (offset from the document's start, 0 on padding)."""
    ids = np.zeros(shape.T, np.int32)
    pos = np.zeros(shape.T, np.int32)
    start, doc = 0, 0
    for run in shape.segments or ():
        if run > 0:
            doc += 1
            ids[start:start + run] = doc
            pos[start:start + run] = np.arange(run)
        start += abs(run)
    return ids, pos


@dataclasses.dataclass(frozen=True)
class Group:
    """Shapes measured alike. `sweep` names the axis that varies ("T" or "B") for plots;
    `implementations` are labels "name" or "name@dtype" (see implementations.py)."""

    name: str
    title: str
    shapes: tuple[Shape, ...]
    implementations: tuple[str, ...]
    modes: tuple[str, ...] = ("fwd", "fwdbwd")
    sweep: str | None = None
    description: str = ""


@dataclasses.dataclass(frozen=True)
class Preset:
    """kind: "attention" (rows are implementations, `runner.py`), "context_parallel" (rows
    are strategies x orders and emulated ranks, `context.py`) or "layer" (rows are variants of
    the guide's decoder layer, `layer.py`)."""

    name: str
    description: str
    groups: tuple[Group, ...]
    causal_check: Shape | None = None  # the codelab's "what did the mask change" check
    kind: str = "attention"

    def shapes(self) -> list[Shape]:
        return [s for g in self.groups for s in g.shapes]


# -- the codelab (reference/002) -------------------------------------------------------------
CODELAB_IMPLS = ("naive@f32", "xla@f32", "xla@bf16", "cudnn@bf16", "flashmesh@bf16", "flashmesh@f32")
PEERS = ("fa3", "tokamax:mosaic", "tokamax:triton")


def _codelab_shape(name, B=4, T=128, N=8, K=8, H=64, mask="none"):
    return Shape(name, B=B, T=T, N=N, K=K, Dqk=H, mask=mask)


def codelab(platform: str, *, seq_lens=None, batches=(1, 2, 4, 8, 16), module_lens=None) -> Preset:
    on_gpu = platform == "gpu"
    if seq_lens is None:  # the codelab's 64..1024; a GPU goes on to where naive runs out of memory
        seq_lens = (64, 128, 256, 512, 1024) + ((2048, 4096, 8192, 16384, 32768, 65536) if on_gpu else ())
    module_lens = module_lens or (128, 256, 512, 1024, 2048)
    heads = [_codelab_shape(f"codelab_{kind}_T64", B=2, T=64, K=K) for kind, K in (("mha", 8), ("gqa", 2), ("mqa", 1))]
    if on_gpu:  # the codelab's size is launch-bound; a longer one shows what sharing KV heads saves
        heads += [_codelab_shape(f"codelab_{kind}_T4096", B=2, T=4096, K=K)
                  for kind, K in (("mha", 8), ("gqa", 2), ("mqa", 1))]
    groups = (
        Group("default", "Default shape (codelab steps 4-6, 8)", (_codelab_shape("codelab_default"),),
              CODELAB_IMPLS + PEERS,
              description="B=4, T=128, N=8, H=64 without a mask: naive float32 attention, "
                          "jax.nn.dot_product_attention (xla float32 and bfloat16, cudnn bfloat16), flashmesh."),
        Group("causal", "Causal mask (codelab step 7)", (_codelab_shape("codelab_causal", mask="causal"),),
              CODELAB_IMPLS + PEERS, description="The default shape with a causal mask."),
        Group("seq_sweep", "Sequence-length sweep (codelab step 8)",
              tuple(_codelab_shape(f"codelab_T{t}", T=t) for t in seq_lens),
              CODELAB_IMPLS + PEERS, modes=("fwd",), sweep="T",
              description="B=4, N=8, H=64, no mask. Naive attention materialises the [B, N, T, S] "
                          "logits (O(T^2) memory) and runs out of memory on long sequences; fused "
                          "kernels keep O(T)."),
        Group("batch_sweep", "Batch-size sweep (codelab step 8)",
              tuple(_codelab_shape(f"codelab_B{b}_T256", B=b, T=256) for b in batches),
              CODELAB_IMPLS + PEERS, modes=("fwd",), sweep="B",
              description="T=256, N=8, H=64, no mask; larger batches amortise launch overhead."),
        Group("heads", "MHA, GQA and MQA (codelab step 9)", tuple(heads), CODELAB_IMPLS + PEERS,
              description="8 query heads against 8, 2 and 1 key/value heads."),
        Group("module_sweep", "Causal module sweep (codelab step 10)",
              tuple(_codelab_shape(f"codelab_causal_T{t}", T=t, mask="causal") for t in module_lens),
              ("naive@bf16", "xla@bf16", "cudnn@bf16", "module@bf16", "flashmesh@bf16") + PEERS,
              modes=("fwd", "fwdbwd") if on_gpu else ("fwd",), sweep="T",
              description="Causal attention, B=4, N=8, H=64: flashmesh's Flax "
                          "DotProductAttention (the module the codelab benchmarks) against "
                          "jax.nn.dot_product_attention and the flashmesh function."),
    )
    return Preset("codelab", "The attention codelab's comparisons in order (reference/002).",
                  groups, causal_check=_codelab_shape("codelab_causal_check"))


def small(platform: str) -> Preset:
    """The codelab's steps at sizes that run on a CPU in about a minute: float32 rows (a CPU
    emulates bfloat16 slowly), one bfloat16 row where the codelab compares dtypes."""
    base = {g.name: g for g in codelab(platform, seq_lens=(64, 128, 256, 512), batches=(1, 2, 4, 8),
                                       module_lens=(128, 256, 512)).groups}
    f32 = ("naive@f32", "xla@f32", "flashmesh@f32")
    impls = {"default": ("naive@f32", "xla@f32", "xla@bf16", "cudnn@bf16", "flashmesh@f32"),
             "causal": f32, "seq_sweep": f32 + ("xla@bf16",), "batch_sweep": f32, "heads": f32,
             "module_sweep": ("naive@f32", "xla@f32", "module@f32", "flashmesh@f32")}
    modes = {"default": ("fwd", "fwdbwd")}
    groups = tuple(dataclasses.replace(base[name], implementations=labels, modes=modes.get(name, ("fwd",)))
                   for name, labels in impls.items())
    return Preset("small", "The codelab's steps at CPU sizes (the default without a GPU).", groups,
                  causal_check=_codelab_shape("codelab_causal_check"))


# -- the anchors (anchors/RESULTS.md) ---------------------------------------------------------
ANCHOR_SHAPES = (
    Shape("seed000_gqa_swa", B=2, T=4096, N=128, K=8, Dqk=128, mask="causal", window=(128, 0),
          note="tutorial 000: GQA + sliding window"),
    Shape("seed000_mla", B=2, T=4096, N=128, K=8, Dqk=128, Dv=64, mask="causal",
          note="tutorial 000: MLA head dims"),
    Shape("full_4k_h16_d128", B=4, T=4096, N=16, K=16, Dqk=128),
    Shape("causal_8k_h32_d128", B=1, T=8192, N=32, K=32, Dqk=128, mask="causal"),
    Shape("causal_8k_h32_d64", B=1, T=8192, N=32, K=32, Dqk=64, mask="causal"),
    Shape("gqa_causal_16k", B=1, T=16384, N=64, K=8, Dqk=128, mask="causal"),
    Shape("codelab_small", B=4, T=128, N=8, K=8, Dqk=64),
    Shape("codelab_te_2048", B=4, T=2048, N=8, K=8, Dqk=64, mask="causal"),
)
WORKLOAD_SHAPES = (
    Shape("cp_tutorial_packed_64k", B=2, T=65536, N=128, K=8, Dqk=128, mask="causal", window=(8192, 0),
          segments=(12288, -4096) * 4,
          note="tutorial 003 on one GPU: 4 slots of 16384 holding 12288 tokens each"),
)
# Issue 10's packed-documents target: 16 documents of 4096 tokens packed in one 64k row, against
# the same documents as a batch of 16 (the packed call should be within 10% of it).
DOCUMENT_SHAPES = (
    Shape("packed_16docs_64k", B=1, T=65536, N=32, K=8, Dqk=128, mask="causal", segments=(4096,) * 16,
          note="16 causal documents of 4096 tokens packed in one row"),
    Shape("batch_16docs_4k", B=16, T=4096, N=32, K=8, Dqk=128, mask="causal",
          note="the same 16 documents as a batch"),
)
ANCHOR_IMPLS = ("naive", "xla", "cudnn", "flashmesh", "flashmesh:cudnn", "flashmesh:pallas_mosaic_gpu",
                "flashmesh:chunked") + PEERS


def anchors(platform: str) -> Preset:
    groups = (
        Group("anchors", "Anchor shapes (anchors/RESULTS.md)", ANCHOR_SHAPES, ANCHOR_IMPLS,
              description="The shapes the peers were measured on, bfloat16, forward and forward+backward."),
        Group("workloads", "Whole workloads of the reference documents", WORKLOAD_SHAPES, ANCHOR_IMPLS,
              description="The context-parallel tutorial's single-GPU attention: packed documents "
                          "with padding, GQA 128:8, causal sliding window."),
        Group("documents", "Packed documents against the same documents as a batch", DOCUMENT_SHAPES,
              ANCHOR_IMPLS, description="16 causal documents of 4096 tokens (GQA 32:8, d128): packed "
                                        "in one 65536-token row, and as a batch of 16."),
    )
    return Preset("anchors", "The anchor shapes of anchors/RESULTS.md against every peer.", groups)


# -- quick (tests, smoke runs) ------------------------------------------------------------------
QUICK_IMPLS = ("naive", "xla", "cudnn", "flashmesh", "flashmesh:reference", "flashmesh:chunked",
               "flashmesh:cudnn") + PEERS


def quick(platform: str) -> Preset:
    mk = lambda name, **kw: Shape(name, **({"B": 1, "T": 64, "N": 4, "K": 2, "Dqk": 32} | kw))
    groups = (
        Group("masks", "Masks on tiny shapes",
              (mk("quick_full"), mk("quick_causal", mask="causal"),
               mk("quick_window", mask="causal", window=(16, 0)),
               mk("quick_causal_br_T48_S64", T=48, S=64, mask="causal_bottom_right"),
               mk("quick_packed", mask="causal", segments=(20, -4, 30))),
              QUICK_IMPLS),
        Group("quick_seq_sweep", "Tiny sequence sweep", tuple(mk(f"quick_T{t}", T=t) for t in (32, 64, 128)),
              QUICK_IMPLS, modes=("fwd",), sweep="T"),
    )
    return Preset("quick", "Tiny shapes for smoke tests (seconds on a CPU).", groups,
                  causal_check=mk("quick_causal_check"))


# -- context parallelism (reference/003) ------------------------------------------------------
CP_STRATEGIES = ("ring", "all_gather", "all_to_all")
CP_ORDERS = ("contiguous", "dual_chunk", "striped")
ONE_DEVICE = "one_device"
EMULATED_VARIANTS = ("steps", "ring_local")
EMULATED_CP = 4  # the tutorial's cp_size: the ranks whose work one device runs in turn


@dataclasses.dataclass(frozen=True)
class CpRow:
    """One context-parallel row: a strategy and the order the sequence is stored in (striped
    with its stripe size). Label: "ring/dual_chunk", "all_gather/striped:512"."""

    strategy: str
    order: str
    stripe_size: int | None = None

    @property
    def label(self) -> str:
        return f"{self.strategy}/{self.order}" + (f":{self.stripe_size}" if self.order == "striped" else "")

    @classmethod
    def parse(cls, label: str) -> "CpRow":
        strategy, _, order = label.partition("/")
        order, _, stripe = order.partition(":")
        if strategy not in CP_STRATEGIES or order not in CP_ORDERS or (stripe and order != "striped"):
            raise ValueError(f"cp row {label!r} must be <strategy>/<order>[:stripe] with strategy in "
                             f"{CP_STRATEGIES} and order in {CP_ORDERS}, e.g. ring/striped:1")
        if order == "striped" and not (stripe.isdigit() and int(stripe) > 0):
            raise ValueError(f"cp row {label!r}: striped needs a positive stripe size, "
                             f"e.g. {strategy}/striped:1")
        return cls(strategy, order, int(stripe) if order == "striped" else None)


CP_TUTORIAL = WORKLOAD_SHAPES[0]
CP_SMALL = Shape("cp_tutorial_small", B=2, T=1024, N=8, K=2, Dqk=32, mask="causal", window=(128, 0),
                 segments=(192, -64) * 4, note="tutorial 003 at CPU size: 4 slots of 256, 192 tokens each")
CP_TINY = Shape("cp_tutorial_tiny", B=2, T=256, N=8, K=2, Dqk=16, mask="causal", window=(32, 0),
                segments=(48, -16) * 4, note="tutorial 003, tiny (--quick): 4 slots of 64, 48 tokens each")
# The larger stripe of each workload: the tutorial's all-gather stripe (512 of 65536 tokens), scaled.
CP_STRIPES = {CP_TUTORIAL.name: 512, CP_SMALL.name: 16, CP_TINY.name: 4}


def cp_rows(shape: Shape, quick: bool = False) -> tuple[str, ...]:
    """Every strategy x order (striped with stripe 1 and the workload's larger stripe); --quick:
    the tutorial's two cases."""
    big = CP_STRIPES.get(shape.name, 1)
    if quick:  # the tutorial's two cases: ring striped by 1, all-gather by its larger stripe
        return ("ring/striped:1", f"all_gather/striped:{big}")
    orders = ("contiguous", "dual_chunk", "striped:1", f"striped:{big}")
    return tuple(f"{s}/{o}" for s in CP_STRATEGIES for o in orders)


def cp(platform: str, *, quick: bool = False, devices: int | None = None) -> Preset:
    """TransformerEngine's CP tutorial workload (B=2, T=65536, 4 packed slots of 16384 tokens with
    12288 valid, GQA 128:8, d=128, causal window (8192, 0), bf16) on a GPU; small on a CPU, tiny
    with --quick. cp is the number of devices (`jax.device_count()` unless given): with two or
    more the strategies run against one device; with one device (and always on a CPU) the
    `emulated_ranks` group runs the ranks' work of cp=4 one after another."""
    if devices is None:
        import jax

        devices = jax.device_count()
    shape = CP_TINY if quick else CP_TUTORIAL if platform == "gpu" else CP_SMALL
    groups = []
    if devices >= 2:
        groups.append(Group(
            "strategies", f"Context parallelism over {devices} devices against one device", (shape,),
            (ONE_DEVICE,) + cp_rows(shape, quick),
            description=f"cp = {devices} (every device). `one_device` is flashmesh.attention on the global "
                        "arrays on one device; every other row is flashmesh.parallel's "
                        "context_parallel_attention with that strategy on arrays stored in that order "
                        "(reorder_for_context_parallel) and sharded over the mesh axis, checked against "
                        "the one-device outputs before it is timed."))
    if devices == 1 or platform != "gpu":
        groups.append(Group(
            "emulated_ranks", f"The ranks' work of cp={EMULATED_CP}, one rank after another on one device",
            (shape,), (ONE_DEVICE,) + EMULATED_VARIANTS,
            description=f"For cp={EMULATED_CP} in contiguous order: each rank's per-step attention calls "
                        "(the ring's steps.attend calls with its step spec, positions, ids and K/V blocks) "
                        "run back to back on one device, rank by rank. The sum over ranks against the "
                        "one-device call says whether the context-parallel machinery adds compute."))
    return Preset("cp", "Context parallelism on the CP tutorial's workload (reference/003), "
                  "scaled to the devices present.", tuple(groups), kind="context_parallel")


def select_cp_rows(groups: tuple[Group, ...] | list[Group], labels: list[str]) -> list[Group]:
    """The cp groups restricted to `labels` (cp rows, emulated variants), `one_device` always
    kept as the baseline. A label no group can run is a ValueError."""
    for label in labels:
        if label != ONE_DEVICE and label not in EMULATED_VARIANTS:
            CpRow.parse(label)  # ValueError names the bad one
    kept = []
    for g in groups:
        runnable = [lab for lab in labels if (lab in EMULATED_VARIANTS) == (g.name == "emulated_ranks")
                    and lab != ONE_DEVICE]
        if runnable:
            kept.append(dataclasses.replace(g, implementations=(ONE_DEVICE, *dict.fromkeys(runnable))))
    if not kept:
        raise ValueError(f"--implementations {labels} selects no row of the cp preset's groups "
                         f"({', '.join(g.name for g in groups)})")
    return kept


# -- the getting-started decoder layer (reference/004) -----------------------------------------
@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One decoder layer's size: B batch, T sequence, `hidden` model width, `ffn` MLP width,
    `heads` attention heads (head dim hidden // heads); causal self-attention."""

    name: str
    B: int
    T: int
    hidden: int
    ffn: int
    heads: int
    note: str = ""

    def __post_init__(self):
        if min(self.B, self.T, self.hidden, self.ffn, self.heads) <= 0:
            raise ValueError(f"layer shape {self.name!r} has a non-positive dimension")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be a multiple of heads={self.heads} in {self.name!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def describe(self) -> str:
        return (f"B={self.B}, T={self.T}, hidden={self.hidden}, FFN={self.ffn}, heads={self.heads} "
                f"(head dim {self.head_dim}), causal")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


LAYER_GUIDE = LayerShape("guide_layer", B=4, T=2048, hidden=4096, ffn=16384, heads=32,
                         note="the getting-started guide's layer (reference/004)")


def layer_attention(shape: LayerShape) -> Shape:
    """A layer shape's attention call (self-attention, causal, as many kv heads as heads): what
    `flashmesh tune --shapes guide_layer_attention` tunes the kernels' tiles for."""
    return Shape(f"{shape.name}_attention", B=shape.B, T=shape.T, N=shape.heads, K=shape.heads,
                 Dqk=shape.head_dim, mask="causal")


GUIDE_LAYER_ATTENTION = layer_attention(LAYER_GUIDE)

LAYER_TINY = LayerShape("guide_layer_tiny", B=2, T=32, hidden=64, ffn=256, heads=4,
                        note="the guide's layer at CPU size (examples/getting_started.py --small)")
# Rows of the layer preset (flashmesh.bench.layer_models.VARIANTS describes each).
LAYER_VARIANTS = ("flax", "te_unfused_flax_attention", "te_unfused", "te_fused", "te_unfused_fp8",
                  "te_fused_fp8", "transformer_layer", "transformer_layer_fp8",
                  "transformer_layer_no_attn_dropout", "transformer_layer_no_attn_dropout_fp8",
                  "transformer_layer_fp8_attention", "jax_cudnn")


def layer(platform: str, *, quick: bool = False) -> Preset:
    """The guide's decoder layer, one fwd+bwd training step per variant: the guide's size on a
    GPU, tiny on a CPU and with --quick."""
    shape = LAYER_GUIDE if platform == "gpu" and not quick else LAYER_TINY
    group = Group("layer", "The getting-started decoder layer: one training step (fwd+bwd) per variant",
                  (shape,), LAYER_VARIANTS, modes=("fwdbwd",),
                  description="Each row is jit(value_and_grad) of <layer(x), dy> over the variables and "
                              "the input, with the FP8 state threaded from step to step as training "
                              "does; checked against a float32 reference before it is timed.")
    return Preset("layer", "The getting-started guide's decoder layer (reference/004): plain Flax, "
                  "flashmesh's TransformerEngine modules in bf16 and FP8, and a hand-written JAX layer.",
                  (group,), kind="layer")


PRESETS = {"codelab": codelab, "anchors": anchors, "small": small, "quick": quick, "cp": cp, "layer": layer}


def preset(name: str, platform: str, *, quick: bool = False) -> Preset:
    """The named preset; `quick` picks the cp and layer presets' tiny workloads (other presets
    cut their sweeps in `cli.make_plan`)."""
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} must be one of {sorted(PRESETS)}")
    return PRESETS[name](platform, quick=quick) if name in ("cp", "layer") else PRESETS[name](platform)


def default_preset(platform: str) -> str:
    """What `flashmesh bench` runs without --preset: the anchors on a GPU, `small` elsewhere."""
    return "anchors" if platform == "gpu" else "small"


def all_shapes(platform: str) -> dict[str, Shape]:
    """Every named shape of every preset (for --shapes)."""
    table: dict[str, Shape] = {}
    for name in PRESETS:
        for s in preset(name, platform).shapes():
            table.setdefault(s.name, s)
    return table
