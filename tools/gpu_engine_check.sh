#!/usr/bin/env bash
# One device call for the GPU engine path: the runner's GPU tests, then the benchmarks, with
# JSON and logs under $OUT (at most 8 files: the device tool returns no more).
#
#   OUT=/some/dir bash tools/gpu_engine_check.sh
#
# Makes `import tidal.*` work without installing (a temp folder whose `tidal` subpackages are
# symlinks to the repo's top-level folders, first on PYTHONPATH; see gpu_kernel_check.sh).
# TIDAL_STAGES picks stages (default: tests,lat_qwen,tp,lat_llama,cpu); each stage runs under
# its own time limit (TIDAL_T_<stage> seconds) so a slow one cannot starve the rest. Extra
# arguments per stage: TIDAL_ARGS_<stage>. The CUDA extension builds in the background from
# the start (stage `build` waits for it); benchmarks use the Triton kernels unless told
# otherwise (--ops/--attention-backend in TIDAL_ARGS_*).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/gpu_engine_out}"
PY="${PYTHON:-python3}"
STAGES="${TIDAL_STAGES:-tests,lat_qwen,tp,lat_llama,cpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
mkdir -p "$SHIM/tidal"
for d in engine_core frontend worker csrc; do ln -s "$REPO/$d" "$SHIM/tidal/$d"; done
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO"

LOG="$OUT/bench.log"
{
  echo "== environment"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
  "$PY" -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  nproc
} > "$OUT/tests.log" 2>&1
cat "$OUT/tests.log"

if [[ ",$STAGES," == *",build,"* ]]; then
  "$PY" -c "from tidal.worker.ops.cuda_ext import build_result as b; r = b(); print('cuda ext build:', 'ok' if r.module else r.error, round(r.seconds, 1), 's')" > "$OUT/build.txt" 2>&1 &
  BUILD_PID=$!
fi

run_stage() {  # name, default seconds, command...
  local name=$1 secs=$2; shift 2
  local var="TIDAL_T_$name"; secs="${!var:-$secs}"
  echo "== $name (limit ${secs}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=15 "$secs" "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$LOG"
  return $rc
}

status=0
for stage in ${STAGES//,/ }; do
  argsvar="TIDAL_ARGS_$stage"; extra="${!argsvar:-}"
  case $stage in
    build)
      wait "${BUILD_PID:-0}" 2>/dev/null; cat "$OUT/build.txt" | tee -a "$LOG" ;;
    tests)
      echo "== tests" | tee -a "$OUT/tests.log"
      t0=$SECONDS
      # shellcheck disable=SC2086
      timeout --signal=INT "${TIDAL_T_tests:-240}" "$PY" -m pytest -p no:cacheprovider -x -q -rs \
        tests/worker/test_gpu_runner.py $extra >> "$OUT/tests.log" 2>&1 || status=1
      echo "== tests done after $((SECONDS - t0))s (status $status)" | tee -a "$OUT/tests.log"
      tail -5 "$OUT/tests.log" ;;
    lat_qwen)
      # shellcheck disable=SC2086
      run_stage lat_qwen 150 "$PY" tools/bench_latency.py --shape qwen3-0.6b --batches 1,8,64,256 \
        --ops triton --profile --profile-out "$OUT/profile.txt" --out "$OUT/latency_qwen3.json" $extra || status=1 ;;
    lat_llama)
      # shellcheck disable=SC2086
      run_stage lat_llama 150 "$PY" tools/bench_latency.py --shape llama-3.1-8b --batches 1,8 \
        --prefill 8x2048 --ops triton --profile --profile-out "$OUT/profile.txt" \
        --out "$OUT/latency_llama8b.json" $extra || status=1 ;;
    tp)
      tok=""; [ -d .bench_assets/qwen3 ] && tok="--tokenizer .bench_assets/qwen3"
      # shellcheck disable=SC2086
      run_stage tp 200 "$PY" tools/bench_throughput.py --shape qwen3-0.6b --ops triton $tok \
        --out "$OUT/throughput.json" $extra || status=1 ;;
    lat_qwen_sync)  # the same decode steps without async scheduling, for the default
      # shellcheck disable=SC2086
      run_stage lat_qwen_sync 90 "$PY" tools/bench_latency.py --shape qwen3-0.6b --batches 1,64 \
        --prefill "" --ops triton --async-scheduling 0 --no-ceilings \
        --out "$OUT/latency_qwen3_sync.json" $extra || status=1 ;;
    tp_sync)
      # shellcheck disable=SC2086
      run_stage tp_sync 90 "$PY" tools/bench_throughput.py --shape qwen3-0.6b --ops triton \
        --workloads nano --repeats 1 --async-scheduling 0 --out "$OUT/throughput_sync.json" \
        $extra || status=1 ;;
    cpu)
      # shellcheck disable=SC2086
      run_stage cpu 90 "$PY" tools/bench_cpu_step.py --out "$OUT/cpu_step.json" $extra || status=1 ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done

echo "== summary" | tee -a "$LOG"
grep -hE "ms/step|tok/s|prefill|batch |passed|failed|error|Error|calibration|async:|sync :" "$LOG" "$OUT/tests.log" | tail -40
exit $status
