"""``python -m recpipe.train [overrides]``: the training command line (recpipe.train.cli)."""

from recpipe.train.cli import main

if __name__ == "__main__":
    main()
