#!/usr/bin/env bash
# Set up (with test tools) and run the whole CPU test suite. CI runs exactly this (.ci/run).
# pytest's exit code is passed through, so "no tests ran" (5) fails like a test failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
export TRITON_INTERPRET=1  # Triton kernels run in the interpreter on CPU
exec .venv/bin/python -m pytest -q "$@"
