"""PNG plots of a run (matplotlib, Agg backend: no display needed).

Per group and mode: latency against the swept axis (sequence length or batch, log scales),
throughput against sequence length, speed-up bars against the naive baseline, and TFLOP/s
bars for groups of unrelated shapes. Each implementation keeps one colour in every plot;
an implementation that ran out of memory says from where in the legend.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.ticker import FuncFormatter  # noqa: E402

from flashmesh.bench import runner  # noqa: E402
from flashmesh.bench.runner import Result  # noqa: E402
from flashmesh.bench.shapes import Group, Preset  # noqa: E402

MODE_NAMES = {"fwd": "forward", "fwdbwd": "forward + backward"}
AXIS_NAMES = {"T": "Sequence length T (tokens, log scale)", "B": "Batch size B (log scale)"}
_ORDER = ["naive", "xla", "cudnn", "flashmesh", "flashmesh:chunked", "flashmesh:cudnn", "flashmesh:pallas_mosaic_gpu",
          "flashmesh:reference",
          "module", "fa3", "tokamax:mosaic", "tokamax:triton"]
_MARKERS = "osd^v<>PXh*"


def _style(label: str) -> dict:
    """A fixed colour per implementation (and a line style per dtype) across all plots."""
    name, _, dtype = label.partition("@")
    i = _ORDER.index(name) if name in _ORDER else len(_ORDER) + hash(name) % 5
    cmap = plt.get_cmap("tab20")
    return dict(color=cmap((2 * i) % 20 if dtype != "f32" else (2 * i + 1) % 20),
                marker=_MARKERS[i % len(_MARKERS)], linestyle="--" if dtype == "f32" else "-")


def _tokens(x, _pos=None) -> str:
    x = int(round(x))
    return f"{x // 1024}k" if x >= 1024 and x % 1024 == 0 else str(x)


def _minor_label(y: float, every: bool) -> str:
    """A minor tick's label: every one, or only 2x and 5x a power of ten (0.2, 0.5, 20, 50)."""
    mantissa = y / 10 ** math.floor(math.log10(y) + 1e-9)
    return f"{y:g}" if every or any(abs(mantissa - m) < 1e-6 for m in (2, 5)) else ""


def _log_y(ax, values) -> None:
    """Log y axis with plain numbers (50, 200, not 5x10^1). Within a decade, every minor tick
    is labelled; within two, those at 2x and 5x (all of them would overlap); beyond, none."""
    from matplotlib.ticker import NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos=None: f"{y:g}"))
    lo, hi = min(values), max(values)
    decades = math.log10(hi / max(lo, 1e-12))
    minor = FuncFormatter(lambda y, _pos=None: _minor_label(y, every=decades < 1))
    ax.yaxis.set_minor_formatter(minor if decades < 2 else NullFormatter())


def _fixed_dims(group: Group) -> str:
    """The shape description without the swept dimension, e.g. 'B=4, N=8, K=8, D=64, full'."""
    text = group.shapes[0].describe()
    return ", ".join(p for p in text.split(", ") if not p.startswith(f"{group.sweep}="))


def _baseline(rows: list[Result]) -> dict[tuple[str, str], float]:
    """Naive attention's ms per (shape, mode)."""
    return {(r.shape.name, r.mode): r.ms for r in rows if r.implementation == "naive" and r.status in runner.TIMED}


def _labels(rows: list[Result]) -> list[str]:
    return list(dict.fromkeys(r.label for r in rows))


def _failure_note(rows: list[Result], sweep: str | None) -> str:
    oom = [r for r in rows if r.status in (runner.OOM, runner.SKIPPED)]
    if oom and sweep:
        return f" (out of memory from {sweep}={_tokens(getattr(oom[0].shape, sweep))})"
    if not any(r.status in runner.TIMED for r in rows) and rows:
        return f" ({rows[0].status})"
    return ""


def latency_plot(group: Group, rows: list[Result], mode: str, path: Path, device: str,
                 throughput: bool = False) -> bool:
    """Latency (or TFLOP/s) against the swept axis; False if there is nothing to draw."""
    rows = [r for r in rows if r.mode == mode]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    drawn = False
    for label in _labels(rows):
        mine = [r for r in rows if r.label == label]
        ok = sorted((getattr(r.shape, group.sweep), r.tflops if throughput else r.ms)
                    for r in mine if r.status in runner.TIMED)
        note = _failure_note(mine, group.sweep)
        if not ok:
            continue
        ax.plot([x for x, _ in ok], [y for _, y in ok], label=label + note, **_style(label))
        drawn = True
    if not drawn:
        plt.close(fig)
        return False
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(_tokens))
    xs = sorted({getattr(s, group.sweep) for s in group.shapes})
    ax.set_xticks(xs)
    _log_y(ax, [y for line in ax.get_lines() for y in line.get_ydata()])
    ax.set_xlabel(AXIS_NAMES.get(group.sweep, group.sweep))
    if throughput:
        ax.set_ylabel("TFLOP/s (visible pairs, log scale; higher is better)")
        what = "throughput"
    else:
        ax.set_ylabel("Median time per call (ms, log scale; lower is better)")
        what = "latency"
    ax.set_title(f"Attention {MODE_NAMES[mode]} {what} vs {'sequence length' if group.sweep == 'T' else 'batch size'}\n"
                 f"{_fixed_dims(group)} · {device}", fontsize=11)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def bar_plot(group: Group, rows: list[Result], mode: str, path: Path, device: str, speedup: bool) -> bool:
    """Grouped bars per shape: speed-up over naive (speedup=True) or TFLOP/s."""
    all_rows = [r for r in rows if r.mode == mode]
    rows = [r for r in all_rows if r.status in runner.TIMED]
    base = _baseline(rows)
    categories = list(dict.fromkeys(r.shape.name for r in rows))
    missing = []
    if speedup:
        missing = [c for c in categories if (c, mode) not in base]
        categories = [c for c in categories if (c, mode) in base]
        rows = [r for r in rows if r.implementation != "naive" and r.shape.name in categories]
    labels = _labels(rows)
    if not categories or not labels:
        return False
    values = {(r.shape.name, r.label): (base[(r.shape.name, mode)] / r.ms if speedup else r.tflops) for r in rows}
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(min(14.0, max(8.0, 0.35 * len(categories) * len(labels) + 3)), 5.5))
    for i, label in enumerate(labels):
        xs = [j + (i - (len(labels) - 1) / 2) * width for j, c in enumerate(categories) if (c, label) in values]
        ys = [values[(c, label)] for c in categories if (c, label) in values]
        style = _style(label)
        ax.bar(xs, ys, width=width, label=label, color=style["color"],
               hatch="//" if style["linestyle"] == "--" else None, edgecolor="white")
    # A row that ran but has no bar says why in its slot (unsupported, error, out of memory...).
    failed = {(r.shape.name, r.label): r.status.split(":")[0] for r in all_rows
              if r.status not in runner.TIMED}
    for i, label in enumerate(labels):
        for j, c in enumerate(categories):
            if (c, label) not in values and (c, label) in failed:
                ax.text(j + (i - (len(labels) - 1) / 2) * width, 0.02, failed[(c, label)],
                        transform=ax.get_xaxis_transform(), rotation=90, ha="center", va="bottom",
                        fontsize=7, color="dimgray")
    by_name = {s.name: s for s in group.shapes}
    tick = (lambda c: _tokens(getattr(by_name[c], group.sweep))) if group.sweep else (lambda c: c)
    ax.set_xticks(range(len(categories)))
    ax.set_xticklabels([tick(c) for c in categories], rotation=0 if group.sweep else 25,
                       ha="center" if group.sweep else "right", fontsize=8)
    if group.sweep:
        ax.set_xlabel(AXIS_NAMES[group.sweep].replace(", log scale", ""))
    ys = list(values.values())
    if speedup and ys and max(ys) / max(min(ys), 1e-9) > 30:  # TFLOP/s stay linear: ceilings compare
        _log_y(ax, ys)
    subtitle = (_fixed_dims(group) + " · " if group.sweep else "") + device
    if speedup:
        ax.axhline(1.0, color="black", linewidth=0.8)
        naive = next((lab for lab in group.implementations if lab.partition("@")[0] == "naive"), "naive")
        ax.set_ylabel(f"Speed-up over {naive} (x, higher is better)")
        if missing:  # say where the baseline itself failed, rather than dropping shapes silently
            statuses = {r.status for r in all_rows if r.implementation == "naive" and r.shape.name in missing}
            subtitle += f"\nno naive baseline ({', '.join(sorted(statuses)) or 'not run'}) at: " + \
                ", ".join(tick(c) for c in missing)
        ax.set_title(f"{group.title}: speed-up over naive attention, {MODE_NAMES[mode]}\n{subtitle}", fontsize=11)
    else:
        ax.set_ylabel("TFLOP/s (visible pairs; higher is better)")
        ax.set_title(f"{group.title}: throughput, {MODE_NAMES[mode]}\n{subtitle}", fontsize=11)
    ax.grid(True, axis="y", which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)  # never over bars
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def make_plots(preset: Preset, results: list[Result], directory: Path, device: str) -> dict[str, list[tuple[str, str]]]:
    """Draw every plot of the run into `directory`; returns {group: [(title, file name)]}."""
    made: dict[str, list[tuple[str, str]]] = {}
    for group in preset.groups:
        rows = [r for r in results if r.group == group.name]
        for mode in group.modes:
            jobs = []
            if group.sweep:
                jobs.append((f"latency_{group.name}_{mode}.png", f"Latency vs {group.sweep}, {MODE_NAMES[mode]}",
                             lambda p: latency_plot(group, rows, mode, p, device)))
                if group.sweep == "T":
                    jobs.append((f"throughput_{group.name}_{mode}.png", f"TFLOP/s vs T, {MODE_NAMES[mode]}",
                                 lambda p: latency_plot(group, rows, mode, p, device, throughput=True)))
            else:
                jobs.append((f"tflops_{group.name}_{mode}.png", f"TFLOP/s, {MODE_NAMES[mode]}",
                             lambda p: bar_plot(group, rows, mode, p, device, speedup=False)))
            jobs.append((f"speedup_{group.name}_{mode}.png", f"Speed-up over naive, {MODE_NAMES[mode]}",
                         lambda p: bar_plot(group, rows, mode, p, device, speedup=True)))
            for filename, title, draw in jobs:
                if draw(directory / filename):
                    made.setdefault(group.name, []).append((title, filename))
    return made
