#!/usr/bin/env bash
# Set up a virtual environment for InstGenIE: torch, the locked dependencies, the project (editable).
#   bash scripts/setup.sh                  # .venv: runtime dependencies, requirements/lock.txt
#   bash scripts/setup.sh --dev            # plus test tools: requirements/lock-dev.txt
#   bash scripts/setup.sh --cluster        # plus Ray (`serve --cluster`), at lock-dev's pins
#   bash scripts/setup.sh --dev --latest   # .venv-latest: the newest versions pyproject.toml
#                                          # allows instead of the lock (CI drift check)
# torch is installed first and is not in the lock (CPU and CUDA builds differ): on a machine
# without an NVIDIA GPU, requirements/torch-cpu.txt (torch==2.13.0, a local CPU wheel here, and
# the triton its interpreter needs); on a GPU machine `torch` as pip resolves it, with the triton
# and CUDA libraries that build pins. INSTGENIE_TORCH_SPEC (pip arguments) overrides either.
# The locks hold every other package, transitive ones included, for Python >= 3.11 (markers
# where versions differ); scripts/lock.sh regenerates them (README, "Dependencies and the lock
# file").
set -euo pipefail
cd "$(dirname "$0")/.."

dev=0
latest=0
cluster=0
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 ;;
    --latest) latest=1 ;;
    --cluster) cluster=1 ;;
    *) echo "usage: bash scripts/setup.sh [--dev] [--cluster] [--latest]" >&2; exit 2 ;;
  esac
done
venv=.venv
((latest)) && venv=.venv-latest

if [[ ! -x $venv/bin/python ]]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
py=$venv/bin/python
pip=("$py" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip

if ! $py -c "import torch" 2>/dev/null; then
  if [[ -n "${INSTGENIE_TORCH_SPEC:-}" ]]; then
    read -ra spec <<<"$INSTGENIE_TORCH_SPEC"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    # the CPU machines' torch version (the lock is resolved against it), as a CUDA build
    spec=("$(grep -E '^torch==' requirements/torch-cpu.txt | cut -d' ' -f1)")
  else
    spec=(-r requirements/torch-cpu.txt)
  fi
  echo "installing ${spec[*]}"
  "${pip[@]}" "${spec[@]}"
fi

if ((latest)); then
  # the newest versions pyproject.toml allows, torch kept as installed (a CUDA/CPU build swap is
  # not a dependency upgrade)
  keep=$(mktemp)
  trap 'rm -f "$keep"' EXIT
  $py -c 'import torch; print("torch==" + torch.__version__)' >"$keep"
  extras=""
  ((dev)) && extras="[dev]"
  "${pip[@]}" --upgrade --upgrade-strategy eager -c "$keep" -e ".${extras}"
else
  # exactly the lock, then the project without resolving anything else
  lock=requirements/lock.txt
  ((dev)) && lock=requirements/lock-dev.txt
  "${pip[@]}" --no-deps -r "$lock"
  "${pip[@]}" --no-deps -e .
  if ((cluster && !dev)); then  # the cluster extra at the dev lock's versions (it pins Ray's)
    "${pip[@]}" -c requirements/lock-dev.txt -e ".[cluster]"
  fi
  $py -m pip check >/dev/null || { $py -m pip check; exit 1; }
fi
echo "setup done ($venv): $($py -c 'import torch, diffusers, transformers; print("torch", torch.__version__, "diffusers", diffusers.__version__, "transformers", transformers.__version__)')"
