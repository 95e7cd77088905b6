"""Diagnosis only (numbers are claimed from `flashmesh bench`): the Mosaic GPU forward
(`attention/pallas_mosaic_gpu_sm90.py`) against cuDNN on a few anchor shapes:
error against cuDNN and the time per call of 20 calls back to back, each block size listed.

`--fwdbwd`: also fwd+bwd of the registered implementation against cuDNN's (`--dropout`: each
also with attention dropout 0.1; `--fwdbwd-only`: not the forward's block sizes; `--dropout-hash
element|pairs8|round1`: instead of the library's last hash round (once per adjacent key pair,
16 bits per decision, since 2026-12-06), the one it replaced (once per element, 32 bits), once
per keys j, j+8, or one cheap round per element (masks different from the library's: for
timing only, see `_element_keep`, `_pair8_keep`, `_round1_keep`)). `--bwd`: the
backward kernels alone (`pallas_mosaic_gpu_sm90_bwd.backward_spec`) per BackwardBlockSizes in
BWD_CONFIGS (the two-kernel default against the fused five-GEMM kernel), each checked against
the default's gradients, and cuDNN's fwd+bwd minus its fwd for scale; `--bwd-grid`: the same
over a small grid of valid configs (`bwd_grid`); `--bwd-overlap`: BWD_OVERLAP (each config with
BackwardBlockSizes.overlap off and on), timed in 3 alternated rounds; `--bwd-wg-ranges`:
BWD_WG_RANGES (BackwardBlockSizes.wg_ranges, persistent_dq) the same way; `--bwd-delta`:
BWD_DELTA (delta_in_dq) the same way; `--bwd-fold`: BWD_FOLD (overlap, fold_stats, the fused form
by columns, dq_writer, ds_sync) the same way; `--window`: the window kernel's WINDOW_CONFIGS
(ping-pong off and on, the Q ring, persistent with the band a ring or reloaded) the same way, on the window shapes named;
`--window-parts`: the table's window config with one stage left out at a time (WINDOW_PARTS:
mask, exp2, P·V, the stores), timed the same way, then with G, G / 2 and G / 4 query heads
per group on the same grid (a line through them: the per-head and the fixed cost). Each alternated mode also lists each config's kernels.
`--fwd-alt`: FWD_ALT (persistent, intra_wg_overlap, on the table's forward config) the
same way. `--bwd-cfg=fused_dq+dq_columns+num_stages=2`: that one config alone (fields joined by `+`, a bare
name meaning True), on top of today's config, so that a profiler's launch count finds it (the
`ncu` step of device_run.sh: the forward's launch, then two calls of the backward before the 20
timed ones)."""
import dataclasses
import itertools
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import flashmesh
from flashmesh.bench import timing
from flashmesh.attention import pallas_mosaic_gpu_sm90 as sm90
from flashmesh.attention import pallas_mosaic_gpu_sm90_bwd as bwd
from flashmesh.attention import pallas_mosaic_gpu_sm90_bwd_dkv as bwd_dkv
from flashmesh.attention.pallas_mosaic_gpu_common import BlockSizes


def _per_element(row_hash, key0, shape, key_dim: int):
    """The last round's input per element (key numbers key0 + iota, no pairing), shared by the
    per-element forms below."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    from flashmesh.attention.masks import DROPOUT_KEY_MULT

    u = jnp.uint32
    base = row_hash + jnp.asarray(key0).astype(u) * u(DROPOUT_KEY_MULT)
    keys = plgpu.broadcasted_iota(jnp.int32, shape, key_dim, layout=plgpu.Layout.WGMMA)
    return lax.broadcast_in_dim(base, shape, [1 - key_dim]) + keys.astype(u) * u(DROPOUT_KEY_MULT)


def _threshold32(rate: float):
    return jnp.uint32(min(int(round(rate * 2.0**32)), 2**32 - 1))


def _element_keep(row_hash, key0, shape, key_dim: int, rate: float):
    """The library's hash before 2026-12-06: the last round once per element, 32 bits per
    decision (what the key-pair hash replaced). Not the library's mask: for timing only."""
    from flashmesh.attention import masks

    return masks.mix32(_per_element(row_hash, key0, shape, key_dim)) >= _threshold32(rate)


def _pair8_keep(row_hash, key0, shape, key_dim: int, rate: float):
    """Keys j and j+8 of each 16-key group sharing a hash: the pairs a thread holds in the
    WGMMA layout along both dims (columns c, c+8; rows r, r+8), so the backward (keys along
    rows) could share them too. key0 is a multiple of 16. Not the library's mask."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    from flashmesh.attention import masks
    from flashmesh.attention.masks import DROPOUT_KEY_MULT

    u = jnp.uint32
    base = row_hash + (jnp.asarray(key0) >> 1).astype(u) * u(DROPOUT_KEY_MULT)
    keys = plgpu.broadcasted_iota(jnp.int32, shape, key_dim, layout=plgpu.Layout.WGMMA)
    pair = ((keys >> 4) << 3) | (keys & 7)
    x = lax.broadcast_in_dim(base, shape, [1 - key_dim]) + pair.astype(u) * u(DROPOUT_KEY_MULT)
    h = masks.mix32(x)
    bits = jnp.where((keys & 8) == 8, h >> 16, h & u(0xFFFF))
    return bits >= u(masks.dropout_threshold(rate))


def _round1_keep(row_hash, key0, shape, key_dim: int, rate: float):
    """One xor-shift-multiply round per element instead of the full finaliser (the row hash is
    already mixed): a bound on what a cheaper per-element hash could buy. Not the library's mask."""
    x = _per_element(row_hash, key0, shape, key_dim)
    return (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D) >= _threshold32(rate)


_HASHES = {"element": _element_keep, "pairs8": _pair8_keep, "round1": _round1_keep}
if "--dropout-hash" in sys.argv:
    _kind = sys.argv[sys.argv.index("--dropout-hash") + 1]
    if _kind not in _HASHES:
        raise SystemExit(f"--dropout-hash: expected one of {sorted(_HASHES)}, got {_kind}")
    sm90.dropout_keep = bwd.dropout_keep = bwd_dkv.dropout_keep = _HASHES[_kind]


SHAPES = [  # name, B, T, N, K, D, window
    ("causal_8k_h32_d128", 1, 8192, 32, 32, 128, (-1, 0)),
    ("full_4k_h16_d128", 4, 4096, 16, 16, 128, (-1, -1)),
    ("seed000_gqa_swa", 2, 4096, 128, 8, 128, (128, 0)),
    ("causal_8k_h32_d64", 1, 8192, 32, 32, 64, (-1, 0)),
    ("layer_causal_2k_b4_h32_d128", 4, 2048, 32, 32, 128, (-1, 0)),  # the guide's layer (issue 9)
    ("gqa_causal_16k", 1, 16384, 64, 8, 128, (-1, 0)),
]
# BlockSizes fields per config; dict() is the default (ping-pong + intra-warpgroup overlap,
# O staged in Q's buffer, LPT order, 128 / 128 / 2 stages / 2 compute warpgroups).
FIRST = dict(pingpong=False, intra_wg_overlap=False, reuse_q_for_o=False, lpt_order=False)
COMMON = [
    dict(),
    dict(num_stages=3),
    dict(intra_wg_overlap=False),  # ping-pong only (tokamax's schedule)
    dict(intra_wg_overlap=False, num_stages=3),
    dict(pingpong=False),  # overlap only
    dict(lpt_order=False),
    dict(compute_registers=240, memory_registers=24),  # FA3's split
    dict(num_stages=3, compute_registers=240, memory_registers=24),
    FIRST,  # the first kernel's schedule (the 1.18x row)
]
EXTRA = {  # shape-specific tiles
    "full_4k_h16_d128": [dict(block_kv=192), dict(block_kv=192, intra_wg_overlap=False)],
    "seed000_gqa_swa": [dict(block_kv=64), dict(block_kv=64, intra_wg_overlap=False),
                        dict(block_kv=64, num_stages=3)],
    "causal_8k_h32_d64": [dict(block_q=192, num_compute_wgs=3, num_stages=4),
                          dict(block_q=192, num_compute_wgs=3, num_stages=4,
                               intra_wg_overlap=False),
                          dict(num_stages=4), dict(block_kv=256)],
}


# `--fwd-alt`: the table's forward config and, on top of it, the persistent grid (snake order
# under causal masks), FA3's intra-warpgroup overlap (with FA3's 240 / 24 registers), both,
# the named-barrier releases (named_release) alone and persistent;
# alternated in 3 rounds, each config's kernels listed
FWD_ALT = [dict(), dict(persistent=True, reuse_q_for_o=False), dict(intra_wg_overlap=True),
           dict(intra_wg_overlap=True, compute_registers=240, memory_registers=24),
           dict(persistent=True, reuse_q_for_o=False, intra_wg_overlap=True),
           dict(named_release=True), dict(persistent=True, reuse_q_for_o=False, named_release=True)]


def forward_alternated(q, k, v, window, out_ref):
    """`--fwd-alt`: FWD_ALT's configs over the table's, timed in alternated rounds."""
    from flashmesh.attention import pallas_mosaic_gpu_table as config_table

    spec = sm90.spec_for(q, k, v, scale=q.shape[-1] ** -0.5, window=window)
    today = config_table.default_for(spec, jax.devices()[0].device_kind)
    print(f"  table's config: {today}", flush=True)
    seen = set()

    def make(cfg):
        bs = dataclasses.replace(today, **cfg).validate_for(spec)
        if bs in seen:
            return None  # the table's config or an earlier one's
        seen.add(bs)
        return jax.jit(lambda q, k, v: sm90.forward_spec(q, k, v, spec, block_sizes=bs)[0])

    configs_alternated("fwd", [(str(cfg or "table"), cfg) for cfg in FWD_ALT], make, (q, k, v),
                       out_ref)


# BackwardBlockSizes fields per backward config; dict() is default_for's two-kernel backward.
BWD_CONFIGS = [dict(), dict(num_stages=2, fused_dq=True), dict(num_stages=1, fused_dq=True),
               dict(num_stages=2, fused_dq=True, dq_columns=True)]
# `--bwd-overlap`: default_for's config and the fused form by columns, each with overlap off
# and on (the GEMMs of a step under its arithmetic), alternated in 3 rounds
BWD_OVERLAP = [dict(), dict(overlap=True), dict(num_stages=2, fused_dq=True, dq_columns=True),
               dict(num_stages=2, fused_dq=True, dq_columns=True, overlap=True)]
# `--bwd-wg-ranges`: default_for's config with each warpgroup's own tile ranges (and with
# overlap), with the persistent dQ kernel, and both, alternated like --bwd-overlap
BWD_WG_RANGES = [dict(), dict(wg_ranges=True), dict(wg_ranges=True, overlap=True),
                 dict(persistent_dq=True), dict(wg_ranges=True, persistent_dq=True)]
# `--bwd-delta`: today's config with and without delta computed by the dQ kernel
BWD_DELTA = [dict(), dict(delta_in_dq=True)]
# `--bwd-fold`: today's config, and with overlap and lse and delta folded into the
# accumulators' initial values (fold_stats); the fused form by columns with overlap, then
# with fold_stats, with the writer warp (dq_writer) too, with the named-barrier dSᵀ exchange
# (ds_sync) too (configs equal to an earlier one are timed once)
FUSED_OVERLAP = dict(num_stages=2, fused_dq=True, dq_columns=True, overlap=True)
BWD_FOLD = [dict(), dict(overlap=True, fold_stats=True), FUSED_OVERLAP,
            dict(FUSED_OVERLAP, fold_stats=True), dict(FUSED_OVERLAP, fold_stats=True, dq_writer=True),
            dict(FUSED_OVERLAP, fold_stats=True, dq_writer=True, ds_sync=True)]
ALTERNATED = {"--bwd-overlap": BWD_OVERLAP, "--bwd-wg-ranges": BWD_WG_RANGES, "--bwd-delta": BWD_DELTA,
              "--bwd-fold": BWD_FOLD}


def named_config(arg: str) -> dict:
    """`--bwd-cfg=a+b=2`: {"a": True, "b": 2}."""
    cfg = {}
    for item in arg.split("=", 1)[1].split("+"):
        name, _, value = item.partition("=")
        cfg[name] = int(value) if value else True
    return cfg


NAMED = [named_config(a) for a in sys.argv if a.startswith("--bwd-cfg=")]  # --bwd-cfg's configs


def bwd_grid(spec):
    """`--bwd-grid`: default_for's config, then every valid one of a small grid (the fused
    kernel has no dQ kernel, so its block_q_dq / block_kv_dq are not varied; each fused config
    also with stagger_q, dq_columns and both where valid)."""
    found, seen = [dict()], set()
    for fused, bq, bqdq, bkvdq, st in itertools.product((False, True), (64, 128), (128, 256),
                                                         (64, 128), (3, 2)):
        cfg = dict(block_q=bq, num_stages=st, fused_dq=fused)
        if not fused:
            cfg.update(block_q_dq=bqdq, block_kv_dq=bkvdq)
        key = tuple(sorted(cfg.items()))
        if key in seen:
            continue
        seen.add(key)
        try:
            bs = bwd.BackwardBlockSizes(**cfg).validate_for(spec)
        except ValueError:
            continue
        if bs != bwd.default_for(spec):
            found.append(cfg)
        if fused:  # and the staggered order, dQ by columns, both, of the same tiles
            for extra in (dict(stagger_q=True), dict(dq_columns=True),
                          dict(dq_columns=True, stagger_q=True)):
                try:
                    bwd.BackwardBlockSizes(**cfg, **extra).validate_for(spec)
                except ValueError:
                    continue
                found.append({**cfg, **extra})
    return found


def backward_alone(name, q, k, v, window, t_cudnn_fwd):
    """The backward kernels per config at the forward's out and lse, back to back."""
    D = q.shape[-1]
    spec = sm90.spec_for(q, k, v, scale=D ** -0.5, window=window)
    out, lse = jax.jit(lambda q, k, v: sm90.forward_spec(q, k, v, spec))(q, k, v)
    do = jax.random.normal(jax.random.key(5), out.shape, out.dtype)
    causal = window[1] == 0
    cudnn = jax.jit(jax.grad(lambda q, k, v: jnp.sum(flashmesh.attention(
        q, k, v, mask="causal" if causal else "none", window=None if window[0] < 0 else window,
        implementation="cudnn").astype(jnp.float32) * do.astype(jnp.float32)), argnums=(0, 1, 2)))
    print(f"  bwd cudnn (fwd+bwd - fwd): {back_to_back(cudnn, q, k, v) - t_cudnn_fwd:.3f} ms", flush=True)
    modes = [ALTERNATED[a] for a in sys.argv if a in ALTERNATED]
    modes += [[cfg] for cfg in NAMED]
    first, alternated = None, bool(modes)
    configs = bwd_grid(spec) if "--bwd-grid" in sys.argv else modes[0] if modes else BWD_CONFIGS
    timed, seen = {}, set()
    for cfg in configs:
        try:
            bs = bwd.default_for(spec)
            if cfg:  # on top of today's config with --bwd-overlap, else on the defaults
                bs = (dataclasses.replace(bs, **cfg) if alternated
                      else bwd.BackwardBlockSizes(**cfg)).validate_for(spec)
            if bs in seen:
                print(f"  bwd mosaic {cfg}: today's config or an earlier one's, not timed again",
                      flush=True)
                continue
            seen.add(bs)
            f = jax.jit(lambda q, k, v, out, lse, do, bs=bs: bwd.backward_spec(
                q, k, v, out, lse, do, spec, block_sizes=bs)[:3])
            grads = jax.block_until_ready(f(q, k, v, out, lse, do))
            first = grads if first is None else first
            err = max(float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
                      for a, b in zip(grads, first))
            if alternated:
                timed[str(cfg or "default")] = (f, err)
                continue
            t = back_to_back(f, q, k, v, out, lse, do)
            print(f"  bwd mosaic {cfg or 'default'}: {t:.3f} ms, max rel err vs default {err:.1e}", flush=True)
        except Exception as e:  # a probe: report and go on
            print(f"  bwd mosaic {cfg or 'default'}: FAILED {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:400] if str(e) else ''}", flush=True)
            traceback.print_exc(limit=3)
    alternated_rounds(timed, (q, k, v, out, lse, do), "bwd mosaic", "max rel err vs default")
    if alternated and not NAMED:  # where each config's device time goes, kernel by kernel
        # (not with --bwd-cfg, which a profiler may be holding: the CUPTI trace would compete)
        from flashmesh.bench.kernel_time import kernels_ms

        for label, (f, _) in timed.items():
            try:
                parts = kernels_ms(f, (q, k, v, out, lse, do))
                print(f"  kernels {label}: " + ", ".join(f"{name[:60]} {ms:.3f}"
                                                          for name, ms in parts.items()), flush=True)
            except Exception as e:  # a probe: report and go on
                print(f"  kernels {label}: FAILED {type(e).__name__}: {e}", flush=True)


# `--window`: the window kernel's WindowBlockSizes, alternated in 3 rounds (ping-pong off / on,
# the band's tiles, the Q ring, overlap_heads)
# (block_kv 128, overlap_heads and the ping-pong with the deep ring lost on the H200,
# benchmarks/results/2026-12-07-nvidia-h200-probes; the persistent forms are timed here)
WINDOW_CONFIGS = [dict(), dict(pingpong=True), dict(q_buffers=4, q_ahead=2),
                  dict(persistent=True), dict(persistent=True, reload_band=True),
                  dict(q_buffers=3, q_ahead=1, persistent=True), dict(q_buffers=4, q_ahead=2, persistent=True),
                  dict(q_buffers=4, q_ahead=2, persistent=True, reload_band=True),
                  dict(pingpong=True, persistent=True), dict(pingpong=True, persistent=True, reload_band=True)]


def window_alone(q, k, v, window, out_ref):
    """The window kernel per WindowBlockSizes in WINDOW_CONFIGS, timed back to back in 3
    alternated rounds, each checked against cuDNN's output, then its kernel time."""
    from flashmesh.attention import pallas_mosaic_gpu_sm90_window as window_kernel
    from flashmesh.attention.pallas_mosaic_gpu_common import WindowBlockSizes

    spec = sm90.spec_for(q, k, v, scale=q.shape[-1] ** -0.5, window=window)

    def make(cfg):
        bs = WindowBlockSizes(**cfg).validate_for(spec)
        return jax.jit(lambda q, k, v: window_kernel.forward_spec(q, k, v, spec, block_sizes=bs)[0])

    configs_alternated("window", [(str(cfg or "default"), cfg) for cfg in WINDOW_CONFIGS], make,
                       (q, k, v), out_ref)


# `--window-parts`: the table's window config with one stage of its per-head step left out
# (diagnosis by difference, H200.md: no hardware counters there), each traced with one module
# attribute replaced: the band mask, exp2, the P·V GEMM, the O and lse stores, and the first
# three together (what is left: the S GEMM, the loads and the row statistics). The outputs of
# all but the first are wrong by construction; only the times mean anything.
WINDOW_PARTS = ["full", "no mask", "no exp2", "no P·V", "no O/lse store", "no mask, exp2, P·V"]


class _Proxy:
    """A module with some attributes replaced (the window kernel's jnp or plgpu)."""

    def __init__(self, module, **replaced):
        self._module, self._replaced = module, replaced

    def __getattr__(self, name):
        return self._replaced[name] if name in self._replaced else getattr(self._module, name)


def window_parts(q, k, v, window, out_ref):
    """`--window-parts`: WINDOW_PARTS, each compiled with its stage left out, alternated."""
    import contextlib
    from unittest import mock

    import jax.experimental.pallas.mosaic_gpu as plgpu

    from flashmesh.attention import pallas_mosaic_gpu_common as common
    from flashmesh.attention import pallas_mosaic_gpu_sm90_parts as parts
    from flashmesh.attention import pallas_mosaic_gpu_sm90_window as window_kernel
    from flashmesh.attention import pallas_mosaic_gpu_table as config_table

    spec = sm90.spec_for(q, k, v, scale=q.shape[-1] ** -0.5, window=window)
    bs = config_table.default_for(spec, jax.devices()[0].device_kind)
    print(f"  table's config: {bs}", flush=True)
    if not isinstance(bs, common.WindowBlockSizes):
        print("  --window-parts: the table gives this call the general kernel; nothing to do")
        return
    left_out = {
        "no mask": [mock.patch.object(parts, "band_mask", lambda s, *a, **kw: s)],
        "no exp2": [mock.patch.object(window_kernel, "jnp", _Proxy(jnp, exp2=lambda x: x))],
        "no P·V": [mock.patch.object(parts, "pv_from_registers", lambda acc, *a: acc)],
        "no O/lse store": [mock.patch.object(window_kernel, "plgpu", _Proxy(
            plgpu, copy_smem_to_gmem=lambda *a, **kw: None))],
    }
    left_out["no mask, exp2, P·V"] = left_out["no mask"] + left_out["no exp2"] + left_out["no P·V"]

    def make(label):
        with contextlib.ExitStack() as stack:
            for patch in left_out.get(label, []):
                stack.enter_context(patch)
            return jax.jit(lambda q, k, v: window_kernel.forward_spec(
                q, k, v, spec, block_sizes=bs)[0]).lower(q, k, v).compile()

    configs_alternated("window part", [(label, label) for label in WINDOW_PARTS], make,
                       (q, k, v), out_ref)
    # The same grid with G, G / 2 and G / 4 query heads per key/value head: a line through
    # the times gives the per-head cost and, at G = 0, the fixed cost of the grid's CTAs
    # (K/V band loads, the first Q's wait, the last stores' drain, the waves' tails).
    G, times = spec.group_size, {}
    for div in (1, 2, 4):
        qd = q[:, :, :q.shape[2] // div]
        try:
            spec_d = sm90.spec_for(qd, k, v, scale=q.shape[-1] ** -0.5, window=window)
            bs_d = bs.validate_for(spec_d)
            f = jax.jit(lambda q, k, v, spec_d=spec_d, bs_d=bs_d: window_kernel.forward_spec(
                q, k, v, spec_d, block_sizes=bs_d)[0])
            times[G // div] = min(back_to_back(f, qd, k, v) for _ in range(3))
            print(f"  window heads per group {G // div}: {times[G // div]:.3f} ms", flush=True)
        except Exception as e:  # a probe: report and go on
            print(f"  window heads per group {G // div}: FAILED {type(e).__name__}: {e}", flush=True)
    if len(times) >= 2:
        slope, intercept = np.polyfit(list(times), list(times.values()), 1)
        print(f"  window fit: {slope * 1e3:.2f} us per head per group, fixed {intercept:.3f} ms "
              f"({intercept / times.get(G, max(times.values())):.0%} of the full call)", flush=True)


def configs_alternated(what, labelled, make, args, out_ref):
    """Forward configs [(label, cfg)]: make(cfg) -> a jitted f(*args) giving O (None: skip it),
    each checked against cuDNN's out_ref, then timed in alternated rounds and its kernels listed."""
    from flashmesh.bench.kernel_time import kernels_ms

    timed = {}
    for label, cfg in labelled:
        try:
            f = make(cfg)
            if f is None:
                print(f"  {what} {label}: the same config as an earlier one, not timed again", flush=True)
                continue
            out = jax.block_until_ready(f(*args))
            err = float(jnp.linalg.norm((out - out_ref).astype(jnp.float32))
                        / jnp.linalg.norm(out_ref.astype(jnp.float32)))
            timed[label] = (f, err)
        except Exception as e:  # a probe: report and go on
            print(f"  {what} {label}: FAILED {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:400] if str(e) else ''}", flush=True)
            traceback.print_exc(limit=3)
    alternated_rounds(timed, args, what, "rel err vs cudnn")
    for label, (f, _) in timed.items():
        try:
            print(f"  kernels {label}: " + ", ".join(f"{name[:60]} {ms:.3f}" for name, ms in
                                                     kernels_ms(f, args).items()), flush=True)
        except Exception as e:  # a probe: report and go on
            print(f"  kernels {label}: FAILED {type(e).__name__}: {e}", flush=True)


def alternated_rounds(timed: dict, args, what: str, err_name: str, rounds: int = 3):
    """Each {label: (f, err)} timed back to back in `rounds` alternated rounds, one line each."""
    times = {label: [] for label in timed}
    for _ in range(rounds if timed else 0):
        for label, (f, _) in timed.items():
            times[label].append(back_to_back(f, *args))
    for label, ts in times.items():
        print(f"  {what} {label}: {' '.join(f'{t:.3f}' for t in ts)} ms (min {min(ts):.3f}), "
              f"{err_name} {timed[label][1]:.1e}", flush=True)


def back_to_back(f, *args, n=20):
    jax.block_until_ready(f(*args))  # compiled and warm
    return timing.back_to_back(f, args, n)


def main():
    only = [a for a in sys.argv[1:] if not a.startswith("--") and a not in _HASHES] or None
    for name, B, T, N, K, D, window in SHAPES:
        if only and name not in only:
            continue
        kq, kk, kv = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(kq, (B, T, N, D), jnp.bfloat16)
        k = jax.random.normal(kk, (B, T, K, D), jnp.bfloat16)
        v = jax.random.normal(kv, (B, T, K, D), jnp.bfloat16)
        causal = window[1] == 0
        ref = jax.jit(lambda q, k, v: flashmesh.attention(
            q, k, v, mask="causal" if causal else "none",
            window=None if window[0] < 0 else window, implementation="cudnn"))
        out_ref = ref(q, k, v)
        t_ref = back_to_back(ref, q, k, v)
        print(f"{name}: cudnn {t_ref:.3f} ms", flush=True)
        if "--window" in sys.argv:
            window_alone(q, k, v, window, out_ref)
            continue
        if "--window-parts" in sys.argv:
            window_parts(q, k, v, window, out_ref)
            continue
        if "--fwd-alt" in sys.argv:
            forward_alternated(q, k, v, window, out_ref)
            continue
        if {"--bwd", "--bwd-grid", *ALTERNATED} & set(sys.argv) or NAMED:
            backward_alone(name, q, k, v, window, t_ref)
            continue
        if "--fwdbwd" in sys.argv:  # the registered implementation's fwd+bwd against cuDNN's
            rates = (0.0, 0.1) if "--dropout" in sys.argv else (0.0,)
            for impl, rate in itertools.product(("cudnn", "pallas_mosaic_gpu"), rates):
                label = f"{impl}{f' dropout {rate}' if rate else ''}"
                try:
                    step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(flashmesh.attention(
                        q, k, v, mask="causal" if causal else "none",
                        window=None if window[0] < 0 else window, dropout_rate=rate,
                        dropout_rng=jax.random.key(7) if rate else None,
                        implementation=impl).astype(jnp.float32)), argnums=(0, 1, 2)))
                    print(f"  fwd+bwd {label}: {back_to_back(step, q, k, v):.3f} ms", flush=True)
                except Exception as e:  # a probe: report and go on
                    print(f"  fwd+bwd {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            if "--fwdbwd-only" in sys.argv:
                continue
        for cfg in COMMON + EXTRA.get(name, []):
            try:
                bs = BlockSizes(**cfg) if cfg else None
                f = jax.jit(lambda q, k, v: sm90.forward(q, k, v, scale=D ** -0.5, window=window,
                                                         block_sizes=bs)[0])
                t0 = time.perf_counter()
                out = jax.block_until_ready(f(q, k, v))
                compile_s = time.perf_counter() - t0
                err = float(jnp.linalg.norm((out - out_ref).astype(jnp.float32))
                            / jnp.linalg.norm(out_ref.astype(jnp.float32)))
                t = back_to_back(f, q, k, v)
                print(f"  mosaic {cfg or 'default'}: {t:.3f} ms ({t / t_ref:.2f}x cudnn), "
                      f"rel err vs cudnn {err:.1e}, first call {compile_s:.1f} s", flush=True)
            except Exception as e:  # a probe: report and go on
                print(f"  mosaic {cfg or 'default'}: FAILED {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:400] if str(e) else ''}", flush=True)
                traceback.print_exc(limit=3)


if __name__ == "__main__":
    main()
