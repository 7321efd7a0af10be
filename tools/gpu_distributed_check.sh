#!/usr/bin/env bash
# One-command GPU check of tidal's tensor parallelism, on a host with 2 or more GPUs:
#
#   OUT=/some/dir bash tools/gpu_distributed_check.sh [PHASE...]     (default: equal perf allreduce)
#
# 1. makes `import tidal.*` work with no install (a temp `tidal` namespace of symlinks to the
#    repo's top-level folders, first on PYTHONPATH, as tools/gpu_kernel_check.sh does);
# 2. equality: greedy tokens of tiny random Llama/Qwen3 (float32) at TP=2 (and 4) == TP=1;
# 3. performance, one fresh process per TP size (1, 2, 4 as GPUs allow): Llama-3.1-8B shape,
#    dummy weights, bf16: decode ms/step at batch 1, the all-reduce share of a decode step
#    (torch profiler), output tok/s on the fixed-length 1024/1024 workload;
# 4. allreduce: latency of one NCCL all-reduce of decode hidden states, eager and in a graph;
#    push: TP>1 perf with the all-reduce fused into the batch-1 GEMVs (TIDAL_PUSH_ALLREDUCE=1,
#    off by default); nolamport: TP>1 perf without the signal-free all-reduce
#    (TIDAL_LAMPORT_ALLREDUCE=0); noapart: perf with the RMSNorm always in the GEMV prologue
#    (TIDAL_NORM_APART=0); nopreload: perf with split-decode attention loading its first tile
#    after the dependent-launch wait (TIDAL_ATTN_PRELOAD=0); stages2: perf with split-decode
#    attention pipelined in two stages (TIDAL_ATTN_SPLIT_STAGES=2); nostream: perf with the
#    GEMV weights loaded with the default L2 policy (TIDAL_GEMV_STREAM=0); tests: the GPU tests
#    of the all-reduce and decode kernels;
#    TIDAL_CHECK_ARGS="--trace-dir DIR" adds each rank's step timeline (tools/trace_steps.py);
# 5. a summary with the TP=2 / TP=1 decode ratio (target <= 0.6) in $OUT/tp_summary.json.
# TIDAL_CHECK_TPS overrides the TP sizes (default: 1 2, and 4 with 4 GPUs).
# If a run fails with the defaults it is retried once with enforce_eager and triton attention
# (the GPU model runner is under active work); the JSON says which settings produced numbers.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 etc.): it can take a shared host's GPUs down.
# TIDAL_CHECK_BUDGET_S (default 300) bounds the whole script: phases that would not fit are
# skipped and say so. TIDAL_TP_REQUESTS sets the throughput batch (default 64 requests).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/gpu_dist_out}"
PY="${PYTHON:-python3}"
BUDGET="${TIDAL_CHECK_BUDGET_S:-300}"
REQUESTS="${TIDAL_TP_REQUESTS:-64}"
TAG="${TIDAL_CHECK_TAG:-}"  # suffix of result names, to keep two runs apart in one $OUT
EXTRA="${TIDAL_CHECK_ARGS:-}"  # e.g. "--device cpu --shape small" for a smoke run without GPUs
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
mkdir -p "$SHIM/tidal"
for d in engine_core frontend worker csrc; do ln -s "$REPO/$d" "$SHIM/tidal/$d"; done
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO"

left() { echo $(( BUDGET - SECONDS )); }
# run NAME LIMIT ARGS...: bench_tp.py with a time limit; on failure, once more eager + triton.
run() {
    local name=$1 limit=$2 l rc; shift 2
    l=$(left)
    if (( l < 20 )); then
        echo "== $name: skipped (budget: ${l}s left)"
        echo '{"ok": false, "error": "skipped: out of time budget"}' > "$OUT/$name.json"
        return 1
    fi
    (( limit > l )) && limit=$l
    echo "== $name (limit ${limit}s, ${l}s of budget left)"
    # shellcheck disable=SC2086
    timeout -k 5 "$limit" "$PY" tools/bench_tp.py "$@" $EXTRA --out "$OUT/$name.json" \
        > "$OUT/$name.log" 2>&1; rc=$?
    grep -v " INFO " "$OUT/$name.log" | tail -n 25
    (( rc == 0 )) && return 0
    l=$(left)
    if (( l < 30 )); then echo "== $name failed (rc $rc); no budget left to retry"; return 1; fi
    (( limit > l )) && limit=$l
    echo "== $name failed (rc $rc); retrying with --eager --attention triton"
    # shellcheck disable=SC2086
    timeout -k 5 "$limit" "$PY" tools/bench_tp.py "$@" $EXTRA --eager --attention triton \
        --out "$OUT/$name.json" > "$OUT/$name.eager.log" 2>&1; rc=$?
    grep -v " INFO " "$OUT/$name.eager.log" | tail -n 25
    return $rc
}

# variant NAME MIN_TP VAR=VALUE: the perf phase with one setting changed, for every TP size of
# at least MIN_TP, as perf_tp<N>_NAME.
variant() {
    local name=$1 min_tp=$2 setting=$3 tp
    for tp in $TPS; do
        (( tp >= min_tp )) || continue
        ( export "$setting"; run "perf_tp${tp}_$name$TAG" 110 perf --tp "$tp" \
              --requests "$REQUESTS" ) || status=1
    done
}

echo "== environment"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
nvidia-smi topo -m 2>/dev/null | head -8 || true
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
"$PY" -c "import torch; print('nccl', torch.cuda.nccl.version())" 2>/dev/null || true
"$PY" -c "import tidal.engine_core.multiproc_executor as m; print('tidal from', m.__file__)" || { echo "tidal is not importable"; exit 3; }
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
TPS="${TIDAL_CHECK_TPS:-}"
if [ -z "$TPS" ]; then TPS="1 2"; (( NGPU >= 4 )) && TPS="1 2 4"; fi
PHASES="${*:-equal perf allreduce}"

status=0
for phase in $PHASES; do
    case $phase in
        # shellcheck disable=SC2086
        equal) run "equal$TAG" 240 equal --tp $TPS || status=1 ;;
        perf) for tp in $TPS; do
                  run "perf_tp$tp$TAG" 110 perf --tp "$tp" --requests "$REQUESTS" || status=1
              done ;;
        # TP>1 with the all-reduce fused into the batch-1 GEMVs (opt-in; what it gains or costs).
        push) variant push 2 TIDAL_PUSH_ALLREDUCE=1 ;;
        # The RMSNorm always as the GEMV prologue, for comparison.
        noapart) variant noapart 1 TIDAL_NORM_APART=0 ;;
        # TP>1 with the signal-free all-reduce off (the one-shot or NCCL path instead).
        nolamport) variant nolamport 2 TIDAL_LAMPORT_ALLREDUCE=0 ;;
        # Split-decode attention loading its first tile after the dependent-launch wait.
        nopreload) variant nopreload 1 TIDAL_ATTN_PRELOAD=0 ;;
        # Split-decode attention with a two-stage software pipeline (the default before).
        stages2) variant stages2 1 TIDAL_ATTN_SPLIT_STAGES=2 ;;
        # The GEMVs' weights loaded with the default L2 policy, not evict-first.
        nostream) variant nostream 1 TIDAL_GEMV_STREAM=0 ;;
        tests) l=$(left); (( l > 240 )) && l=240
               TEST_FILTER="lamport or rank_order or push or pushed or squares or norm or prefetch"
               TEST_FILTER+=" or gather or vocab or lm_head or chain or stamps"
               echo "== tests (limit ${l}s): the all-reduce kernels across GPUs and simulated"
               timeout -k 5 "$l" "$PY" -m pytest -p no:cacheprovider -q -rs -s \
                   tests/worker/test_lamport_allreduce_gpu.py tests/worker/test_kernels_allreduce.py \
                   tests/worker/test_push_allreduce_gpu.py tests/worker/test_kernels_decode.py \
                   tests/worker/test_kernels_ops.py \
                   -k "$TEST_FILTER" \
                   > "$OUT/tests$TAG.log" 2>&1 || status=1
               grep -i "start-up choice" "$OUT/tests$TAG.log"
               tail -n 15 "$OUT/tests$TAG.log" ;;
        allreduce) multi=$(echo "$TPS" | tr ' ' '\n' | awk '$1 > 1' | tr '\n' ' ')
                   # shellcheck disable=SC2086
                   [ -n "$multi" ] && { run "allreduce$TAG" 60 allreduce --tp $multi || status=1; } ;;
        *) echo "unknown phase $phase (equal, perf, push, noapart, nolamport, nopreload, tests," \
                "allreduce)"
           status=1 ;;
    esac
done

echo "== summary"
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
summary = {name.stem: json.loads(name.read_text())
           for name in sorted(out.glob("equal*.json")) + sorted(out.glob("allreduce*.json"))}
summary["perf"] = {}
for p in sorted(out.glob("perf_tp*.json")):
    d = json.loads(p.read_text())
    row = {k: d.get(k) for k in ("ok", "error", "eager", "attention", "executor",
                                 "decode_batch1_ms_median", "decode_batch1_ms_p90")}
    prof = d.get("profile") or {}
    row["allreduce_ms_per_step"] = prof.get("allreduce_ms_per_step")
    row["allreduce_share_of_step"] = prof.get("allreduce_share_of_step")
    row["device_kernel_ms_per_step"] = prof.get("device_kernel_ms_per_step")
    row["output_tok_s_1024_1024"] = (d.get("throughput") or {}).get("output_tok_s")
    row["throughput_requests"] = (d.get("throughput") or {}).get("requests")
    summary["perf"][p.stem.replace("perf_", "")] = row
t1 = summary["perf"].get("tp1", {}).get("decode_batch1_ms_median")
for tp, row in summary["perf"].items():
    if t1 and row.get("decode_batch1_ms_median"):
        row["decode_vs_tp1"] = row["decode_batch1_ms_median"] / t1
for tp, row in summary["perf"].items():
    if tp.startswith("tp2") and row.get("decode_vs_tp1") is not None:
        summary[f"{tp}_over_tp1_decode"] = row["decode_vs_tp1"]
        summary[f"{tp}_meets_target_0.6"] = row["decode_vs_tp1"] <= 0.6
(out / "tp_summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
EOF
echo "== done (status $status, ${SECONDS}s); results in $OUT"
exit $status
