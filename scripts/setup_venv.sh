#!/usr/bin/env bash
# Create (once) the virtualenv .venv/ with everything recpipe needs on a CPU machine:
# torch 2.13.0 (CPU build), fbgemm-gpu-cpu 1.8.0, torchrec 1.8.0 (--no-deps: its declared
# dependency is the CUDA fbgemm-gpu) and torchrec's small pure-Python dependencies, triton 3.9
# (for TRITON_INTERPRET tests), hydra and the test tools; then recpipe itself, editable. Then
# the MovieLens-100k data, data/movielens100k.npz (scripts/prepare_movielens.py; skipped if it
# exists). Idempotent: a finished .venv is marked by .venv/.recpipe-ready.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.recpipe-ready
want="v1 $(sha1sum scripts/setup_venv.sh pyproject.toml | sha1sum | cut -c1-12)"
prepare_data() { [ -f data/movielens100k.npz ] || .venv/bin/python scripts/prepare_movielens.py; }
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then prepare_data; exit 0; fi
python3 -m venv .venv
pip() { .venv/bin/python -m pip "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; }; return "${PIPESTATUS[0]}"; }
pip install -q --disable-pip-version-check torch==2.13.0 fbgemm-gpu-cpu==1.8.0
pip install -q --disable-pip-version-check --no-deps torchrec==1.8.0
pip install -q --disable-pip-version-check torch==2.13.0 \
  tensordict==0.15.3 pyre-extensions torchmetrics==1.0.3 tqdm iopath \
  hydra-core==1.3.8 omegaconf==2.3.1 triton==3.9.0 matplotlib \
  pytest pytest-xdist pytest-timeout "hypothesis>=6.100"
pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
.venv/bin/python -c "import torch, fbgemm_gpu, torchrec, recpipe.ops; print('recpipe venv ready: torch', torch.__version__)"
echo "$want" >"$stamp"
prepare_data
