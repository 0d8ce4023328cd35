#!/usr/bin/env bash
# Create (once) a virtualenv with everything recpipe needs on a CPU machine, then recpipe itself,
# editable. One argument, the torchrec stack (default 1.9):
#   1.9  .venv/      torch 2.14.0, fbgemm-gpu-cpu 1.9.0, torchrec 1.9.2 (the newest: CI's)
#   1.8  .venv-1.8/  torch 2.13.0, fbgemm-gpu-cpu 1.8.0, torchrec 1.8.0 (CI's second step)
# torchrec goes in last, with --no-deps: its declared dependency is the CUDA fbgemm-gpu. Then,
# for .venv, the MovieLens-100k data (python -m recpipe.train.prepare_movielens, the README's
# command: it checks the file, rebuilds a bad one). Idempotent: a finished venv is marked by its
# .recpipe-ready stamp.
set -euo pipefail
cd "$(dirname "$0")/.."
stack=${1:-1.9}
case "$stack" in
  1.9) venv=.venv torch=torch==2.14.0 fbgemm=1.9.0 torchrec=1.9.2 triton=triton==3.8.0 ;;
  1.8) venv=.venv-1.8 torch=torch==2.13.0 fbgemm=1.8.0 torchrec=1.8.0 triton=triton==3.9.0 ;;
  *) echo "error: setup_venv.sh: unknown stack '$stack': give 1.9 (default) or 1.8" >&2; exit 2 ;;
esac
stamp=$venv/.recpipe-ready
want="v2 $(sha1sum scripts/setup_venv.sh pyproject.toml | sha1sum | cut -c1-12)"
prepare_data() { [ "$venv" != .venv ] || .venv/bin/python -m recpipe.train.prepare_movielens; }
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then prepare_data; exit 0; fi
# torch 2.14's only wheel here is a CUDA build: 5.5 GB, plus pip's unpacking
need_gb=$([ "$stack" = 1.9 ] && echo 8 || echo 3)
free_gb=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
if [ "$free_gb" -lt "$need_gb" ]; then
  echo "error: setup_venv.sh: $venv needs about $need_gb GB free here, $(pwd) has $free_gb GB: free some space (old clones, venvs, ~/.cache/pip) and run it again" >&2
  exit 1
fi
python3 -m venv "$venv"
# pip's notes on this machine's local package mirror are noise
pip() { "$venv/bin/python" -m pip -q --disable-pip-version-check "$@" 2>&1 \
  | { grep -v "^WARNING: Location '" || true; }; return "${PIPESTATUS[0]}"; }
pip install "$torch" "fbgemm-gpu-cpu==$fbgemm" "$triton" \
  tensordict==0.15.3 pyre-extensions torchmetrics==1.0.3 tqdm iopath \
  hydra-core==1.3.8 omegaconf==2.3.1 matplotlib \
  pytest pytest-xdist pytest-timeout "hypothesis>=6.100"
pip install --no-deps "torchrec==$torchrec"
# one at a time (scripts/test.sh runs two set-ups at once): setuptools writes recpipe.egg-info
# into the checkout
exec 9>.setup.lock && flock 9
pip install --no-deps --no-build-isolation -e .
flock -u 9
"$venv/bin/python" -c "import torch, fbgemm_gpu, torchrec, recpipe.ops
print('recpipe venv ready:', '$venv', 'torch', torch.__version__, 'torchrec', torchrec.__version__)"
echo "$want" >"$stamp"
prepare_data
