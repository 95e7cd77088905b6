"""What a `--preset layer` run leaves behind: terminal table, results.json, report.md, a plot.

Same folder and json as every preset (`report.results_dir`, `report.write_json`, with the goals
beside the rows). The plot: one bar per variant, the back-to-back step in ms (the measure of
the goals and of the recorded anchors, drawn where the run is the guide's size).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from flashmesh.bench import layer, layer_checks, report, runner  # noqa: E402
from flashmesh.bench.layer import LayerResult  # noqa: E402
from flashmesh.bench.shapes import LAYER_GUIDE, Preset  # noqa: E402

COLUMNS = ("variant", "ms", "back to back", "host enqueue", "vs plain Flax", "TFLOP/s", "memory", "FP8 update",
           "error out / dx / dparams", "status")
# The goals on one H200 at the guide's size (ms, or a share of the step), judged on the
# back-to-back step: the yardsticks (anchors2.py's timeit) and the guide's speedometer
# are means of steps issued back to back with one synchronisation at the end.
GOALS = (("transformer_layer", "ms_back_to_back", 14.5, "TransformerLayer bf16 <= 14.5 ms (back to back)"),
         ("transformer_layer_fp8", "ms_back_to_back", 10.0,
          "TransformerLayer FP8 (DelayedScaling) <= 10.0 ms (back to back)"),
         ("*_fp8", "fp8_update_share", 0.03, "FP8 state update <= 3% of the step"))
# Recorded on the H200 (anchors/RESULTS.md, 2026-12-01), drawn on the plot at the guide's size.
ANCHORS = ((36.8, "plain Flax, recorded 36.8-37.1 ms"), (15.6, "hand-written bf16 + cuDNN, recorded 15.6 ms"))


def goals(results: list[LayerResult], device: str) -> list[dict]:
    """Each goal against the run: met True/False, or None with why it does not apply."""
    out = []
    for label, field, bound, text in GOALS:
        rows = [r for r in results if (r.fp8 if label == "*_fp8" else r.label == label)]
        entry = dict(goal=text, bound=bound, field=field, met=None, measured=None, rows=[r.label for r in rows])
        values = [getattr(r, field) for r in rows if r.timed and getattr(r, field) is not None]
        if not rows or not values:
            entry["why"] = "no timed row"
        elif rows[0].shape != LAYER_GUIDE or "H200" not in device:
            entry["why"] = "the goals are for the guide's size on an H200"
            entry["measured"] = max(values)
        else:
            entry["measured"] = max(values)
            entry["met"] = len(values) == len(rows) and entry["measured"] <= bound
        out.append(entry)
    return out


def _share(r: LayerResult) -> str:
    if r.fp8_update_ms is None:
        return "-"
    return (f"{r.fp8_update_ms_back_to_back:.3g} ms b2b, {r.fp8_update_ms:.3g} ms alone "
            f"({100 * r.fp8_update_share:.2f}%)")


def _errors(r: LayerResult) -> str:
    if r.error is None:
        return "-"
    return " / ".join(report.fmt_err(e) for e in (r.out_error, r.dx_error, r.dparams_error))


def status_text(r: LayerResult) -> str:
    if r.status in runner.TIMED:
        extra = "; ".join(x for x in (r.detail, r.reason) if x)
        return ("ok" if r.status == runner.OK else r.status) + (f" ({extra})" if extra else "")
    return f"{r.status}: {r.reason}" if r.reason else r.status


def row_cells(r: LayerResult) -> list[str]:
    speedup = "-" if r.speedup is None else f"{r.speedup:.2f}x"
    return [r.label, report.fmt_ms(r.ms), report.fmt_ms(r.ms_back_to_back), report.fmt_ms(r.enqueue_ms), speedup, report.fmt_tflops(r.tflops),
            report.fmt_bytes(r.memory_bytes), _share(r), _errors(r), status_text(r)]


def _goal_text(g: dict) -> str:
    measured = "-" if g["measured"] is None else (
        f"{100 * g['measured']:.2f}%" if g["field"] == "fp8_update_share" else f"{g['measured']:.2f} ms")
    verdict = {True: "met", False: "NOT met", None: f"n/a ({g.get('why', '')})"}[g["met"]]
    return f"{g['goal']}: {measured}, {verdict}"


# -- terminal ---------------------------------------------------------------------------------
def print_tables(plan: Preset, results: list[LayerResult], device: str, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    style = {runner.OK: "green", runner.UNCHECKED: "yellow", runner.WRONG: "bold red", runner.ERROR: "red",
             runner.OOM: "magenta"}
    for group in plan.groups:
        rows = [r for r in results if r.group == group.name]
        if not rows:
            continue
        table = Table(title=f"{group.title}: {rows[0].shape.describe()}", title_justify="left")
        for col in COLUMNS:
            table.add_column(col, justify="left" if col in ("variant", "status") else "right",
                             no_wrap=True, overflow="ellipsis", max_width=80 if col == "status" else None)
        for r in rows:
            cells = row_cells(r)
            table.add_row(*cells[:-1], f"[{style.get(r.status, 'dim')}]{cells[-1]}[/]")
        console.print(table)
    for g in goals(results, device):
        console.print(f"[bold]goal[/] {_goal_text(g)}")
    console.print(f"[dim]{layer.FLOP_FORMULA}.[/]")


# -- plot -------------------------------------------------------------------------------------
def step_plot(rows: list[LayerResult], path: Path, device: str) -> bool:
    """Horizontal bars: the back-to-back step per variant; failed rows say why in their slot."""
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(rows) + 2.2))
    top = max([r.ms_back_to_back for r in rows if r.timed] or [1.0])
    for i, r in enumerate(rows):
        if r.timed:
            colour = "tab:orange" if r.fp8 else "tab:gray" if r.label == "flax" else "tab:blue"
            ax.barh(i, r.ms_back_to_back, color=colour)
            note = f" {r.ms_back_to_back:.3g} ms" + (f" ({r.speedup:.2f}x)" if r.speedup else "")
            ax.text(r.ms_back_to_back, i, note, va="center", fontsize=8)
        else:
            ax.text(0.01 * top, i, r.status, va="center", fontsize=8, color="dimgray")
    guide = rows[0].shape == LAYER_GUIDE
    if guide:
        for bound, text in [(g[2], g[3]) for g in GOALS if g[1] == "ms_back_to_back"] + list(ANCHORS):
            ax.axvline(bound, linestyle="--" if "<=" in text else ":", linewidth=0.9, color="black")
            ax.text(bound, len(rows) - 0.4, text, rotation=90, fontsize=7, va="top", ha="right")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r.label for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("Median training step, fwd+bwd (ms, lower is better; bars: orange FP8, blue bf16)")
    ax.set_title(f"The getting-started decoder layer, one training step\n{rows[0].shape.describe()} · {device}",
                 fontsize=10)
    ax.grid(True, axis="x", alpha=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- markdown ---------------------------------------------------------------------------------
def _md(cells) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def markdown(meta: dict, plan: Preset, results: list[LayerResult], plots: list[tuple[str, str]]) -> str:
    lines = [
        f"# flashmesh bench: `{meta['preset']}` on {meta['device']}", "", plan.description, "",
        "| | |", "|---|---|",
        f"| date | {meta['date']} {meta['time_utc']} UTC |",
        f"| device | {meta['device']} ({meta['platform']}, {meta['device_count']} device(s)) |",
        f"| commit | `{meta['commit']}` |",
        f"| jax | {meta['jax_version']} |",
        f"| command | `{meta['command']}` |",
        f"| input dtype | {meta['default_dtype']} |", "",
        "How to read this report:", "",
        f"- **ms**: {meta['timing']} ({max(meta['warmup'], 2)} warm-up steps, up to {meta['iters']} timed). "
        "Dropout is on in timed steps (the guide's `deterministic=False`).",
        "- **host enqueue**: the host's time per step to issue the back-to-back steps (before their "
        "synchronisation): where it nears the back-to-back figure the step is bound by the host, not the GPU.",
        "- **vs plain Flax**: the guide's FlaxTransformerLayer's back-to-back ms over the row's.",
        f"- **TFLOP/s**: {meta['flop_formula']}.",
        "- **FP8 update**: `jit(update_fp8_metas)` alone over the `fp8_metas` pytree and its cotangent, "
        "issued back to back (each call on the state the last one left, one synchronisation) and alone "
        "(median of synchronised calls, mostly dispatch); the share is the back-to-back figure over the "
        "row's back-to-back step. The amax and scale arithmetic itself runs inside the step's backward "
        "(the new state is the cotangent).",
        "- **error**: relative L2 error ||x - ref|| / ||ref|| of the output, dx and the worst parameter "
        "gradient (its denominator at least 1% of the whole gradient's norm apportioned to its size; "
        "Flax attention's key-bias gradient, zero in exact arithmetic, is left out), with dropout off, on the "
        "row's own parameters (moved by noise) after the warm-up (so FP8 rows have a warmed state). "
        "Other rows against a float32 reference (matmuls at HIGHEST): the guide's plain Flax layer for "
        "the Flax-attention structure, a plain-JAX einsum layer for TransformerEngine's; their "
        f"tolerance is {layer_checks.TOLERANCE_FACTOR}x the error of a plain layer of the row's structure in the run's dtype plus {layer_checks.TOLERANCE_FLOOR}. FP8 rows against "
        "their bf16 twin on the same parameters, tolerance 0.2 (their float32 error is in the json). "
        "A wrong row is reported, not timed.", "",
    ]
    for group in plan.groups:
        rows = [r for r in results if r.group == group.name]
        if not rows:
            continue
        lines += [f"## {group.title}", "", f"Shape: `{rows[0].shape.name}` ({rows[0].shape.describe()})", ""]
        if group.description:
            lines += [group.description, ""]
        lines += [_md(COLUMNS), "|" + "---|" * len(COLUMNS)] + [_md(row_cells(r)) for r in rows] + [""]
        lines += ["Rows:", ""] + [f"- `{r.label}`: {r.description}; checked against "
                                  f"{r.checked_against or '-'}" for r in rows] + [""]
    lines += ["## Goals", ""] + [f"- {_goal_text(g)}" for g in goals(results, meta["device"])] + [""]
    for title, filename in plots:
        lines += [f"![{title}]({filename})", ""]
    return "\n".join(lines)


def write_report(directory: Path, meta: dict, plan: Preset, results: list[LayerResult],
                 plots: bool = True) -> Path:
    """results.json, the PNG plot and report.md into `directory`; returns report.md's path."""
    made = []
    if plots and step_plot(results, directory / "layer_step_ms.png", meta["device"]):
        made.append(("Training step per variant", "layer_step_ms.png"))
    report.write_json(directory / "results.json", meta, results, dict(goals=goals(results, meta["device"])))
    path = directory / "report.md"
    path.write_text(markdown(meta, plan, results, made))
    return path
