#!/usr/bin/env bash
# GPU benchmark: a whole server (`instgenie serve`, one worker) under open-loop Poisson traffic
# from `instgenie loadtest`, masked path (edits of registered templates) against the full path
# (the same edits sent as unregistered images). Not a test. Results: docs/benchmarks/serving-*.md.
#   OUT=out/serving MODEL=sdxl-inpaint:full SIZE=1024 bash bench/bench_serving.sh
# Environment: MODEL, SIZE (px), STEPS (20), RATES ("0.5 1 2"), REQUESTS (24 per rate),
# SLO_MS (5000), PORT (8000), OUT (directory for the reports and the server log).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${MODEL:-sdxl-inpaint:full}" SIZE="${SIZE:-1024}" STEPS="${STEPS:-20}"
RATES="${RATES:-0.5 1 2}" REQUESTS="${REQUESTS:-24}" SLO_MS="${SLO_MS:-5000}"
PORT="${PORT:-8000}" OUT="${OUT:-out/serving}"
DEVICE="${DEVICE:-cuda:0}"
mkdir -p "$OUT"
py="${PYTHON:-python3}"
$py -m instgenie.server serve --model "$MODEL" --devices "$DEVICE" --port "$PORT" \
    --default-steps "$STEPS" > "$OUT/server.log" 2>&1 &
server=$!
stop() { kill -TERM "$server" 2>/dev/null || true; wait "$server" || true; }
trap stop EXIT
# wait for /ready while the server lives (a server that died is reported at once, with its log)
for _ in $(seq 900); do
  kill -0 "$server" 2>/dev/null || { echo "server exited:"; tail -20 "$OUT/server.log"; exit 1; }
  $py -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/ready', timeout=2)" \
      2>/dev/null && break
  sleep 1
done
common=(--server "http://127.0.0.1:$PORT" --size "$SIZE" --templates 2 --requests "$REQUESTS"
        --slo-ms "$SLO_MS" --seed 0)
# shellcheck disable=SC2086 # RATES is a list
$py -m instgenie.cli loadtest "${common[@]}" --wait-ready-s 60 --rate $RATES \
    --out "$OUT/masked.json" > "$OUT/masked.jsonl"
# shellcheck disable=SC2086
$py -m instgenie.cli loadtest "${common[@]}" --full --rate $RATES \
    --out "$OUT/full.json" > "$OUT/full.jsonl"
