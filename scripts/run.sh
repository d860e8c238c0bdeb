#!/usr/bin/env bash
# Installs everything and runs the project's main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/sluice-demo "$@"
