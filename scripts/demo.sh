#!/usr/bin/env bash
# The main job on a fresh machine: set up (.venv, CPU torch, the project), start the server with
# one CPU worker on the SDXL-inpaint reference model (trained weights, 256 px), send one edit of
# the bundled scene from the command line (its dress repainted as asked, written to
# out/edit.png, one JSON line of timings printed), then stop the server with SIGTERM (it drains
# and exits 0).
#   INSTGENIE_DEMO_PORT (default 8000)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
port="${INSTGENIE_DEMO_PORT:-8000}"
.venv/bin/instgenie serve --model sdxl-inpaint:ref --devices cpu --port "$port" &
server=$!
stop() { kill -TERM "$server" 2>/dev/null || true; wait "$server" || true; }
trap stop EXIT
mkdir -p out  # -o never makes directories
.venv/bin/instgenie client edit --server "http://127.0.0.1:$port" --wait-ready-s 300 \
    --image instgenie/assets/scene.png --mask instgenie/assets/scene_mask.png \
    --prompt "a person in a blue dotted dress on a grey wall, a yellow chair on the left" \
    --steps 20 --seed 1 -o out/edit.png
