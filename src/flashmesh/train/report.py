"""What a training run leaves behind: results.json, report.md and loss.png.

Everything goes to `<out>/<date>-<device>-train/` (`-train-tiny` for the CI size), named and
stamped (date, git commit, device) by the benchmark report's own helpers
(`flashmesh.bench.report`). The check: the FP8 run's final validation loss must lie within
`TOLERANCE` (2 %) of the bf16 run's, relative to bf16's.
"""

from __future__ import annotations

import datetime
import math
import platform as py_platform
import sys
from pathlib import Path

import jax

from flashmesh.bench import report as bench_report
from flashmesh.bench import runner
from flashmesh.train.loop import Curves

TOLERANCE = 0.02
COLORS = {"bf16": "tab:blue", "fp8": "tab:orange"}


def metadata(name: str, config: dict, argv: list[str] | None = None) -> dict:
    """Date, commit, device and versions (as `flashmesh bench` records them), plus `config`
    (the model, training and data settings). `name` ends the results folder's name."""
    import flashmesh

    now = datetime.datetime.now(datetime.timezone.utc)
    return dict(
        date=now.strftime("%Y-%m-%d"), time_utc=now.strftime("%H:%M:%S"), preset=name,
        command=" ".join(["flashmesh", "train", *(argv if argv is not None else sys.argv[1:])]),
        commit=bench_report.git_commit(), device=bench_report.device_kind(), platform=runner.platform(),
        device_count=jax.device_count(), jax_version=jax.__version__,
        flashmesh_version=flashmesh.__version__, python=py_platform.python_version(), **config)


def compare(curves: list[Curves], tolerance: float = TOLERANCE) -> dict | None:
    """The final-loss check: FP8's final validation loss against bf16's, or None unless both ran.

    relative = |fp8 - bf16| / bf16; passed when it is at most `tolerance` and both runs finished.
    """
    by_name = {c.precision: c for c in curves}
    if "bf16" not in by_name or "fp8" not in by_name:
        return None
    bf16, fp8 = by_name["bf16"].final_val_loss, by_name["fp8"].final_val_loss
    relative = abs(fp8 - bf16) / bf16 if math.isfinite(fp8) and math.isfinite(bf16) and bf16 > 0 else math.inf
    finished = all(by_name[p].status == "ok" for p in ("bf16", "fp8"))
    return dict(bf16_final_val_loss=bf16, fp8_final_val_loss=fp8, relative_difference=relative,
                tolerance=tolerance, passed=bool(finished and relative <= tolerance))


def check_text(check: dict | None) -> str:
    if check is None:
        return "no check (it needs both bf16 and fp8 runs)"
    verdict = "PASS" if check["passed"] else "FAIL"
    return (f"{verdict}: FP8 final validation loss {check['fp8_final_val_loss']:.4f} vs bf16 "
            f"{check['bf16_final_val_loss']:.4f} ({100 * check['relative_difference']:.2f} % apart; "
            f"limit {100 * check['tolerance']:.0f} %)")


# -- plot -------------------------------------------------------------------------------------------
def _smooth(values: list[float], width: int) -> list[float]:
    """Trailing mean over `width` steps (the first ones over what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def plot(curves: list[Curves], path: Path, title: str) -> Path:
    """Training (left: raw, faint; smoothed, solid) and validation (right) loss against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True, constrained_layout=True)
    for c in curves:
        color = COLORS.get(c.precision)
        width = max(1, len(c.steps) // 50)
        left.plot(c.steps, c.train_loss, color=color, alpha=0.25, linewidth=0.8)
        left.plot(c.steps, _smooth(list(c.train_loss), width), color=color, linewidth=1.6,
                  label=c.precision if width == 1 else f"{c.precision} (mean of {width} steps)")
        right.plot(c.val_steps, c.val_loss, color=color, marker="o", markersize=3, linewidth=1.6,
                   label=f"{c.precision}: final {c.final_val_loss:.4f}")
    for ax, name in ((left, "training loss"), (right, "validation loss")):
        ax.set_xlabel("step")
        ax.set_ylabel(f"{name} (nats per byte, log scale)")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _pos=None: f"{y:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda y, _pos=None: f"{y:g}"))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        ax.set_title(name)
        ax.tick_params(labelleft=True, which="both")  # sharey hides the right panel's labels
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -- markdown ---------------------------------------------------------------------------------------
def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(meta: dict, curves: list[Curves], check: dict | None, plot_file: str | None) -> str:
    model, run, corpus = meta["model"], meta["training"], meta["data"]
    params = f"{curves[0].params:,}" if curves else "-"
    lines = [
        f"# flashmesh train: byte-level GPT on the Python standard library, on {meta['device']}",
        "",
        "| | |", "|---|---|",
        f"| date | {meta['date']} {meta['time_utc']} UTC |",
        f"| device | {meta['device']} ({meta['platform']}, {meta['device_count']} device(s)) |",
        f"| commit | `{meta['commit']}` |",
        f"| jax | {meta['jax_version']} (Python {meta['python']}) |",
        f"| command | `{meta['command']}` |",
        f"| model | {model['layers']} x TransformerLayer, hidden {model['hidden']}, {model['num_heads']} heads, "
        f"MLP {model['mlp_width']}, {model['positions']} positions, "
        f"{'tied' if model['tied'] else 'separate'} output projection, {params} parameters |",
        f"| training | {run['steps']} steps of {run['batch']} x {model['seq']} bytes, AdamW (peak lr "
        f"{run['lr']:g}, {run['warmup']} warm-up steps, cosine to {run['min_lr_ratio']:g} x, weight decay "
        f"{run['weight_decay']:g}, clip {run['clip']:g}), seed {run['seed']} |",
        f"| data | {corpus['train_files']} train files ({corpus['train_bytes']:,} bytes), "
        f"{corpus['validation_files']} validation files ({corpus['validation_bytes']:,} bytes) under "
        f"`{corpus['root']}`; validation: {run['eval_batches']} fixed batches every {run['eval_every']} steps |",
        "",
        "Losses are cross-entropy in nats per byte (ln 256 = 5.545 for a uniform guess). Both runs start "
        "from the same parameters and see the same batches; FP8 is TransformerEngine's DelayedScaling "
        f"(HYBRID: E4M3 forward, E5M2 gradients, amax history {run['amax_history_len']}, 'max') on the "
        "layers' GEMMs; the embedding stays bf16, and so does the output projection when tied "
        f"({'tied here' if model['tied'] else 'here it is a separate DenseGeneral, in FP8'}).",
        "",
        f"**Check: {check_text(check)}**",
        "",
        *[f"**{p} failed**: {_md_escape(why)}" + "\n" for p, why in meta.get("failures", {}).items()],
        "| precision | final train loss | final validation loss | steps | status | compile s | train s "
        "| tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in curves:
        lines.append(f"| {c.precision} | {c.final_train_loss:.4f} | {c.final_val_loss:.4f} | {len(c.steps)} | "
                     f"{c.status} | {c.compile_seconds:.1f} | {c.train_seconds:.1f} | {c.tokens_per_second:,.0f} |")
    lines += ["", "final train loss: the mean over the last 5 % of the steps; train s: the loop without "
              "compilation and evaluations.", ""]
    if plot_file:
        lines += [f"![training and validation loss]({plot_file})", ""]
    return "\n".join(lines)


def write_report(out: str | Path, meta: dict, curves: list[Curves], make_plots: bool = True) -> Path:
    """Write results.json, loss.png and report.md into a new `<out>/<date>-<device>-<name>/`;
    returns report.md's path."""
    directory = bench_report.results_dir(out, meta)
    check = compare(curves)
    plot_file = None
    if make_plots and curves:
        plot(curves, directory / "loss.png", f"{meta['device']}: {', '.join(c.precision for c in curves)}")
        plot_file = "loss.png"
    bench_report.write_json(directory / "results.json", meta, curves, dict(check=check))
    path = directory / "report.md"
    path.write_text(markdown(meta, curves, check, plot_file))
    return path


def print_summary(curves: list[Curves], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="flashmesh train", title_justify="left")
    for col in ("precision", "final train", "final val", "steps", "status", "tokens/s"):
        table.add_column(col, justify="left" if col in ("precision", "status") else "right")
    for c in curves:
        table.add_row(c.precision, f"{c.final_train_loss:.4f}", f"{c.final_val_loss:.4f}", str(len(c.steps)),
                      c.status, f"{c.tokens_per_second:,.0f}")
    console.print(table)
    check = compare(curves)
    style = "dim" if check is None else "green" if check["passed"] else "bold red"
    console.print(f"[{style}]{check_text(check)}[/]")
