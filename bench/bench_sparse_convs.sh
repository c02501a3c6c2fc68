#!/usr/bin/env bash
# GPU benchmark: sparse convolutions (ResNets and samplers on the masked tiles, issue 28) against
# attention-only masking, side by side on one card: bench_masked_step.py once per setting of
# INSTGENIE_SPARSE_CONVS (step rows at RATIOS x BATCHES, and the image-level run at 20 steps,
# m = 0.2: this project's full path, masked, and the stock-ops full path). Not a test.
#   OUT=/tmp/o MODEL=sdxl-inpaint:full bash bench/bench_sparse_convs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/sparse_convs}" MODEL="${MODEL:-sdxl-inpaint:full}"
# EXTRA: more bench_masked_step.py flags (e.g. --profile: the top kernels at m = 0.2)
RATIOS="${RATIOS:-0.05 0.2 0.35}" BATCHES="${BATCHES:-1 8}" SETTINGS="${SETTINGS:-off auto}"
mkdir -p "$OUT"
for s in $SETTINGS; do
  # shellcheck disable=SC2086 # word splitting of the lists is intended
  INSTGENIE_SPARSE_CONVS=$s python3 bench/bench_masked_step.py --model "$MODEL" \
    --ratios $RATIOS --batches $BATCHES --image-steps 20 --image-ratio 0.2 --warmup 2 --iters 5 \
    --out "$OUT/sparse_convs_$s.json" ${EXTRA:-}
done
