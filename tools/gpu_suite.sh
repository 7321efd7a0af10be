#!/usr/bin/env bash
# The test suite on a GPU machine whose image lacks some of tidal's dependencies and has no
# network (the device machines): installs the wheels carried in .whl/ (pyzmq, msgspec, gguf,
# from ../shared/tools/gpu-wheels.sh, plus the openai client and its needs for the server
# tests), makes `import tidal.*` work from the checkout, and runs pytest.
#
#   OUT=/some/dir bash tools/gpu_suite.sh NAME [pytest args...]    (log: $OUT/suite_NAME.log)
#
# LIMIT_S=N interrupts pytest after N seconds (SIGINT, so the summary of what ran is still
# written). A test running longer than TEST_TIMEOUT_S (default 300) fails with the stacks of
# its process and of the tidal processes under it (tests/conftest.py), and the run goes on.
#
# Tests that need a package the image lacks and cannot carry (the bundled SmolLM2 and MiniLM
# models are over the carry limit) skip with the reason printed.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/gpu_suite_out}"
NAME="${1:-all}"; shift || true
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TIDAL_TEST_TIMEOUT_S="${TEST_TIMEOUT_S:-300}"
if ! python3 -c "import msgspec, zmq, gguf, openai" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/tidal_site "$REPO"/.whl*/*.whl 2>&1 | grep -v WARNING
  export PYTHONPATH="/tmp/tidal_site${PYTHONPATH:+:$PYTHONPATH}"
fi
S=$(mktemp -d); mkdir -p "$S/tidal"
for d in engine_core frontend worker csrc; do ln -s "$REPO/$d" "$S/tidal/$d"; done
export PYTHONPATH="$S:$REPO:$PYTHONPATH"
cd "$REPO"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout -s INT -k 20 "${LIMIT_S:-0}" python3 -m pytest -v -rfEs --durations=15 \
  -p no:cacheprovider "${@:-tests}" \
  > "$OUT/suite_$NAME.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/suite_$NAME.log" | tail -40
exit $rc
