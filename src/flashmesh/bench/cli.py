"""`flashmesh bench`: the command line (also `python -m flashmesh bench`)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import signal
import sys

from flashmesh.bench import shapes as shape_tables
from flashmesh.bench.implementations import DTYPES, Candidate

EPILOG = """\
presets:
  small     the codelab's steps at CPU sizes (default without a GPU, about a minute on a CPU)
  codelab   the codelab's steps in order: naive f32, jax.nn xla f32/bf16, cudnn bf16, flashmesh;
            causal; sequence sweep (to 64k on a GPU); batch sweep; MHA/GQA/MQA; the Flax module
  anchors   the shapes of anchors/RESULTS.md against every peer (default on a GPU)
  quick     tiny shapes, seconds on a CPU (smoke tests)
  cp        context parallelism on the CP tutorial's workload (reference/003): every strategy x
            order over all devices against one device; with one device, the ranks' work of cp=4
            one rank after another. On a CPU the CLI asks JAX for 4 fake devices; where JAX has
            already started, set XLA_FLAGS=--xla_force_host_platform_device_count=4 instead.
            Its rows (--implementations): <strategy>/<order>[:stripe], e.g. ring/striped:1, and
            the emulated programs steps, ring_local
  layer     the getting-started guide's decoder layer (reference/004): one training step (fwd+bwd,
            FP8 state written back each step) per variant, the guide's size on a GPU (B=4, T=2048,
            hidden 4096, FFN 16384, 32 heads), tiny on a CPU or with --quick; input dtype bf16
            unless --dtype. Each row is checked against a float32 reference (FP8 rows against
            their bf16 twin) before it is timed; also the steps back to back, TFLOP/s and the
            FP8 state update's share of the step. Its rows (--implementations): flax,
            te_unfused_flax_attention, te_unfused, te_fused, te_unfused_fp8, te_fused_fp8,
            transformer_layer, transformer_layer_fp8, jax_cudnn

implementations (add @bf16, @f16 or @f32 to fix a row's dtype, e.g. xla@f32):
  naive, xla, cudnn, flashmesh, flashmesh:<backend> (reference, chunked, cudnn, ...),
  module (flashmesh.te.flax.DotProductAttention), fa3, tokamax:mosaic, tokamax:triton

Every row is checked against flashmesh's float32 reference before it is timed; a row that
cannot run records why. Results go to <out>/<date>-<device>-<preset>/ (results.json,
report.md and PNG plots). See `flashmesh bench --list` for every shape.
"""


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashmesh", description="flashmesh: fused attention for JAX.")
    sub = parser.add_subparsers(dest="command")
    bench = sub.add_parser(
        "bench", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        help="compare attention implementations (time, TFLOP/s, memory, error)",
        description="Compare attention implementations on named shapes, forward and forward+backward: "
                    "check each against the reference, time it, and write a table, json, plots and "
                    "a markdown report.")
    bench.add_argument("--preset", choices=sorted(shape_tables.PRESETS),
                       help="named set of shapes and implementations (default: anchors on a GPU, small otherwise)")
    bench.add_argument("--groups", type=_csv, metavar="GROUP,...",
                       help="only these groups of the preset (e.g. seq_sweep,batch_sweep; see --list)")
    bench.add_argument("--shapes", type=_csv, metavar="NAME,...",
                       help="only these shapes (names from --list; may come from any preset)")
    bench.add_argument("--implementations", type=_csv, metavar="IMPL,...",
                       help="rows to compare instead of the preset's, e.g. naive,xla@f32,cudnn,flashmesh")
    bench.add_argument("--dtype", choices=sorted(DTYPES),
                       help="input dtype of every row (default: each row's own, else bf16 on a GPU, f32 otherwise)")
    bench.add_argument("--modes", type=_csv, metavar="MODE,...",
                       help="fwd and/or fwdbwd (default: the preset's per group)")
    bench.add_argument("--out", default="benchmarks/results", metavar="DIR",
                       help="parent folder of the results folder (default: benchmarks/results)")
    bench.add_argument("--quick", action="store_true",
                       help="fewer repeats (1 warm-up, 5 timed) and sweeps cut to their first 3 points")
    bench.add_argument("--list", action="store_true", help="list presets, shapes and implementations, then exit")
    bench.add_argument("--warmup", type=int, help="untimed calls per row (default 3 on a GPU, 2 on a CPU, --quick 1)")
    bench.add_argument("--iters", type=int,
                       help="timed calls per row, median reported (default 20 on a GPU, 10 on a CPU, --quick 5)")
    bench.add_argument("--rounds", type=int, default=5,
                       help="the rows of one shape and mode are timed in this many interleaved rounds, "
                            "so that drift hits them alike (default 5)")
    bench.add_argument("--no-kernel-time", action="store_true",
                       help="skip the device kernel time of each row (a profiler trace per row on a GPU)")
    bench.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    bench.add_argument("--no-progress", action="store_true", help="no live progress bar")
    from flashmesh.train import cli as train_cli

    train_cli.add_arguments(sub.add_parser(
        "train", help="train a small byte-level GPT in bf16 and FP8 and report both loss curves",
        description="Train a small GPT (TransformerLayers) on the bytes of the Python standard library "
                    "in bf16 and in FP8; write results.json, report.md and loss.png."))
    from flashmesh.bench import tune

    tune.add_arguments(sub.add_parser(
        "tune", help="time the Mosaic GPU kernel's tile configs on this GPU and write the fastest "
                     "into its table",
        description="For each anchor shape, check and time every candidate forward config of the "
                    "pallas_mosaic_gpu kernel, write the fastest into pallas_mosaic_gpu_configs.json "
                    "and a report under --out."))
    return parser


# -- the plan ------------------------------------------------------------------------------------------
def _find_shapes(names: list[str], presets: list[shape_tables.Preset]) -> list[shape_tables.Group]:
    """Groups (from the first preset defining each name) restricted to the named shapes."""
    wanted, groups, found = set(names), [], set()
    for preset in presets:
        for group in preset.groups:
            keep = tuple(s for s in group.shapes if s.name in wanted and s.name not in found)
            if keep:
                groups.append(dataclasses.replace(group, shapes=keep))
                found |= {s.name for s in keep}
    missing = [n for n in names if n not in found]
    if missing:
        known = sorted({s.name for p in presets for s in p.shapes()})
        raise ValueError(f"--shapes: unknown shape(s) {missing}; known: {', '.join(known)}")
    return groups


def make_plan(args, platform: str) -> shape_tables.Preset:
    """The preset after --groups, --shapes, --implementations, --dtype, --modes and --quick.

    --shapes picks from the chosen preset's groups; without --preset it also looks in the
    other presets, and a selection reaching outside the default preset is called "custom".
    The cp preset's rows are strategies x orders (`shapes.select_cp_rows`), all in the run's
    dtype; its --quick is a tiny workload. The layer preset's rows are the guide's variants
    (`shapes.LAYER_VARIANTS`), all with the run's input dtype, fwd+bwd only; --quick is tiny.
    """
    name = args.preset or shape_tables.default_preset(platform)
    preset = shape_tables.preset(name, platform, quick=args.quick)
    cp = preset.kind == "context_parallel"
    layer = preset.kind == "layer"
    groups = list(preset.groups)
    if args.groups:
        unknown = [g for g in args.groups if g not in {grp.name for grp in groups}]
        if unknown:
            raise ValueError(f"--groups: unknown group(s) {unknown} in preset {name!r}; "
                             f"known: {', '.join(g.name for g in groups)}")
        groups = [g for g in groups if g.name in args.groups]
    if args.shapes:
        own = [g.name for g in groups]
        search = [dataclasses.replace(preset, groups=tuple(groups))]
        if not args.preset:
            search += [p for p in (shape_tables.preset(n, platform) for n in shape_tables.PRESETS if n != name)
                       if p.kind == "attention"]
        groups = _find_shapes(args.shapes, search)
        if any(g.name not in own or g.shapes[0] not in preset.shapes() for g in groups):
            name = "custom"
    if args.implementations and cp:  # the cp preset's rows are strategies/orders, not implementations
        groups = shape_tables.select_cp_rows(groups, args.implementations)
    elif args.implementations and layer:  # the layer preset's rows are the guide's variants
        unknown = [v for v in args.implementations if v not in shape_tables.LAYER_VARIANTS]
        if unknown:
            raise ValueError(f"--implementations: {unknown} are not rows of the layer preset; "
                             f"known: {', '.join(shape_tables.LAYER_VARIANTS)}")
        groups = [dataclasses.replace(g, implementations=tuple(dict.fromkeys(args.implementations)))
                  for g in groups]
    elif args.implementations:
        for label in args.implementations:
            Candidate.parse(label)  # ValueError names the bad one
        groups = [dataclasses.replace(g, implementations=tuple(args.implementations)) for g in groups]
    if args.dtype and not (cp or layer):  # cp and layer rows all run in the run's dtype (config.dtype)
        def retype(labels):
            return tuple(dict.fromkeys(f"{label.partition('@')[0]}@{args.dtype}" for label in labels))
        groups = [dataclasses.replace(g, implementations=retype(g.implementations)) for g in groups]
    if args.modes:
        bad = [m for m in args.modes if m not in ("fwd", "fwdbwd")]
        if bad:
            raise ValueError(f"--modes: {bad} must be fwd and/or fwdbwd")
        if layer and args.modes != ["fwdbwd"]:
            raise ValueError(f"--modes: {args.modes}: the layer preset times training steps, fwdbwd only")
        groups = [dataclasses.replace(g, modes=tuple(args.modes)) for g in groups]
    if args.quick:
        groups = [dataclasses.replace(g, shapes=g.shapes[:3]) if g.sweep else g for g in groups]
    return dataclasses.replace(preset, name=name, groups=tuple(groups))


def list_everything(platform: str) -> None:
    from flashmesh.bench import implementations

    print(f"presets (platform: {platform}):")
    for name in shape_tables.PRESETS:
        p = shape_tables.preset(name, platform)
        print(f"  {name}: {p.description}")
        for g in p.groups:
            print(f"    {g.name} ({', '.join(g.modes)}): {', '.join(s.name for s in g.shapes)}")
            print(f"      implementations: {', '.join(g.implementations)}")
    print("\nshapes:")
    for s in shape_tables.all_shapes(platform).values():
        print(f"  {s.name:28s} {s.describe()}" + (f"  ({s.note})" if s.note else ""))
    print("\nimplementations:")
    peers = {"fa3": "flash_attn3_jax", "tokamax:mosaic": "tokamax", "tokamax:triton": "tokamax"}
    for name in implementations.names():
        impl = implementations.get(name)
        note = ""
        if name in peers:
            note = "  [installed]" if importlib.util.find_spec(peers[name]) else "  [not installed]"
        print(f"  {name:22s} {impl.description}{note}")


# -- main ----------------------------------------------------------------------------------------------
def bench(args, argv: list[str], parser: argparse.ArgumentParser | None = None) -> int:
    from rich.console import Console

    from flashmesh.bench import checks, report, runner

    # A pipe or a log file gets a wide table instead of rich's 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=180)
    if args.preset == "cp":  # fake CPU devices must be asked for before jax starts a backend
        from flashmesh.bench import context

        context.use_fake_cpu_devices()
    platform = runner.platform()
    if args.list:
        list_everything(platform)
        return 0
    try:
        for name, least in (("warmup", 0), ("iters", 1), ("rounds", 1)):
            value = getattr(args, name)
            if value is not None and value < least:
                raise ValueError(f"--{name} must be >= {least}, got {value}")
        plan = make_plan(args, platform)
    except ValueError as e:  # user mistakes: one line, naming the argument
        if parser is None:
            raise
        parser.exit(2, f"flashmesh bench: error: {e}\n")
    # (warm-up, timed calls, seconds of timing per row at most)
    warmup, iters, max_seconds = (1, 5, 2.0) if args.quick else (3, 20, 10.0) if platform == "gpu" else (2, 10, 2.0)
    layer = plan.kind == "layer"  # the guide's input is bf16 on every platform
    config = runner.RunConfig(
        dtype=args.dtype or ("bf16" if platform == "gpu" or layer else "f32"),
        warmup=args.warmup if args.warmup is not None else warmup,
        iters=args.iters if args.iters is not None else iters,
        max_seconds=max_seconds, rounds=args.rounds, progress=not args.no_progress,
        kernel_time=not args.no_kernel_time)
    if plan.name == "anchors" and platform != "gpu":
        console.print("[yellow]the anchors preset is sized for a GPU; on a CPU it takes very long[/]")
    meta = report.metadata(plan, config, argv)
    directory = report.results_dir(args.out, meta)
    cp = plan.kind == "context_parallel"
    if cp:  # rows of strategies and orders, measured and reported by their own modules
        from flashmesh.bench import context, context_facts, context_report
    if layer:  # rows of the guide's layer variants, likewise
        from flashmesh.bench import layer as layer_bench
        from flashmesh.bench import layer_report

        meta.update(flop_formula=layer_bench.FLOP_FORMULA, timing=layer_bench.TIMING_TEXT)
    size = context.plan_size(plan) if cp else layer_bench.plan_size(plan) if layer else runner.plan_size(plan)
    console.print(f"flashmesh bench: preset [bold]{plan.name}[/] on {meta['device']} "
                  f"({size} rows) -> {directory}")
    extra = context_facts.facts(plan, config) if cp else None
    done: list = []

    def on_result(result):  # keep results.json current, so a killed run leaves its rows
        done.append(result)
        report.write_json(directory / "results.json", meta, done, extra)

    causal = checks.causal_check(plan.causal_check) if plan.causal_check is not None else None
    # A killed run (Ctrl-C, or SIGTERM from a time limit) still writes the report of its rows.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        results = (context.run if cp else layer_bench.run if layer else runner.run)(plan, config,
                                                                                  on_result=on_result)
    except KeyboardInterrupt:
        results = layer_bench.finish(list(done)) if layer else list(done)
        console.print(f"[yellow]interrupted after {len(results)} rows: writing the report of those[/]")
        meta["interrupted_after_rows"] = len(results)
        report.write_json(directory / "results.json", meta, results, extra)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if cp:
        context_report.print_tables(plan, results, extra, console)
        path = context_report.write_report(directory, meta, plan, results, extra, plots=not args.no_plots)
    elif layer:
        layer_report.print_tables(plan, results, meta["device"], console)
        path = layer_report.write_report(directory, meta, plan, results, plots=not args.no_plots)
    else:
        report.print_tables(plan, results, console, causal)
        path = report.write_report(directory, meta, plan, results, causal, make_plots=not args.no_plots)
    console.print(f"report: {path}")
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train":
        from flashmesh.train import cli as train_cli

        return train_cli.run(args, argv[1:], parser)
    if args.command == "tune":
        from flashmesh.bench import tune

        return tune.cli(args, argv[1:], parser)
    if args.command != "bench":
        parser.print_help()
        return 0
    return bench(args, argv[1:], parser)


if __name__ == "__main__":
    raise SystemExit(main())
