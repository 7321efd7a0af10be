#!/usr/bin/env bash
# The speed side of issue 22 ("What it must show") on the current GPU, in one command:
#
#   OUT=/some/dir bash tools/gpu_moe_bench.sh
#
# Dummy bf16 weights; bytes and FLOPs are the MoE/MLA-aware ones of tools/bench_common.py
# (decode reads the routed experts the batch touches: top-k per MoE layer at batch 1, the
# uniform-routing expectation E·(1 − (1 − k/E)^B) at batch B; prefill MFU counts active FLOPs).
#   qwen3-lat      Qwen3-30B-A3B: decode batch 1 and 64 at context 1024 (MBU targets 70 % / 75 %),
#                  prefill 8 x 2048 (MFU target 45 %)
#   qwen3-nano     Qwen3-30B-A3B: nano-vllm's workload, output tok/s and its roofline ratio
#   deepseek-lat   DeepSeek-V2-Lite: decode batch 1 and 256 at context 4096 (MBU target 70 %),
#                  the latent KV bytes per token against MHA (target >= 7x smaller)
#   mixtral-lat    Mixtral-8x7B: decode batch 1 (MBU target 75 %); 94 GB of weights, so whole
#                  only on a GPU of >= 100 GB (H200); on a smaller one a PROXY with 16 of its 32
#                  layers (bench_latency --num-layers 16, labelled so in its JSON)
#   qwen3-profile  (not in the default list) Qwen3-30B-A3B decode batch 1 with the profiler's
#                  kernel table: where a batch-1 step's time goes
# MOE_BENCH_RUNS picks runs (default: the first four, in that order); each run has a time limit
# so the whole script stays under ~8 minutes. JSON, logs and a summary in $OUT.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/gpu_imports.sh"
OUT="${OUT:-$REPO/gpu_moe_bench_out}"
mkdir -p "$OUT"

RUNS="${MOE_BENCH_RUNS:-qwen3-lat qwen3-nano deepseek-lat mixtral-lat}"
GPU_GIB=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)" \
  2>/dev/null || echo 0)
echo "== GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), ${GPU_GIB} GiB"

status=0
run() {  # name, time limit (s), command...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=20 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    echo "== $name FAILED (exit $rc; 124: over its time limit)"
    status=1
  fi
}

for r in $RUNS; do
  case "$r" in
    qwen3-lat)
      # 61 GB of weights on an 80 GB card: 0.95 leaves room for batch 64's KV.
      run qwen3-lat 200 python3 tools/bench_latency.py --shape qwen3-30b-a3b --batches 1,64 \
        --context 1024 --repeats 3 --prefill 8x2048 --prefill-repeats 2 \
        --gpu-memory-utilization 0.95 --out "$OUT/qwen3-lat.json" ;;
    qwen3-nano)
      run qwen3-nano 180 python3 tools/bench_throughput.py --shape qwen3-30b-a3b \
        --workloads nano --repeats 1 --gpu-memory-utilization 0.95 \
        --out "$OUT/qwen3-nano.json" ;;
    deepseek-lat)
      # 256 x 4k tokens of latent cache is ~34 GB next to 31 GB of weights.
      run deepseek-lat 170 python3 tools/bench_latency.py --shape deepseek-v2-lite \
        --batches 1,256 --context 4096 --repeats 3 --prefill "" \
        --gpu-memory-utilization 0.95 --out "$OUT/deepseek-lat.json" ;;
    mixtral-lat)
      layers=()
      if [ "$GPU_GIB" -lt 100 ]; then
        echo "== mixtral-lat: Mixtral-8x7B's 94 GB of bf16 weights need a GPU of >= 100 GB" \
          "(this one has ${GPU_GIB} GiB; whole on an H200): a PROXY of 16 layers instead"
        layers=(--num-layers 16)
      fi
      run mixtral-lat 170 python3 tools/bench_latency.py --shape mixtral-8x7b "${layers[@]}" \
        --batches 1 --context 1024 --repeats 3 --prefill "" --out "$OUT/mixtral-lat.json" ;;
    qwen3-profile)
      run qwen3-profile 170 python3 tools/bench_latency.py --shape qwen3-30b-a3b --batches 1 \
        --context 1024 --repeats 3 --prefill "" --gpu-memory-utilization 0.95 --profile \
        --profile-out "$OUT/qwen3-profile.txt" --out "$OUT/qwen3-profile.json" ;;
    *) echo "== unknown run $r (qwen3-lat qwen3-nano deepseek-lat mixtral-lat qwen3-profile)"
       status=1 ;;
  esac
done

echo "== summary"
python3 - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
targets = {("qwen3-30b-a3b", 1): 0.70, ("qwen3-30b-a3b", 64): 0.75,
           ("deepseek-v2-lite", 256): 0.70, ("mixtral-8x7b", 1): 0.75}
for f in sorted(out.glob("*.json")):
    r = json.loads(f.read_text())
    dev = r.get("device")
    if r.get("benchmark") == "latency":
        if r.get("layers_override"):
            print(f"{r['shape']}: a PROXY with {r['num_layers']} layers")
        for d in r["decode"]:
            t = targets.get((r["shape"], d["batch"]))
            print(f"{r['shape']} decode batch {d['batch']} context {d['context']}: "
                  f"{d['ms_per_step']['median']} ms/step, {d['bytes_per_step'] / 1e9:.2f} GB/step, "
                  f"MBU {d.get('MBU', {}).get('median')}"
                  + (f" ({d['MBU_omitted']})" if d.get("MBU_omitted") else "")
                  + (f" (target {t})" if t else "") + f" [{dev}]")
        p = r.get("prefill")
        if p:
            print(f"{r['shape']} prefill {p['prompts']}x{p['prompt_len']}: {p.get('TFLOPs')} "
                  f"TFLOP/s active, MFU {p.get('MFU', {}).get('median')} (target 0.45) [{dev}]")
        if r.get("mla"):
            print(f"{r['shape']} KV bytes/token {r['kv_bytes_per_token']} vs MHA "
                  f"{r['mla']['mha_kv_bytes_per_token']}: {r['mla']['kv_reduction_vs_mha']}x "
                  "smaller (target >= 7)")
    elif r.get("benchmark") == "throughput":
        for w in r["workloads"]:
            print(f"{r['shape']} {w['workload']}: {w['output_tok_s']} output tok/s, roofline "
                  f"{w.get('roofline_output_tok_s')} tok/s, ratio {w.get('ratio_to_roofline')}, "
                  f"kv blocks {r['engine']['kv_blocks']} [{dev}]")
EOF
echo "== done (status $status); results in $OUT"
exit $status
