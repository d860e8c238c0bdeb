#!/usr/bin/env bash
# Installs everything and runs every test: the C tests under ASan/UBSan, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

echo "== C tests (AddressSanitizer + UndefinedBehaviorSanitizer)"
cmake -S . -B build/ctest -DSLUICE_BUILD_TESTS=ON -DSLUICE_CUDA=OFF -DSLUICE_FFI=OFF \
      -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build build/ctest -j"$(nproc)" >/dev/null
(cd build/ctest && ctest --output-on-failure)

echo "== Python tests"
# Run from tests/ so `import sluice` finds the installed package, not the source tree.
cd tests && ../.venv/bin/python -m pytest -rs --durations=10 -p no:cacheprovider python "$@"
