#!/usr/bin/env bash
# Set up (with test tools) and run the whole CPU test suite. CI runs exactly this (.ci/run).
#   bash scripts/test.sh [pytest args]            # .venv, installed from requirements/lock.txt
#   bash scripts/test.sh --latest [pytest args]   # .venv-latest, the newest allowed versions
# pytest's exit code is passed through, so "no tests ran" (5) fails like a test failure.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
if [[ "${1:-}" == "--latest" ]]; then
  shift
  venv=.venv-latest
  bash scripts/setup.sh --dev --latest
else
  bash scripts/setup.sh --dev
fi
export TRITON_INTERPRET=1  # Triton kernels run in the interpreter on CPU
exec "$venv/bin/python" -m pytest -q --durations=15 "$@"  # the slowest tests, for CI time
