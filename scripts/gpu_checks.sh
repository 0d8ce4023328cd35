#!/usr/bin/env bash
# Every GPU check of the open issues, for one device call each (logs and tables under $OUT):
#   bash scripts/gpu_checks.sh permute    # nvidia-h100-x1: CUDA op tests + bench_permute
#   bash scripts/gpu_checks.sh pipeline   # any GPU count: pipeline-checks + pipeline-bench
#        pipeline-checks: parity, sanitizer, deterministic large-config losses, 500-step growth
#        pipeline-bench: large config, 5 alternating runs per pipeline
#   bash scripts/gpu_checks.sh pipeline-shared  # 1 GPU: 2 gloo ranks share it (P2 on CUDA)
#   bash scripts/gpu_checks.sh host       # 1 GPU: the interleaved host-time method (profile_host.py
#        --blocks) for tiny, small and MovieLens; fresh processes to the first step (--first-step)
#   bash scripts/gpu_checks.sh allreduce  # >= 2 GPUs: allreduce-checks + allreduce-bench
#        allreduce-checks: tests, latency table, losses over 100 steps (DDP vs nccl vs symm_mem)
#        allreduce-bench: step time with each dense all-reduce, 5 alternating runs, small and
#        dense_heavy configs
#   bash scripts/gpu_checks.sh allreduce-profile  # >= 2 GPUs: traces + recompiles, DDP vs symm/auto,
#        each collective's exposed GPU time per step (PROFILE_CONFIG, BATCH_SIZE)
#   bash scripts/gpu_checks.sh train      # >= 2 GPUs: torchrun training, both pipelines; bench
#   bash scripts/gpu_checks.sh multinode  # 2 GPUs as 2 torchrun "nodes" of 1 vs 1 node of 2
#   bash scripts/gpu_checks.sh scaling    # 4 or 8 GPUs: 4-rank parity, large bench, all-reduce
#   bash scripts/gpu_checks.sh overlap    # 2 GPUs, issue 39 in one call (CALL_LIMIT-bound):
#        overlap-table: bench_allreduce, 200 interleaved calls, 95% intervals, --write-table
#        overlap-checks: BucketedAllReduce's GPU tests, sanitizer (tiny; auto and symm_mem)
#        overlap-bench: DDP vs auto vs nccl all-reduce, dense_heavy then small (OVERLAP_CONFIGS),
#        5 alternating runs each (those that fit before CALL_LIMIT: 200 s kept per later config)
#   bash scripts/gpu_checks.sh plane      # 2 GPUs, issue 38: 1 rank, column- and row-wise, anchors
#   bash scripts/gpu_checks.sh parity-repeat  # 2 GPUs: 200 consecutive row-wise parity runs
# Run from the repo root with carry [".devenv", ".whl"]; it sources the kits itself.
set -uo pipefail
out=${OUT:-/tmp/recpipe-gpu}
mkdir -p "$out"
source .devenv/install.sh && source scripts/gpu_env.sh || exit 1
export PYTHONWARNINGS=ignore
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
# seconds left of the device call (CALL_LIMIT, default 570, counted from this script's start)
# minus $1: a bench's --time-limit, so that it reports the runs done before the call ends
left() { local s=$(( ${CALL_LIMIT:-570} - SECONDS - ${1:-0} )); echo $(( s > 1 ? s : 1 )); }
echo "gpus: $ngpu ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"
# the large pipeline config: row-wise needs >= 2 GPUs; the one-rank variant is the 3-slot ring
# (torchrec's Base and Lite: the anchors of the memory-time plane)
sharding=table_wise,column_wise pipelines=${PIPELINES:-torchrec,recpipe,torchrec_base,torchrec_lite}
[ "$ngpu" -ge 2 ] && sharding=table_wise,row_wise
case "${1:-}" in
  permute)
    python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_permute_op.py tests/test_permute_triton.py \
      2>&1 | tee "$out/permute_tests.log" | tail -3
    python3 scripts/bench_permute.py --shapes small,large 2>&1 | tee "$out/bench_permute.md"
    ;;
  pipeline|pipeline-checks)  # parity (1 GPU: the one-rank tests; 2-rank gloo ones are CI's),
    # sanitizer, large-config losses, 500-step memory growth
    k="not four"  # 4 ranks: gloo in CI, NCCL in `scaling`
    [ "$ngpu" -eq 1 ] && k="single_rank or test_kjt"
    [ "$ngpu" -ge 4 ] && k=""
    python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_pipeline_parity.py tests/test_kjt.py -k "$k" \
      2>&1 | tee "$out/parity.log" | tail -3
    # one process per pipeline and plan (a flagged run stops the benchmark's next ones); the
    # tiny config's batches are below min_batch_bytes, so recpipe_always
    csan_pipelines="torchrec recpipe_always" csan_plans=table_wise,column_wise
    [ "$ngpu" -eq 1 ] && csan_pipelines="torchrec recpipe_always recpipe_ring"
    [ "$ngpu" -ge 2 ] && csan_pipelines="$csan_pipelines recpipe_always_dist_after_forward" \
      csan_plans="table_wise,column_wise table_wise,row_wise"
    # (scripts/csan: zero-size tensors left out, which the sanitizer keys by reusable Python ids)
    for plan in $csan_plans; do
      for p in $csan_pipelines; do
        CSAN_NULL=skip PYTHONPATH="$PWD/scripts/csan:$PYTHONPATH" TORCH_CUDA_SANITIZER=1 \
          python3 scripts/bench_pipeline.py --config tiny --repeats 1 \
          --warmup 2 --steps 8 --sharding "$plan" --pipelines "$p" >"$out/csan-$plan-$p.log" 2>&1
        echo "sanitizer $plan $p: rc=$? reports=$(grep -ci 'data race' "$out/csan-$plan-$p.log")" \
          "enabled=$(grep -c 'TORCH_CUDA_SANITIZER=1' "$out/csan-$plan-$p.log")" \
          "left out: $(grep -o 'skipped [0-9]* null' "$out/csan-$plan-$p.log" | tr '\n' ' ')"
      done
    done
    # bit-identity at the large size needs deterministic kernels (fbgemm's TBE backward)
    python3 scripts/bench_pipeline.py --config large --deterministic --repeats 1 --warmup 2 \
      --steps 10 --sharding "$sharding" --pipelines torchrec,recpipe --json "$out/large-det-$ngpu.json" \
      2>&1 | tee "$out/large-det.log" | grep -E "vs|identical across all|rror"
    # 500 steps: allocated memory from mid-run to the end must not grow
    python3 scripts/bench_pipeline.py --config small --repeats 1 --warmup 5 --steps 500 \
      --sharding "$sharding" --pipelines torchrec,recpipe --json "$out/growth-$ngpu.json" \
      2>&1 | tee "$out/growth.log" | grep -E "^  run|rror"
    ;;&
  pipeline|pipeline-bench)  # large config, alternating runs
    python3 scripts/bench_pipeline.py --config large --repeats "${REPEATS:-5}" --sharding "$sharding" \
      --pipelines "$pipelines" --time-limit "$(left)" \
      --json "$out/large-$ngpu.json" --out "$out/large.md" 2>&1 | tee "$out/large.log" \
      | grep -E "^  run|^\||vs|identical|^###|time-limit|rror"
    ;;
  pipeline-checks) ;;
  host)  # 1 GPU (carry data/movielens100k.npz too), issue 41: the interleaved host-time method
    # (both pipelines in one process, alternating blocks) for tiny, small and MovieLens, then
    # fresh processes timed from launch to their first step (MovieLens, large), 5 rounds each
    for c in tiny small movielens; do
      python3 scripts/profile_host.py --config $c --blocks 60 --block-steps 20 --warmup 100 \
        --calls-steps 20 --json "$out/host-time-$c.json" 2>"$out/host-time-$c.err" | tee "$out/host-time-$c.md"
    done
    for c in movielens large; do
      python3 scripts/profile_host.py --config $c --first-step 5 --json "$out/first-step-$c.json" \
        2>"$out/first-step-$c.err" | tee "$out/first-step-$c.md"
    done
    ;;
  pipeline-shared)  # 1 GPU: 2 ranks share it over gloo (RECPIPE_SHARED_GPU=1), so that the
    # multi-rank path (the all-to-all, P2) runs on real CUDA streams: parity incl. row-wise and
    # per-rank memory at the large size, both plans, with Base and Lite (timings mean nothing:
    # gloo goes via host). No sanitizer: it cannot see gloo's own stream syncs and flags
    # torchrec's pipeline itself.
    export RECPIPE_SHARED_GPU=1
    python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_pipeline_parity.py \
      -k "not single_rank and not four and not detects" 2>&1 | tee "$out/parity-shared.log" | tail -3
    for plan in table_wise,column_wise table_wise,row_wise; do  # issue 38 point 2's memory rule
      python3 scripts/bench_pipeline.py --nproc 2 --config large --repeats "${REPEATS:-1}" --warmup 3 \
        --steps 6 --sharding $plan --pipelines torchrec,recpipe,torchrec_base,torchrec_lite \
        --json "$out/large-shared-${plan//,/_}.json" --out "$out/large-shared-${plan//,/_}.md" 2>&1 \
        | tee "$out/large-shared-${plan//,/_}.log" | grep -E "^  run|^\||vs|identical|^###|rror"
    done
    ;;
  allreduce|allreduce-checks)  # >= 2 GPUs: GPU tests, latency table, 100 training steps each
    python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_all_reduce.py tests/test_data_parallel.py \
      2>&1 | tee "$out/allreduce_tests.log" | tail -3
    python3 -m torch.distributed.run --nproc-per-node="$ngpu" scripts/bench_allreduce.py \
      --json "$out/allreduce-$ngpu.json" 2>&1 | tee "$out/bench_allreduce.log" | grep -E "^\||^###|rror"
    for v in ddp nccl symm_mem auto; do
      python3 -m torch.distributed.run --nproc-per-node="$ngpu" scripts/train.py hardware=cuda \
        data=synthetic model=large pipeline.dense_allreduce=$v trainer.steps=100 trainer.log_interval=1 trainer.checkpoint=false \
        output_dir="$out/allreduce-$v" 2>&1 | tee "$out/allreduce-$v.log" | grep -E "rror" | tail -3
    done
    for v in nccl symm_mem auto; do
      python3 scripts/compare_metrics.py "$out"/allreduce-ddp/*/metrics.jsonl \
        "$out"/allreduce-$v/*/metrics.jsonl --rtol 1e-5
    done
    ;;&
  allreduce|allreduce-bench)  # the step time with each dense all-reduce (DDP = plain recpipe),
    # on the small config and the dense-heavy one
    for c in small dense_heavy; do
      python3 scripts/bench_pipeline.py --config $c --repeats "${REPEATS:-5}" --sharding "$sharding" \
        --pipelines recpipe,recpipe_nccl_ar,recpipe_symm_ar,recpipe_auto_ar --json "$out/dense-$c-$ngpu.json" \
        --out "$out/dense-$c.md" 2>&1 | tee "$out/dense-$c.log" | grep -E "^\||vs|identical|^###|rror"
    done
    ;;
  allreduce-profile)  # >= 2 GPUs: host and device timelines (torch.profiler, stacks) and dynamo
    # recompiles of DDP vs the symmetric-memory and auto buckets, PROFILE_CONFIG (small), 1 run
    # each; then each collective's exposed GPU time per step (scripts/exposed_comm.py)
    TORCH_LOGS=recompiles python3 scripts/bench_pipeline.py --config "${PROFILE_CONFIG:-small}" --repeats 1 \
      --sharding "$sharding" --pipelines recpipe,recpipe_symm_ar,recpipe_auto_ar ${BATCH_SIZE:+--batch-size $BATCH_SIZE} \
      --profile "$out/profile" 2>&1 | tee "$out/profile.log" | grep -E "^\||vs|ecompil|rror"
    python3 scripts/exposed_comm.py "$out"/profile/*-rank0.json | tee "$out/exposed_comm.md"
    ;;
  allreduce-checks) ;;
  train)  # torchrun training on MovieLens-100k (carry data/: scripts/prepare_movielens.py makes
         # it) with both pipelines, deterministic: bit-identical losses, eval AUC; then the bench
    for p in torchrec recpipe; do
      python3 -m torch.distributed.run --nproc-per-node="$ngpu" scripts/train.py hardware=cuda \
        data=movielens pipeline=$p trainer.log_interval=1 trainer.checkpoint=false \
        trainer.deterministic=true output_dir="$out/train-$p" \
        2>&1 | tee "$out/train-$p.log" | grep -E "rror" | tail -3
    done
    python3 scripts/compare_metrics.py "$out"/train-torchrec/*/metrics.jsonl \
      "$out"/train-recpipe/*/metrics.jsonl
    python3 scripts/bench_pipeline.py --config small --repeats "${REPEATS:-5}" \
      --sharding table_wise,row_wise --json "$out/small.json" --out "$out/small.md" 2>&1 \
      | tee "$out/small.log" | grep -E "^\||vs|identical|^###|rror"
    ;;
  multinode)  # 2 GPUs: two torchrun "nodes" of 1 GPU each (CUDA_VISIBLE_DEVICES per node, c10d
    # rendezvous on localhost) against one node of 2, deterministic: the layout and symmetric-
    # memory lines of each run's log, and bit-identical losses
    run=(scripts/train.py hardware=cuda data=synthetic model=tiny pipeline.dense_allreduce=auto
         trainer.steps=100 trainer.log_interval=1 trainer.checkpoint=false trainer.deterministic=true)
    port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    for i in 0 1; do
      CUDA_VISIBLE_DEVICES=$i python3 -m torch.distributed.run --nnodes=2 --node-rank=$i \
        --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:$port --rdzv-id=multinode \
        "${run[@]}" output_dir="$out/two-nodes" >"$out/two-nodes-$i.log" 2>&1 &
    done
    wait
    python3 -m torch.distributed.run --standalone --nproc-per-node=2 "${run[@]}" \
      output_dir="$out/one-node" >"$out/one-node.log" 2>&1
    grep -hE "world size|all-reduce|rror" "$out"/two-nodes-0.log "$out"/one-node.log
    python3 scripts/compare_metrics.py "$out"/one-node/*/metrics.jsonl "$out"/two-nodes/*/metrics.jsonl
    ;;
  scaling)  # nvidia-h200-x4 / -x8 (issue 7): large bench and all-reduce latency, as JSON for
    # scripts/plot_scaling.py (run here, with the files of every GPU count)
    python3 -m pytest -q -p no:cacheprovider tests/test_pipeline_parity.py -k four \
      2>&1 | tee "$out/parity4.log" | tail -1
    python3 scripts/bench_pipeline.py --config large --repeats "${REPEATS:-5}" \
      --sharding table_wise,row_wise --pipelines torchrec,recpipe --json "$out/large-$ngpu.json" \
      --out "$out/large.md" 2>&1 | tee "$out/large.log" | grep -E "^\||vs|identical|^###|rror"
    python3 -m torch.distributed.run --nproc-per-node="$ngpu" scripts/bench_allreduce.py \
      --json "$out/allreduce-$ngpu.json" 2>&1 | tee "$out/bench_allreduce.log" | grep -E "^###|rror"
    ;;
  overlap|overlap-table)  # the latency table auto reads below (cache dir: kept while the machine
    # is warm; a copy comes back under $out/allreduce-table, its name's characters other than
    # letters, digits, '.', '_' and '-' as '_' (the device tool returns no others: the cache
    # name has torch's '+cu130'): ship it as ops/all_reduce_tables/<gpu>-w<world>.json, or
    # rebuild it from the JSON with bench_allreduce.py --table-from), and auto's verdict line
    python3 -m torch.distributed.run --nproc-per-node="$ngpu" scripts/bench_allreduce.py --iters 200 \
      --write-table --json "$out/allreduce-200-$ngpu.json" 2>&1 | tee "$out/bench_allreduce-200.log" \
      | grep -E "^\||^###|^auto|^wrote|rror"
    table=$(grep -oP '^wrote \K.*' "$out/bench_allreduce-200.log" | tail -1)
    name=$(basename "${table:-none}")
    if [ -f "$table" ]; then
      mkdir -p "$out/allreduce-table" && cp "$table" "$out/allreduce-table/${name//[^A-Za-z0-9._-]/_}"
      echo "table copy: $out/allreduce-table/${name//[^A-Za-z0-9._-]/_}"
    else
      echo "no table written (see $out/bench_allreduce-200.log)"
    fi
    ;;&
  overlap|overlap-checks)  # losses as DDP's, also with each symmetric reduction behind a spin
    # kernel on the communication stream; then the sanitizer on the hook's reduction (tiny: one
    # bucket, NCCL for auto, one-shot for symm_mem), one process each (TORCH_LOGS=recompiles: the
    # hook compiles nothing, so any recompile would be the model's)
    python3 -m pytest -q -p no:cacheprovider tests/test_data_parallel.py 2>&1 \
      | tee "$out/overlap_tests.log" | tail -3
    for p in recpipe_auto_ar recpipe_symm_ar; do
      TORCH_CUDA_SANITIZER=1 TORCH_LOGS=recompiles python3 scripts/bench_pipeline.py --config tiny \
        --repeats 1 --warmup 2 --steps 8 --sharding "$sharding" --pipelines $p >"$out/csan-overlap-$p.log" 2>&1
      echo "sanitizer $p: rc=$? reports=$(grep -ci 'data race' "$out/csan-overlap-$p.log")" \
        "enabled=$(grep -c 'TORCH_CUDA_SANITIZER=1' "$out/csan-overlap-$p.log")" \
        "recompiles=$(grep -c 'Recompiling function' "$out/csan-overlap-$p.log")"
    done
    ;;&
  overlap|overlap-bench)  # step time, DDP (plain recpipe) vs the overlapped bucketed all-reduce
    # (auto, nccl; OVERLAP_PIPELINES), alternating runs in fresh processes, per config of
    # OVERLAP_CONFIGS (default dense_heavy then small; BATCH_SIZE overrides theirs), each but the
    # last stopping 200 s early per config after it
    configs=(${OVERLAP_CONFIGS:-dense_heavy small})
    for i in "${!configs[@]}"; do
      c=${configs[$i]}
      python3 scripts/bench_pipeline.py --config "$c" --repeats "${REPEATS:-5}" --sharding "$sharding" \
        --pipelines ${OVERLAP_PIPELINES:-recpipe,recpipe_auto_ar,recpipe_nccl_ar} ${BATCH_SIZE:+--batch-size $BATCH_SIZE} --time-limit "$(left $(( (${#configs[@]} - 1 - i) * 200 )))" \
        --json "$out/overlap-$c-$ngpu.json" --out "$out/overlap-$c.md" 2>&1 | tee "$out/overlap-$c.log" \
        | grep -E "^  run|^\||vs|identical|^###|time-limit|rror"
    done
    ;;
  overlap-table|overlap-checks) ;;
  plane)  # 2 GPUs, issue 38: every plan on the memory-time plane, large config: torchrec and
    # recpipe in REPEATS (5) alternating runs, then Base and Lite once each (their memory does not
    # vary run to run), for each of PLANES (1 rank on GPU 0, table-/column-wise and table-/row-wise
    # on both GPUs; each plan gets an equal share of CALL_LIMIT, less than 5 runs of a pair need, so
    # give one plan per call). Plot on any machine:
    # scripts/plot_pareto.py plane-*.json --plot plane.png (merge each plan's -anchors.json first)
    [ "$ngpu" -ge 2 ] || { echo "gpu_checks.sh plane: needs 2 GPUs, found $ngpu" >&2; exit 2; }
    planes=${PLANES:-1rank table_wise,column_wise table_wise,row_wise}
    share=$(( ${CALL_LIMIT:-570} / $(wc -w <<<"$planes") )) later=${CALL_LIMIT:-570}
    for plan in $planes; do
      later=$(( later - share )); nproc=2 shard=$plan gpus=0,1 name=plane-${plan//,/_}
      [ "$plan" = 1rank ] && nproc=1 shard=table_wise,column_wise gpus=0
      for set in "torchrec,recpipe ${REPEATS:-5} $(( later + 60 ))" "torchrec_base,torchrec_lite 1 $later"; do
        read -r pl reps keep <<<"$set"; [ "$pl" = torchrec_base,torchrec_lite ] && name=$name-anchors
        CUDA_VISIBLE_DEVICES=$gpus python3 scripts/bench_pipeline.py --nproc $nproc --config large \
          --warmup 5 --steps 8 --distinct-batches 2 --repeats "$reps" --sharding "$shard" \
          --pipelines "$pl" --time-limit "$(left "$keep")" --json "$out/$name.json" 2>&1 \
          | tee "$out/$name.log" | grep -E "^  run|^\||vs|^###|time-limit|rror"
      done
    done
    ;;
  parity-repeat)  # 2 GPUs, issue 38 point 3: PARITY_RUNS (200) 2-rank runs of the row-wise
    # case, every CUDA default acting from the first batch, bit-identical to torchrec's,
    # PARITY_WORKERS (4) at a time (the 2 GPUs are shared, so that is hardly faster than one at
    # a time: 200 runs fill about half a session's device time either way,
    # docs/results/sanitizer-parity-1.8_2xH200_2026-11-28.md); stops at the first difference (a
    # run cut by CALL_LIMIT: the dots say how many passed)
    RECPIPE_PARITY_REPEATS=${PARITY_RUNS:-200} timeout "$(left 20)" python3 -m pytest -x -q -p no:cacheprovider \
      -n "${PARITY_WORKERS:-4}" \
      tests/test_pipeline_parity.py -k "cuda_defaults_on_every_batch and tw_rw_cw- and not after_forward and not recat_ring" \
      2>&1 | tee "$out/parity-repeat.log" | tail -3
    echo "parity-repeat: $(head -c 100000 "$out/parity-repeat.log" | grep -o '^[.F]*' | tr -d '\n' | tr -cd . | wc -c) runs passed"
    ;;
  *) echo "usage: bash scripts/gpu_checks.sh permute|pipeline[-checks|-bench|-shared]|allreduce[-checks|-bench|-profile]|train|multinode|scaling|overlap[-table|-checks|-bench]|plane|parity-repeat" >&2; exit 2 ;;
esac
