"""recpipe.testing: what the tests, benchmarks, example and training app share, as torchrec's
``distributed/test_utils``: a small DLRM-style model on synthetic KJT batches (``synthetic``)
and each rank's backend and device (``launch``). Not part of the product: the pipeline,
``recpipe.kjt`` and ``recpipe.ops`` never import it."""
