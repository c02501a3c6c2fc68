#!/usr/bin/env bash
# GPU benchmark: the CUDA-graph capture policy (INSTGENIE_GRAPH_CAPTURE, engine/graphs.py) under
# serving traffic — one bench/bench_serving.sh run per policy, each on a fresh server with the
# same arrivals and masks (SEED). Not a test. Results: docs/benchmarks/serving-*.md.
#   OUT=out/capture POLICIES="auto buckets" MODES="masked full" bash bench/bench_graph_capture.sh
# Any other setting the same way: VAR names its variable, VALUES its values, e.g. the K/V cache:
#   VAR=INSTGENIE_KV_CACHE VALUES="off on" MODEL=flux-fill:full bash bench/bench_graph_capture.sh
# Environment: POLICIES ("always auto"), MODES ("masked full"), OUT, VAR
# (INSTGENIE_GRAPH_CAPTURE), VALUES ($POLICIES); the rest (MODEL, SIZE,
# RATES, REQUESTS, SEED, ...) is bench_serving.sh's. Reports: $OUT/<policy>_<mode>.json; each
# phase's `steps` counts the denoising steps by how they ran (replay, capture, warmup, eager);
# the server's log and its seconds from start to ready: $OUT/<policy>_server.log, _ready_s.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/capture}" POLICIES="${POLICIES:-always auto}" MODES="${MODES:-masked full}"
VAR="${VAR:-INSTGENIE_GRAPH_CAPTURE}" VALUES="${VALUES:-$POLICIES}"
mkdir -p "$OUT"
for policy in $VALUES; do
  work=$(mktemp -d)
  echo "== $VAR=$policy" >&2
  if ! env "$VAR=$policy" OUT="$work" MODES="$MODES" bash bench/bench_serving.sh; then
    tail -30 "$work/server.log"
    exit 1
  fi
  for mode in $MODES; do cp "$work/$mode.json" "$OUT/${policy}_$mode.json"; done
  cp "$work/server.log" "$OUT/${policy}_server.log"; cp "$work/ready_s" "$OUT/${policy}_ready_s"
  cp "$work/health.json" "$OUT/${policy}_health.json" 2>/dev/null || true
done
