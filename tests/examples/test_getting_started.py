"""The ported getting-started guide (examples/getting_started.py) runs end to end on CPU at its
--small size, prints what the guide prints, and holds the same class text as the package's one
copy (flashmesh.bench.layer_models)."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "getting_started.py"
GUIDE_CLASSES = ("FlaxMLP", "FlaxTransformerLayer", "TEUnfusedMLP", "TEUnfusedTransformerLayer",
                 "TEFusedTransformerLayer")
# XLA's CPU back end at its lowest optimisation: the guide compiles ~250 programs (most of them
# its eager inits, op by op), and at these sizes compiling is nearly all of the run.
FAST_CPU_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _classes(path: pathlib.Path) -> dict[str, str]:
    text = path.read_text()
    return {node.name: ast.get_source_segment(text, node) for node in ast.parse(text).body
            if isinstance(node, ast.ClassDef)}


def test_the_example_and_the_package_hold_the_same_guide_classes():
    example = _classes(EXAMPLE)
    package = _classes(ROOT / "src" / "flashmesh" / "bench" / "layer_models.py")
    assert set(GUIDE_CLASSES) <= set(example)
    for name in GUIDE_CLASSES:
        assert example[name] == package[name], f"{name} differs between the example and layer_models.py"


IMPORTS = {  # the example's import lines and the guide's
    "import flashmesh.te as te": "import transformer_engine.jax as te",
    "import flashmesh.te.flax as te_flax": "import transformer_engine.jax.flax as te_flax",
    "from flashmesh.te.flax.transformer import DotProductAttention as TEDotProductAttention":
        "from transformer_engine.jax.flax.transformer import DotProductAttention as TEDotProductAttention",
    "from flashmesh.te.recipe import Format, DelayedScaling":
        "from transformer_engine.common.recipe import Format, DelayedScaling",
}


def _code_lines(text: str) -> list[str]:
    """The example's code after its docstring, without the marked flashmesh additions (the
    `import sys` line and the indented --small block), import lines mapped back."""
    body = text.split('"""', 2)[2].splitlines()
    lines, in_small = [], False
    for line in body:
        if line.startswith('if "--small" in sys.argv:'):
            in_small = True
            continue
        if in_small and (line.startswith(" ") or not line.strip()):
            continue
        in_small = False
        if line.strip() and "# flashmesh:" not in line:
            lines.append(IMPORTS.get(line, line))
    return lines


def test_only_the_import_lines_differ_from_the_guide():
    """The example's code lines are the guide's own lines in the guide's order (the guide's
    text is prose around its code), every code cell of the guide is there, and its only
    additions are the marked flashmesh ones."""
    guide_path = ROOT.parent / "shared" / "reference" / "004_7938b2da6a7638f9.txt"
    if not guide_path.exists():
        pytest.skip("the reference guide is not beside this checkout")
    guide = guide_path.read_text().splitlines()
    example = EXAMPLE.read_text()
    mine = _code_lines(example)
    at = 0
    for line in mine:  # a subsequence of the guide's lines, verbatim
        while at < len(guide) and guide[at] != line:
            at += 1
        assert at < len(guide), f"not the guide's line (or out of order): {line!r}"
        at += 1
    assert sum(line.startswith("utils.speedometer(") for line in mine) == 6
    assert len(mine) == 313  # the non-blank lines of the guide's twelve code cells, all of them
    assert set(IMPORTS) <= set(example.splitlines())


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="--small is the CPU path; on GPUs run the example")
def test_getting_started_runs_small():
    env = dict(os.environ, XLA_FLAGS=FAST_CPU_COMPILE, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(EXAMPLE), "--small"], cwd=EXAMPLE.parent, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    printed = out.stdout
    assert "Pure Flax FlaxTransformerLayer initialized successfully!" in printed
    # The guide's parameter tree at the small size (hidden 64, FFN 256, 4 heads of 16 -> Flax's 4 x 4).
    assert "'Dense_0': {'bias': (192,), 'kernel': (64, 192)}" in printed
    assert "'query': {'bias': (4, 4), 'kernel': (64, 4, 4)}" in printed
    assert "Input shape: (2, 32, 64)\nOutput shape: (2, 32, 64)\nOutput dtype: float32\n" in printed
    assert "Forward pass completed successfully!" in printed
    times = [float(t) for t in re.findall(r"^Mean time: ([0-9.e+-]+) ms$", printed, re.M)]
    assert len(times) == 6 and all(t > 0 for t in times), printed  # the guide's six timings
