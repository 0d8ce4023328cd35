#!/usr/bin/env python3
"""What is live at the peak of a CUDA memory snapshot (``bench_pipeline.py --snapshot``):
``recpipe.bench.memory_snapshot``; ``--help`` for the options."""

import sys

from recpipe.bench.memory_snapshot import main

if __name__ == "__main__":
    sys.exit(main())
