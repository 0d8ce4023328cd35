#!/usr/bin/env python3
"""The scaling model on paper (ms/iter and memory per rank from 1 GPU to 64 nodes):
``recpipe.bench.scale_model``; ``--help`` for the options."""

from recpipe.bench.scale_model import main

if __name__ == "__main__":
    main()
