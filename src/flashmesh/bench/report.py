"""What a run leaves behind: a terminal table, raw json, and a markdown report with plots.

Everything goes to `<out>/<date>-<device>-<preset>/`: `results.json` (metadata + one object
per row), `report.md` (how to read it, one table per group, the plots embedded) and the PNGs.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform as py_platform
import re
import subprocess
import sys
from pathlib import Path

import jax

from flashmesh.bench import checks, flops, runner
from flashmesh.bench.runner import Result
from flashmesh.bench.shapes import Preset

TIMING_TEXT = ("each row is compiled ahead of time, run once and compared with the float32 "
               "reference, then warmed up; the rows of one shape and mode are timed together in "
               "interleaved rounds, call by call (each call ended by jax.block_until_ready); "
               "ms is the median over all rounds; 'back to back' is the time per call of as many "
               "calls issued back to back with one synchronisation at the end, the median of 3 "
               "such batches interleaved across the rows (the host's dispatch "
               "hidden behind the device's work: closer to kernel time on short rows); 'kernel' is "
               "the device's kernel time per call from a jax.profiler trace of up to 5 calls (the "
               "sum of the GPU kernels' durations; '-' where the profiler gives none, e.g. on a CPU)")
MEMORY_TEXT = ("memory is XLA's buffer plan of the compiled call (arguments + outputs + "
               "temporaries); device_peak_bytes in the json is the device's high-water mark "
               "(device.memory_stats(), process-wide) where the device reports it")


# -- metadata ----------------------------------------------------------------------------------------
def git_commit(path: str | os.PathLike | None = None) -> str:
    """The commit of the checkout at `path` (default: the working directory), with
    "+modified" when tracked files differ from it, or 'unknown'.

    A copy of the tree whose .git is missing or stale (a remote benchmark machine) can name its
    commit in FLASHMESH_COMMIT; it is recorded as given, for the report only."""
    if os.environ.get("FLASHMESH_COMMIT"):
        return os.environ["FLASHMESH_COMMIT"]
    for where in (path or os.getcwd(), Path(__file__).resolve().parent):
        head = _git(where, "rev-parse", "--short=12", "HEAD")
        if head:
            changed = _git(where, "status", "--porcelain", "--untracked-files=no")
            return head + ("+modified" if changed else "")
    return "unknown"


def _git(where, *args: str) -> str | None:
    """git's stripped output in `where`, or None when git fails there."""
    try:
        out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def device_kind() -> str:
    return jax.devices()[0].device_kind


def device_slug(kind: str | None = None) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (for folder names)."""
    return re.sub(r"[^a-z0-9]+", "-", (kind or device_kind()).lower()).strip("-") or "device"


def metadata(preset: Preset, config: runner.RunConfig, argv: list[str] | None = None) -> dict:
    now = datetime.datetime.now(datetime.timezone.utc)
    import flashmesh

    return dict(
        date=now.strftime("%Y-%m-%d"), time_utc=now.strftime("%H:%M:%S"), preset=preset.name,
        preset_description=preset.description,
        command=" ".join(["flashmesh", "bench", *(argv if argv is not None else sys.argv[1:])]),
        commit=git_commit(), device=device_kind(), platform=runner.platform(),
        device_count=jax.device_count(), jax_version=jax.__version__,
        flashmesh_version=flashmesh.__version__, python=py_platform.python_version(),
        flop_formula=flops.FORMULA_TEXT, tolerances=checks.TOLERANCE, timing=TIMING_TEXT,
        memory=MEMORY_TEXT, default_dtype=config.dtype, warmup=config.warmup, iters=config.iters,
        max_seconds_per_row=config.max_seconds, rounds=config.rounds)


def results_dir(out: str | os.PathLike, meta: dict) -> Path:
    """`<out>/<date>-<device>-<preset>`, with -2, -3, ... when that folder already exists."""
    base = Path(out) / f"{meta['date']}-{device_slug(meta['device'])}-{meta['preset']}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    path.mkdir(parents=True)
    return path


def write_json(path: Path, meta: dict, results: list[Result], extra: dict | None = None) -> None:
    def clean(x):  # json has no inf/nan
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    payload = dict(meta=meta, **(extra or {}), rows=[r.to_dict() for r in results])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(clean(payload), indent=1))
    tmp.replace(path)  # a reader never sees half a file, even if the run is killed


# -- formatting --------------------------------------------------------------------------------------
def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms:.3f}" if ms < 100 else f"{ms:.1f}"


def fmt_tflops(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t:.1f}" if t >= 1 else f"{t:.3f}"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB"


def fmt_err(e: float | None) -> str:
    return "-" if e is None else f"{e:.1e}"


def status_text(r: Result) -> str:
    if r.status == runner.OK:
        return f"ok ({r.detail})" if r.detail else "ok"
    return f"{r.status}: {r.reason}" if r.reason else r.status


COLUMNS = ("shape", "implementation", "mode", "ms", "back to back", "kernel", "TFLOP/s", "memory", "error",
           "status")
NUMERIC = ("ms", "back to back", "kernel", "TFLOP/s", "memory", "error")


def row_cells(r: Result) -> list[str]:
    return [r.shape.name, r.label, r.mode, fmt_ms(r.ms), fmt_ms(r.ms_back_to_back), fmt_ms(r.ms_kernel),
            fmt_tflops(r.tflops),
            fmt_bytes(r.memory_bytes), fmt_err(r.error), status_text(r)]


# -- terminal ----------------------------------------------------------------------------------------
def print_tables(preset: Preset, results: list[Result], console=None, causal: list[dict] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if causal:
        table = Table(title="Causal mask: max |causal - full| (codelab step 7)", title_justify="left")
        for col in ("implementation", "first position (t=0)", "last position (t=T-1)"):
            table.add_column(col)
        for c in causal:
            if "error" in c:
                table.add_row(c["implementation"], c["error"], "")
            else:
                table.add_row(c["implementation"], f"{c['first_position_diff']:.4f}", f"{c['last_position_diff']:.2e}")
        console.print(table)
    style = {runner.OK: "green", runner.UNCHECKED: "yellow", runner.WRONG: "bold red",
             runner.ERROR: "red", runner.OOM: "magenta"}
    for group in preset.groups:
        rows = [r for r in results if r.group == group.name]
        if not rows:
            continue
        table = Table(title=group.title, title_justify="left", show_lines=False)
        for col in COLUMNS:
            table.add_column(col, justify="right" if col in NUMERIC else "left",
                             no_wrap=True, overflow="ellipsis", max_width=70 if col == "status" else None)
        for r in rows:
            cells = row_cells(r)
            table.add_row(*cells[:-1], f"[{style.get(r.status, 'dim')}]{cells[-1]}[/]")
        console.print(table)
    console.print(f"[dim]{flops.FORMULA_TEXT}. error = max|x - ref| / max|ref| over out (and dq, dk, dv).[/]")


# -- markdown ----------------------------------------------------------------------------------------
def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(meta: dict, preset: Preset, results: list[Result], plots: dict[str, list[tuple[str, str]]],
             causal: list[dict] | None = None) -> str:
    tol = ", ".join(f"{k} {v:.0e}" for k, v in meta["tolerances"].items())
    lines = [
        f"# flashmesh bench: `{meta['preset']}` on {meta['device']}",
        "",
        f"{preset.description}",
        "",
        "| | |", "|---|---|",
        f"| date | {meta['date']} {meta['time_utc']} UTC |",
        f"| device | {meta['device']} ({meta['platform']}, {meta['device_count']} device(s)) |",
        f"| commit | `{meta['commit']}` |",
        f"| jax | {meta['jax_version']} |",
        f"| command | `{meta['command']}` |",
        "",
        "How to read this report:",
        "",
        f"- **ms**: {meta['timing']} ({meta['warmup']} warm-up calls, up to {meta['iters']} timed in {meta.get('rounds', 1)} rounds).",
        f"- **TFLOP/s**: {meta['flop_formula']}. Masked pairs are not counted, so a kernel gets "
        "no credit for work the mask throws away.",
        f"- **error**: max |x - ref| / max |ref| against flashmesh's float32 reference, over the output "
        f"(and dq, dk, dv for fwd+bwd); a row above its dtype's tolerance ({tol}) is reported as a "
        "wrong result and not timed. Where the reference does not fit in memory it runs on a slice "
        "(see *checked against* in the json).",
        f"- **memory**: {meta['memory']}.",
        "- A row that cannot run says why (unsupported, not installed, out of memory); "
        "`fwdbwd` times the forward and the backward (gradients of q, k and v) together.",
        "",
    ]
    if causal:
        lines += ["## The causal mask (codelab step 7)", "",
                  "Max |causal - full| at the first and the last query: large at t=0 (it then sees only "
                  "itself), ~0 at t=T-1 (it sees every key either way).", "",
                  "| implementation | first position (t=0) | last position (t=T-1) |", "|---|---|---|"]
        for c in causal:
            if "error" in c:
                lines.append(f"| {c['implementation']} | {_md_escape(c['error'])} | |")
            else:
                lines.append(f"| {c['implementation']} | {c['first_position_diff']:.4f} | "
                             f"{c['last_position_diff']:.2e} |")
        lines.append("")
    for group in preset.groups:
        rows = [r for r in results if r.group == group.name]
        if not rows:
            continue
        lines += [f"## {group.title}", ""]
        if group.description:
            lines += [group.description, ""]
        shapes = dict.fromkeys(r.shape for r in rows)
        lines += ["Shapes: " + "; ".join(f"`{s.name}` ({s.describe()})" for s in shapes), ""]
        lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        for r in rows:
            lines.append("| " + " | ".join(_md_escape(c) for c in row_cells(r)) + " |")
        lines.append("")
        for title, filename in plots.get(group.name, []):
            lines += [f"![{title}]({filename})", ""]
    return "\n".join(lines)


def write_report(directory: Path, meta: dict, preset: Preset, results: list[Result],
                 causal: list[dict] | None = None, make_plots: bool = True) -> Path:
    """Write results.json, the PNG plots and report.md into `directory`; returns report.md's path."""
    plots: dict[str, list[tuple[str, str]]] = {}
    if make_plots:
        from flashmesh.bench import plots as plotting

        plots = plotting.make_plots(preset, results, directory, meta["device"])
    write_json(directory / "results.json", meta, results, dict(causal_check=causal or []))
    path = directory / "report.md"
    path.write_text(markdown(meta, preset, results, plots, causal))
    return path
