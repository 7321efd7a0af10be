#!/usr/bin/env bash
# Issue 22, the legs not measured yet, on one H100 (80 GB), dummy bf16, in priority order:
#  1. qwen3-b1-profile  Qwen3-30B-A3B decode batch 1 (ctx 1024): MBU + torch.profiler kernel table
#                       of 4 steps + tools/trace_steps.py per-step timeline breakdown (where the time
#                       beyond the MoE kernels goes: attention, router GEMV, routing/top-k, norms)
#  2. qwen3-nano        Qwen3-30B-A3B, nano-vllm's workload: output tok/s and roofline ratio
#  3. deepseek-b256     DeepSeek-V2-Lite decode batch 256 at ctx 4096: MBU; the latent KV bytes per
#                       token vs MHA (bench_latency's "mla" block, from the shape's config)
#  4. mixtral16-b1-PROXY Mixtral-8x7B with 16 of its 32 layers (--num-layers 16, a PROXY: the full
#                       shape's 93 GB do not fit an H100): decode batch 1 MBU
# Each leg has a time cap, cut further to what is left of a 540 s budget (a leg with < 45 s left is
# skipped). At most 8 files come back from $OUT: the 7 results below and legs.log (all output).
# Needs .whl carried (tools/gpu_imports.sh); on the device machine: bash tools/gpu_moe_legs.sh
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET=${MOE_LEGS_BUDGET_S:-540}
OUT=${OUT:-/tmp/moe_legs_out}
mkdir -p "$OUT"
W=/tmp/moe_legs  # raw profiler traces and scratch (not returned)
rm -rf "$W"; mkdir -p "$W"
LOG="$OUT/legs.log"
. tools/gpu_imports.sh
echo "== GPU: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)" | tee -a "$LOG"
# Lines worth seeing in the reply (the whole output goes to legs.log).
KEEP='Error|error:|Traceback|OutOfMemory|exceeds the KV|KV cache:|decode batch|prefill:|startup|captured|^ *[0-9]+ +[0-9]+ |workload|nano|MLA KV|FAILED|Killed'

leg() {  # name cap_s command...
  local name=$1 cap=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - T0) - 10 ))
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 45 ]; then
    echo "== $name SKIPPED: only ${left}s of the ${BUDGET}s budget left" | tee -a "$LOG"; return 1
  fi
  echo "== $name (cap ${cap}s, t=$(( $(date +%s) - T0 ))s): $*" | tee -a "$LOG"
  local t=$(date +%s)
  timeout -k 15 "$cap" "$@" 2>&1 | tee -a "$LOG" | grep -E "$KEEP" | cut -c1-300 | tail -12
  local rc=${PIPESTATUS[0]}
  echo "== $name rc=$rc (124: hit its cap) in $(( $(date +%s) - t ))s" | tee -a "$LOG"
  return "$rc"
}

# 1. ~90 s: start-up ~50 s (60 GB dummy weights, Triton JIT, ~20 s graph capture), ceilings ~5 s,
#    1024-token prefill + 8 + 3x32 timed steps + 4 profiled steps at ~3.2 ms, trace export.
leg qwen3-b1-profile 170 python3 tools/bench_latency.py --shape qwen3-30b-a3b --batches 1 \
  --context 1024 --repeats 3 --prefill "" --gpu-memory-utilization 0.95 --profile \
  --profile-out "$W/qwen3_b1.profile.txt" --out "$OUT/qwen3_b1_profile.json"
cp "$W/qwen3_b1.profile.txt" "$OUT/qwen3_b1_profile.txt" 2>/dev/null
TR=$(ls "$W"/qwen3_b1.profile.decode_batch_1.trace.json 2>/dev/null)
if [ -n "$TR" ]; then
  timeout 60 python3 tools/trace_steps.py "$TR" --steps 4 --json "$OUT/qwen3_b1_trace_steps.json" \
    --strip-to "$W/strip" 2>&1 | tee -a "$LOG" | cut -c1-300 | head -40
  GZ=$(ls "$W"/strip/*.json.gz 2>/dev/null | head -1)
  if [ -n "$GZ" ] && [ "$(stat -c %s "$GZ")" -lt 16000000 ]; then
    cp "$GZ" "$OUT/qwen3_b1_trace.json.gz"
  else
    echo "== stripped trace missing or over 16 MB: not returned" | tee -a "$LOG"
  fi
fi

# 2. ~120 s: start-up ~60 s (graphs up to batch 256), one warm-up request, the workload (133,966
#    output tokens at ~5-10k tok/s, 142,827 prompt tokens; ~15 GB of KV, so some preemption).
leg qwen3-nano 200 python3 tools/bench_throughput.py --shape qwen3-30b-a3b --workloads nano \
  --repeats 1 --gpu-memory-utilization 0.95 --out "$OUT/qwen3_nano.json"

# 3. ~120 s: start-up ~30 s (31 GB weights), prefill of 256 x 4096 = 1.05M tokens (expanded MLA
#    prefill, per request; ~15-30k tok/s: 35-70 s), 8 + 3x32 steps at ~30 ms. KV needed: 256 x
#    4280 tokens x 31104 B = 34 GB; 0.95 of the card leaves ~41 GiB after weights and activations.
leg deepseek-b256 200 python3 tools/bench_latency.py --shape deepseek-v2-lite --batches 256 \
  --context 4096 --repeats 3 --prefill "" --gpu-memory-utilization 0.95 \
  --out "$OUT/deepseek_b256.json"

# 4. ~75 s: PROXY, 16 of Mixtral-8x7B's 32 layers (46.7 GB of weights, 12.9 GB read per batch-1
#    step); per-layer cost is the full model's, the LM head/embeddings weigh ~2x their share.
leg mixtral16-b1-PROXY 130 python3 tools/bench_latency.py --shape mixtral-8x7b --num-layers 16 \
  --batches 1 --context 1024 --repeats 3 --prefill "" --out "$OUT/mixtral16_b1_proxy.json"

echo "== summary (t=$(( $(date +%s) - T0 ))s)" | tee -a "$LOG"
python3 - "$OUT" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
targets = {("qwen3-30b-a3b", 1): 0.70, ("deepseek-v2-lite", 256): 0.70, ("mixtral-8x7b", 1): 0.75}
for f in sorted(out.glob("*.json")):
    try:
        r = json.loads(f.read_text())
    except Exception as e:  # noqa: BLE001
        print(f"{f.name}: unreadable ({e})")
        continue
    if isinstance(r, list):  # trace_steps
        for t in r:
            if t.get("error"):
                print(f"{f.name}: {t['error']}")
                continue
            print(f"{f.name}: {t['per_step_us']:.1f} us/step, idle {t['idle_us_per_step']:.1f}, "
                  f"{t['kernels_per_step']:.0f} kernels/step; by category (us/step): "
                  f"{json.dumps(t['by_category_us_per_step'])}")
            for k in t["top_kernels"][:15]:
                print(f"    {k['us_per_step']:9.1f} us/step {k['calls_per_step']:6.1f}/step  {k['name']}")
        continue
    dev = r.get("device")
    if r.get("benchmark") == "latency":
        tag = (f" PROXY {r['num_layers']} layers" if r.get("layers_override") else "")
        e = r.get("engine", {})
        print(f"{f.name}: {r['shape']}{tag} startup {e.get('startup_s')} s, graphs "
              f"{e.get('graph_capture_s')} s, kv_blocks {e.get('kv_blocks')} [{dev}, HBM "
              f"{r['ceilings'].get('hbm_GBps')} GB/s]")
        for d in r["decode"]:
            t = targets.get((r["shape"], d["batch"]))
            print(f"  decode b{d['batch']} ctx {d['context']}: {d['ms_per_step']['median']} ms/step,"
                  f" {d['bytes_per_step'] / 1e9:.2f} GB/step, MBU {d.get('MBU', {}).get('median')}"
                  + (f" ({d['MBU_omitted']})" if d.get("MBU_omitted") else "")
                  + (f" target {t}" if t else ""))
            for k in d.get("profile_top_kernels", [])[:15]:
                print(f"    {k['device_us_total'] / 4:9.1f} us/step {k['calls'] // 4:5d}/step  {k['name']}")
        if r.get("mla"):
            print(f"  KV bytes/token {r['kv_bytes_per_token']} vs MHA {r['mla']['mha_kv_bytes_per_token']}:"
                  f" {r['mla']['kv_reduction_vs_mha']}x smaller (target >= 7)")
    elif r.get("benchmark") == "throughput":
        for w in r["workloads"]:
            print(f"{f.name}: {r['shape']} {w['workload']}: {w['output_tok_s']} output tok/s, roofline "
                  f"{w.get('roofline_output_tok_s')} tok/s, ratio {w.get('ratio_to_roofline')}, "
                  f"{w['seconds']['median']} s, kv_blocks {r['engine']['kv_blocks']} [{dev}]")
EOF
ls -la "$OUT"
echo "== done in $(( $(date +%s) - T0 ))s"
