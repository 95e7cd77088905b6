"""`flashmesh train`: train the byte-level GPT in bf16 and in FP8 and report both loss curves.

    flashmesh train                      # the GPU size: 4 layers, hidden 768, T 512, batch 64, 1500 steps
    flashmesh train --tiny               # the CI size: 2 layers, hidden 32, T 32, batch 8, 20 steps (CPU)
    flashmesh train --precisions bf16 --steps 300

`add_arguments(parser)` fills a (sub)parser; `run(args, argv)` runs what it parsed;
`main(argv)` does both on its own parser. The results go to
`<out>/<date>-<device>-train/` (`-train-tiny` with --tiny): results.json, report.md, loss.png.
Exit status 0 when every precision ran (the 2 % check is reported, not an exit status), 1 when
one failed (its error is recorded in the report), 2 for a bad option.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

# Each size: (model, training) settings; an option given on the command line replaces its entry.
SIZES = {
    "gpu": dict(layers=4, hidden=768, heads=None, seq=512, batch=64, steps=1500, lr=1e-3,
                eval_every=100, eval_batches=8),
    "tiny": dict(layers=2, hidden=32, heads=2, seq=32, batch=8, steps=20, lr=3e-3,
                 eval_every=5, eval_batches=2),
}


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `flashmesh train` options (defaults None: the chosen size's value)."""
    parser.add_argument("--tiny", action="store_true",
                        help="the CI size: 2 layers, hidden 32, 2 heads, T 32, batch 8, 20 steps")
    parser.add_argument("--steps", type=int, help="optimizer steps (default 1500; --tiny 20)")
    parser.add_argument("--layers", type=int, help="TransformerLayers (default 4; --tiny 2)")
    parser.add_argument("--hidden", type=int, help="model width (default 768; --tiny 32)")
    parser.add_argument("--heads", type=int, help="attention heads (default hidden / 64; --tiny 2)")
    parser.add_argument("--seq", type=int, help="window length T in bytes (default 512; --tiny 32)")
    parser.add_argument("--batch", type=int, help="windows per step (default 64; --tiny 8)")
    parser.add_argument("--precisions", type=_csv, default=["bf16", "fp8"], metavar="P,...",
                        help="bf16 and/or fp8, run in this order (default bf16,fp8)")
    parser.add_argument("--lr", type=float, help="peak learning rate (default 1e-3; --tiny 3e-3)")
    parser.add_argument("--warmup", type=int, help="warm-up steps (default min(100, steps / 10))")
    parser.add_argument("--eval-every", type=int, help="validation loss every N steps (default 100; --tiny 5)")
    parser.add_argument("--positions", choices=("learned", "rotary"), default="learned",
                        help="learned position embedding or the layers' rotary embedding (default learned)")
    parser.add_argument("--untied", action="store_true",
                        help="a separate output projection (DenseGeneral) instead of the embedding's transpose")
    parser.add_argument("--seed", type=int, default=0, help="seed of parameters, batches and validation windows")
    parser.add_argument("--out", default="benchmarks/results", metavar="DIR",
                        help="parent folder of the results folder (default: benchmarks/results)")
    parser.add_argument("--no-plots", action="store_true", help="skip loss.png")
    parser.add_argument("--no-progress", action="store_true", help="no live progress bar")
    return parser


def configs(args):
    """(GPTConfig, TrainConfig, precisions) from parsed options; ValueError names a bad one."""
    from flashmesh.train import gpt, loop

    size = dict(SIZES["tiny" if args.tiny else "gpu"])
    for name in ("steps", "layers", "hidden", "heads", "seq", "batch", "lr", "eval_every"):
        if getattr(args, name) is not None:
            size[name] = getattr(args, name)
    precisions = list(args.precisions)
    bad = [p for p in precisions if p not in loop.PRECISIONS]
    if bad or not precisions or len(set(precisions)) != len(precisions):
        raise ValueError(f"--precisions must name each of {', '.join(loop.PRECISIONS)} at most once, "
                         f"got {','.join(precisions) or 'nothing'}")
    model = gpt.GPTConfig(layers=size["layers"], hidden=size["hidden"], heads=size["heads"], seq=size["seq"],
                          positions=args.positions, tied=not args.untied)
    steps = size["steps"]
    warmup = args.warmup if args.warmup is not None else min(100, steps // 10)
    training = loop.TrainConfig(steps=steps, batch=size["batch"], lr=size["lr"], warmup=warmup,
                                eval_every=size["eval_every"], eval_batches=size["eval_batches"], seed=args.seed)
    return model, training, precisions


def run(args, argv: list[str], parser: argparse.ArgumentParser | None = None) -> int:
    """Run what `add_arguments`' options parsed into `args`; `argv` is recorded as the command."""
    from rich.console import Console

    try:
        model, training, precisions = configs(args)
    except ValueError as e:  # user mistakes: one line, naming the option
        if parser is None:
            raise
        parser.exit(2, f"flashmesh train: error: {e}\n")
    from flashmesh.train import data, loop, report

    console = Console() if sys.stdout.isatty() else Console(width=160)
    corpus = data.load_corpus()
    meta = report.metadata("train-tiny" if args.tiny else "train",
                           dict(model=model.to_dict(), training=dataclasses.asdict(training),
                                data=corpus.describe(), precisions=precisions), argv)
    console.print(f"flashmesh train on {meta['device']}: {model.layers} layers, hidden {model.hidden}, "
                  f"T {model.seq}, batch {training.batch}, {training.steps} steps, {', '.join(precisions)}; "
                  f"{corpus.train.size:,} training bytes from {len(corpus.train_files)} files")
    curves, failures = [], {}
    for precision in precisions:
        try:
            curves.append(loop.train(model, training, corpus, precision, progress=not args.no_progress))
        except Exception as e:  # noqa: BLE001  (a precision that cannot run is recorded, the other still reports)
            failures[precision] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            console.print(f"[red]{precision} failed: {failures[precision]}[/]")
    meta["failures"] = failures
    if curves:
        report.print_summary(curves, console)
    path = report.write_report(args.out, meta, curves, make_plots=not args.no_plots)
    console.print(f"report: {path}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = add_arguments(argparse.ArgumentParser(
        prog="flashmesh train", description="Train a small byte-level GPT on the Python standard library "
        "in bf16 and FP8 and report both loss curves."))
    return run(parser.parse_args(argv), argv, parser)


if __name__ == "__main__":
    raise SystemExit(main())
