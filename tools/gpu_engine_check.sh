#!/usr/bin/env bash
# One device call for the GPU engine path: the runner's GPU tests, then the benchmarks, with
# JSON and logs under $OUT (at most 8 files: the device tool returns no more).
#
#   OUT=/some/dir bash tools/gpu_engine_check.sh
#
# Makes `import tidal.*` work without installing (a temp folder whose `tidal` subpackages are
# symlinks to the repo's top-level folders, first on PYTHONPATH; see gpu_kernel_check.sh).
# TIDAL_STAGES picks stages (default: tests,lat_qwen,tp,lat_llama,cpu; also: ktests — the
# Triton kernel tests, no CUDA-extension build; par_tests — tests and ktests at once, both light
# on the GPU; kbench — the batch-1 decode microbenchmarks; lat_llama_ab — Llama batch 1 again
# with TIDAL_GEMV_MAX_MB=${TIDAL_AB_GEMV_MAX_MB:-40}, big weights on cuBLAS; lat_qwen_ab — Qwen3
# batch 1 again under the environment TIDAL_AB_ENV, default TIDAL_PDL=0; lat_qwen_base — Qwen3
# batch 1 with the decode kernels and PDL off, the path before them; warm — "ready means
# warm": tools/bench_startup.py for qwen3-0.6b, cold then warm kernel cache, first-request TTFT
# against steady state (startup.json), then tests/worker/test_gpu_warmup.py, zero JIT compiles
# after ready under a served workload (warm_tests.log; on the kernels the bench cached, limit
# TIDAL_T_warm_tests)); each stage runs under its own time limit (TIDAL_T_<stage> seconds) so
# a slow one cannot starve the rest. Extra arguments per stage: TIDAL_ARGS_<stage>. The CUDA
# extension builds in the background from the start (stage `build` waits for it); benchmarks
# use the Triton kernels unless told otherwise (--ops/--attention-backend in TIDAL_ARGS_*).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/gpu_engine_out}"
PY="${PYTHON:-python3}"
STAGES="${TIDAL_STAGES:-tests,lat_qwen,tp,lat_llama,cpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# The GPU image lacks a few of tidal's dependencies (msgspec, pyzmq, gguf): install the wheels
# carried in .whl/ (call with carry=[".whl"]; see the device README) into a temp folder.
if ! "$PY" -c "import msgspec, zmq, gguf" 2>/dev/null; then
  for d in "$REPO/.whl" "$REPO/../.whl"; do
    if ls "$d"/*.whl >/dev/null 2>&1; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/tidal_site "$d"/*.whl && export PYTHONPATH="/tmp/tidal_site${PYTHONPATH:+:$PYTHONPATH}"
      break
    fi
  done
fi

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

run_tests() {  # the runner's GPU tests
  # shellcheck disable=SC2086
  timeout --signal=INT "${TIDAL_T_tests:-240}" "$PY" -m pytest -p no:cacheprovider -x -q -rs \
    tests/worker/test_gpu_runner.py ${TIDAL_ARGS_tests:-} > "$OUT/tests_runner.log" 2>&1
}

run_ktests() {  # the Triton kernel tests (the CUDA-extension ones need a build: left out)
  local workers="" rc=0
  if "$PY" -c "import xdist" 2>/dev/null; then workers="-n ${TIDAL_TEST_WORKERS:-4}"; fi
  local attn=tests/worker/test_kernels_attention.py
  # shellcheck disable=SC2086
  timeout --signal=INT "${TIDAL_T_ktests:-300}" "$PY" -m pytest -p no:cacheprovider -q -rs \
    $workers tests/worker/test_kernels_decode.py "$attn::test_triton_attention_matches_reference" \
    "$attn::test_decode_replays_in_cuda_graph[triton]" ${TIDAL_ARGS_ktests:-} \
    > "$OUT/ktests.log" 2>&1 || rc=1
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
    ktests)
      t0=$SECONDS
      run_ktests || status=1
      echo "== ktests done after $((SECONDS - t0))s (status $status)" | tee -a "$OUT/tests.log"
      cat "$OUT/ktests.log" >> "$OUT/tests.log"; rm -f "$OUT/ktests.log"
      tail -5 "$OUT/tests.log" ;;
    par_tests)
      t0=$SECONDS
      run_tests & tp=$!
      run_ktests & kp=$!
      wait $tp || status=1
      wait $kp || status=1
      { echo "== runner tests + kernel tests (in parallel) done after $((SECONDS - t0))s (status $status)"
        cat "$OUT/tests_runner.log" "$OUT/ktests.log"; } >> "$OUT/tests.log"
      rm -f "$OUT/tests_runner.log" "$OUT/ktests.log"
      grep -E "passed|failed|error" "$OUT/tests.log" | tail -6 ;;
    kbench)
      # shellcheck disable=SC2086
      run_stage kbench 150 "$PY" tools/gpu_kernel_check.py bench --sections decode1 --sweep \
        --out "$OUT/kernel_bench.json" $extra || status=1 ;;
    lat_llama_ab)
      # shellcheck disable=SC2086
      TIDAL_GEMV_MAX_MB="${TIDAL_AB_GEMV_MAX_MB:-40}" run_stage lat_llama_ab 120 "$PY" \
        tools/bench_latency.py --shape llama-3.1-8b --batches 1 --prefill "" --ops triton \
        --no-ceilings --out "$OUT/latency_llama8b_ab.json" $extra || status=1 ;;
    lat_qwen_ab)  # Qwen3 batch 1 again under TIDAL_AB_ENV (e.g. "TIDAL_PDL=0"), same machine
      echo "##### qwen3-0.6b, ${TIDAL_AB_ENV:-TIDAL_PDL=0}" >> "$OUT/profile.txt"
      # shellcheck disable=SC2086
      run_stage lat_qwen_ab 90 env ${TIDAL_AB_ENV:-TIDAL_PDL=0} "$PY" tools/bench_latency.py \
        --shape qwen3-0.6b --batches 1 --prefill "" --ops triton --no-ceilings --profile \
        --profile-out "$OUT/profile.txt" --out "$OUT/latency_qwen3_ab.json" $extra || status=1 ;;
    lat_qwen_base)  # Qwen3 batch 1 on the pre-decode-kernel path (same machine: before/after)
      echo "##### qwen3-0.6b, TIDAL_DECODE_KERNELS=0 TIDAL_PDL=0" >> "$OUT/profile.txt"
      # shellcheck disable=SC2086
      run_stage lat_qwen_base 90 env TIDAL_DECODE_KERNELS=0 TIDAL_PDL=0 "$PY" \
        tools/bench_latency.py --shape qwen3-0.6b --batches 1 --prefill "" --ops triton \
        --no-ceilings --profile --profile-out "$OUT/profile.txt" \
        --out "$OUT/latency_qwen3_base.json" $extra || status=1 ;;
    lat_qwen)
      echo "##### qwen3-0.6b" >> "$OUT/profile.txt"
      # shellcheck disable=SC2086
      run_stage lat_qwen 150 "$PY" tools/bench_latency.py --shape qwen3-0.6b --batches 1,8,64,256 \
        --ops triton --profile --profile-out "$OUT/profile.txt" --out "$OUT/latency_qwen3.json" $extra || status=1 ;;
    lat_llama)
      echo "##### llama-3.1-8b" >> "$OUT/profile.txt"
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
    warm)
      WARM_DIR="$(mktemp -d)"
      # shellcheck disable=SC2086
      run_stage warm 300 "$PY" tools/bench_startup.py --shape qwen3-0.6b --ops triton \
        --cache-dir "$WARM_DIR" --out "$OUT/startup.json" $extra || status=1
      t0=$SECONDS
      TIDAL_CACHE_DIR="$WARM_DIR/cache" timeout --signal=INT --kill-after=15 \
        "${TIDAL_T_warm_tests:-240}" "$PY" -m pytest -p no:cacheprovider -q -rs -s \
        tests/worker/test_gpu_warmup.py ${TIDAL_ARGS_warm_tests:-} > "$OUT/warm_tests.log" 2>&1 \
        || status=1
      echo "== warm tests: done after $((SECONDS - t0))s (status $status)" | tee -a "$LOG"
      grep -E "^warm-up:|JIT compile after ready|passed|failed|error" "$OUT/warm_tests.log" \
        | tail -12 | tee -a "$LOG"
      rm -rf "$WARM_DIR" ;;
    cpu)
      # shellcheck disable=SC2086
      run_stage cpu 90 "$PY" tools/bench_cpu_step.py --out "$OUT/cpu_step.json" $extra || status=1 ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done

echo "== summary" | tee -a "$LOG"
grep -hE "ms/step|tok/s|prefill|batch |passed|failed|error|Error|calibration|async:|sync :|warm/cold|TTFT first|after ready" "$LOG" "$OUT/tests.log" | tail -40
exit $status
