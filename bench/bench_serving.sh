#!/usr/bin/env bash
# GPU benchmark: a whole server (`instgenie serve`) under open-loop Poisson traffic from
# `instgenie loadtest`, one report per workload mode: masked (edits of registered templates),
# full (the same edits sent as unregistered images), mixed (FULL_FRACTION of them full).
# Not a test. Results: docs/benchmarks/serving-*.md, routing-*.md.
#   OUT=out/serving MODEL=sdxl-inpaint:full SIZE=1024 bash bench/bench_serving.sh
#   DEVICE=cuda:0,cuda:1 ROUTING=least-loaded MODES=mixed OUT=out/ll bash bench/bench_serving.sh
# Environment: MODEL, SIZE (px), STEPS (20), RATES ("0.5 1 2"), REQUESTS (24 per rate),
# SLO_MS (5000), PORT (8000), OUT (directory for the reports and the server log), DEVICE (one
# worker per device, comma-separated), ROUTING (server default if empty), PROFILE (latency
# profile JSON, none if empty), MODES ("masked full"), FULL_FRACTION (0.25, mode mixed),
# MASK_RATIOS (loadtest default if empty), TEMPLATES (2), SEED (0: arrivals, masks, full draws),
# SERVE_ARGS / LOADTEST_ARGS (extra flags, e.g. "--vae-dtype bf16", "--distinct-prompts").
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${MODEL:-sdxl-inpaint:full}" SIZE="${SIZE:-1024}" STEPS="${STEPS:-20}"
RATES="${RATES:-0.5 1 2}" REQUESTS="${REQUESTS:-24}" SLO_MS="${SLO_MS:-5000}"
PORT="${PORT:-8000}" OUT="${OUT:-out/serving}"
DEVICE="${DEVICE:-cuda:0}" MODES="${MODES:-masked full}" FULL_FRACTION="${FULL_FRACTION:-0.25}"
TEMPLATES="${TEMPLATES:-2}"
mkdir -p "$OUT"
py="${PYTHON:-python3}"
serve=(--model "$MODEL" --devices "$DEVICE" --port "$PORT" --default-steps "$STEPS")
[ -n "${ROUTING:-}" ] && serve+=(--routing "$ROUTING")
[ -n "${PROFILE:-}" ] && serve+=(--profile "$PROFILE")
# shellcheck source=bench/serve_lib.sh
source bench/serve_lib.sh
start_server
# what the workers run with (/health: workers[].execution), beside the reports
$py -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())" \
    "http://127.0.0.1:$PORT/health" > "$OUT/health.json" || true
common=(--server "http://127.0.0.1:$PORT" --size "$SIZE" --templates "$TEMPLATES"
        --requests "$REQUESTS" --slo-ms "$SLO_MS" --seed "${SEED:-0}" --wait-ready-s 60)
[ -n "${MASK_RATIOS:-}" ] && common+=(--mask-ratios "$MASK_RATIOS")
# shellcheck disable=SC2206 # LOADTEST_ARGS is a list of extra `loadtest` flags
[ -n "${LOADTEST_ARGS:-}" ] && common+=($LOADTEST_ARGS)
for mode in $MODES; do
  case "$mode" in
    masked) extra=() ;;
    full) extra=(--full) ;;
    mixed) extra=(--full-fraction "$FULL_FRACTION") ;;
    *) echo "unknown mode $mode (masked | full | mixed)"; exit 2 ;;
  esac
  # shellcheck disable=SC2086 # RATES is a list
  $py -m instgenie.cli loadtest "${common[@]}" "${extra[@]}" --rate $RATES \
      --out "$OUT/$mode.json" > "$OUT/$mode.jsonl"
done
