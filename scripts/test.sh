#!/usr/bin/env bash
# The test command (README, .ci/run): set up .venv if needed, then run the suite in parallel and
# the Triton kernels under the interpreter. pytest's exit code 5 (no tests collected) fails too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
.venv/bin/python -m pytest -q -n 2 --timeout 900 --durations=15 "$@"
TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -p no:randomly --timeout 900 tests/test_permute_triton.py
