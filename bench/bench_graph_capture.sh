#!/usr/bin/env bash
# GPU benchmark: the CUDA-graph capture policy (INSTGENIE_GRAPH_CAPTURE, engine/graphs.py) under
# serving traffic — one bench/bench_serving.sh run per policy, each on a fresh server with the
# same arrivals and masks (SEED). Not a test. Results: docs/benchmarks/serving-*.md.
#   OUT=out/capture POLICIES="auto buckets" MODES="masked full" bash bench/bench_graph_capture.sh
# Environment: POLICIES ("always auto"), MODES ("masked full"), OUT; the rest (MODEL, SIZE,
# RATES, REQUESTS, SEED, ...) is bench_serving.sh's. Reports: $OUT/<policy>_<mode>.json; each
# phase's `steps` counts the denoising steps by how they ran (replay, capture, warmup, eager);
# the server's log and its seconds from start to ready: $OUT/<policy>_server.log, _ready_s.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/capture}" POLICIES="${POLICIES:-always auto}" MODES="${MODES:-masked full}"
mkdir -p "$OUT"
for policy in $POLICIES; do
  work=$(mktemp -d)
  echo "== INSTGENIE_GRAPH_CAPTURE=$policy" >&2
  if ! INSTGENIE_GRAPH_CAPTURE="$policy" OUT="$work" MODES="$MODES" bash bench/bench_serving.sh; then
    tail -30 "$work/server.log"
    exit 1
  fi
  for mode in $MODES; do cp "$work/$mode.json" "$OUT/${policy}_$mode.json"; done
  cp "$work/server.log" "$OUT/${policy}_server.log"; cp "$work/ready_s" "$OUT/${policy}_ready_s"
done
