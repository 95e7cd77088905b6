"""Diagnosis only (numbers are claimed from `flashmesh bench --preset layer`): time the guide's
TransformerLayer fwd+bwd in bf16 and FP8 at the guide's size and count the FP8 GEMMs.

`--profile DIR` also traces 5 steps with jax.profiler into DIR and prints where a step's GPU
time goes: per category (GEMM, attention, other kernels), then the longest XLA ops and kernels,
and where the host's time goes while it enqueues the steps (`trace_table.host_table`).
The hand-written bf16 JAX layer with cuDNN attention (the bench's `jax_cudnn` row) is traced the
same way, for comparison. `--hlo DIR` writes each step's compiled HLO text into DIR; `--only
NAME,...` runs only those steps (jax_cudnn, transformer_layer_bf16, transformer_layer_fp8);
`--top N` lists the N longest ops and kernels (25); the timing line also gives the host's time to enqueue a step (a step host-bound where it nears the back-to-back figure); `--layernorm autodiff` differentiates
LayerNorm by autodiff instead of `nn.layernorm_vjp`'s kernel (an untraced A/B of the kernel).
`--hidden-dropout R` sets the TransformerLayer's hidden dropout (0 by default here; the guide
and the bench use 0.1); `--fp8-quantize xla|words|kernel` makes each FP8 operand's two layouts
XLA's quantise and `.T`, XLA's quantise and the uint32-word transpose, or the one-pass Pallas
kernel, instead of the library's automatic choice (`quantization.layouts.quantize_both`).
"""
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from trace_table import host_table, profile_table

import flashmesh.te as te
import flashmesh.te.flax as te_flax
from flashmesh.quantization import written_state
from flashmesh.te.recipe import DelayedScaling, Format


def _option(name):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


if _option("--layernorm") == "autodiff":  # LayerNorm's backward by autodiff, not the kernel
    import functools as _functools
    import importlib

    _ln = importlib.import_module("flashmesh.nn.layernorm")  # flashmesh.nn.layernorm is also a function
    _ln.normalize = _functools.partial(_ln.normalize, kernel=False)
elif _option("--layernorm"):
    raise SystemExit(f"--layernorm: expected autodiff, got {_option('--layernorm')}")

if _option("--fp8-quantize"):  # xla: quantise + .T; words: + byte_transpose; kernel: the Pallas kernel
    import functools

    from flashmesh.quantization import layouts as _layouts
    from flashmesh.quantization import scaling as _scaling
    _kind = _option("--fp8-quantize")
    if _kind == "xla":
        def _plain(x, s, dtype):
            q = _scaling.quantize(x, s, dtype)
            return q, q.T, _scaling.amax(x)
        _layouts.quantize_both = _plain
    elif _kind in ("kernel", "words"):
        _layouts.quantize_both = functools.partial(_layouts.quantize_both, kernel=_kind == "kernel")
    else:
        raise SystemExit(f"--fp8-quantize {_kind}: expected xla, words or kernel")

B, T, H, F, N = 4, 2048, 4096, 16384, 32
if "--small" in sys.argv:
    B, T, H, F, N = 2, 128, 256, 1024, 4
IMPL = "cudnn" if jax.default_backend() == "gpu" else None
x = jax.random.normal(jax.random.key(0), (B, T, H), jnp.bfloat16)
dy = jax.random.normal(jax.random.key(1), (B, T, H), jnp.bfloat16)
layer = te_flax.TransformerLayer(hidden_size=H, mlp_hidden_size=F, num_attention_heads=N,
                                 mlp_activations=("gelu",), self_attn_mask_type="causal",
                                 layernorm_epsilon=1e-5, use_bias=True, intermediate_dropout=0.0,
                                 enable_relative_embedding=False, self_attn_bias_type="no_bias",
                                 hidden_dropout=float(_option("--hidden-dropout") or 0.0))


def run(fp8, hand_written):
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    label = "jax_cudnn" if hand_written else ("transformer_layer_fp8" if fp8 else "transformer_layer_bf16")
    with te.autocast(enabled=fp8, recipe=recipe):
        if hand_written:
            from flashmesh.bench.layer_models import init_jax_layer, jax_layer

            variables = {"params": init_jax_layer(jax.random.key(2), H, F, jnp.bfloat16)}

            def apply(v, x, key):
                return jax_layer(v["params"], x, heads=N, implementation=IMPL)
        else:
            # jitted: an eager init runs (and compiles) the FP8 forward op by op, which took
            # more than 3 minutes on the H200 (2026-12-02)
            variables = jax.jit(lambda key, x: layer.init(key, x, deterministic=False))(
                jax.random.key(2), x)

            def apply(v, x, key):
                return layer.apply(v, x, deterministic=False, rngs={"dropout": key})

        def step(v, x, dy, key):
            def loss(v, x):
                return jnp.vdot(apply(v, x, key), dy).astype(jnp.float32)
            # The loss is returned: discarded, the layer's output is dead and XLA drops the
            # last projection's forward GEMM (2026-12-03: ~1.6 ms of the bf16 step; the profiles
            # of this script before then lack it).
            value, (gv, gx) = jax.value_and_grad(loss, argnums=(0, 1))(v, x)
            return written_state(v, gv), gv["params"], gx, value

        f = jax.jit(step)
        t0 = time.perf_counter()
        text = f.lower(variables, x, dy, jax.random.key(3)).compile().as_text()
        print(f"{label}: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
    if _option("--hlo"):
        with open(f"{_option('--hlo')}/{label}.hlo.txt", "w") as out:
            out.write(text)
    targets = re.findall(r'custom_call_target="([^"]+)"', text)
    gemms = {t: targets.count(t) for t in set(targets) if "cublas" in t or "cudnn" in t}
    triton = len(re.findall(r"__triton_gemm|triton_nested_gemm", text))
    with te.autocast(enabled=fp8, recipe=recipe):
        for i in range(5):
            state, g, gx, _ = f(variables, x, dy, jax.random.key(i))
            variables = {**variables, **state}
        jax.block_until_ready((state, g, gx))
        times = []
        for i in range(20):
            t0 = time.perf_counter()
            state, g, gx, _ = f(variables, x, dy, jax.random.key(i))
            variables = {**variables, **state}
            jax.block_until_ready((state, g, gx))
            times.append(time.perf_counter() - t0)
        keys = [jax.random.key(i) for i in range(20)]
        jax.block_until_ready(keys)
        t0 = time.perf_counter()
        for i in range(20):
            state, g, gx, _ = f(variables, x, dy, keys[i])
            variables = {**variables, **state}
        enqueued = (time.perf_counter() - t0) / 20
        jax.block_until_ready((state, g, gx))
        b2b = (time.perf_counter() - t0) / 20
    times.sort()
    print(f"{label}: median {times[10]*1e3:.2f} ms, back-to-back {b2b*1e3:.2f} ms (host enqueue {enqueued*1e3:.2f} ms a step); gemms {gemms} triton {triton}",
          flush=True)
    if "--profile" in sys.argv:
        trace_dir = tempfile.mkdtemp(dir=_option("--profile"))
        with te.autocast(enabled=fp8, recipe=recipe), jax.profiler.trace(trace_dir):
            for i in range(5):
                state, g, gx, _ = f(variables, x, dy, jax.random.key(i))
            variables = {**variables, **state}
            jax.block_until_ready((state, g, gx))
        print(profile_table(trace_dir, 5, top=int(_option("--top") or 25)), flush=True)
        print(host_table(trace_dir, 5, top=int(_option("--top") or 25)), flush=True)


RUNS = {"jax_cudnn": (False, True), "transformer_layer_bf16": (False, False),
        "transformer_layer_fp8": (True, False)}
for label in (_option("--only") or ",".join(RUNS)).split(","):
    if label not in RUNS:
        raise ValueError(f"--only: expected names from {sorted(RUNS)}, got {label!r}")
    print(f"--- {label} {time.strftime('%H:%M:%S')}", flush=True)
    run(*RUNS[label])
