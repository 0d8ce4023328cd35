"""The training application behind ``scripts/train.py``: Hydra schemas (``config``), the loop
(``trainer``), checkpoints and data sources. The product (the pipeline class, ``recpipe.kjt``,
``recpipe.ops``) never imports this package; Hydra is imported only here and by the scripts."""
