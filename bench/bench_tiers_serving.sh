#!/usr/bin/env bash
# GPU benchmark (issue 24): the same open-loop traffic through `instgenie serve` with the template
# caches in each tier, one configuration after another on one card (bench/bench_serving.sh).
# Not a test. Results: docs/benchmarks/host-tiers-*.md.
#   OUT=out/tiers CONFIGS="gpu dram disk" bash bench/bench_tiers_serving.sh
# Configurations (CONFIGS, in order):
#   gpu      no host cache (INSTGENIE_CACHE_ROOT=""): every template in the loop's GPU memory
#   dram     host DRAM tier, no device tier (--cache-gpu-bytes 0): every edit reads DRAM
#   disk     DRAM tier smaller than one template (2 GB), no device tier: captured to disk, read
#            from disk step by step
#   default  no cache flags: root and budgets from the machine, device tier above DRAM
# Environment: as bench_serving.sh (MODEL, RATES, REQUESTS, PROFILE, ...); DISK_RATES for the
# disk configuration (default: RATES). Each configuration's report: $OUT/<config>.json, the
# tail of its server log: $OUT/<config>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/tiers}"
mkdir -p "$OUT"
scratch="$(mktemp -d)"
for config in ${CONFIGS:-gpu dram disk}; do
  root="$scratch/root-$config"
  rates="${RATES:-0.5 1}"
  case "$config" in
    gpu) args="" ; export INSTGENIE_CACHE_ROOT="" ;;  # set and empty: no host cache
    dram) args="--cache-root $root --cache-dram-bytes 40000000000 --cache-gpu-bytes 0" ;;
    disk) args="--cache-root $root --cache-dram-bytes 2000000000 --cache-disk-bytes 40000000000"
          args="$args --cache-gpu-bytes 0"; rates="${DISK_RATES:-$rates}" ;;
    default) args="" ; export INSTGENIE_CACHE_ROOT="$root" ;;
    *) echo "unknown configuration $config"; exit 2 ;;
  esac
  echo "== $config: $args"
  OUT="$scratch/$config" RATES="$rates" MODES=masked SERVE_ARGS="$args ${SERVE_ARGS:-}" \
    bash bench/bench_serving.sh || echo "$config failed"
  unset INSTGENIE_CACHE_ROOT
  cp "$scratch/$config/masked.json" "$OUT/$config.json" 2>/dev/null
  grep -v -e "Triton kernel" "$scratch/$config/server.log" | tail -40 > "$OUT/$config.log"
  tail -n 3 "$scratch/$config/masked.jsonl" | cut -c1-400
  rm -rf "$root" /dev/shm/igc_* 2>/dev/null
done
rm -rf "$scratch"
