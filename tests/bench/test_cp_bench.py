"""`flashmesh bench --preset cp --quick` end to end on fake CPU devices: every row checked
before it is timed, json with the workload facts, a report with its plots."""

import json
import re

import jax
import pytest

from flashmesh.bench import cli, shapes


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    assert cli.main(["bench", "--preset", "cp", "--quick", "--no-progress", "--out", str(out)]) == 0
    (directory,) = out.iterdir()
    return directory


def test_rows_are_checked_then_timed(run_dir):
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-[a-z0-9-]+-cp", run_dir.name)
    data = json.loads((run_dir / "results.json").read_text())
    meta, rows = data["meta"], data["rows"]
    for key in ("date", "commit", "device", "jax_version", "command"):
        assert meta[key], key
    assert "--preset cp" in meta["command"]
    cp = jax.device_count()
    strategies = [r for r in rows if r["group"] == "strategies"]
    labels = {r["label"] for r in strategies}
    assert labels == {"one_device", *shapes.cp_rows(shapes.CP_TINY, quick=True)}
    assert {r["mode"] for r in strategies} == {"fwd", "fwdbwd"}
    for r in strategies:
        assert r["status"] == "ok", r
        assert r["ms"] > 0 and r["error"] < 1e-4 and r["memory_bytes"] > 0 and r["speedup"] > 0
        if r["kind"] == "cp":
            assert r["cp"] == cp and r["checked_against"].startswith("one_device")
            assert r["memory_fraction"] < 1  # no rank holds the whole problem


def test_emulated_ranks_add_up(run_dir):
    rows = [r for r in json.loads((run_dir / "results.json").read_text())["rows"]
            if r["group"] == "emulated_ranks"]
    for mode in ("fwd", "fwdbwd"):
        mine = [r for r in rows if r["mode"] == mode]
        ranks = [r for r in mine if r["kind"] == "rank"]
        assert len(ranks) == shapes.EMULATED_CP * len(shapes.EMULATED_VARIANTS)
        assert all(r["status"] == "ok" and r["error"] < 1e-4 and r["ms"] > 0 for r in ranks), ranks
        for variant in shapes.EMULATED_VARIANTS:
            (total,) = [r for r in mine if r["label"] == f"sum · {variant}"]
            parts = [r["ms"] for r in ranks if r["label"].endswith(variant)]
            assert total["ms"] == pytest.approx(sum(parts)) and total["ratio"] > 0 and total["verdict"]


def test_facts_and_report(run_dir):
    data = json.loads((run_dir / "results.json").read_text())
    entries = {e["cp"]: e for e in data["cp_workloads"]}
    four = entries[shapes.EMULATED_CP]
    # The tutorial's slots coincide with 4 contiguous shards: perfect balance, no K/V to move.
    assert four["planner"]["order"] == "contiguous" and four["planner"]["kv_volume_total"] == 0
    assert four["orders"]["contiguous"]["balance"]["balance"] == pytest.approx(1.0)
    for entry in entries.values():
        for order in entry["orders"].values():
            assert order["auto"]["strategy"] in shapes.CP_STRATEGIES, order
    report = (run_dir / "report.md").read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)
    assert {"cp_speedup_fwd.png", "cp_memory.png", "emulated_ranks_fwdbwd.png"} <= set(links)
    for name in links:
        assert (run_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "Workload facts" in report and "sum · steps" in report


def test_cp_rows_and_selection():
    assert shapes.CpRow.parse("all_gather/striped:512") == shapes.CpRow("all_gather", "striped", 512)
    assert shapes.CpRow.parse("ring/dual_chunk").label == "ring/dual_chunk"
    for bad in ("ring/striped", "warp/contiguous", "ring/contiguous:4"):
        with pytest.raises(ValueError, match="cp row"):
            shapes.CpRow.parse(bad)
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--preset", "cp", "--implementations", "ring/contiguous,steps"])
    plan = cli.make_plan(args, "cpu")
    assert [g.implementations for g in plan.groups] == [("one_device", "ring/contiguous"),
                                                        ("one_device", "steps")]
    assert plan.kind == "context_parallel"
    with pytest.raises(ValueError, match="cp row"):
        cli.make_plan(parser.parse_args(["bench", "--preset", "cp", "--implementations", "xla"]), "cpu")
    one_gpu = shapes.cp("gpu", devices=1)
    assert [g.name for g in one_gpu.groups] == ["emulated_ranks"]
    assert one_gpu.groups[0].shapes[0].T == 65536
    assert [g.name for g in shapes.cp("gpu", devices=8).groups] == ["strategies"]


def test_second_baseline_when_the_steps_run_another_backend():
    from flashmesh.bench import context, runner

    cfg = runner.RunConfig(dtype="f32", warmup=0, iters=1, rounds=1, progress=False)
    one = context.OneDevice(cfg, 2**30, share=False)
    rows, outputs, label = context.baselines("g", shapes.CP_TINY, "fwd", one, "chunked")
    assert [r.fields["label"] for r in rows] == ["one_device", "one_device:chunked"]
    assert label == "one_device:chunked" and len(outputs) == 1
    assert "differ by" in rows[1].fields["verdict"] and "disagree" not in rows[1].fields["verdict"]
    assert context.step_implementation(shapes.CP_TINY, "f32", 4) == "reference"  # the CPU's choice
