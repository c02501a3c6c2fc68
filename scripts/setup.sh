#!/usr/bin/env bash
# Set up .venv for InstGenIE: a virtual environment, torch, and the project (editable).
#   bash scripts/setup.sh          # runtime dependencies
#   bash scripts/setup.sh --dev    # plus test tools (pytest, ruff, hypothesis)
# On a machine without an NVIDIA GPU the CPU build of torch is installed first (torch==2.13.0 is
# available as a local CPU wheel here); INSTGENIE_TORCH_SPEC overrides what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"

if [[ ! -x .venv/bin/python ]]; then
  "${PYTHON:-python3}" -m venv .venv
fi
py=.venv/bin/python
$py -m pip install -q --upgrade pip

if ! $py -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec="${INSTGENIE_TORCH_SPEC:-torch}"
  else
    spec="${INSTGENIE_TORCH_SPEC:-torch==2.13.0}"
  fi
  echo "installing $spec"
  $py -m pip install -q "$spec"
fi
$py -m pip install -q -e ".${extras}"
echo "setup done: $($py -c 'import torch, diffusers; print("torch", torch.__version__, "diffusers", diffusers.__version__)')"
