#!/usr/bin/env bash
# One-command GPU check of tidal's kernels, run from anywhere on a machine with a CUDA GPU:
#
#   OUT=/some/dir bash tools/gpu_kernel_check.sh
#
# 1. makes `import tidal.*` work with no install: a temp folder holding a `tidal` namespace
#    whose subpackages are symlinks to the repo's top-level folders (the mapping pyproject's
#    package-dir declares), put first on PYTHONPATH;
# 2. builds the CUDA extension (logs the build time) into ~/.cache/tidal/cuda_ext;
# 3. runs the kernel tests (tests/worker/test_kernels_*.py, pytest -x -q by default);
# 4. runs the microbenchmarks (decode/prefill attention, fused ops, HBM copy ceiling).
# Installs nothing; needs torch, triton, numpy, pytest, nvcc and ninja (the GPU image has them).
# Logs and JSON go to $OUT (default: ./gpu_check_out). Exit status: non-zero if the build or a
# test failed. TIDAL_PYTEST_ARGS overrides "-x -q"; TIDAL_TEST_WORKERS the xdist worker count (4);
# TIDAL_BENCH_ARGS=--sweep adds the launch-configuration sweeps to the benchmark.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/gpu_check_out}"
PY="${PYTHON:-python3}"
PYTEST_ARGS="${TIDAL_PYTEST_ARGS:--x -q}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
mkdir -p "$SHIM/tidal"
for d in engine_core frontend worker csrc; do ln -s "$REPO/$d" "$SHIM/tidal/$d"; done
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO"

status=0
echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
"$PY" -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
(nvcc --version | tail -2) || echo "nvcc: not found"
"$PY" -c "import tidal.worker.ops as o; print('tidal.worker.ops from', o.__file__)" || { echo "tidal is not importable"; exit 3; }

echo "== build CUDA extension"
"$PY" tools/gpu_kernel_check.py build --out "$OUT/build.json" 2>&1 | tee "$OUT/build.log" || status=1

echo "== kernel tests"
# Triton compiles dominate the test time; spread them over a few processes when xdist is there
# (the extension is already built, so each worker just loads it from the cache).
if "$PY" -c "import xdist" 2>/dev/null; then PYTEST_ARGS="$PYTEST_ARGS -n ${TIDAL_TEST_WORKERS:-4}"; fi
# shellcheck disable=SC2086
"$PY" -m pytest -p no:cacheprovider $PYTEST_ARGS tests/worker/test_kernels_*.py 2>&1 | tee "$OUT/pytest.log" || status=1

echo "== microbenchmarks"
# shellcheck disable=SC2086
"$PY" tools/gpu_kernel_check.py bench --out "$OUT/kernel_bench.json" ${TIDAL_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" || status=1

echo "== done (status $status); results in $OUT"
exit $status
