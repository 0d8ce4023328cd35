"""Train from a source checkout: ``python scripts/train.py [overrides]`` is ``recpipe-train`` /
``python -m recpipe.train`` (recpipe.train.cli: its docstring gives the commands, configs, exit
statuses and output), e.g.

    python scripts/train.py pipeline=torchrec trainer.steps=100
    recpipe-torchrun --standalone --nproc-per-node=2 scripts/train.py hardware=cuda
"""

from recpipe.train.cli import main

if __name__ == "__main__":
    main()
