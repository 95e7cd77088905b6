"""`flashmesh tune`: measure the Mosaic GPU forward kernel's tile configurations on this GPU and
write the fastest into its table (`attention/pallas_mosaic_gpu_configs.json`).

Shape legend as `shapes.Shape` (B, T, S, N, K, Dqk, Dv).

For every shape (the anchor shapes the kernel can run, or `--shapes`): each candidate
`BlockSizes` of `candidates(spec)` that is valid for the call is compiled, run once and checked
against `chunked` on the same inputs (relative L2 error <= TOLERANCE; a wrong or failing
candidate is reported and never chosen), then all of them are timed together in interleaved
rounds (`timing.time_interleaved`); the fastest by the back-to-back figure (calls issued with one
synchronisation) wins. Its table entry (the one naming the shape as `anchor`, else the one with
the same key, else a new one) gets the config, `tuned: true` and what was measured. The run
also writes `<out>/<date>-<device>-tune/` (results.json with every candidate, report.md).

`--backward` tunes the backward kernels the same way instead (`tune_backward`: checked against
chunked's gradients, written into the table's backward_entries).

`--interpret` runs the kernels in Mosaic GPU's interpreter on a CPU, at the given (tiny) shapes:
it checks the plumbing; its times say nothing about a GPU and it writes no table unless
`--table` names one.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from flashmesh.attention import pallas_mosaic_gpu
from flashmesh.attention import pallas_mosaic_gpu_common as common
from flashmesh.attention import pallas_mosaic_gpu_table as config_table
from flashmesh.bench import report, runner, tune_backward, tune_measure
from flashmesh.bench.tune_measure import table_key
from flashmesh.bench.shapes import ANCHOR_SHAPES, GUIDE_LAYER_ATTENTION, Shape

TOLERANCE = 2e-2  # relative L2 against chunked, bf16 inputs (the kernels measure ~5e-3)
SEARCH = dict(  # the candidate grid; invalid combinations (SMEM, registers) are dropped
    tiles=((128, 2), (192, 3), (64, 1)),  # (block_q, num_compute_wgs)
    block_kv=(64, 128, 192),
    num_stages=(2, 3),
    intra_wg_overlap=(False, True),
)
# (persistent, reuse_q_for_o) variants of the call's current config, tried right after it
# (a persistent grid with O in its own buffer prefetches the next tile's Q)
PERSISTENT = ((True, False), (True, True))


def spec_of(shape: Shape, dtype: str = "bfloat16"):
    """The AttentionSpec of a shape's forward call (flashmesh.normalize on placeholders)."""
    from flashmesh.attention.api import normalize

    q = jax.ShapeDtypeStruct((shape.B, shape.T, shape.N, shape.Dqk), jnp.dtype(dtype))
    k = jax.ShapeDtypeStruct((shape.B, shape.S, shape.K, shape.Dqk), jnp.dtype(dtype))
    v = jax.ShapeDtypeStruct((shape.B, shape.S, shape.K, shape.Dv), jnp.dtype(dtype))
    found = []
    jax.eval_shape(lambda q, k, v: found.append(normalize(q, k, v, mask=shape.mask, window=shape.window)[1]),
                   q, k, v)  # traced: no arrays of the shape's size are made
    return found[0]


def candidates(spec, limit: int | None = None) -> list:
    """Valid configurations for this call, the one it gets today first: BlockSizes from the
    SEARCH grid, and where the window kernel takes the call its WindowBlockSizes."""
    found, seen = [], set()
    try:
        default = config_table.default_for(spec, jax.devices()[0].device_kind)
    except NotImplementedError:  # not a Hopper GPU (interpret mode): the table's fallback
        default = config_table.heuristic(spec)
    grid = itertools.product(SEARCH["tiles"], SEARCH["block_kv"], SEARCH["num_stages"],
                             SEARCH["intra_wg_overlap"])
    windows = (common.WindowBlockSizes(block_kv=kv, num_compute_wgs=w, pingpong=p, q_buffers=nq, q_ahead=a)
               for kv, w, p, (nq, a) in itertools.product((64, 128), (2, 1), (False, True),
                                                          ((2, 1), (3, 2), (3, 1), (4, 3), (4, 2)))
               if w == 2 or not p)
    # today's config's twins: on a persistent grid; for the window kernel, its plain form
    # (neither persistent nor overlap_heads), then persistent with the band a ring and with it
    # reloaded, and with overlap_heads (P·V with the next head's S)
    twins = ([dataclasses.replace(default, persistent=p, reuse_q_for_o=r) for p, r in PERSISTENT]
             if isinstance(default, common.BlockSizes) and default.num_splits == 1 else [])
    if isinstance(default, common.WindowBlockSizes):  # (persistent excludes overlap_heads)
        plain = dataclasses.replace(default, persistent=False, reload_band=False, overlap_heads=False)
        twins = [dataclasses.replace(plain, persistent=True), dataclasses.replace(plain, persistent=True, reload_band=True)]
        if not default.pingpong:
            twins.append(dataclasses.replace(plain, overlap_heads=True))
        twins = [plain] + twins
    for bs in itertools.chain([default], twins, windows, (common.BlockSizes(block_q=bq, num_compute_wgs=w, block_kv=kv,
                                                                      num_stages=st, intra_wg_overlap=ov)
                                                   for (bq, w), kv, st, ov in grid)):
        try:
            bs.validate_for(spec)
        except (ValueError, NotImplementedError):
            continue
        if bs not in seen:
            seen.add(bs)
            found.append(bs)
    return found[:limit]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def tune_shape(shape: Shape, config: runner.RunConfig, *, interpret: bool = False, limit: int | None = None,
               advance=lambda text: None) -> dict:
    """Every candidate of one shape: {"shape", "key", "rows": [...], "best": config or None}."""
    from flashmesh.attention import chunked
    from flashmesh.attention import pallas_mosaic_gpu

    spec = spec_of(shape)
    q, k, v, _, _ = runner.make_inputs(shape, "bf16", config.seed)
    want = chunked.attention(_inputs(q, k, v), spec)[0]
    rows = tune_measure.measure(
        candidates(spec, limit),
        lambda bs: lambda q, k, v: pallas_mosaic_gpu.forward(q, k, v, spec, bs, interpret=interpret)[0],
        (q, k, v), lambda got: _rel(got, want), fields=config_table.config_fields, tolerance=TOLERANCE,
        interpret=interpret, config=config, label=shape.name, advance=advance)
    # rows[0]: the heuristic's config
    return dict(shape=shape.name, key=table_key(spec), **tune_measure.summary(rows))


def _inputs(q, k, v):
    from flashmesh.attention.spec import AttentionInputs

    return AttentionInputs(q=q, k=k, v=v)


def write_table(path: Path, results: list[dict], meta: dict) -> None:
    """Each shape's best config into its entry (by anchor name, else key; new entries appended):
    forward results into "entries", backward ones (`tune_backward`) into "backward_entries"."""
    table = json.loads(path.read_text(encoding="utf-8"))
    entries = table["entries"]
    tune_backward.write_entries(table, [r for r in results if r.get("kernel") == "backward"], meta)
    for res in tune_measure.unshared([r for r in results if r.get("kernel") != "backward"], "tune"):
        best = res["best"]
        if best.get("kernel") == "window":  # every field that differs from WindowBlockSizes' defaults
            fields, flags = ("kernel", "block_kv", "num_compute_wgs"), ("pingpong", "q_buffers", "q_ahead")
            defaults = dataclasses.asdict(common.WindowBlockSizes())  # (q_ahead None: q_buffers - 1)
        else:  # the schedule flags only where they differ from BlockSizes' defaults
            fields = ("block_q", "block_kv", "num_stages", "num_compute_wgs", "intra_wg_overlap")
            flags, defaults = ("persistent", "reuse_q_for_o"), dataclasses.asdict(common.BlockSizes())
        config = {f: best[f] for f in fields} | {
            f: best[f] for f in flags if f in best and best[f] != defaults[f]}
        entry = tune_measure.table_entry(entries, res["shape"], res["key"])
        best_row = next((r for r in res["rows"] if r.get("config") == best), {})
        if best_row.get("compile_s") is not None:  # what explain reports as its compile time
            entry["compile_s"] = round(best_row["compile_s"], 3)
        entry.update(tuned=True, config=config, source=(
            f"flashmesh tune {meta['date']} on {meta['device']} (commit {meta['commit']}): "
            f"{res['best_ms_back_to_back']:.4f} ms back to back, best of {len(res['rows'])} candidates"))
    path.write_text(json.dumps(table, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    config_table.load_table.cache_clear()
    config_table.load_table(str(path))  # the written table must load (valid configs, unique keys)


def run(shapes: list[Shape], config: runner.RunConfig, *, interpret: bool = False, limit: int | None = None,
        table: Path | None = None, out: str = "benchmarks/results", argv=None,
        backward: bool = False) -> tuple[list[dict], Path]:
    """Tune every shape (the backward kernels' configs when `backward`, else the forward's);
    write the table (unless interpret without `table`) and the report."""
    if not interpret and (reason := pallas_mosaic_gpu._device_reason()):
        raise NotImplementedError(f"flashmesh tune measures the Mosaic GPU kernels: {reason}")
    for shape in shapes:
        if reason := pallas_mosaic_gpu.static_reason(spec_of(shape)):
            raise ValueError(f"--shapes: {shape.name} cannot run on the kernels: {reason}")
    meta = dict(metadata(argv, interpret), kernel="backward" if backward else "forward")
    specs = {s.name: spec_of(s) for s in shapes}
    count = tune_backward.candidates if backward else candidates
    total = sum(len(count(specs[s.name], limit)) for s in shapes)
    results = []
    with runner._progress(config.progress, total) as advance:
        if not config.progress:  # a log's reader (a GPU run's output) sees where the run is
            numbers = itertools.count(1)

            def advance(text: str):
                print(f"tune {next(numbers)}/{total} {time.strftime('%H:%M:%S')}: {text}", flush=True)
        for shape in shapes:
            if backward:
                results.append(tune_backward.tune_shape(
                    shape, specs[shape.name], config, interpret=interpret, limit=limit, advance=advance,
                    rel=_rel, tolerance=TOLERANCE))
            else:
                results.append(tune_shape(shape, config, interpret=interpret, limit=limit, advance=advance))
    if table is None and not interpret:
        table = config_table.CONFIGS_PATH
    if table is not None:
        write_table(Path(table), results, meta)
    directory = report.results_dir(out, meta)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.json").write_text(json.dumps(dict(meta=meta, shapes=results), indent=1, default=str))
    (directory / "report.md").write_text(markdown(meta, results))
    return results, directory


def metadata(argv, interpret: bool) -> dict:
    import datetime

    now = datetime.datetime.now(datetime.timezone.utc)
    return dict(date=now.strftime("%Y-%m-%d"), time_utc=now.strftime("%H:%M:%S"), preset="tune",
                command=" ".join(["flashmesh", "tune", *(argv or [])]), commit=report.git_commit(),
                device=report.device_kind(), jax_version=jax.__version__, interpret=interpret,
                search=SEARCH, tolerance=TOLERANCE)


def named_shapes() -> dict[str, Shape]:
    """What --shapes names: the anchors and the layer preset's attention call."""
    return {s.name: s for s in (*ANCHOR_SHAPES, GUIDE_LAYER_ATTENTION)}


def default_shapes() -> list[Shape]:
    """The anchor shapes the kernels can run (no segments)."""
    return [s for s in ANCHOR_SHAPES if s.segments is None and pallas_mosaic_gpu.static_reason(spec_of(s)) is None]


def markdown(meta: dict, results: list[dict]) -> str:
    lines = [f"# flashmesh tune on {meta['device']}", "",
             f"{meta['date']} {meta['time_utc']} UTC, commit `{meta['commit']}`, jax {meta['jax_version']}"
             + (" (interpret mode: times say nothing about a GPU)" if meta["interpret"] else ""), "",
             f"Each candidate {meta.get('kernel', 'forward')} config of `pallas_mosaic_gpu_sm90"
             f"{'_bwd' if meta.get('kernel') == 'backward' else ''}` checked against `chunked` "
             f"(relative L2 <= {TOLERANCE}{', the largest of dq, dk, dv' if meta.get('kernel') == 'backward' else ''}), then timed in interleaved rounds; ms is the median of "
             "synchronised calls, back to back the time per call of calls issued with one "
             "synchronisation (the figure that chooses).", ""]
    for res in results:
        lines += [f"## {res['shape']}", "", "| config | ms | back to back | error | status |", "|---|---|---|---|---|"]
        for r in sorted(res["rows"], key=lambda r: r.get("ms_back_to_back", math.inf)):
            cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items() if v is not None)
            ms = f"{r['ms']:.4f}" if "ms" in r else "-"
            b2b = f"{r['ms_back_to_back']:.4f}" if "ms_back_to_back" in r else "-"
            err = f"{r['error']:.1e}" if "error" in r else "-"
            lines.append(f"| {cfg} | {ms} | {b2b} | {err} | {r['status']}{': ' + r['reason'] if r.get('reason') else ''} |")
        lines.append("")
    return "\n".join(lines)


def add_arguments(parser):
    """The `flashmesh tune` options."""
    parser.add_argument("--shapes", type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
                        metavar="NAME,...", help="anchor shapes (or guide_layer_attention, the layer preset's attention) to tune "
                             "(default: every anchor the kernels run)")
    parser.add_argument("--max-candidates", type=int, metavar="N", help="at most N configs per shape")
    parser.add_argument("--table", metavar="PATH",
                        help="the table to update (default: the package's pallas_mosaic_gpu_configs.json)")
    parser.add_argument("--out", default="benchmarks/results", metavar="DIR", help="parent of the report folder")
    parser.add_argument("--interpret", action="store_true",
                        help="run in Mosaic GPU's interpreter on a CPU (plumbing only; tiny shapes via "
                             "--tiny; writes no table unless --table)")
    parser.add_argument("--tiny", action="store_true", help="one tiny shape (for --interpret)")
    parser.add_argument("--backward", action="store_true",
                        help="tune the backward kernels' configs (the table's backward_entries)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-progress", action="store_true", help="no live progress bar")
    return parser


def _interpreter_threads(devices: int = 8) -> None:
    """Mosaic GPU's interpreter runs a kernel's warpgroups as threads that wait on each other
    inside XLA callbacks; with the CPU client's default single device on a 2-core machine they
    deadlock (observed: `tune --interpret` hung with no CPU use), with 8 CPU devices (as the
    test suite runs) they do not. Set before JAX's backend starts; a started one is left as it
    is (a warning)."""
    try:
        jax.config.update("jax_num_cpu_devices", max(devices, jax.config.jax_num_cpu_devices))
    except RuntimeError as e:  # the backend already started
        import warnings

        warnings.warn(f"flashmesh tune --interpret: could not raise the CPU device count ({e}); "
                      "the interpreter may deadlock on a machine with few cores")


TINY = Shape("tune_tiny", B=1, T=256, N=2, K=1, Dqk=64, mask="causal")


def cli(args, argv, parser) -> int:
    from rich.console import Console

    known = named_shapes()
    if args.interpret:
        _interpreter_threads()
    try:
        if args.tiny:
            shapes = [TINY]
        elif args.shapes:
            if missing := [n for n in args.shapes if n not in known]:
                raise ValueError(f"--shapes: unknown {missing}; known: {', '.join(known)}")
            shapes = [known[n] for n in args.shapes]
        else:
            shapes = default_shapes()
        if args.max_candidates is not None and args.max_candidates < 1:
            raise ValueError(f"--max-candidates={args.max_candidates} must be >= 1")
        config = runner.RunConfig(warmup=args.warmup, iters=args.iters, rounds=args.rounds,
                                  progress=not args.no_progress)
        results, directory = run(shapes, config, interpret=args.interpret, limit=args.max_candidates,
                                 table=Path(args.table) if args.table else None, out=args.out, argv=argv,
                                 backward=args.backward)
    except (ValueError, NotImplementedError) as e:
        parser.exit(2, f"flashmesh tune: error: {e}\n")
    console = Console()
    for res in results:
        best = res["best"]
        console.print(f"{res['shape']}: " + ("no candidate ran" if best is None else
                      f"best {best} at {res['best_ms_back_to_back']:.4f} ms back to back "
                      f"(today's config: {res['default_ms_back_to_back'] or float('nan'):.4f})"))
    console.print(f"report: {directory / 'report.md'}")
    return 0
