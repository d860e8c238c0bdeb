#!/usr/bin/env bash
# Installs everything and runs the project's main job: dropless MoE training of the `tiny` preset on the
# real-text corpus with the sluice kernels (CPU here; a GPU when one is present). Extra arguments go to
# sluice-train (e.g. --moe-impl dense --capacity-factor 1.25, --steps 1000). Each call starts its run
# afresh in its run directory (--overwrite), unless the arguments say otherwise: --resume continues
# it, and a run directory of your own (--out) is never overwritten unless you pass --overwrite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
again=(--overwrite)
for arg in "$@"; do
  case "$arg" in --resume | --overwrite | --out | --out=*) again=() ;; esac
done
.venv/bin/sluice-train --preset tiny --moe-impl sluice ${again[@]+"${again[@]}"} "$@"
