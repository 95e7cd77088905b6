"""What a `--preset cp` run leaves behind: terminal tables, results.json, report.md and plots.

Same folder and json as every preset (`report.results_dir`, `report.write_json`, with the
workload facts of `context.facts` beside the rows). The plots: speed-up over one device per
order and strategy (one per mode), memory per device as a fraction of one device's, and the
emulated ranks' times stacked against the one-device call.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from flashmesh.bench import report, runner  # noqa: E402
from flashmesh.bench.context import CPResult  # noqa: E402
from flashmesh.bench.plots import MODE_NAMES  # noqa: E402
from flashmesh.bench.shapes import CP_STRATEGIES, EMULATED_CP, Preset  # noqa: E402

COLUMNS = ("row", "mode", "ms", "speed-up", "TFLOP/s", "memory/device", "of one device", "error", "status")
_COLOURS = {"ring": "tab:blue", "all_gather": "tab:orange", "all_to_all": "tab:green"}


def _x(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}x"


def status_text(r: CPResult) -> str:
    if r.status in runner.TIMED:
        text = r.status if r.status != runner.OK else "ok"
        extra = "; ".join(x for x in (r.verdict, r.detail, r.reason) if x)
        return f"{text} ({extra})" if extra else text
    return f"{r.status}: {r.reason}" if r.reason else r.status


def row_cells(r: CPResult) -> list[str]:
    return [r.label, r.mode, report.fmt_ms(r.ms), _x(r.speedup), report.fmt_tflops(r.tflops),
            report.fmt_bytes(r.memory_bytes), _x(r.memory_fraction, 3), report.fmt_err(r.error), status_text(r)]


def _words(xs) -> str:
    return " ".join(str(x) for x in xs)


def _order_rows(entry: dict) -> list[list[str]]:
    rows = []
    for label, o in entry["orders"].items():
        bal, auto = o["balance"], o["auto"]
        rows.append([
            label,
            bal.get("error") or f"{bal['balance']:.3f}",
            "" if "error" in bal else _words(bal["work_per_rank"]),
            "" if "error" in bal else f"{bal['kv_received_total']} ({_words(bal['kv_received_per_rank'])})",
            auto.get("error") or auto["strategy"],
            "" if "error" in auto else _words(auto["hops"]),
            "" if "error" in auto else ", ".join(f"{k} {b / 2**20:.2f} MiB" for k, b in auto["received_bytes"].items()),
        ])
    return rows


ORDER_COLUMNS = ("order", "balance (max/mean)", "visible pairs per rank", "K/V tokens received (per rank)",
                 "auto picks", "ring hops", "bytes received per rank")


def _planner_line(entry: dict) -> str:
    p = entry["planner"]
    return f"planner: {p['error']}" if "error" in p else f"planner: {p['describe']}"


# -- terminal ---------------------------------------------------------------------------------
def print_tables(preset: Preset, results: list[CPResult], facts: dict | None, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for entry in (facts or {}).get("cp_workloads", []):
        table = Table(title=f"{entry['shape']} over cp={entry['cp']} ({', '.join(entry['groups'])})",
                      title_justify="left", caption=_planner_line(entry), caption_justify="left")
        for col in ORDER_COLUMNS:
            table.add_column(col)
        for cells in _order_rows(entry):
            table.add_row(*cells)
        console.print(table)
    style = {runner.OK: "green", runner.UNCHECKED: "yellow", runner.WRONG: "bold red", runner.ERROR: "red",
             runner.OOM: "magenta"}
    for group in preset.groups:
        rows = [r for r in results if r.group == group.name]
        if not rows:
            continue
        table = Table(title=group.title, title_justify="left")
        for col in COLUMNS:
            table.add_column(col, justify="left" if col in ("row", "mode", "status") else "right",
                             no_wrap=True, overflow="ellipsis", max_width=80 if col == "status" else None)
        for r in rows:
            cells = row_cells(r)
            table.add_row(*cells[:-1], f"[{style.get(r.status, 'dim')}]{cells[-1]}[/]")
        console.print(table)


# -- plots ------------------------------------------------------------------------------------
def speedup_plot(rows: list[CPResult], mode: str, path: Path, device: str) -> bool:
    """Bars per order, one per strategy: speed-up over one device (lines at 1 and at cp)."""
    rows = [r for r in rows if r.mode == mode and r.kind == "cp"]
    if not rows:
        return False
    orders = list(dict.fromkeys(r.label.partition("/")[2] for r in rows))
    strategies = [s for s in CP_STRATEGIES if any(r.strategy == s for r in rows)]
    width = 0.8 / len(strategies)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(orders) + 3), 5))
    labelled = set()
    for i, s in enumerate(strategies):
        for j, order in enumerate(orders):
            r = next((r for r in rows if r.strategy == s and r.label.partition("/")[2] == order), None)
            x = j + (i - (len(strategies) - 1) / 2) * width
            if r is not None and r.speedup is not None:
                ax.bar(x, r.speedup, width=width, color=_COLOURS[s], label=None if s in labelled else s)
                labelled.add(s)
            elif r is not None:  # a row with no bar says why in its slot
                ax.text(x, 0.02, r.status, transform=ax.get_xaxis_transform(), rotation=90, ha="center",
                        va="bottom", fontsize=7, color="dimgray")
    cp = rows[0].cp
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(cp, color="gray", linewidth=0.8, linestyle="--", label=f"ideal ({cp}x)")
    ax.set_xticks(range(len(orders)))
    ax.set_xticklabels(orders)
    ax.set_ylabel("Speed-up over one device (x, higher is better)")
    ax.set_title(f"Context parallelism over {cp} devices: speed-up, {MODE_NAMES[mode]}\n"
                 f"{rows[0].shape.describe()} · {device}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(True, axis="y", alpha=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def memory_plot(rows: list[CPResult], path: Path, device: str) -> bool:
    """Memory per device as a fraction of one device's (forward+backward if measured), line at 1/cp."""
    mode = "fwdbwd" if any(r.mode == "fwdbwd" for r in rows) else "fwd"
    rows = [r for r in rows if r.mode == mode and r.kind == "cp" and r.memory_fraction is not None]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(max(7.0, 0.5 * len(rows) + 3), 5))
    ax.bar(range(len(rows)), [r.memory_fraction for r in rows], color=[_COLOURS[r.strategy] for r in rows])
    cp = rows[0].cp
    ax.axhline(1.0 / cp, color="gray", linewidth=0.8, linestyle="--", label=f"1/cp = {1 / cp:.3f}")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r.label for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("Memory per device / one device's (lower is better)")
    ax.set_title(f"Compiled memory per device, {MODE_NAMES[mode]} · {device}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def emulated_plot(rows: list[CPResult], mode: str, path: Path, device: str) -> bool:
    """One-device bars against the ranks' times stacked, per program."""
    rows = [r for r in rows if r.mode == mode]
    bars = [(r.label, [r.ms]) for r in rows if r.kind == "one_device" and r.timed]
    for variant in dict.fromkeys(r.label.split(" · ")[1] for r in rows if r.kind == "rank"):
        ranks = sorted((r for r in rows if r.kind == "rank" and r.label.endswith(variant) and r.timed),
                       key=lambda r: r.rank)
        if ranks:
            bars.append((f"{variant} (ranks 0-{len(ranks) - 1})", [r.ms for r in ranks]))
    if not bars:
        return False
    fig, ax = plt.subplots(figsize=(9, 0.7 * len(bars) + 2))
    cmap = plt.get_cmap("tab10")
    labelled = set()
    for i, (label, parts) in enumerate(bars):
        left = 0.0
        for j, ms in enumerate(parts):
            name = f"rank {j}" if len(parts) > 1 else None
            ax.barh(i, ms, left=left, color=cmap(j if name else 7), edgecolor="white",
                    label=None if name in labelled else name)
            labelled.add(name)
            left += ms
        ax.text(left, i, f" {left:.3g} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(bars)))
    ax.set_yticklabels([b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("Median time (ms; ranks stacked: their sum is what cp ranks compute in all)")
    ax.set_title(f"The ranks' work of cp={EMULATED_CP} on one device, "
                 f"{MODE_NAMES[mode]}\n{rows[0].shape.describe()} · {device}", fontsize=10)
    ax.grid(True, axis="x", alpha=0.25)
    if labelled - {None}:
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def make_plots(preset: Preset, results: list[CPResult], directory: Path, device: str) -> dict:
    made: dict[str, list[tuple[str, str]]] = {}
    for group in preset.groups:
        rows = [r for r in results if r.group == group.name]
        jobs = []
        if group.name == "strategies":
            for mode in group.modes:
                jobs.append((f"cp_speedup_{mode}.png", f"Speed-up over one device, {MODE_NAMES[mode]}",
                             lambda p, mode=mode: speedup_plot(rows, mode, p, device)))
            jobs.append(("cp_memory.png", "Memory per device", lambda p: memory_plot(rows, p, device)))
        else:
            for mode in group.modes:
                jobs.append((f"emulated_ranks_{mode}.png", f"Ranks on one device, {MODE_NAMES[mode]}",
                             lambda p, mode=mode: emulated_plot(rows, mode, p, device)))
        for filename, title, draw in jobs:
            if draw(directory / filename):
                made.setdefault(group.name, []).append((title, filename))
    return made


# -- markdown ---------------------------------------------------------------------------------
def _md(cells) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def markdown(meta: dict, preset: Preset, results: list[CPResult], facts: dict | None, plots: dict) -> str:
    lines = [
        f"# flashmesh bench: `{meta['preset']}` on {meta['device']}", "", preset.description, "",
        "| | |", "|---|---|",
        f"| date | {meta['date']} {meta['time_utc']} UTC |",
        f"| device | {meta['device']} ({meta['platform']}, {meta['device_count']} device(s)) |",
        f"| commit | `{meta['commit']}` |",
        f"| jax | {meta['jax_version']} |",
        f"| command | `{meta['command']}` |", "",
        "How to read this report:", "",
        f"- **ms**: {meta['timing']} ({meta['warmup']} warm-up calls, up to {meta['iters']} timed in "
        f"{meta.get('rounds', 1)} rounds). The context-parallel rows of one mode are timed in the same "
        "rounds as the one-device row.",
        "- **speed-up**: the one-device row's ms over the row's (same run, same mode).",
        f"- **TFLOP/s**: of the whole call, every device together; {meta['flop_formula']}.",
        "- **memory/device**: XLA's buffer plan of one device's compiled program (arguments + outputs "
        "+ temporaries); **of one device** is its fraction of the one-device row's (ideal: 1/cp).",
        "- **error**: max |x - ref| / max |ref| over out (and dq, dk, dv for fwd+bwd). The one-device "
        "row is checked against flashmesh's float32 reference; every context-parallel or emulated row "
        "against the one-device outputs, before it is timed. A wrong row is reported, not timed.",
        "- **balance**: max / mean visible (query, key) pairs per rank when the workload is stored in "
        "that order; **K/V tokens received**: distinct key tokens a rank's queries see on other ranks "
        "(exact counts, `flashmesh.parallel.schedule`). **auto picks**: `explain(strategy=\"auto\")`.", "",
    ]
    for entry in (facts or {}).get("cp_workloads", []):
        lines += [f"## Workload facts: `{entry['shape']}` over cp={entry['cp']}", "", _planner_line(entry), "",
                  _md(ORDER_COLUMNS), "|" + "---|" * len(ORDER_COLUMNS)]
        lines += [_md(cells) for cells in _order_rows(entry)] + [""]
    for group in preset.groups:
        rows = [r for r in results if r.group == group.name]
        if not rows:
            continue
        lines += [f"## {group.title}", ""]
        if group.description:
            lines += [group.description, ""]
        lines += [f"Shape: `{rows[0].shape.name}` ({rows[0].shape.describe()})", ""]
        lines += [_md(COLUMNS), "|" + "---|" * len(COLUMNS)] + [_md(row_cells(r)) for r in rows] + [""]
        verdicts = [r for r in rows if r.kind == "sum" and r.verdict]
        if verdicts:
            lines += ["Sum of the ranks against one device:", ""]
            lines += [f"- {r.mode} {r.label}: {r.verdict}" for r in verdicts] + [""]
        for title, filename in plots.get(group.name, []):
            lines += [f"![{title}]({filename})", ""]
    return "\n".join(lines)


def write_report(directory: Path, meta: dict, preset: Preset, results: list[CPResult], facts: dict | None,
                 plots: bool = True) -> Path:
    """results.json, the PNG plots and report.md into `directory`; returns report.md's path."""
    made = make_plots(preset, results, directory, meta["device"]) if plots else {}
    report.write_json(directory / "results.json", meta, results, facts)
    path = directory / "report.md"
    path.write_text(markdown(meta, preset, results, facts, made))
    return path
