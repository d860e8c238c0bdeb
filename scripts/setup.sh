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
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.txt
# The CUDA kernels build where nvcc is found (a few minutes); SLUICE_CUDA=OFF skips them.
# --no-build-isolation: the build reads the XLA FFI headers from the jax installed above.
if [ "${SLUICE_CUDA:-AUTO}" != OFF ] && command -v nvcc >/dev/null; then
  echo "building libsluice with the CUDA kernels (sm_80, sm_90a: a few minutes; SLUICE_CUDA=OFF skips them)"
else
  echo "building libsluice (CPU)"
fi
CMAKE_ARGS="${CMAKE_ARGS:-} -DSLUICE_CUDA=${SLUICE_CUDA:-AUTO}" \
  .venv/bin/python -m pip install -q --no-build-isolation .
.venv/bin/python -c "import sluice; print('sluice', sluice.__version__, 'built, CUDA kernels:', sluice.has_cuda())"
