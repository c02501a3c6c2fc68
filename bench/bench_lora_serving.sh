#!/usr/bin/env bash
# GPU benchmark of per-request LoRAs through a whole server: `instgenie serve` (one worker) under
# Poisson traffic from `instgenie loadtest`, masked edits of registered templates, three workloads
# at the same rates: no LoRA; every edit naming one shared LoRA; edits naming 8 different LoRAs
# (a batch mixes them). LoRAs: bench/make_loras.py (rank RANK on every attention projection),
# registered with POST /v1/loras. Not a test. Results: docs/benchmarks/lora-*.md.
#   OUT=out/lora MODEL=sdxl-inpaint:full bash bench/bench_lora_serving.sh
# Environment: MODEL, SIZE (1024), STEPS (20), RATES ("0.5 1"), REQUESTS (24 per rate), RANK
# (64), ASYNC_STEPS (1: --lora-async-steps), DEVICE (cuda:0), PORT (8000), OUT, SERVE_ARGS,
# LOADTEST_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${MODEL:-sdxl-inpaint:full}" SIZE="${SIZE:-1024}" STEPS="${STEPS:-20}"
RATES="${RATES:-0.5 1}" REQUESTS="${REQUESTS:-24}" RANK="${RANK:-64}" PORT="${PORT:-8000}"
OUT="${OUT:-out/lora}" ASYNC_STEPS="${ASYNC_STEPS:-1}" DEVICE="${DEVICE:-cuda:0}"
mkdir -p "$OUT/files"
py="${PYTHON:-python3}"
$py bench/make_loras.py --model "$MODEL" --count 8 --rank "$RANK" --out "$OUT/files" > /dev/null
serve=(--model "$MODEL" --devices "$DEVICE" --port "$PORT" --default-steps "$STEPS"
       --lora-async-steps "$ASYNC_STEPS" --max-body-bytes 1GiB --state-db none)
# shellcheck source=bench/serve_lib.sh
source bench/serve_lib.sh
start_server
ids=$($py - "$PORT" "$OUT/files" <<'PY'
import json, pathlib, sys, urllib.request, uuid
port, d = sys.argv[1], pathlib.Path(sys.argv[2])
for f in sorted(d.glob("lora*.safetensors")):  # multipart by hand: the stdlib only
    b = uuid.uuid4().hex
    body = (f'--{b}\r\nContent-Disposition: form-data; name="file"; filename="{f.name}"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n").encode() + f.read_bytes() + \
        f"\r\n--{b}--\r\n".encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/loras", data=body, method="POST",
                                 headers={"Content-Type": f"multipart/form-data; boundary={b}"})
    with urllib.request.urlopen(req, timeout=600) as r:
        print(json.load(r)["id"])
PY
)
read -r -a lora <<< "$(echo $ids)"
common=(--server "http://127.0.0.1:$PORT" --size "$SIZE" --requests "$REQUESTS" --seed 0
        --wait-ready-s 60 --keep-templates)
# shellcheck disable=SC2206 # LOADTEST_ARGS is a list of extra `loadtest` flags
[ -n "${LOADTEST_ARGS:-}" ] && common+=($LOADTEST_ARGS)
declare -A workloads=([none]="" [shared]="--lora ${lora[0]}"
                      [distinct]="$(printf -- '--lora %s ' "${lora[@]}")")
for name in none shared distinct; do
  # shellcheck disable=SC2086 # RATES and the workload's flags are lists
  $py -m instgenie.cli loadtest "${common[@]}" ${workloads[$name]} --rate $RATES \
      --out "$OUT/$name.json" > "$OUT/$name.jsonl"
done
