#!/usr/bin/env bash
# Installs everything and runs the project's main job: dropless MoE training of the `tiny` preset on the
# real-text corpus with the sluice kernels (CPU here; a GPU when one is present). Extra arguments go to
# sluice-train (e.g. --moe-impl dense --capacity-factor 1.25, --steps 1000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/sluice-train --preset tiny --moe-impl sluice "$@"
