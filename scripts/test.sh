#!/usr/bin/env bash
# The test command (README, .ci/run): set up .venv if needed, then run the suite in parallel and
# the Triton kernels under the interpreter; then the drop-in, interception and parity tests on
# the previous stack too (.venv-1.8: torchrec 1.8, torch 2.13). pytest's exit code 5 (no tests
# collected) fails too. Arguments go to the main suite's pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# the two set-ups in parallel (pip unpacking from disk: one core each); .venv-1.8's log is shown
# if it fails
bash scripts/setup_venv.sh 1.8 >.venv-1.8.log 2>&1 &
setup_18=$!
trap 'kill "$setup_18" 2>/dev/null || true' EXIT
bash scripts/setup_venv.sh
.venv/bin/python -m pytest -q -n 2 --timeout 900 --durations=15 "$@"
TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -n 2 --timeout 900 tests/test_permute_triton.py
wait "$setup_18" || { cat .venv-1.8.log >&2; exit 1; }
# (on 1.8, the tests where torchrec's versions differ: one 2-rank plan, no 4 ranks, no host-cost
# count; the main suite runs them all)
.venv-1.8/bin/python -m pytest -q -n 2 --timeout 900 -p no:cacheprovider \
  tests/test_dropin.py tests/test_interception.py tests/test_pipeline_parity.py \
  -k "not four_ranks and not on_two_ranks and not python_calls and not torchrec[table_wise] and not torchrec[column_wise]"
