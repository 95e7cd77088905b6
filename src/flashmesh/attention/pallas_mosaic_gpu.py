"""The `pallas_mosaic_gpu` implementation: flashmesh's own Hopper kernels in Pallas Mosaic GPU.

Shape legend: B batch, T query length, S key length, N query heads, K key/value heads,
Dqk / Dv head dims.

Forward: `pallas_mosaic_gpu_sm90.forward_spec` (warp-specialised, TMA producer, exp2 online
softmax, tile skipping from the band's tile ranges), or for narrow windows (a band of at most
256 keys per 64 queries) `pallas_mosaic_gpu_sm90_window.forward_spec` (the band kept in shared
memory for the group's query heads), as `pallas_mosaic_gpu_table.default_for` configures. Backward: `pallas_mosaic_gpu_sm90_bwd.backward_spec` (a dK/dV kernel over the
band's query tiles and the group's query heads, and a dQ kernel), under one custom VJP here;
an lse cotangent enters as delta - d_lse. Under a mesh over several devices each kernel call
runs on its device's batch rows and heads (`pallas_mosaic_gpu_partition`), as cuDNN's does.

Runs: band masks (causal, (left, right) windows, both diagonal alignments), any scale, GQA and
MQA, Dqk != Dv, any T and S, logits soft cap, off-by-one and learnable sinks, dropout (the
elements masks.dropout_keep drops, global query and head numbers included), bf16 / f16 on a
compute-capability 9.0 GPU (H100 / H200), packed segments, padding and explicit positions
(per-token tables and per-batch tile ranges from the block map, `pallas_mosaic_gpu_tokens`;
padding tokens are zeroed first, so whatever they hold never reaches an output), a post-scale
bias [B|1, N|1, T, S] read in q's dtype with its gradient (dS per visited tile from the dQ
kernel, summed over broadcast dims), head dims that are multiples of 16 (the shared-memory
tiles take the widest swizzle their rows allow: 128 bytes for multiples of 64, 64 for 96, 32
for 80). Not yet (the reason is returned): dropout with global key numbers (kv_index, a
context-parallel step's key shard; `AttentionSpec.context_step`).

Dropout: `sm90.dropout_row_hash` turns the seed (and q_index, head_index) into per-row
hashes, uint32 [B, N, T], outside the custom VJP. The forward and both backward kernels read
them, so the seed never reaches the kernels and is not differentiated.

In the automatic order on a GPU, first for dropout (cuDNN cannot draw flashmesh's mask), windows
narrow enough for the window kernel (faster than cuDNN), head dim 64 self-attention with the
fused backward, packed documents in self-attention, and any call cuDNN cannot run; cuDNN keeps
the rest, and context-parallel steps and q of 2^30 elements or more wait for a GPU check
(`automatic_reason`).
Measured on the H200 with every peer in one run (`flashmesh bench --preset anchors`,
benchmarks/results/2026-12-05-nvidia-h200-anchors, bf16, back to back, fwd / fwd+bwd over the
best of cuDNN, FA3 and tokamax): sliding window seed000_gqa_swa 0.77x / 0.63x; MLA 128/64 1.00x /
0.90x; full_4k_h16_d128 1.01x / 1.25x; causal_8k_h32_d128 1.05x / 1.21x; causal_8k_h32_d64 0.95x /
0.94x; gqa_causal_16k 1.13x / 1.22x. The d128 backward is the slower half.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from flashmesh.attention import pallas_mosaic_gpu_partition as partition
from flashmesh.attention.spec import AttentionInputs, AttentionSpec

MAX_HEAD_DIM = 256  # WGMMA N of the O and dK / dV accumulators (d256 takes the split dK/dV passes)


def _device_reason() -> str | None:
    devices = jax.devices()
    if devices[0].platform != "gpu":
        return f"needs an NVIDIA GPU (the default device is {devices[0].platform})"
    cc = getattr(devices[0], "compute_capability", None)
    if cc != "9.0":
        return (f"written for Hopper (compute capability 9.0, WGMMA and TMA); this GPU is "
                f"{devices[0].device_kind} (compute capability {cc})")
    return None


def static_reason(spec: AttentionSpec) -> str | None:
    """Why the kernels cannot run this call whatever the device, or None."""
    from flashmesh.attention.pallas_mosaic_gpu_common import KERNEL_DTYPES

    if spec.context_step and spec.has_dropout:
        return ("dropout with global key numbers (kv_index, a context-parallel step's key shard) "
                "is not implemented: the kernels number keys 0..S-1 from their tile offsets")
    if spec.dtype not in KERNEL_DTYPES:
        return f"dtype {spec.dtype}: the kernels take {' or '.join(KERNEL_DTYPES)} (WGMMA operands)"
    for name, dim in (("Dqk", spec.qk_dim), ("Dv", spec.v_dim)):
        if dim % 16 or dim > MAX_HEAD_DIM:
            return (f"{name}={dim}: the kernels take multiples of 16 up to {MAX_HEAD_DIM} (32-byte "
                    "rows, WGMMA's K step; larger dims exceed the backward's register budget)")
    from flashmesh.attention import pallas_mosaic_gpu_sm90_bwd as bwd

    try:  # every call gets a backward config (a custom VJP cannot know it won't be differentiated)
        bwd.default_for(spec)
    except (NotImplementedError, ValueError) as e:
        return f"the backward kernels have no config for this call: {e}"
    return None


def automatic_reason(spec: AttentionSpec, platform: str, device_kind: str | None = None) -> str | None:
    """Why the automatic choice passes over this call (to cuDNN where it runs it), or None.

    Taken: dropout (cuDNN cannot draw flashmesh's mask), windows narrow enough for the window
    kernel (measured faster than cuDNN), head dim 64 full or causal self-attention (T == S, no
    segments, no wider window) where the backward is the fused kernel (the table's causal
    entry, and full attention up to 128: measured faster than cuDNN on the three d64 anchors,
    fwd and fwd+bwd, benchmarks/results/2026-12-02-nvidia-h200-anchors-2), packed documents in self-attention
    (16 causal documents of 4096 tokens in one 64k row, GQA 32:8, d128: 0.96x cuDNN's time fwd
    and 0.89x fwd+bwd, with 3.3 GiB where cuDNN's fwd+bwd took 36.5,
    benchmarks/results/2026-12-02-nvidia-h200-anchors-3; one shape measured: the rule takes
    every packed self-attention call, resting on that memory gap as much as on the time), and
    whatever cuDNN refuses. Passed over: calls of the kinds cuDNN measured faster or about as
    fast on (d128 full, causal, wider windows, MLA where its version runs it), and what has not
    been checked on a GPU yet: context-parallel steps, programs under a mesh over several
    devices (the split over batch and heads), and q of 2^30 elements or more (only the forward was checked there). device_kind: jax's, for the
    tiles (default: this machine's)."""
    from flashmesh.attention import cudnn
    from flashmesh.attention import pallas_mosaic_gpu_common as common

    if spec.context_step:
        return ("not yet checked on a GPU inside a context-parallel step (shard_map); name it "
                "(implementation='pallas_mosaic_gpu') to run it there")
    if partition.multi_device() is not None:
        return ("a mesh over several devices: the kernels split over batch and heads "
                "(pallas_mosaic_gpu_partition), which has not yet run on GPUs; name it "
                "(implementation='pallas_mosaic_gpu') to run it there")
    if spec.q_elements >= cudnn.MAX_Q_ELEMENTS:
        return ("q of 2^30 elements or more: only the forward has been checked on the H200 at "
                "this size, not yet the backward (cuDNN's dq was wrong there)")
    fwd, bwd = config(spec, device_kind)
    if spec.has_dropout or isinstance(fwd, common.WindowBlockSizes):
        return None
    if (bwd.fused_dq and spec.qk_dim == spec.v_dim == 64 and spec.q_len == spec.kv_len
            and spec.segments is None and spec.window in ((-1, -1), (-1, 0))):
        return None  # d64 full or causal self-attention with the fused backward: the d64 anchors
    if spec.segments == "packed" and spec.q_len == spec.kv_len:
        return None  # packed documents: faster than cuDNN's with offsets, a ninth of its memory
    if cudnn.unsupported_reason(spec, platform, automatic=True) is not None:
        return None
    return ("cuDNN runs this call and measured faster or about as fast on calls of its kind "
            "(these kernels' fwd+bwd back to back: 1.18x cuDNN's time on full_4k_h16_d128, 1.09x "
            "on causal_8k_h32_d128, benchmarks/results/2026-12-02-nvidia-h200-anchors-2)")


def unsupported_reason(spec: AttentionSpec, platform: str, *, automatic: bool = False) -> str | None:
    if platform != "gpu":
        return f"needs an NVIDIA Hopper GPU (platform is {platform!r})"
    reason = static_reason(spec) or _device_reason()
    if reason is None:
        try:  # the tiles this device's table (or the heuristic) gives the call
            config(spec)
        except (NotImplementedError, ValueError) as e:
            reason = f"no tile configuration fits this call: {e}"
    if reason is None and automatic:
        reason = automatic_reason(spec, platform)
    return reason


def config(spec: AttentionSpec, device_kind: str | None = None):
    """(forward BlockSizes, backward BackwardBlockSizes) a call gets on a device (jax's
    device_kind, default: this machine's); shown by `explain` through `describe`.
    With dropout the forward drops stages while its row hashes do not fit in shared memory."""
    from flashmesh.attention import pallas_mosaic_gpu_common as common
    from flashmesh.attention import pallas_mosaic_gpu_sm90 as sm90
    from flashmesh.attention import pallas_mosaic_gpu_sm90_bwd as bwd
    from flashmesh.attention import pallas_mosaic_gpu_table as config_table

    fwd = config_table.default_for(spec, device_kind or jax.devices()[0].device_kind)
    while (isinstance(fwd, common.BlockSizes) and fwd.num_stages > 1
           and sm90.smem_bytes(spec, fwd) > common.SMEM_BYTES):
        fwd = dataclasses.replace(fwd, num_stages=fwd.num_stages - 1)
    return fwd, bwd.default_for(spec)


def describe(spec: AttentionSpec, device_kind: str | None = None) -> str:
    """The tiles a call gets and where they come from (the tuned table or the heuristic)."""
    from flashmesh.attention import pallas_mosaic_gpu_common as common
    from flashmesh.attention import pallas_mosaic_gpu_table as config_table

    kind = device_kind or jax.devices()[0].device_kind
    fwd, back = config(spec, kind)
    entry = config_table.matching_entry(spec, kind)
    source = ("the heuristic (no table entry)" if entry is None else
              f"table entry {entry.get('anchor', entry['key'])} ({'tuned' if entry.get('tuned') else 'untuned'})")
    if isinstance(fwd, common.WindowBlockSizes):
        forward = (f"forward: the window kernel, a band of {fwd.band_tiles(spec)}x{fwd.block_kv} keys "
                   f"per 64 queries shared by {fwd.num_compute_wgs} warpgroups over the group's "
                   f"{spec.group_size} heads{' in ping-pong' if fwd.pingpong else ''}, "
                   f"{fwd.q_buffers} Q buffers each, loads {fwd.ahead} head(s) ahead")
        if fwd.persistent:
            forward += (", persistent (one CTA per SM over runs of neighbouring blocks, the band "
                        + ("reloaded per block)" if fwd.reload_band else "a ring of its tiles)"))
        if fwd.overlap_heads:
            forward += ", each head's P·V beside the next head's S"
    else:
        forward = (f"forward tiles {fwd.block_q}x{fwd.block_kv}, {fwd.num_stages} stages, "
                   f"{fwd.num_compute_wgs} compute warpgroups")
        if fwd.num_splits > 1:
            forward += f", keys split {fwd.num_splits} ways (flash-decoding)"
    compile_s = None if entry is None else entry.get("compile_s")
    compiled = ("forward compile time not measured (no tuned entry)" if compile_s is None else
                f"forward compiled in {compile_s:.2f} s when tuned")
    passes = " in two passes (dK, then dV)" if back.split_dkv else ""
    if back.fused_dq:
        backward = (f"backward one fused kernel {back.block_q}x{back.block_kv} (dK/dV, and dQ by TMA "
                    f"reduce-add{', staggered' if back.stagger_q else ''}"
                    f"{', split by columns' if back.dq_columns else ''}; not bit-reproducible)"
                    f"{', GEMMs overlapping the arithmetic' if back.overlap else ''}")
    else:
        backward = (f"backward dK/dV {back.block_q}x{back.block_kv}{passes}, dQ "
                    f"{back.block_q_dq}x{back.block_kv_dq}"
                    f"{' persistent' if back.persistent_dq else ''}"
                    f"{' (computing delta)' if back.delta_in_dq else ''}"
                    f"{', GEMMs overlapping the arithmetic' if back.overlap else ''}")
    if back.wg_ranges:
        backward += ", each warpgroup over its own band tiles"
    from flashmesh.attention import pallas_mosaic_gpu_sm90_bwd_tiles as bwd_tiles

    measured = bwd_tiles.measured_entry(spec)
    if measured is not None and bwd_tiles.BackwardBlockSizes(**measured["config"]) == back:
        origin = f"backward table entry {measured.get('anchor', measured['key'])}"
    elif measured is not None:
        origin = (f"backward rule (the table entry {measured.get('anchor', measured['key'])} does not "
                  f"fit this call{' under reproducible=True' if spec.reproducible else ''})")
    else:
        origin = "backward rule (no table entry)"
    return f"{forward} from {source}; {backward}, {back.num_stages} stages, from the {origin}; {compiled}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kernel(setup, q, k, v, sink, bias, dropout_hash, tables):
    """setup: (spec, forward BlockSizes or WindowBlockSizes, BackwardBlockSizes, interpret),
    static; dropout_hash and tables (segments) are integers, never differentiated."""
    spec, fwd_blocks, _, interpret = setup

    def call(local, q, k, v, sink, bias, dropout_hash, *tables):
        return forward(q, k, v, local, fwd_blocks, sink=sink, dropout_hash=dropout_hash,
                       tables=_tables(tables), bias=bias, interpret=interpret)

    return partition.run(call, spec, (q, k, v, sink, bias, dropout_hash, *_table_list(tables)),
                         ("q", "kv", "kv", "heads", "bias", "rows") + ("tokens",) * 4, ("q", "rows"),
                         split=not interpret)


def _table_list(tables) -> tuple:
    """The four token tables of a call as operands (None each without tables)."""
    return (None,) * 4 if tables is None else tuple(tables)


def _tables(arrays):
    from flashmesh.attention import pallas_mosaic_gpu_tokens as tokens

    return None if arrays[0] is None else tokens.TokenTables(*arrays)


def forward(q, k, v, spec: AttentionSpec, blocks, *, sink=None, dropout_hash=None, tables=None,
            bias=None, interpret: bool = False):
    """(out, lse) of the forward kernel a configuration names: the window kernel for a
    WindowBlockSizes, the general one (sm90.forward_spec) for a BlockSizes."""
    from flashmesh.attention import pallas_mosaic_gpu_common as common
    from flashmesh.attention import pallas_mosaic_gpu_sm90 as sm90
    from flashmesh.attention import pallas_mosaic_gpu_sm90_window as window

    if isinstance(blocks, common.WindowBlockSizes):
        if dropout_hash is not None or tables is not None or bias is not None:
            raise ValueError("the window kernel takes no dropout, segments or bias")
        return window.forward_spec(q, k, v, spec, sink=sink, block_sizes=blocks, interpret=interpret)
    return sm90.forward_spec(q, k, v, spec, sink=sink, dropout_hash=dropout_hash, tables=tables,
                             bias=bias, block_sizes=blocks, interpret=interpret)


def _kernel_fwd(setup, q, k, v, sink, bias, dropout_hash, tables):
    q, k, v, sink, bias, dropout_hash, tables = custom_vjp_primal_tree_values(
        (q, k, v, sink, bias, dropout_hash, tables))
    out, lse = _kernel(setup, q, k, v, sink, bias, dropout_hash, tables)
    return (out, lse), (q, k, v, sink, bias, dropout_hash, tables, out, lse)


SECOND_ORDER = ("pallas_mosaic_gpu gives first derivatives only (its backward is kernels, which "
                "have no derivative); name implementation='chunked' or 'reference' for grad of grad")


def _first_order_only(fn):
    """fn(*args) as a custom VJP whose own derivative raises NotImplementedError(SECOND_ORDER),
    instead of JAX's error about differentiating a kernel call."""
    @jax.custom_vjp
    def once(*args):
        return fn(*args)

    def never(_, cotangents):
        raise NotImplementedError(SECOND_ORDER)

    once.defvjp(lambda *args: (fn(*args), None), never)
    return once


def _kernel_bwd(setup, res, cts):
    from flashmesh.attention import pallas_mosaic_gpu_sm90_bwd as bwd

    spec, _, bwd_blocks, interpret = setup
    q, k, v, sink, bias, dropout_hash, tables, out, lse = res
    d_out, d_lse = cts
    if isinstance(d_out, SymbolicZero) and isinstance(d_lse, SymbolicZero):
        return None, None, None, None, None, None, None
    d_out = jnp.zeros_like(out) if isinstance(d_out, SymbolicZero) else d_out
    d_lse = None if isinstance(d_lse, SymbolicZero) else d_lse

    def call(local, q, k, v, out, lse, d_out, sink, d_lse, dropout_hash, bias, *tables):
        grads = bwd.backward_spec(q, k, v, out, lse, d_out, local, sink=sink, d_lse=d_lse,
                                  dropout_hash=dropout_hash, tables=_tables(tables), bias=bias,
                                  block_sizes=bwd_blocks, interpret=interpret)
        return tuple(g for g in grads if g is not None)

    def kernels(q, k, v, out, lse, d_out, sink, d_lse, dropout_hash, tables, bias):
        out_roles = ("q", "kv", "kv") + (("heads",) if sink is not None else ()) + (
            ("bias",) if bias is not None else ())
        grads = iter(partition.run(
            call, spec, (q, k, v, out, lse, d_out, sink, d_lse, dropout_hash, bias, *_table_list(tables)),
            ("q", "kv", "kv", "q", "rows", "q", "heads", "rows", "rows", "bias") + ("tokens",) * 4,
            out_roles, split=not interpret))
        dq, dk, dv = next(grads), next(grads), next(grads)
        return (dq, dk, dv, next(grads) if sink is not None else None,
                next(grads) if bias is not None else None)

    dq, dk, dv, dsink, dbias = _first_order_only(kernels)(
        q, k, v, out, lse, d_out.astype(q.dtype), sink, d_lse, dropout_hash, tables, bias)
    dsink = None if dsink is None else dsink.astype(sink.dtype)
    return dq, dk, dv, dsink, dbias, None, None  # row hashes and tables: integers, no cotangent


_kernel.defvjp(_kernel_fwd, _kernel_bwd, symbolic_zeros=True)


def attention(inputs: AttentionInputs, spec: AttentionSpec) -> tuple[jax.Array, jax.Array]:
    """Returns (out [B, T, N, Dv] in q's dtype, lse [B, N, T] float32); NotImplementedError with
    the reason for a call the kernels cannot run."""
    reason = static_reason(spec)
    if reason is not None:
        raise NotImplementedError(f"pallas_mosaic_gpu cannot run this call: {reason}")
    return attention_with(inputs, spec, *config(spec))


def attention_with(inputs: AttentionInputs, spec: AttentionSpec, fwd_blocks, bwd_blocks, *,
                   interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """`attention` with the tiles given (BlockSizes, BackwardBlockSizes) and optionally in
    Mosaic GPU's interpreter (CPU tests of the custom VJP); no static_reason check."""
    from flashmesh.attention import masks
    from flashmesh.attention import pallas_mosaic_gpu_sm90 as sm90
    from flashmesh.attention import pallas_mosaic_gpu_tokens as tokens

    inputs = masks.without_padding(inputs)  # padding may hold anything (NaN): never read
    sink = inputs.sink if spec.softmax == "learnable" else None
    dropout_hash = sm90.inputs_dropout_hash(inputs, spec)  # NotImplementedError for kv_index
    return _kernel((spec, fwd_blocks, bwd_blocks, interpret), inputs.q, inputs.k, inputs.v, sink,
                   inputs.bias, dropout_hash, tokens.from_inputs(spec, inputs))
