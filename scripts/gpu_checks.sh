#!/usr/bin/env bash
# Every GPU check of the open issues, for one device call each (logs and tables under $OUT):
#   bash scripts/gpu_checks.sh permute    # nvidia-h100-x1: CUDA op tests + bench_permute
#   bash scripts/gpu_checks.sh pipeline   # any GPU count: parity, sanitizer, large bench
#   bash scripts/gpu_checks.sh allreduce  # >= 2 GPUs: DDP vs funcol (compiled) vs symm_mem
# Run from the repo root with carry [".devenv", ".whl"]; it sources the kits itself.
set -uo pipefail
out=${OUT:-/tmp/recpipe-gpu}
mkdir -p "$out"
source .devenv/install.sh && source scripts/gpu_env.sh || exit 1
export PYTHONWARNINGS=ignore
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "gpus: $ngpu ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"
case "${1:-}" in
  permute)
    python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_permute_op.py tests/test_permute_triton.py \
      2>&1 | tee "$out/permute_tests.log" | tail -3
    python3 scripts/bench_permute.py --shapes small,large 2>&1 | tee "$out/bench_permute.md"
    ;;
  pipeline)
    python3 -m pytest -q -p no:cacheprovider tests/test_pipeline_parity.py tests/test_kjt.py \
      2>&1 | tee "$out/parity.log" | tail -3
    csan_pipelines=torchrec,recpipe
    [ "$ngpu" -eq 1 ] && csan_pipelines=torchrec,recpipe,recpipe_split2
    TORCH_CUDA_SANITIZER=1 python3 scripts/bench_pipeline.py --config tiny --repeats 1 \
      --warmup 2 --steps 8 --pipelines "$csan_pipelines" >"$out/csan.log" 2>&1
    echo "sanitizer: rc=$? reports=$(grep -ci 'data race' "$out/csan.log")" \
      "enabled=$(grep -c 'TORCH_CUDA_SANITIZER=1' "$out/csan.log")"
    sharding=table_wise,column_wise pipelines=torchrec,recpipe,recpipe_split2
    [ "$ngpu" -ge 2 ] && sharding=table_wise,row_wise pipelines=${PIPELINES:-torchrec,recpipe,recpipe_ring}
    python3 scripts/bench_pipeline.py --config large --repeats "${REPEATS:-5}" --sharding "$sharding" \
      --pipelines "$pipelines" \
      --json "$out/large.json" --out "$out/large.md" 2>&1 | tee "$out/large.log" \
      | grep -E "^  run|^\||vs|identical|^###|rror"
    ;;
  allreduce)  # needs >= 2 GPUs: latency table, then training with each dense all-reduce
    python3 -m torch.distributed.run --nproc-per-node="$ngpu" scripts/bench_allreduce.py \
      2>&1 | tee "$out/bench_allreduce.log" | grep -E "^\||^###|rror"
    for v in ddp funcol_compiled symm_mem; do
      python3 -m torch.distributed.run --nproc-per-node="$ngpu" scripts/train.py hardware=cuda \
        pipeline.dense_allreduce=$v trainer.steps=100 trainer.log_interval=20 \
        output_dir="$out/allreduce-$v" 2>&1 | tee "$out/allreduce-$v.log" | grep -E "done|rror"
    done
    ;;
  *) echo "usage: bash scripts/gpu_checks.sh permute|pipeline|allreduce" >&2; exit 2 ;;
esac
