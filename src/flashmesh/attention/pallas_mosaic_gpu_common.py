"""The Pallas Mosaic GPU (Hopper) attention kernels' configurations: pure Python, no kernel code.

* `BlockSizes`: the general forward kernel's tiles and schedule options, and the shared memory
  they need; `WindowBlockSizes` and `window_reason`: the window kernel's.
* The hardware's numbers the kernels are planned against (shared memory, registers, WGMMA's
  rows, swizzles) and the shared-memory layout of a tile (`smem_tile`, `swizzle_for`).
* `check_spec`: what every kernel refuses.

Where the tiles come from: `pallas_mosaic_gpu_ranges` (which tiles a tile meets) and
`pallas_mosaic_gpu_table` (the tuned table and the heuristic that pick a configuration).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from flashmesh.attention.pallas_mosaic_gpu_ranges import band_kv_range, cdiv
from flashmesh.attention.spec import SOFTMAX_TYPES, AttentionSpec

SMEM_BYTES = 227 * 1024  # dynamic shared memory one block may use on H100/H200
REGISTERS_PER_SM = 65536  # 32-bit registers, shared by every thread of a block
WARPGROUP = 128  # threads
WGMMA_M = 64  # rows of one warpgroup's WGMMA
SWIZZLE_BYTES = 128  # Mosaic's widest swizzle: a WGMMA K extent is a multiple of 128 B
SWIZZLES = (128, 64, 32)  # the swizzles a tile's minor dim may take, widest first
SMEM_ALIGNMENT = 1024  # Mosaic GPU rounds every shared memory buffer up to this many bytes


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """The forward kernel's tile configuration (FA3/tokamax structure: compute warpgroups
    plus one memory warpgroup that streams K and V by TMA) and its schedule options.

    block_q: query rows per tile (one CTA; the unit of `kv_ranges`), shared by num_compute_wgs
      warpgroups of block_q // num_compute_wgs rows, each a multiple of WGMMA's M = 64.
    block_kv: keys per step: the N of S = Q Kᵀ (a multiple of 8, at most 256) and the K extent
      of P·V, a multiple of 128 B of the dtype (64 for bf16; `validate_for` checks it).
    num_stages: K/V buffers in shared memory (>= 1).
    num_compute_wgs: compute warpgroups, 1 to 3.
    compute_registers, memory_registers: setmaxnreg per thread of a compute / the memory
      warpgroup (multiples of 8 in [24, 256]); None: 232/40 up to 2 compute warpgroups, 160/32
      with 3 (tokamax, FA3). All warpgroups together get at most 65536 registers.
    pingpong: the compute warpgroups take turns on the tensor cores (FA3's warp scheduler
      barrier, tokamax's schedule barrier): one warpgroup's GEMMs run while the others do
      their softmax. None: on with 2 or more compute warpgroups; True needs 2 or more.
    intra_wg_overlap: within a warpgroup, issue step j's S = Q Kⱼᵀ together with step j-1's
      O += P V and run step j's softmax while that P·V is in flight (FA3's IntraWGOverlap);
      False (the default): S, softmax, P·V one after the other. Measured on the H200
      (benchmarks/results/2026-12-01-nvidia-h200-gpu-tests/probe_mosaic_2.log, forward, ping-pong
      on): off 0.906 ms against on 1.341 on causal_8k_h32_d128, 0.424 against 0.521 on
      seed000_gqa_swa (likely register pressure: S, O and two P tiles live at once).
    reuse_q_for_o: stage the output tile in the warpgroup's Q buffer (Q is dead after the
      last S GEMM; tokamax's RefUnion), which frees block_q * v_dim elements of shared memory;
      only when qk_dim == v_dim, else O gets its own buffer.
    lpt_order: visit the query tiles of each (head, batch) last to first, so the longest
      causal tiles start first and the short ones fill the last wave (tokamax, FA3's LPT).
    num_splits: KV splits (flash-decoding, 1 to 128): each query tile's key tiles are cut into
      num_splits parts (`split_part`) run by separate CTAs, whose normalised outputs and lse XLA
      merges; `split_kv` chooses it when too few tiles fill the chip.
    persistent: one CTA per SM (at most one per tile), each looping over the tiles c, c + C,
      ... of (batch, head, query tile) (tokamax's and FA3's static persistent scheduler for
      non-causal calls): the memory warpgroup streams the next tile's K/V while the compute
      warpgroups finish the last, and with O in its own buffer (not `reuse_q_for_o`) the next
      Q loads under the last P·V and the O store completes under the next tile. Not with
      num_splits > 1.
    tma_tails: a length that is not a multiple of the tiles is read and written in place
      (`in_place`: lengths that are multiples of 8, which Mosaic GPU's TMA tiling needs):
      TMA fills the rows of a tile past the end of Q, K or V with zeros and drops the rows
      of an O tile past T (what the zero padding gives), so Q, K and V are not copied into
      padded arrays and O is not sliced out of one. On by default since its GPU cases passed
      on the H200 (2026-12-06, benchmarks/results/2026-12-06-nvidia-h200-probes); False: the
      padded copies. The lse, dropout hashes, token tables and bias stay padded (`in_place`
      says why; they are small, but for the bias).
    named_release: the compute warpgroups release a K or V slot by `bar.arrive` on a hardware
      named barrier (one per slot and tensor) and one warp of the memory warpgroup, the only
      producer (`warp_map`), waits by `bar.sync` before reusing it (tokamax's form), instead of
      every compute thread arriving on an mbarrier (Mosaic's warpgroup-wide arrive) and the
      memory warpgroup waiting on it. Needs 2 * num_stages named barriers beside the
      ping-pong's (16 per CTA). Off by default until a GPU has timed it (the reading
      benchmarks/notes/2026-12-07-forward-vs-fa3.md expects 1-3%).
    """

    block_q: int = 128
    block_kv: int = 128
    num_stages: int = 2
    num_compute_wgs: int = 2
    compute_registers: int | None = None
    memory_registers: int | None = None
    pingpong: bool | None = None
    intra_wg_overlap: bool = False
    reuse_q_for_o: bool = True
    lpt_order: bool = True
    num_splits: int = 1
    persistent: bool = False
    tma_tails: bool = True
    named_release: bool = False

    def __post_init__(self):
        def check(name, ok, expected):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not ok(value):
                raise ValueError(f"BlockSizes.{name}={value!r} must be {expected}")

        check("num_compute_wgs", lambda w: 1 <= w <= 3, "1, 2 or 3")
        rows = WGMMA_M * self.num_compute_wgs
        check("block_q", lambda b: b > 0 and b % rows == 0,
              f"a positive multiple of 64 * num_compute_wgs = {rows}")
        check("block_kv", lambda b: 0 < b <= 256 and b % 8 == 0, "a multiple of 8 in [8, 256]")
        check("num_stages", lambda s: s >= 1, ">= 1")
        check("num_splits", lambda s: 1 <= s <= 128, "in [1, 128]")
        compute, memory = (232, 40) if self.num_compute_wgs <= 2 else (160, 32)
        if self.compute_registers is None:
            object.__setattr__(self, "compute_registers", compute)
        if self.memory_registers is None:
            object.__setattr__(self, "memory_registers", memory)
        if self.pingpong is None:
            object.__setattr__(self, "pingpong", self.num_compute_wgs >= 2)
        for name in ("pingpong", "intra_wg_overlap", "reuse_q_for_o", "lpt_order", "persistent",
                     "tma_tails", "named_release"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BlockSizes.{name}={getattr(self, name)!r} must be a bool")
        if self.persistent and self.num_splits > 1:
            raise ValueError(f"BlockSizes.persistent=True needs num_splits=1, got "
                             f"{self.num_splits} (a split's CTA owns one part of one tile)")
        if self.pingpong and self.num_compute_wgs < 2:
            raise ValueError(f"BlockSizes.pingpong=True needs num_compute_wgs >= 2, got "
                             f"{self.num_compute_wgs} (one warpgroup has nobody to take turns "
                             "with)")
        for name in ("compute_registers", "memory_registers"):
            check(name, lambda r: 24 <= r <= 256 and r % 8 == 0, "a multiple of 8 in [24, 256]")
        # Mosaic's barriers 0 .. W + 1, the ping-pong's W, then one per slot for K and for V
        named = 2 * (self.num_compute_wgs + 1) + 2 * self.num_stages
        if self.named_release and named > 16:
            raise ValueError(f"BlockSizes.named_release=True with num_stages={self.num_stages} and "
                             f"num_compute_wgs={self.num_compute_wgs} needs {named} named "
                             "barriers, more than the 16 of a CTA")
        total = (self.compute_registers * self.num_compute_wgs + self.memory_registers) * WARPGROUP
        if total > REGISTERS_PER_SM:
            raise ValueError(
                f"BlockSizes.compute_registers={self.compute_registers} * num_compute_wgs="
                f"{self.num_compute_wgs} + memory_registers={self.memory_registers} must be at "
                f"most {REGISTERS_PER_SM // WARPGROUP} (registers per thread of an SM), got "
                f"{total // WARPGROUP}")

    @property
    def rows_per_wg(self) -> int:
        return self.block_q // self.num_compute_wgs

    def o_reuses_q(self, spec: AttentionSpec) -> bool:
        """Whether the forward kernel stages O in the Q buffer for this call."""
        return self.reuse_q_for_o and spec.qk_dim == spec.v_dim

    def smem_bytes(self, spec: AttentionSpec) -> int:
        """Shared memory the forward kernel allocates on a GPU, exactly as Mosaic GPU counts
        it (each buffer rounded up to SMEM_ALIGNMENT, 8 bytes per mbarrier, no reduction
        scratch): Q, num_stages K and V buffers, O unless it reuses Q's buffer, the float32
        lse rows, the learnable sink's rows, and the barriers. Mirrors the scratch list of
        `pallas_mosaic_gpu_sm90.forward_spec` (a test compares the two on compiled kernels)."""
        size, rows, W = jnp.dtype(spec.dtype).itemsize, self.block_q, self.num_compute_wgs
        sink = spec.softmax == "learnable" and self.num_splits == 1  # splits: sink at the merge
        buffers = [rows * spec.qk_dim * size,
                   self.num_stages * self.block_kv * spec.qk_dim * size,
                   self.num_stages * self.block_kv * spec.v_dim * size,
                   0 if self.o_reuses_q(spec) else rows * spec.v_dim * size,
                   rows * 4, rows * 4 if sink else 0]
        # q_ready; k, v ready and (but with named_release) consumed per stage; the sink's
        barriers = W + (2 if self.named_release else 4) * self.num_stages + (W if sink else 0)
        return sum(cdiv(b, SMEM_ALIGNMENT) * SMEM_ALIGNMENT for b in buffers) + 8 * barriers

    def accumulator_registers(self, spec: AttentionSpec) -> int:
        """Registers per compute thread that the live tiles take: the S and O accumulators in
        float32, plus (intra_wg_overlap) the previous step's P in 16 bits, whose P·V is in
        flight during the softmax. A lower bound: the softmax needs some more."""
        p = self.block_kv // 2 if self.intra_wg_overlap else 0
        return self.rows_per_wg * (self.block_kv + spec.v_dim + p) // WARPGROUP

    def validate_for(self, spec: AttentionSpec) -> "BlockSizes":
        """self, checked against a call: ValueError for a tile that cannot work with its dtype
        and head dims, NotImplementedError for head dims no tile can take."""
        if spec.v_dim > 256 or spec.v_dim % 8:
            raise NotImplementedError(f"v_dim={spec.v_dim}: the O accumulator is WGMMA's N, a "
                                      "multiple of 8 of at most 256")
        size = jnp.dtype(spec.dtype).itemsize
        step = SWIZZLE_BYTES // size
        if self.block_kv % step:
            raise ValueError(f"BlockSizes.block_kv={self.block_kv} must be a multiple of {step} "
                             f"for {spec.dtype} (the K extent of P·V under the 128-byte swizzle)")
        if (acc := self.accumulator_registers(spec)) > self.compute_registers:
            p = " + block_kv / 2 (P in flight, intra_wg_overlap)" if self.intra_wg_overlap else ""
            raise ValueError(
                f"BlockSizes: the S and O accumulators need {acc} registers per thread (rows_per_wg="
                f"{self.rows_per_wg} * (block_kv={self.block_kv} + v_dim={spec.v_dim}{p}) / 128), "
                f"more than compute_registers={self.compute_registers}")
        if (smem := self.smem_bytes(spec)) > SMEM_BYTES:
            raise ValueError(
                f"BlockSizes(block_q={self.block_q}, block_kv={self.block_kv}, num_stages="
                f"{self.num_stages}, reuse_q_for_o={self.reuse_q_for_o}) needs {smem} bytes of "
                f"shared memory for qk_dim={spec.qk_dim}, v_dim={spec.v_dim}, {spec.dtype}, "
                f"softmax={spec.softmax!r}; at most {SMEM_BYTES} (227 KB)")
        return self


def swizzle_for(minor_bytes: int) -> int:
    """The widest swizzle (bytes) that divides a shared-memory tile's minor dim in bytes:
    128 for head dims that are multiples of 64 (bf16), 64 for e.g. 96, 32 for e.g. 80;
    NotImplementedError below 32 bytes."""
    for swizzle in SWIZZLES:
        if minor_bytes % swizzle == 0:
            return swizzle
    raise NotImplementedError(f"a shared-memory tile row of {minor_bytes} bytes: the kernels need "
                              f"a multiple of {SWIZZLES[-1]} bytes (WGMMA's swizzled layouts)")


# Rows of the tiling `smem_tile` gives every TMA-copied tile; Mosaic GPU (0.11.2) applies it to
# the whole global array, whose sequence axis must then be a multiple of it (a shorter axis
# gets a shorter tile than the shared-memory one, so it is padded too).
TMA_TILE_ROWS = 8


def in_place(length: int, tma_tails: bool) -> bool:
    """Whether a kernel reads (and writes) a sequence of `length` rows in place, TMA filling a
    tail tile's rows past the end with zeros and dropping stores past it (`tma_tails`), rather
    than from a copy padded to the tiles: only where Mosaic GPU's TMA tiling allows it. Only
    for arrays staged in `smem_tile` buffers (tiled TMA clips per dimension): the lse, delta,
    hash and table rows go through untiled shared memory, whose copies Mosaic clamps only to
    the end of the whole array (rows past T would land in the next head's), so they stay padded."""
    return tma_tails and length % TMA_TILE_ROWS == 0


def smem_tile(shape, dtype):
    """plgpu.SMEM of `shape` with the tiling and swizzle WGMMA wants for its minor dim
    (`swizzle_for`); the forward, backward and window kernels allocate their tiles with it."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    size = jnp.dtype(dtype).itemsize
    swizzle = swizzle_for(shape[-1] * size)
    transforms = (plgpu.TilingTransform((8, swizzle // size)), plgpu.SwizzleTransform(swizzle))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


# -- the window kernel's tiles --------------------------------------------------------------

WINDOW_ROWS = WGMMA_M  # query positions per block of the window kernel: one WGMMA M
WINDOW_MAX_BAND = 256  # keys in its S = Q Kᵀ: WGMMA's largest N
WINDOW_OVERLAP_REGISTERS = 216  # overlap_heads' accumulators a thread may hold (an estimate)


@dataclasses.dataclass(frozen=True)
class WindowBlockSizes:
    """The window kernel's configuration: block_kv keys per band tile (a multiple of 64 for
    16-bit inputs), num_compute_wgs warpgroups sharing the group's heads (1 or 2; G must be a
    multiple). pingpong: the warpgroups take turns issuing their GEMMs (FA3's warp scheduler
    barrier, as `BlockSizes.pingpong`), so one warpgroup's softmax runs under the other's
    GEMMs; needs 2 warpgroups. q_buffers: each warpgroup's ring of Q tiles (its O staged in
    the same slot; 2: double buffering). q_ahead: how many heads ahead a warpgroup loads Q,
    1 .. q_buffers - 1 (`ahead`; None, to which q_buffers - 1 is normalised: q_buffers - 1, so
    the default follows q_buffers under `dataclasses.replace`). Loading into the slot the last
    head's O has just left waits for that O's store to read it; q_ahead = q_buffers - 2 loads
    into the slot of the head before it, whose store has had a head's time to finish.
    tma_tails: as `BlockSizes.tma_tails` (Q, K, V read and O written in place where the length
    is a multiple of 8; on by default). overlap_heads: on a GPU each warpgroup issues head t's
    P·V and head t + 1's S = Q Kᵀ back to back, waits for P·V only, and normalises and stores
    O_t while S_{t+1} runs (FA3's intra-warpgroup overlap, across heads: the band's softmax is
    exact, so a head has one S); the interpreter runs the two GEMMs in turn. Not with
    pingpong (its turns are per GEMM), nor where S, O and P together exceed
    WINDOW_OVERLAP_REGISTERS a thread (`overlap_registers`: 208 at a band of 192 keys and
    v_dim 128). With 2 Q slots the next-but-one head's load waits for O_t's store: pair it
    with q_ahead <= q_buffers - 2. persistent: one CTA an SM, each taking a run of consecutive
    (batch, kv head, query block) items (`window_items`); K and V are a ring of the band's tiles
    (slot s holds the tile that is s modulo the band's count), so the next block of the same kv
    head loads only the tiles entering its band, once every warpgroup is past its last read of
    the leaving one (K after the item's last S, V after its last P·V: under the last head's
    softmax and P·V), and the Q ring runs on across items (the next item's first heads load
    under this one's last), so no CTA start or store drain sits between blocks; not with
    overlap_heads. reload_band (persistent only): every item loads its whole band into the
    slots in order, K once every warpgroup's last S of the item before is done, V after its
    last P·V (no rotated columns, no per-slot loads; the band's traffic from L2 as without
    persistent). Off by default until a GPU has timed them."""

    block_kv: int = 64
    num_compute_wgs: int = 2
    pingpong: bool = False
    q_buffers: int = 2
    q_ahead: int | None = None
    tma_tails: bool = True
    overlap_heads: bool = False
    persistent: bool = False
    reload_band: bool = False

    def __post_init__(self):
        if self.block_kv not in (64, 128):
            raise ValueError(f"WindowBlockSizes.block_kv={self.block_kv!r} must be 64 or 128")
        if self.num_compute_wgs not in (1, 2):
            raise ValueError(f"WindowBlockSizes.num_compute_wgs={self.num_compute_wgs!r} must be 1 or 2")
        for name in ("pingpong", "tma_tails", "overlap_heads", "persistent", "reload_band"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"WindowBlockSizes.{name} must be a bool, got {getattr(self, name)!r}")
        if self.pingpong and self.num_compute_wgs < 2:
            raise ValueError(f"WindowBlockSizes.pingpong=True needs num_compute_wgs=2, got "
                             f"{self.num_compute_wgs}")
        if self.pingpong and self.overlap_heads:
            raise ValueError("WindowBlockSizes.overlap_heads=True needs pingpong=False (the "
                             "ping-pong's turns are per GEMM)")
        if self.persistent and self.overlap_heads:
            raise ValueError("WindowBlockSizes.persistent=True needs overlap_heads=False (its "
                             "heads pair up within one block)")
        if self.reload_band and not self.persistent:
            raise ValueError("WindowBlockSizes.reload_band=True needs persistent=True")
        if self.q_buffers not in (2, 3, 4):
            raise ValueError(f"WindowBlockSizes.q_buffers={self.q_buffers!r} must be 2, 3 or 4")
        if self.q_ahead is not None and (not isinstance(self.q_ahead, int)
                                         or not 1 <= self.q_ahead < self.q_buffers):
            raise ValueError(f"WindowBlockSizes.q_ahead={self.q_ahead!r} must be None or in 1 .. "
                             f"q_buffers - 1 = {self.q_buffers - 1}")
        if self.q_ahead == self.q_buffers - 1:  # one spelling of the default: equal configs compare equal
            object.__setattr__(self, "q_ahead", None)

    @property
    def band_ring(self) -> bool:
        """Whether the band is a ring of its tiles (persistent without reload_band)."""
        return self.persistent and not self.reload_band

    @property
    def ahead(self) -> int:
        """How many heads ahead a warpgroup loads Q (q_ahead, or its default q_buffers - 1)."""
        return self.q_buffers - 1 if self.q_ahead is None else self.q_ahead

    def band_tiles(self, spec: AttentionSpec) -> int:
        """Key tiles in every block's band: the most any 64-position block meets, at most the
        padded key length's tiles."""
        nq, nk = -(-spec.q_len // WINDOW_ROWS), -(-spec.kv_len // self.block_kv)
        r = band_kv_range(np.arange(nq), q_len=spec.q_len, kv_len=spec.kv_len, window=spec.window,
                          diagonal_offset=spec.diagonal_offset, block_q=WINDOW_ROWS, block_kv=self.block_kv)
        return int(min(max(int(r.count.max(initial=1)), 1), nk))

    def validate_for(self, spec: AttentionSpec) -> "WindowBlockSizes":
        """self, checked against a call: NotImplementedError with the reason it does not fit."""
        if (why := window_reason(spec, self)) is not None:
            raise NotImplementedError(f"the window kernel cannot run this call: {why}")
        return self

    def overlap_registers(self, spec: AttentionSpec) -> int:
        """Accumulator-class registers a thread holds at overlap_heads' issue point: S (64 x band
        float32), O (64 x v_dim float32) and the 16-bit P, each spread over 128 threads."""
        band = self.band_tiles(spec) * self.block_kv
        return (WINDOW_ROWS * band * 4 + WINDOW_ROWS * spec.v_dim * 4 + WINDOW_ROWS * band * 2) // (4 * WARPGROUP)

    def smem_bytes(self, spec: AttentionSpec) -> int:
        """Shared memory as Mosaic GPU counts it: the K and V band, q_buffers Q buffers (O staged
        there when Dqk == Dv, else as many O buffers) and lse rows per warpgroup, P for the
        interpreter excluded, 8 bytes per barrier."""
        size, W, band = jnp.dtype(spec.dtype).itemsize, self.num_compute_wgs, self.band_tiles(spec) * self.block_kv
        slots = W * self.q_buffers

        def aligned(n):
            return -(-n // SMEM_ALIGNMENT) * SMEM_ALIGNMENT

        o = 0 if spec.qk_dim == spec.v_dim else aligned(slots * WINDOW_ROWS * spec.v_dim * size)
        return (aligned(band * spec.qk_dim * size) + aligned(band * spec.v_dim * size)
                + aligned(slots * WINDOW_ROWS * spec.qk_dim * size) + o + aligned(slots * WINDOW_ROWS * 4)
                + 8 * (slots + 2 * (self.band_tiles(spec) if self.band_ring else 1) + 2 * self.persistent))


def window_reason(spec: AttentionSpec, bs: "WindowBlockSizes | None" = None) -> str | None:
    """Why the window kernel (pallas_mosaic_gpu_sm90_window) does not take this call with
    these tiles (None: it does)."""
    bs = bs or WindowBlockSizes()
    left, right = spec.window
    if left < 0 or right < 0:
        return f"window={spec.window}: the window kernel needs both sides bounded"
    for name, used in (("dropout", spec.has_dropout), ("segments", spec.segments is not None),
                       ("bias", spec.has_bias), ("custom positions", not spec.positions_canonical)):
        if used:
            return f"{name}: the window kernel runs band masks only"
    if (band := bs.band_tiles(spec) * bs.block_kv) > WINDOW_MAX_BAND:
        return (f"window={spec.window}: the keys of 64 queries span {band} > {WINDOW_MAX_BAND} "
                f"(block_kv={bs.block_kv})")
    if spec.group_size % bs.num_compute_wgs:
        return (f"{spec.group_size} query heads per kv head is not a multiple of "
                f"num_compute_wgs={bs.num_compute_wgs}")
    if bs.overlap_heads and (regs := bs.overlap_registers(spec)) > WINDOW_OVERLAP_REGISTERS:
        return (f"overlap_heads: S ({band} keys), O (v_dim={spec.v_dim}) and P in flight "
                f"together need {regs} registers a thread, above {WINDOW_OVERLAP_REGISTERS} "
                f"(255 less ~40 for addresses and scalars); use overlap_heads=False")
    if (smem := bs.smem_bytes(spec)) > SMEM_BYTES:
        return f"needs {smem} bytes of shared memory, at most {SMEM_BYTES}"
    return None


# -- what the kernels run ----------------------------------------------------------------------

KERNEL_DTYPES = ("bfloat16", "float16")


def check_spec(spec: AttentionSpec, kernel: str, max_dim: int | None = None) -> None:
    """The checks every Mosaic GPU attention kernel makes of a call: NotImplementedError for
    what none of them runs (other dtypes, head dims that are not a multiple of 32 bytes, the
    narrowest swizzle and WGMMA's K step, or above max_dim), ValueError for values out of
    range. `kernel` names the caller."""
    if not 0.0 <= spec.dropout_rate < 1.0:
        raise ValueError(f"dropout_rate={spec.dropout_rate!r} must be in [0, 1)")
    if spec.softmax not in SOFTMAX_TYPES:
        raise ValueError(f"softmax={spec.softmax!r} must be one of {SOFTMAX_TYPES}")
    if spec.logits_soft_cap is not None and not spec.logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap={spec.logits_soft_cap!r} must be positive or None")
    if spec.dtype not in KERNEL_DTYPES:
        raise NotImplementedError(f"pallas_mosaic_gpu_sm90 {kernel}: dtype={spec.dtype}: the "
                                  f"kernels take {KERNEL_DTYPES}")
    step = SWIZZLES[-1] // jnp.dtype(spec.dtype).itemsize
    for name, dim in (("qk_dim", spec.qk_dim), ("v_dim", spec.v_dim)):
        if dim % step or (max_dim is not None and dim > max_dim):
            bound = "" if max_dim is None else f" of at most {max_dim}"
            raise NotImplementedError(f"pallas_mosaic_gpu_sm90 {kernel}: {name}={dim}: must be a "
                                      f"multiple of {step}{bound} for {spec.dtype} (32-byte "
                                      "rows: the narrowest swizzle and WGMMA's K step)")
