"""Train from a source checkout: ``python scripts/train.py [overrides]`` is ``recpipe-train`` /
``python -m recpipe.train`` (recpipe.train.cli: its docstring gives the commands, configs, exit
statuses and output), e.g.

    python scripts/train.py pipeline=torchrec trainer.steps=100
    recpipe-torchrun --standalone --nproc-per-node=2 scripts/train.py hardware=cuda

Run by an interpreter without recpipe (the system's ``python3`` rather than the checkout's
``.venv/bin/python``), it ends with one line saying which interpreter to use.
"""

import sys

try:
    from recpipe.train.cli import main
except ModuleNotFoundError as e:
    if e.name != "recpipe":
        raise
    sys.exit(f"error: recpipe is not installed for {sys.executable}: run this script with the "
             "interpreter of the environment that has it, .venv/bin/python scripts/train.py in a "
             "checkout (bash scripts/setup_venv.sh makes .venv)")

if __name__ == "__main__":
    main()
