"""The benchmark configs, one definition each: ``scripts/bench_pipeline.py --config NAME``, the
scaling model and the training app's ``model=NAME`` presets (``configs/model/NAME.yaml`` holds
the same tables; ``tests/test_train.py`` checks it)."""

from __future__ import annotations

from recpipe.testing.synthetic import ModelSpec

CONFIGS: dict[str, ModelSpec] = {
    # 4 tables per module (EBC, weighted EBC, EC) x 1000 rows x dim 16, batch 64: the CPU tests'
    "tiny": ModelSpec(num_tables=4, rows=1000, dim=16, batch_size=64, pooling=4),
    # 16 tables x 200k rows x dim 128, batch 4096 per rank, 40 ids per feature (host-bound on GPUs)
    "small": ModelSpec(num_tables=16, rows=200_000, dim=128, batch_size=4096, pooling=40,
                       weighted=False, sequence=False),
    # one batch's permuted KJTs: 32 x 16384 x 256 ids x 8 B = 1.0 GiB (+ lengths)
    "large": ModelSpec(num_tables=32, rows=200_000, dim=128, batch_size=16384, pooling=256,
                       weighted=False, sequence=False),
    # 8 tables, a 59M-parameter over-arch (236 MB of fp32 grads)
    "dense_heavy": ModelSpec(num_tables=8, rows=200_000, dim=128, batch_size=4096, pooling=40,
                             weighted=False, sequence=False, over_arch=(4096, 4096, 4096, 4096, 1024)),
}
