#!/usr/bin/env bash
# The fused MoE kernels on a GPU, in one command (issue 22):
#
#   OUT=/some/dir bash tools/gpu_moe_check.sh
#
# 1. the kernel tests (tests/worker/test_triton_moe.py: Triton vs the torch reference for every
#    routing mode, bf16/fp16/fp32, larger shapes, the policy's dispatch, a CUDA-graph capture)
#    and the layer tests (tests/worker/test_fused_moe.py);
# 2. tools/bench_moe.py (Qwen3-30B-A3B and Mixtral-8x7B shapes, T in 1 8 64 256 2048: the
#    Triton layer against the per-expert torch loop, batch-1 weight bandwidth, graph check).
# MOE_BENCH_ARGS adds bench flags, e.g. "--tune" (prints TUNED entries for
# worker/ops/moe_configs.py) or "--shapes qwen3-30b-a3b --tokens 1 64". Results in $OUT.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/gpu_imports.sh"
OUT="${OUT:-$REPO/gpu_moe_out}"
mkdir -p "$OUT"

status=0
echo "== MoE tests"
python3 -m pytest -p no:cacheprovider -q -rs tests/worker/test_triton_moe.py \
  tests/worker/test_fused_moe.py 2>&1 | tee "$OUT/moe_pytest.log" || status=1
echo "== MoE bench"
# shellcheck disable=SC2086
python3 tools/bench_moe.py --out "$OUT/bench_moe.json" ${MOE_BENCH_ARGS:-} 2>&1 \
  | tee "$OUT/bench_moe.log" || status=1
echo "== done (status $status); results in $OUT"
exit $status
