#!/usr/bin/env bash
# GPU benchmark: routing policies back to back on one machine loan, each a whole server under the
# same arrivals (bench/bench_serving.sh per policy). Not a test. Results: docs/benchmarks/routing-*.md.
#   DEVICE=cuda:0,cuda:1 STAGES_PROFILE=1 OUT=$OUT bash bench/bench_routing_ab.sh
# Environment: POLICIES (run in this order, "least-loaded mask-aware"), PROFILE (latency profile,
# profiles/sdxl-inpaint-full-h200.json), STAGES_PROFILE (1: first time the loop's encode/decode
# on the first device with `instgenie profile --stages-only` into a copy of PROFILE, which the
# runs then use, kept as $OUT/profile.json), RUN_TIMEOUT_S (per policy, 330), OUT, and
# bench_serving.sh's variables (MODES defaults to mixed here, FULL_FRACTION to 0.3).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/routing}" PROFILE="${PROFILE:-profiles/sdxl-inpaint-full-h200.json}"
DEVICE="${DEVICE:-cuda:0,cuda:1}" MODEL="${MODEL:-sdxl-inpaint:full}"
mkdir -p "$OUT"
py="${PYTHON:-python3}"
if [ "${STAGES_PROFILE:-0}" = 1 ]; then
  cp "$PROFILE" "$OUT/profile.json"
  $py -m instgenie.cli profile --model "$MODEL" --device "${DEVICE%%,*}" --stages-only \
      --warmup 2 --iters 5 -o "$OUT/profile.json" || exit 1
  PROFILE="$OUT/profile.json"
fi
for policy in ${POLICIES:-least-loaded mask-aware}; do
  echo "== $policy $(date +%T)"
  timeout "${RUN_TIMEOUT_S:-330}" env DEVICE="$DEVICE" MODEL="$MODEL" ROUTING="$policy" \
      PROFILE="$PROFILE" MODES="${MODES:-mixed}" FULL_FRACTION="${FULL_FRACTION:-0.3}" \
      OUT="$OUT/$policy" bash bench/bench_serving.sh || echo "== $policy: exit $?"
  # a server a timeout left behind (this script's port only)
  pkill -TERM -f "instgenie.server serve .*--port ${PORT:-8000}( |$)" 2>/dev/null && sleep 5
done
echo "== done $(date +%T)"
