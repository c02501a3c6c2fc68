#!/usr/bin/env bash
# Regenerate the lock files: exact versions of every dependency, transitive ones included, except
# the accelerator stack (torch, triton, nvidia-*, cuda-*; see requirements/torch-cpu.txt), for
# Python >= 3.11 on any platform (uv's universal resolution: markers where versions differ).
#   requirements/lock-dev.txt   runtime + dev extra (tests, CI: scripts/setup.sh --dev)
#   requirements/lock.txt       runtime only, the same versions (scripts/setup.sh)
#   bash scripts/lock.sh                          # keep current pins, add/remove what changed
#   bash scripts/lock.sh --upgrade                # newest versions pyproject.toml allows
#   bash scripts/lock.sh --upgrade-package fastapi
# Then: bash scripts/test.sh, and commit pyproject.toml and requirements/ together.
# uv (pinned below) is used from PATH or installed into a throwaway virtualenv.
set -euo pipefail
cd "$(dirname "$0")/.."

UV_VERSION=0.13.9
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
uv=$(command -v uv || true)
if [[ -z "$uv" || "$("$uv" --version | cut -d' ' -f2)" != "$UV_VERSION" ]]; then
  "${PYTHON:-python3}" -m venv "$scratch/uv-venv"
  "$scratch/uv-venv/bin/python" -m pip install -q "uv==$UV_VERSION"
  uv="$scratch/uv-venv/bin/uv"
fi

grep -E '^torch==' requirements/torch-cpu.txt >"$scratch/torch.txt"  # resolve against CPU torch

compile() {
  "$uv" pip compile pyproject.toml --universal --python-version 3.11 \
    --no-emit-index-url --no-emit-find-links --custom-compile-command "bash scripts/lock.sh" "$@"
}
# the accelerator stack: torch and what only its builds pull in (names from a first pass, which
# starts from the same pins)
[[ -f requirements/lock-dev.txt ]] && cp requirements/lock-dev.txt "$scratch/all.txt"
compile --extra dev --constraints "$scratch/torch.txt" --no-annotate --no-header -q \
  -o "$scratch/all.txt" "$@"
skip=()
for name in $(sed -nE 's/^(torch|triton|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)==.*/\1/p' \
    "$scratch/all.txt"); do
  skip+=(--no-emit-package "$name")
done
compile --extra dev --constraints "$scratch/torch.txt" "${skip[@]}" -q \
  -o requirements/lock-dev.txt "$@"
# runtime: the dev lock's versions (its pins as constraints, torch's included)
compile --constraints "$scratch/all.txt" "${skip[@]}" -q -o requirements/lock.txt
# annotations name what the constraints are, not the scratch path (a rerun changes no line)
sed -i -e "s|-c $scratch/all.txt|-c requirements/lock-dev.txt|" \
  -e "s|-c $scratch/torch.txt|-c requirements/torch-cpu.txt|" requirements/lock-dev.txt \
  requirements/lock.txt
for f in requirements/lock-dev.txt requirements/lock.txt; do
  echo "$f: $(grep -cE '^[a-z0-9]' "$f") packages pinned"
done
