#!/usr/bin/env bash
# On a CUDA machine: builds the fused-kernel extension, runs tests/gpu, times every
# kernel against the PyTorch reference (eager and torch.compile) and apex's (when
# installed), checks that the dispatch runs the fastest eager implementation of each op
# (bench/bench_kernels.py's "dispatch:" lines; a slower choice fails the stage and names
# the kernels/dispatch.py entry that fixes it), and measures one GPU's training-step
# throughput and MFU for a ~1.1B-parameter GPT in bf16 (target: at least 45%), with the
# fused kernels and without. Writes RESULTS_DIR/results.md (the tables),
# RESULTS_DIR/gpu_check.log (every stage's output) and RESULTS_DIR/bench_kernels.json.
#
#   bash tools/gpu_check.sh [RESULTS_DIR]      (default: build/gpu_check)
#
# Stages run in order of importance under one time budget (GPU_CHECK_BUDGET_S,
# default 480 s); each gets a timeout, and stages that no longer fit are reported as
# skipped. Exits non-zero if any stage failed or timed out. PYTHON picks the
# interpreter (default python3); nothing is downloaded.
# The functions below run through run_stage, which shellcheck cannot follow (SC2317 before shellcheck 0.10,
# SC2329 since).
# shellcheck disable=SC2317,SC2329
set -uo pipefail
cd "$(dirname "$0")/.." || exit

PYTHON=${PYTHON:-python3}
results=${1:-build/gpu_check}
budget=${GPU_CHECK_BUDGET_S:-480}
peak_tflops=${PEAK_TFLOPS:-989}
mkdir -p "$results"
log="$results/gpu_check.log"
stages="$results/stages.md.part"
: >"$log"
: >"$stages"
failures=0
deadline=$((SECONDS + budget))
export PYTHON peak_tflops MAX_JOBS=${MAX_JOBS:-$(nproc)} PYTHONUNBUFFERED=1

# run_stage NAME MAX_SECONDS COMMAND...: runs COMMAND (a program or one of the
# functions below, exported so that timeout's child bash sees them) with its output
# appended to the log, under min(MAX_SECONDS, time left), and records the outcome.
run_stage() {
  local name=$1 max=$2
  shift 2
  local left=$((deadline - SECONDS))
  if ((left < 30)); then
    echo "| $name | skipped: time budget spent | 0 |" >>"$stages"
    return 1
  fi
  local limit=$((max < left ? max : left)) start=$SECONDS status rc
  echo ">>> stage $name (limit ${limit}s): $*" | tee -a "$log"
  timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@" >>"$log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status="TIMED OUT after ${limit}s" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  ((rc == 0)) || failures=$((failures + 1))
  echo "| $name | $status | $((SECONDS - start)) |" | tee -a "$stages"
  return $rc
}

environment() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__,
"| cuda", torch.version.cuda, "|", torch.cuda.get_device_name())'
  command -v nvcc >/dev/null && nvcc --version | tail -n 1
  command -v ninja >/dev/null && echo "ninja $(ninja --version)"
  true
}

build_extension() {
  MEGATRON_LITE_BUILD_KERNELS=1 "$PYTHON" -m pip install --no-deps --no-build-isolation --no-index -e . &&
    "$PYTHON" -c 'import megatron_lite.kernels._fused_cuda as m; print("built", m.__file__)'
}

# ~1.1B parameters: 20 layers x 12 x 2048^2 + a 50k vocabulary; one GPU, bf16.
gpt_step() {
  "$PYTHON" -m megatron_lite.pretrain_gpt --mock-data --bf16 \
    --num-layers 20 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 2048 --max-position-embeddings 2048 --vocab-size 50257 \
    --micro-batch-size 4 --global-batch-size 8 --train-iters 8 --log-interval 1 --log-throughput \
    --peak-tflops "$peak_tflops" "$@"
}

gpt_step_unfused() {
  MEGATRON_LITE_NO_FUSED_KERNELS=1 gpt_step --no-fused-kernels
}

# step_summary LABEL: "| LABEL | TFLOP/s | MFU | ms |" from the last stage's log lines,
# averaged over the iterations after the first two (warm-up).
step_summary() {
  "$PYTHON" - "$1" "$peak_tflops" "$log" <<'PY'
import re, statistics, sys
label, peak, path = sys.argv[1], float(sys.argv[2]), sys.argv[3]
text = open(path).read().rsplit(">>> stage ", 1)[-1]
tflops = [float(v) for v in re.findall(r"throughput per GPU \(TFLOP/s/GPU\): *([0-9.]+)", text)][2:]
ms = [float(v) for v in re.findall(r"elapsed time per iteration \(ms\): *([0-9.]+)", text)][2:]
if tflops:
    t = statistics.mean(tflops)
    print(f"| {label} | {t:.1f} | {100 * t / peak:.1f}% | {statistics.mean(ms):.0f} |")
else:
    print(f"| {label} | no iteration logged | | |")
PY
}

export -f environment build_extension gpt_step gpt_step_unfused

steps=""
run_stage environment 30 environment
run_stage build 300 build_extension
run_stage gpu_tests 240 "$PYTHON" -m pytest -q -p no:cacheprovider -rf tests/gpu/test_fused_kernels.py
run_stage bench 240 "$PYTHON" bench/bench_kernels.py --json "$results/bench_kernels.json"
bench_table=$(awk '/^>>> stage bench/{on=1; next} /^>>> stage /{on=0} on && /^(\||Device:|dispatch:)/' "$log")
run_stage gpt_step_fused 150 gpt_step && steps+="$(step_summary "fused kernels")"$'\n'
run_stage gpt_step_unfused 150 gpt_step_unfused && steps+="$(step_summary "PyTorch reference ops")"$'\n'
run_stage jit_build 200 "$PYTHON" -m pytest -q -p no:cacheprovider -rf tests/gpu/test_jit_build.py

{
  echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  awk '/^>>> stage environment/{on=1; next} /^>>> stage /{on=0} on' "$log"
  echo
  echo "## Stages"
  echo "| stage | result | seconds |"
  echo "| --- | --- | --- |"
  cat "$stages"
  echo
  echo "## Kernel times (ms, forward / forward+backward) and the dispatch's choice"
  echo "${bench_table:-bench did not run}"
  echo
  echo "## GPT training step, ~1.1B parameters, bf16, one GPU (MFU at ${peak_tflops} TFLOP/s peak; target >= 45%)"
  echo "| run | TFLOP/s/GPU | MFU | ms/iteration |"
  echo "| --- | --- | --- | --- |"
  printf '%s' "$steps"
} >"$results/results.md"
rm -f "$stages"
cat "$results/results.md"
exit $((failures > 0))
