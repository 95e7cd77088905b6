#!/usr/bin/env bash
# Runs on a GPU machine from a copy of this tree (no install, no network): the GPU-marked tests
# and `flashmesh bench` presets, each step under its own time limit, results tarred into $OUT.
#
#   benchmarks/device_run.sh STEP[=SECONDS] ...
#   STEP: tests[:<pytest -k expression>] | bench:<preset>[:<group,...>[:<implementation,...>]] | explore:<chunked|dispatch|memory> | example | train | tune[:<args>] | profile | probe_mosaic[:<args, comma-separated>] | ncu:<probe_mosaic args> | probe_train[:<args>] | probe_fp8[:<args>] | probe_gap[:<args>] | probe_dropout_ptx
#   profile: benchmarks/probe_layer.py --profile (the guide's TransformerLayer step, bf16 and FP8,
#   traced; where its GPU time goes, by category, XLA op and kernel) into $OUT/profile.log;
#   PROFILE_ARGS for options, e.g. PROFILE_ARGS="--only transformer_layer_fp8".
#   The device's copy of .git may be older than the tree sent: pass the commit as
#   FLASHMESH_COMMIT=<hash> so the reports name the right one, the hash written out in the
#   command: the command runs on the device, where $(git rev-parse HEAD) gives the stale HEAD
#   (2026-12-01: two reports named the previous commit and were corrected by hand).
#   base:<step> runs a step on a baseline tree, for an A/B of a change in one call: make it
#   with `mkdir -p .ab/base && git archive <rev> src | tar -x -C .ab/base` and carry ".ab"
#   (.gitignore has it), e.g. "base:probe_mosaic:--fwdbwd,..."
#   "probe_mosaic:--fwdbwd,..." "base:probe_mosaic:..." "probe_mosaic:...".
#   tune: `flashmesh tune` (TUNE_ARGS or the step's args for options, e.g. "tune:--backward,--max-candidates,8";
#   two tune steps in one call: the second starts from the first's table); the updated config table comes back as
#   $OUT/pallas_mosaic_gpu_configs.json.
#   Results are written straight under $OUT/benchmarks/results (as each row is measured), so a
#   step killed by its limit, or a call killed by the device's, still brings back what it did.
#   bench:layer at the guide's size takes ~40-80 s a row: split its rows over calls, e.g.
#   bench:layer::flax,te_unfused,te_fused,transformer_layer,transformer_layer_fp8
#   BENCH_ARGS: more options for every bench step, e.g. BENCH_ARGS="--iters 10 --warmup 2"
#
# bench:cp runs the context-parallel preset: with one GPU its emulated_ranks group (the ranks'
# work of cp=4 on the one GPU, issue 8 "On the H200"), with several every strategy and order.
#
# Optional peers (FlashAttention-3's JAX binding, tokamax) come as wheels in .whl/ (see
# benchmarks/README.md); without them their rows say "not installed".
set -uo pipefail
OUT="${OUT:-/tmp/flashmesh-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 COLUMNS=220
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site:$PWD/.whl/stubs"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'

SRC_PATH="$PYTHONPATH"
for step in "$@"; do
  limit="${step#*=}"; [ "$limit" = "$step" ] && limit=540
  step="${step%%=*}"
  # base:<step>: the step on the baseline tree .ab/base/src instead of src/ (an A/B of a code
  # change in one call; header lines in the probe logs tell the two apart)
  export PYTHONPATH="$SRC_PATH"; tree=src
  if [ "${step#base:}" != "$step" ]; then
    step="${step#base:}"; tree=.ab/base/src
    export PYTHONPATH="$PWD/.ab/base/src${SRC_PATH#"$PWD/src"}"
  fi
  echo "=== $step on $tree (limit ${limit}s) $(date -u +%T)"
  case "$step" in
    tests|tests:*)
      # 4 workers share the GPU (compilation is the slow part); each takes a fifth of its memory;
      # --dist load spreads the few files of GPU cases over them (pyproject says loadfile, for CI).
      select="${step#tests}"; select="${select#:}"
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout "$limit" python3 -m pytest -m gpu tests -n 4 --dist load -v -rfEs \
        ${select:+-k "$select"} -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" 2>&1 \
        | tee -a "$OUT/gpu_tests.log" | tail -60 ;;
    explore:*)
      timeout "$limit" python3 benchmarks/explore_chunked.py "${step#explore:}" 2>&1 | tee -a "$OUT/explore.log" ;;
    bench:*)
      IFS=: read -r _ preset groups impls <<<"$step"
      # cp on one GPU: the tutorial's one-device fwd+bwd (cuDNN, ~90 GiB) runs beside the ranks'
      # shards, more than JAX's default 75% pool holds.
      mem=""; [ "$preset" = cp ] && mem="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
      env ${mem:+XLA_PYTHON_CLIENT_MEM_FRACTION=$mem} timeout --signal=TERM "$limit" python3 -m flashmesh bench --preset "$preset" \
        ${groups:+--groups "$groups"} ${impls:+--implementations "$impls"} ${BENCH_ARGS:-} --no-progress \
        --out "$OUT/benchmarks/results" 2>&1 | tee -a "$OUT/bench.log" | tail -60 ;;
    train)
      timeout --signal=TERM "$limit" python3 -m flashmesh train --no-progress ${TRAIN_ARGS:-} \
        --out "$OUT/benchmarks/results" 2>&1 | tee -a "$OUT/train.log" | tail -30 ;;
    tune|tune:*)  # e.g. tune:--backward,--shapes,seed000_gqa_swa (commas: spaces), after TUNE_ARGS
      args="${step#tune}"; args="${args#:}"
      timeout --signal=TERM "$limit" python3 -m flashmesh tune --no-progress ${TUNE_ARGS:-} ${args//,/ } \
        --out "$OUT/benchmarks/results" 2>&1 | tee -a "$OUT/tune.log" | tail -30
      cp src/flashmesh/attention/pallas_mosaic_gpu_configs.json "$OUT/" ;;
    profile)
      mkdir -p /tmp/flashmesh-trace
      timeout "$limit" python3 benchmarks/probe_layer.py --profile /tmp/flashmesh-trace --hlo "$OUT" ${PROFILE_ARGS:-} 2>&1 | tee -a "$OUT/profile.log" ;;
    probe_train|probe_train:*)  # e.g. probe_train:--only,bf16 (commas: spaces)
      args="${step#probe_train}"; args="${args#:}"; mkdir -p /tmp/flashmesh-trace
      timeout "$limit" python3 benchmarks/probe_train.py --profile /tmp/flashmesh-trace ${args//,/ } 2>&1 | tee -a "$OUT/probe_train.log" ;;
    probe_gap|probe_gap:*)  # benchmarks/probe_gap.py: back to back against kernel time (args as probe_mosaic's)
      args="${step#probe_gap}"; args="${args#:}"
      timeout "$limit" python3 benchmarks/probe_gap.py ${args//,/ } 2>&1 | tee -a "$OUT/probe_gap.log" ;;
    probe_fp8|probe_fp8:*)  # benchmarks/probe_fp8_transpose.py (args as probe_mosaic's)
      args="${step#probe_fp8}"; args="${args#:}"
      timeout "$limit" python3 benchmarks/probe_fp8_transpose.py ${args//,/ } 2>&1 | tee -a "$OUT/probe_fp8.log" ;;
    ncu:*)  # probe_mosaic under Nsight Compute (hardware counters; the clocks left alone), e.g.
      # ncu:--bwd-cfg=fused_dq+dq_columns,causal_8k_h32_d128 (one config: the forward's launch,
      # two untimed calls, then the timed ones): NCU_ARGS picks the kernels and sections
      # (default: the 2 Mosaic kernel launches after 7, i.e. one timed call of a two-kernel
      # backward or two of a fused one; speed of light, compute and memory workloads, warp
      # states with their sampled source lines, schedulers, launch, occupancy)
      args="${step#ncu:}"
      timeout "$limit" ncu --clock-control none --target-processes all ${NCU_ARGS:---kernel-name regex:mosaic \
        --launch-skip 7 --launch-count 2 --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section WarpStateStats --section SourceCounters --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy} \
        python3 benchmarks/probe_mosaic.py ${args//,/ } 2>&1 | tee -a "$OUT/ncu.log" | tail -60 ;;
    probe_mosaic|probe_mosaic:*)  # e.g. probe_mosaic:--bwd,causal_8k_h32_d128 (commas: spaces)
      args="${step#probe_mosaic}"; args="${args#:}"; echo "=== $step on $tree" >> "$OUT/probe_mosaic.log"
      timeout "$limit" python3 benchmarks/probe_mosaic.py ${args//,/ } 2>&1 | tee -a "$OUT/probe_mosaic.log" ;;
    probe_dropout_ptx)  # benchmarks/probe_dropout_ptx.py: the dropout kernels' PTX, hashes per probability
      mkdir -p /tmp/flashmesh-ptx
      MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=/tmp/flashmesh-ptx timeout "$limit" python3 \
        benchmarks/probe_dropout_ptx.py 2>&1 | tee -a "$OUT/probe_dropout_ptx.log"
      tar -C /tmp -czf "$OUT/dropout_ptx.tgz" flashmesh-ptx ;;
    example)
      (cd examples && timeout "$limit" python3 single_gpu_attention.py) 2>&1 | tee "$OUT/example.log" ;;
    *) echo "unknown step $step" ;;
  esac
  # The results also as one archive (a results folder itself has not always come back whole).
  [ -d "$OUT/benchmarks" ] && tar -C "$OUT" -czf "$OUT/results.tgz" benchmarks
done
echo "=== done $(date -u +%T)"
