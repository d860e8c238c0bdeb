#!/usr/bin/env bash
# Installs everything sluice needs into ./.venv and builds the library. Idempotent.
# Used by scripts/run.sh and scripts/test.sh; sources nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."

# Real English text for the training run comes from Debian packages (see README, "Data").
if [ -f scripts/apt-packages.txt ] && command -v apt-get >/dev/null; then
  missing=$(for p in $(grep -v '^#' scripts/apt-packages.txt); do
              dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
  if [ -n "$missing" ]; then
    SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq $missing >/dev/null
  fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip
# requirements.txt holds the tested versions, as constraints; pyproject.toml what sluice needs.
# The build's own requirements first, so that the package builds without pip's build isolation
# (the build reads the XLA FFI headers from this jax).
pip install -q -c requirements.txt scikit-build-core jax
# The CUDA kernels build where nvcc is found (a few minutes); SLUICE_CUDA=OFF skips them.
if [ "${SLUICE_CUDA:-AUTO}" != OFF ] && command -v nvcc >/dev/null; then
  echo "building libsluice with the CUDA kernels (sm_80, sm_90a: a few minutes, a line per file;" \
       "SLUICE_CUDA=OFF skips them)"
else
  echo "building libsluice (CPU)"
fi
# sluice with its extras: train (sluice-train, sluice-plot), bpe (BPE token files), test (pytest).
# The build's output goes to a log; its status lines and each CUDA file it compiles are shown.
mkdir -p build
log=build/setup-install.log
set +e
CMAKE_ARGS="${CMAKE_ARGS:-} -DSLUICE_CUDA=${SLUICE_CUDA:-AUTO}" \
  pip install -v -c requirements.txt --no-build-isolation ".[train,bpe,test]" 2>&1 | tee "$log" |
  grep --line-buffered -E -e '-- sluice: ' -e 'Building CUDA object' | sed -u 's/^ *//; s/^/  /'
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" != 0 ]; then
  tail -n 40 "$log"
  echo "setup: installing sluice failed (exit $rc); the whole log: $log" >&2
  exit "$rc"
fi
# What this machine can run: the CUDA kernels need a CUDA build and a GPU that jax sees.
.venv/bin/python - <<'PY'
import jax
import sluice

try:
    gpus = jax.devices("gpu")
except Exception:  # a jax without a GPU backend, or no GPU
    gpus = []
kernels = "built" if sluice.has_cuda() else "not built"
gpu = f"{len(gpus)} x {gpus[0].device_kind}" if gpus else "none found"
where = "the GPU" if gpus and sluice.has_cuda() else "the CPU"
print(f"sluice {sluice.__version__} installed: CUDA kernels {kernels}, GPU: {gpu} (runs on {where})")
PY
