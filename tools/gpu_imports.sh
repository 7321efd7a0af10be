# Sourced by the tools/gpu_*.sh scripts (not run on its own): makes `import tidal.*` work from
# the checkout on a GPU machine whose image lacks some of tidal's dependencies and has no
# network. Installs the wheels carried in .whl*/ (pyzmq, msgspec, gguf from
# ../shared/tools/gpu-wheels.sh, the openai client and its needs) where the image lacks them,
# links the checkout's packages under a `tidal` folder in a temporary directory, puts both on
# PYTHONPATH and sets REPO. EXTRA_PYTHONPATH (optional) goes on PYTHONPATH too.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONUNBUFFERED=1
if ! python3 -c "import msgspec, zmq, gguf" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/tidal_site "$REPO"/.whl*/*.whl 2>&1 | grep -v WARNING
  export PYTHONPATH="/tmp/tidal_site${PYTHONPATH:+:$PYTHONPATH}"
fi
TIDAL_SHIM=$(mktemp -d); mkdir -p "$TIDAL_SHIM/tidal"
trap 'rm -rf "$TIDAL_SHIM"' EXIT
for d in engine_core frontend worker csrc; do ln -s "$REPO/$d" "$TIDAL_SHIM/tidal/$d"; done
export PYTHONPATH="$TIDAL_SHIM:$REPO${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO"
