"""Hopper (sm90) forward attention kernel in Pallas Mosaic GPU: the first version.

Shape legend: B batch, T query length, S key length, N query heads, K key/value heads
(query head n reads key/value head n // (N // K)), Dqk / Dv head dims; block_q query rows per
CTA, split into num_compute_wgs warpgroups of rows_per_wg = block_q // num_compute_wgs rows.

Structure (FA3 / tokamax sm90, research/kernels.md §2.1, §2.5): a grid over (query tile, query
head, batch); per CTA `num_compute_wgs` compute warpgroups and one memory warpgroup. The memory
warpgroup streams K and V tiles by TMA into a ring of `num_stages` SMEM buffers (separate
"ready" barriers for K and V, so P·V waits only for V; "consumed" barriers release a slot once
every compute warpgroup is done with it). Each compute warpgroup loads its Q rows once, then per
key tile runs S = Q Kᵀ (WGMMA), an exp2 online softmax in float32 and O += P V (WGMMA).

Tile skipping: the key tiles of a query tile come from `band_kv_range` (the closed form of
`kv_ranges`) evaluated on the traced tile index: tiles outside [lo, hi) are never loaded or
computed, tiles inside [full_lo, full_hi) run without mask arithmetic, the rest are masked
element-wise. A query tile that sees no key writes exactly 0 and lse = EMPTY_ROW_LSE.

Tails (T or S not a multiple of block_q / block_kv): the wrapper zero-pads q, k, v to the
block multiples (`jnp.pad`), the kernel masks keys past S in the last key tile (never FULL in
`band_kv_range`) and out / lse are sliced back to T. Padded query rows (q = 0, finite logits,
no NaN) are computed and dropped; TMA stores do not mask out-of-bounds rows (research/
kernels.md §3.2 item 6), so the outputs need the padding in any case.

Soft cap and sinks: with `logits_soft_cap` the logits are cap * tanh(scale * q.k / cap)
(after the scale, before the mask, as reference.py). A sink (softmax "off_by_one": z = 0,
"learnable": z = sink[n], float32 [N]) is one more logit without a value: the online softmax
starts from m = z, l = 1 instead of m = -inf, l = 0, so lse = log(sum_j exp(s_ij) + exp(z)),
and a row that sees no key gets output 0 and lse = z (never EMPTY_ROW_LSE). The learnable
sink reaches the kernel as [N, rows_per_wg] float32 (sink * log2 e, broadcast in the wrapper)
and each compute warpgroup copies its head's row into SMEM by TMA.

Implemented: causal and (left, right) windows in both alignments (top-left, bottom-right),
any scale, GQA/MQA, Dqk != Dv, bf16/f16 inputs with float32 accumulation, lse [B, N, T] in
the natural-log convention of reference.py, sequence tails (wrapper padding), the logit soft
cap, and the off-by-one and learnable sink softmax. Not implemented (NotImplementedError):
head dims that are not multiples of 64 (the 128-byte swizzle), bias, dropout, segments, and
the backward pass. Not yet done for speed: OOB-filled TMA loads instead of padded input
copies, the ping-pong schedule barrier between the compute warpgroups, intra-warpgroup overlap
of softmax with the next S GEMM, per-warpgroup ranges, a persistent LPT grid, Q/O SMEM
aliasing and named barriers.

Interpret mode (`interpret=True`, CPU): the Mosaic GPU interpreter in jax 0.11.2 cannot take a
register operand as WGMMA's A, nor `pl.run_state` over an accumulator (it meets the discharged
`wgmma` primitive). So there P goes through an SMEM buffer and each step's P·V goes into a fresh
zero accumulator that is added to O (`_pv_from_smem`). On a GPU the kernel uses the FA3 form,
P from registers accumulated in place (`_pv_from_registers`). Everything else is shared.

Example:
    >>> q = jax.random.normal(jax.random.key(0), (1, 256, 2, 64), jnp.bfloat16)
    >>> kv = jax.random.normal(jax.random.key(1), (1, 256, 1, 64), jnp.bfloat16)
    >>> out, lse = forward(q, kv, kv, scale=0.125, window=(-1, 0), interpret=True)
    >>> out.shape, lse.shape
    ((1, 256, 2, 64), (1, 2, 256))
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from flashmesh.attention.pallas_mosaic_gpu_common import SWIZZLE_BYTES, BlockSizes, band_kv_range
from flashmesh.attention.spec import EMPTY_ROW_LSE, SOFTMAX_TYPES, AttentionInputs, AttentionSpec

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
DTYPES = ("bfloat16", "float16")


def _smem(shape, dtype):
    """SMEM tile with the 128-byte swizzle WGMMA wants (minor dim a multiple of 128 B)."""
    elems = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(SWIZZLE_BYTES))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _pv_from_registers(acc, alpha, p16, v_tile, p_smem):
    """O = alpha O + P V with P as WGMMA's register operand, accumulated in place (FA3)."""
    del p_smem
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

    def mma(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_tile)

    return pl.run_state(mma)(plgpu.ACC.init(acc))


def _pv_from_smem(acc, alpha, p16, v_tile, p_smem):
    """O = alpha O + P V with P staged in SMEM and a fresh accumulator (what interpret mode runs)."""
    p_smem[...] = p16
    plgpu.commit_smem()  # make the generic-proxy stores visible to WGMMA's async proxy

    def mma(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v_tile)
        return acc_ref[...]

    pv = pl.run_scoped(mma, plgpu.ACC(acc.shape, jnp.float32))
    return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv


def _kernel(q_ref, k_ref, v_ref, sink_ref, out_ref, lse_ref, smem, barriers, *,
            spec: AttentionSpec, bs: BlockSizes, interpret: bool):
    # q_ref [B, Tp, N, Dqk], k_ref [B, Sp, K, Dqk], v_ref [B, Sp, K, Dv] (GMEM, padded to the
    # block multiples Tp, Sp); sink_ref [N, rows] f32 (the sink logit times log2 e) or None
    # out_ref [B, Tp, N, Dv], lse_ref [B, N, Tp] float32 (GMEM)
    # q_smem [W, rows, Dqk], k_smem [stages, block_kv, Dqk], v_smem [stages, block_kv, Dv],
    # o_smem [W, rows, Dv], lse_smem [W, rows] f32, p_smem [W, rows, block_kv] or None,
    # sink_smem [W, rows] f32 or None
    q_smem, k_smem, v_smem, o_smem, lse_smem, p_smem, sink_smem = smem
    q_ready, k_ready, v_ready, k_consumed, v_consumed, sink_ready = barriers
    W, rows, stages, bkv = bs.num_compute_wgs, bs.rows_per_wg, bs.num_stages, bs.block_kv
    dtype = jnp.dtype(spec.dtype)
    q_tile, head, batch = lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    # One range per CTA, so both compute warpgroups consume every tile the producer loads.
    r = band_kv_range(q_tile, q_len=spec.q_len, kv_len=spec.kv_len, window=spec.window,
                      diagonal_offset=spec.diagonal_offset, block_q=bs.block_q, block_kv=bkv)
    lo, full_lo, full_hi, hi = r.lo, r.full_lo, r.full_hi, r.hi

    def slot_of(step):
        return lax.rem(step - lo, jnp.int32(stages))

    @pl.when(wg < W)
    def _compute():
        plgpu.set_max_registers(bs.compute_registers, action="increase")
        row0 = q_tile * bs.block_q + wg * rows
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(row0, rows), head], q_smem.at[wg],
                                q_ready.at[wg])
        if sink_ref is not None:
            plgpu.copy_gmem_to_smem(sink_ref.at[head], sink_smem.at[wg], sink_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])
        pv_step = _pv_from_smem if interpret else _pv_from_registers
        p_tile = None if p_smem is None else p_smem.at[wg]
        scale2 = spec.scale * LOG2E  # logits in log2 units: exp(x) = exp2(x log2 e), one FMA
        cap = spec.logits_soft_cap
        left, right = spec.window
        kv_tail = spec.kv_len % bkv != 0  # the last key tile holds padded columns past S
        has_sink = spec.softmax != "vanilla"

        def kv_step(step, carry, *, masked: bool):
            # Without a window or a key tail every tile is FULL.
            masked = masked and (spec.has_window or kv_tail)
            acc, m_i, l_i = carry
            slot = slot_of(step)
            plgpu.barrier_wait(k_ready.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((rows, bkv), jnp.float32))
            plgpu.barrier_arrive(k_consumed.at[slot])
            if cap is None:
                s = s * scale2
            else:  # cap tanh(scale s / cap) in log2 units, tanh x = 1 - 2 / (exp(2x) + 1):
                # exact at both ends, and finer than approx_math's tanh.approx (~2^-11).
                e = jnp.exp2(s * (2.0 * LOG2E * spec.scale / cap))
                s = (1.0 - 2.0 / (e + 1.0)) * (cap * LOG2E)
            if masked:  # only the boundary tiles of [lo, hi) pay for the mask
                i = plgpu.broadcasted_iota(jnp.int32, (rows, bkv), 0, layout=plgpu.Layout.WGMMA)
                j = plgpu.broadcasted_iota(jnp.int32, (rows, bkv), 1, layout=plgpu.Layout.WGMMA)
                col = j + step * bkv
                d = (i + (row0 + spec.diagonal_offset)) - col  # query pos - key pos
                visible = []
                if left >= 0:
                    visible.append(d <= left)
                if right >= 0:
                    visible.append(d >= -right)
                if kv_tail:  # padded keys past S get zero weight
                    visible.append(col < spec.kv_len)
                s = jnp.where(functools.reduce(operator.and_, visible), s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            if masked and not has_sink:  # with a sink m starts finite
                # A row with no visible key so far keeps m = -inf; shift it by 0 instead, so
                # exp2 gives exact zeros rather than NaN (-inf - -inf).
                m_new_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            else:
                m_new_safe = m_new  # an unmasked tile gives every row a finite maximum
            alpha = jnp.exp2(m_i - m_new_safe)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new_safe, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            plgpu.barrier_wait(v_ready.at[slot])
            acc = pv_step(acc, alpha, p.astype(dtype), v_smem.at[slot], p_tile)
            plgpu.barrier_arrive(v_consumed.at[slot])
            return acc, m_new, l_i

        acc = plgpu.layout_cast(jnp.zeros((rows, spec.v_dim), jnp.float32), plgpu.Layout.WGMMA)
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        if spec.softmax == "vanilla":
            m_i = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), row_layout)
            l_i = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), row_layout)
        else:
            # The sink is one more logit z (0 or sink[n]) with no value: start the online
            # softmax from it, m = z and l = exp(z - m) = 1 (log2 units).
            if sink_ref is None:  # off_by_one
                m_i = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), row_layout)
            else:
                plgpu.barrier_wait(sink_ready.at[wg])
                m_i = plgpu.load(sink_smem.at[wg], layout=row_layout)
            l_i = plgpu.layout_cast(jnp.ones((rows,), jnp.float32), row_layout)
        carry = (acc, m_i, l_i)
        masked_step = lambda s, c: kv_step(s, c, masked=True)  # noqa: E731
        full_step = lambda s, c: kv_step(s, c, masked=False)  # noqa: E731
        carry = lax.fori_loop(lo, full_lo, masked_step, carry)
        carry = lax.fori_loop(full_lo, full_hi, full_step, carry)
        acc, m_i, l_i = lax.fori_loop(full_hi, hi, masked_step, carry)

        seen = l_i > 0.0  # always true with a sink: an empty row gives 0 and lse = z
        inv = jnp.where(seen, 1.0 / jnp.where(seen, l_i, 1.0), 0.0)  # an empty row gives exactly 0
        o_smem.at[wg][...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
        log2_l = jnp.log(jnp.where(seen, l_i, 1.0)) * LOG2E
        lse_smem.at[wg][...] = jnp.where(seen, (m_i + log2_l) * LN2, EMPTY_ROW_LSE)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg], out_ref.at[batch, pl.ds(row0, rows), head])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, pl.ds(row0, rows)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == W)
    def _memory():
        plgpu.set_max_registers(bs.memory_registers, action="decrease")
        kv_head = lax.div(head, jnp.int32(spec.group_size))

        @pl.loop(lo, hi)
        def _(step):
            slot, reuse = slot_of(step), step - lo >= stages
            rows_kv = (batch, pl.ds(step * bkv, bkv), kv_head)

            @pl.when(reuse)
            def _():
                plgpu.barrier_wait(k_consumed.at[slot])

            plgpu.copy_gmem_to_smem(k_ref.at[rows_kv], k_smem.at[slot], k_ready.at[slot])

            @pl.when(reuse)
            def _():
                plgpu.barrier_wait(v_consumed.at[slot])

            plgpu.copy_gmem_to_smem(v_ref.at[rows_kv], v_smem.at[slot], v_ready.at[slot])

        # Drain: observe the release of the last (up to num_stages) slots too, so every phase
        # of the consumed barriers is waited for exactly once (the interpreter checks this at
        # deallocation; on hardware it keeps the barrier phases in step for a persistent loop).
        @pl.loop(jnp.maximum(hi - stages, lo), hi)
        def _(step):
            plgpu.barrier_wait(k_consumed.at[slot_of(step)])
            plgpu.barrier_wait(v_consumed.at[slot_of(step)])


def check(spec: AttentionSpec, bs: BlockSizes) -> None:
    """NotImplementedError for a call this kernel cannot run, ValueError for a bad tile."""
    features = {"bias": spec.has_bias, "dropout": spec.has_dropout,
                "segments": spec.segments is not None}
    if missing := [name for name, used in features.items() if used]:
        raise NotImplementedError(f"pallas_mosaic_gpu_sm90 forward: {', '.join(missing)} not "
                                  "implemented yet (first kernel: band masks only)")
    if spec.softmax not in SOFTMAX_TYPES:
        raise ValueError(f"softmax={spec.softmax!r} must be one of {SOFTMAX_TYPES}")
    if spec.logits_soft_cap is not None and not spec.logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap={spec.logits_soft_cap!r} must be positive or None")
    if spec.dtype not in DTYPES:
        raise NotImplementedError(f"dtype={spec.dtype}: the kernel takes {DTYPES}")
    step = SWIZZLE_BYTES // jnp.dtype(spec.dtype).itemsize
    for name, dim in (("qk_dim", spec.qk_dim), ("v_dim", spec.v_dim)):
        if dim % step:
            raise NotImplementedError(f"{name}={dim}: must be a multiple of {step} for "
                                      f"{spec.dtype} (128-byte swizzle; narrower swizzles not yet)")
    bs.validate_for(spec)


def spec_for(q, k, v, *, scale: float, window=(-1, -1), bottom_right: bool = False,
             logits_soft_cap: float | None = None, softmax: str = "vanilla") -> AttentionSpec:
    """The AttentionSpec of a band-mask call (ValueError for inconsistent shapes)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be 4-D [B, T|S, N|K, H], got {q.shape=}, {k.shape=}, {v.shape=}")
    B, T, N, Dqk = q.shape
    S, K, Dv = k.shape[1], k.shape[2], v.shape[3]
    if k.shape != (B, S, K, Dqk) or v.shape != (B, S, K, Dv):
        raise ValueError(f"k.shape={k.shape} and v.shape={v.shape} must be {(B, S, K, Dqk)} and "
                         f"{(B, S, K, Dv)} (from q.shape={q.shape})")
    if N % K:
        raise ValueError(f"num_heads={N} must be a multiple of num_kv_heads={K}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    cap = None if logits_soft_cap is None else float(logits_soft_cap)
    return AttentionSpec(B, T, S, N, K, Dqk, Dv, jnp.dtype(q.dtype).name, float(scale),
                         window=tuple(window), bottom_right=bottom_right, softmax=softmax,
                         logits_soft_cap=cap)


def _sink_rows(spec: AttentionSpec, sink, rows: int):
    """The learnable sink as the kernel reads it: [N, rows] f32 of sink[n] * log2 e (one row
    of a warpgroup's TMA copy per head), None for the other softmax types."""
    if spec.softmax != "learnable":
        if sink is not None:
            raise ValueError(f"sink must be None for softmax={spec.softmax!r}")
        return None
    if sink is None or sink.shape != (spec.num_heads,):
        raise ValueError(f"softmax='learnable' needs sink of shape ({spec.num_heads},), got "
                         f"{None if sink is None else sink.shape}")
    z2 = sink.astype(jnp.float32) * jnp.float32(LOG2E)
    return jnp.broadcast_to(z2[:, None], (spec.num_heads, rows))


def _pad_to(x, axis: int, multiple: int):
    extra = -x.shape[axis] % multiple
    return jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)]) if extra else x


def forward_spec(q, k, v, spec: AttentionSpec, *, sink=None,
                 block_sizes: BlockSizes | None = None, interpret: bool = False):
    """`forward` for a normalised spec (what the registry will call)."""
    bs = BlockSizes() if block_sizes is None else block_sizes
    check(spec, bs)
    sink_rows = _sink_rows(spec, sink, bs.rows_per_wg)
    # Tails: zero-pad T and S to the block multiples (padded keys are masked in the kernel),
    # then slice the outputs back to T.
    q = _pad_to(q, 1, bs.block_q)
    k, v = _pad_to(k, 1, bs.block_kv), _pad_to(v, 1, bs.block_kv)
    Tp = q.shape[1]
    W = bs.num_compute_wgs
    dtype = jnp.dtype(spec.dtype)
    smem = [
        _smem((W, bs.rows_per_wg, spec.qk_dim), dtype),
        _smem((bs.num_stages, bs.block_kv, spec.qk_dim), dtype),
        _smem((bs.num_stages, bs.block_kv, spec.v_dim), dtype),
        _smem((W, bs.rows_per_wg, spec.v_dim), dtype),
        plgpu.SMEM((W, bs.rows_per_wg), jnp.float32),
        _smem((W, bs.rows_per_wg, bs.block_kv), dtype) if interpret else None,
        plgpu.SMEM((W, bs.rows_per_wg), jnp.float32) if sink_rows is not None else None,
    ]
    barriers = [
        plgpu.Barrier(num_barriers=W),
        plgpu.Barrier(num_barriers=bs.num_stages),
        plgpu.Barrier(num_barriers=bs.num_stages),
        plgpu.Barrier(num_arrivals=W, num_barriers=bs.num_stages),
        plgpu.Barrier(num_arrivals=W, num_barriers=bs.num_stages),
        plgpu.Barrier(num_barriers=W) if sink_rows is not None else None,
    ]
    n_smem = len(smem)

    def entry(q_ref, k_ref, v_ref, *refs):
        sink_ref = refs[0] if sink_rows is not None else None
        out_ref, lse_ref = refs[-2:]

        def body(*scratch):
            it = iter(scratch)  # the None entries take no scratch
            allocated = [None if a is None else next(it) for a in smem + barriers]
            _kernel(q_ref, k_ref, v_ref, sink_ref, out_ref, lse_ref, allocated[:n_smem],
                    allocated[n_smem:], spec=spec, bs=bs, interpret=interpret)

        pl.run_scoped(body, *[a for a in smem + barriers if a is not None], collective_axes="wg")

    out_type = (jax.ShapeDtypeStruct((spec.batch, Tp, spec.num_heads, spec.v_dim), dtype),
                jax.ShapeDtypeStruct((spec.batch, spec.num_heads, Tp), jnp.float32))
    inputs = (q, k, v) if sink_rows is None else (q, k, v, sink_rows)
    out, lse = plgpu.kernel(
        entry, out_type=out_type,
        grid=(Tp // bs.block_q, spec.num_heads, spec.batch),
        grid_names=("q", "heads", "batch"),
        num_threads=W + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*inputs)
    return out[:, :spec.q_len], lse[:, :, :spec.q_len]


def forward(q: Float[Array, "B T N Dqk"], k: Float[Array, "B S K Dqk"],
            v: Float[Array, "B S K Dv"], *, scale: float, window: tuple[int, int] = (-1, -1),
            bottom_right: bool = False, logits_soft_cap: float | None = None,
            softmax: str = "vanilla", sink: Float[Array, "N"] | None = None,
            block_sizes: BlockSizes | None = None,
            interpret: bool = False) -> tuple[Float[Array, "B T N Dv"], Float[Array, "B N T"]]:
    """Band-mask attention forward: (out [B, T, N, Dv] in q's dtype, lse [B, N, T] float32).

    Args:
      q, k, v: bf16 or f16; N a multiple of K (query head n reads kv head n // (N // K)).
      scale: logit scale (the caller's 1/sqrt(Dqk) default is applied by api.py).
      window: (left, right): query at position i sees keys [i - left, i + right], -1 unbounded;
        causal is (-1, 0).
      bottom_right: query i sits at position i + S - T (the diagonal ends at the last query
        and key) instead of i.
      logits_soft_cap: s = cap * tanh(s / cap) after the scale, before the mask; None: off.
      softmax: "vanilla", "off_by_one" (an extra exp(0) in the denominator) or "learnable"
        (an extra exp(sink[n]) per query head).
      sink: float32 [N] sink logits, for softmax="learnable" only.
      block_sizes: the tile configuration, `BlockSizes()` by default (the lead's registry will
        pass `default_for`); T and S need not be multiples of block_q and block_kv (tails are
        padded in the wrapper).
      interpret: run on CPU in Mosaic GPU's interpreter (P·V through SMEM, see module doc).
    lse is log(sum_j exp(s_ij) + z) with z = 0, 1 or exp(sink[n]) (as reference.py); under
    vanilla softmax a row that sees no key gets output 0 and lse = EMPTY_ROW_LSE; with a sink
    it gets output 0 and lse = the sink logit (0 for off_by_one).
    """
    spec = spec_for(q, k, v, scale=scale, window=window, bottom_right=bottom_right,
                    logits_soft_cap=logits_soft_cap, softmax=softmax)
    return forward_spec(q, k, v, spec, sink=sink, block_sizes=block_sizes, interpret=interpret)


def attention(inputs: AttentionInputs, spec: AttentionSpec, *,
              block_sizes: BlockSizes | None = None, interpret: bool = False):
    """The backend interface (not registered yet): forward only, no custom VJP."""
    return forward_spec(inputs.q, inputs.k, inputs.v, spec, sink=inputs.sink,
                        block_sizes=block_sizes, interpret=interpret)
