#!/usr/bin/env bash
# Train both reference models side by side on one GPU from one rendered pool (the command the
# committed weights came from; docs/reference-models.md). Usage:
#   bash scripts/train_reference.sh OUT_DIR [SCENES] [VAE_MINUTES] [MINUTES] [extra train args...]
# Writes OUT_DIR/sdxl-inpaint, OUT_DIR/flux-fill (pipelines + training.json) and their logs.
set -euo pipefail
out="$1"; scenes="${2:-16000}"; vae_min="${3:-1.5}"; minutes="${4:-5.5}"; shift 4 || shift $#
py="${PYTHON:-python3}"
mkdir -p "$out"
pool="${POOL:-/tmp/instgenie-pool-$scenes.npz}"
$py -m instgenie.cli train-reference --render-only --pool "$pool" --scenes "$scenes"
pids=()
for family in sdxl-inpaint flux-fill; do
    $py -m instgenie.cli train-reference --family "$family" --pool "$pool" --scenes "$scenes" \
        --out "$out/$family" --vae-minutes "$vae_min" --max-minutes "$minutes" "$@" \
        > "$out/$family.log" 2>&1 &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
tail -n 3 "$out"/*.log
exit $rc
