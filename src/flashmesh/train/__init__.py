"""A real training run: a small byte-level GPT on the Python standard library's sources,
trained in bf16 and in FP8 with flashmesh's TransformerEngine-named modules.

  data.py    the stdlib bytes, a deterministic train/validation split by file, random windows
  gpt.py     the model (embedding, N x TransformerLayer, final LayerNorm, output projection)
  loop.py    the jitted step (AdamW, warm-up + cosine, FP8 state threaded), validation, progress
  report.py  results.json, report.md and loss.png, and the FP8-vs-bf16 final-loss check
  cli.py     `flashmesh train`

Submodules import on use (`from flashmesh.train import loop`): `flashmesh bench`'s command line
adds `train`'s options from `cli` without loading the model, the loop or matplotlib.
"""

__all__ = ["cli", "data", "gpt", "loop", "report"]
