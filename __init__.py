"""recpipe: TorchRec training-pipeline components without the hidden memory and latency taxes
of sparse data distribution (``recpipe.ops``, ``recpipe.kjt``, ``recpipe.pipeline``)."""

__version__ = "0.2.0"
