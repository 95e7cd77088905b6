"""`flashmesh bench` end to end on CPU: table, json, markdown report with existing PNGs."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flashmesh.bench import cli, runner


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    argv = ["bench", "--preset", "quick", "--quick", "--no-progress", "--out", str(out),
            "--shapes", "quick_causal,quick_T32,quick_T64",
            "--implementations", "naive,xla,flashmesh:reference,cudnn,flashmesh:cudnn,fa3"]
    assert cli.main(argv) == 0
    (directory,) = out.iterdir()
    return directory


def test_writes_valid_json(run_dir):
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-[a-z0-9-]+-quick", run_dir.name)
    data = json.loads((run_dir / "results.json").read_text())
    meta = data["meta"]
    for key in ("date", "commit", "device", "jax_version", "command", "flop_formula"):
        assert meta[key], key
    assert "--preset quick" in meta["command"]
    rows = data["rows"]
    # 1 masks shape x 2 modes x 6 + 2 sweep shapes x 1 mode x 6
    assert len(rows) == 2 * 6 + 2 * 6
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["implementation"] for r in ok} >= {"naive", "xla", "flashmesh:reference"}
    for r in ok:
        assert r["ms"] > 0 and r["tflops"] > 0 and r["error"] < 1e-4 and r["checked_against"]
        assert r["memory_bytes"] > 0 and r["flops"] > 0
    assert data["causal_check"]


def test_unsupported_rows_have_reasons(run_dir):
    rows = json.loads((run_dir / "results.json").read_text())["rows"]
    for name in ("cudnn", "flashmesh:cudnn", "fa3"):
        mine = [r for r in rows if r["implementation"] == name]
        assert mine
        if runner.platform() != "gpu":
            assert all(r["status"] != "ok" and r["reason"] and r["ms"] is None for r in mine), mine


def test_report_links_existing_plots(run_dir):
    report = (run_dir / "report.md").read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)
    assert any(name.startswith("latency_quick_seq_sweep") for name in links)
    assert any(name.startswith("speedup_") for name in links)
    for name in links:
        png = run_dir / name
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "TFLOP/s" in report and "2 * B * N * pairs * (Dqk + Dv)" in report
    assert "cuDNN needs an NVIDIA GPU" in report or runner.platform() == "gpu"


def test_plan_options():
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--shapes", "codelab_T1024,quick_T32", "--dtype", "bf16",
                              "--modes", "fwdbwd", "--implementations", "xla@f32,xla,naive"])
    plan = cli.make_plan(args, "cpu")
    assert plan.name == "custom"
    assert [s.name for g in plan.groups for s in g.shapes] == ["codelab_T1024", "quick_T32"]
    assert all(g.implementations == ("xla@bf16", "naive@bf16") and g.modes == ("fwdbwd",) for g in plan.groups)
    quick = cli.make_plan(parser.parse_args(["bench", "--preset", "codelab", "--quick"]), "gpu")
    sweep = next(g for g in quick.groups if g.name == "seq_sweep")
    assert len(sweep.shapes) == 3
    gpu = cli.make_plan(parser.parse_args(["bench", "--preset", "codelab"]), "gpu")
    sweep = next(g for g in gpu.groups if g.name == "seq_sweep")
    assert max(s.T for s in sweep.shapes) >= 32768  # on to where naive runs out of memory
    assert cli.make_plan(parser.parse_args(["bench"]), "gpu").name == "anchors"
    assert cli.make_plan(parser.parse_args(["bench"]), "cpu").name == "small"


def test_bad_arguments_are_one_line_errors(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--shapes", "nope", "--out", "/nonexistent/never"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--shapes" in err and "nope" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit):
        cli.main(["bench", "--implementations", "xla,warp9"])
    assert "warp9" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "--rounds", "0"])
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err


def test_list_and_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "flashmesh", "bench", "--list"], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).parent)
    assert out.returncode == 0, out.stderr
    assert "seed000_gqa_swa" in out.stdout and "flashmesh:reference" in out.stdout


def test_interrupted_run_still_writes_its_report(tmp_path, monkeypatch):
    def run(plan, config, on_result=None):  # one row, then Ctrl-C / SIGTERM
        shape = plan.groups[0].shapes[0]
        on_result(runner.Result(plan.groups[0].name, shape, "fa3", "fa3", "f32", "fwd",
                                runner.NOT_INSTALLED, reason="no flash_attn3_jax"))
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run", run)
    argv = ["bench", "--preset", "quick", "--groups", "masks", "--shapes", "quick_full", "--no-progress",
            "--no-plots", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    (directory,) = tmp_path.iterdir()
    data = json.loads((directory / "results.json").read_text())
    assert data["meta"]["interrupted_after_rows"] == 1 and len(data["rows"]) == 1
    assert "no flash_attn3_jax" in (directory / "report.md").read_text()


def test_groups_option():
    parser = cli.build_parser()
    plan = cli.make_plan(parser.parse_args(["bench", "--preset", "codelab", "--groups", "heads,batch_sweep"]), "cpu")
    assert [g.name for g in plan.groups] == ["batch_sweep", "heads"]
    with pytest.raises(ValueError, match="--groups"):
        cli.make_plan(parser.parse_args(["bench", "--preset", "codelab", "--groups", "nope"]), "cpu")
