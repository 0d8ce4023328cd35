"""recpipe.bench: the benchmarks' shared parts, importable (``scripts/`` holds thin entry
points): the model configs (``configs``), the pipeline variants built from public switches
(``variants``), the allocator-snapshot analysis (``memory_snapshot``) and the scaling model
(``scale_model``). Not part of the product: the pipeline, ``recpipe.kjt`` and ``recpipe.ops``
never import it."""
