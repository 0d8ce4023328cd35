# Source on the GPU machine (device tool), from the repo root, after .devenv/install.sh:
#     source .devenv/install.sh && source scripts/gpu_env.sh && python3 ...
# Installs the carried test wheels (.whl/, if any) into /tmp/site and makes `recpipe.*` importable
# from this checkout without a build (a package folder of symlinks to ops/, kjt/, pipeline/,
# testing/, train/, bench/, configs/ (the app's Hydra configs), __init__.py).
# Keeps NVLink multicast off (shared machines: never use multicast).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ] && [ ! -f /tmp/site/.whl-ok ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --disable-pip-version-check --target /tmp/site .whl/*.whl && touch /tmp/site/.whl-ok
fi
mkdir -p /tmp/recpipe-src/recpipe
for _p in ops kjt pipeline testing train bench configs __init__.py py.typed; do ln -sfn "$PWD/$_p" /tmp/recpipe-src/recpipe/$_p; done
unset _p
case ":${PYTHONPATH:-}:" in
  *:/tmp/recpipe-src:*) ;;
  *) export PYTHONPATH=/tmp/recpipe-src${PYTHONPATH:+:$PYTHONPATH} ;;
esac
export PYTHONUNBUFFERED=1
