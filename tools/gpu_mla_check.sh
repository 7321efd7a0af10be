#!/usr/bin/env bash
# DeepSeek-V2's multi-head latent attention on a GPU, in one command (issue 22):
#
#   OUT=/some/dir bash tools/gpu_mla_check.sh
#
# 1. tests/worker/test_triton_mla.py (the Triton absorbed decode and latent write against the
#    torch reference at V2-Lite's latent size, bf16/fp16/fp32) and tests/worker/test_deepseek_v2.py
#    (greedy tokens against HF on tiny configs, on the CPU and on the GPU: Triton MLA, decode
#    steps replayed from CUDA graphs, the fused MoE kernel);
# 2. tools/bench_mla.py (the decode kernel's read rate against the measured HBM bandwidth,
#    batch 1 32 256 at context 1024 and 4096, 16 heads). MLA_BENCH_ARGS adds bench flags, e.g.
#    "--batch 256 --ctx 4096 --splits 0 1 2 4". Results in $OUT.
set -uo pipefail
EXTRA_PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/tests"
. "$(dirname "${BASH_SOURCE[0]}")/gpu_imports.sh"
OUT="${OUT:-$REPO/gpu_mla_out}"
mkdir -p "$OUT"

status=0
echo "== MLA tests"
python3 -m pytest -p no:cacheprovider -q -rs tests/worker/test_triton_mla.py \
  tests/worker/test_deepseek_v2.py 2>&1 | tee "$OUT/mla_pytest.log" || status=1
echo "== MLA bench"
# shellcheck disable=SC2086
python3 tools/bench_mla.py --out "$OUT/bench_mla.json" ${MLA_BENCH_ARGS:-} 2>&1 \
  | tee "$OUT/bench_mla.log" || status=1
echo "== done (status $status); results in $OUT"
exit $status
