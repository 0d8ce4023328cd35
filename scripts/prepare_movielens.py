"""Make ``data/movielens100k.npz`` from a source checkout: ``python scripts/prepare_movielens.py
[--out PATH] [--force]`` is ``python -m recpipe.train.prepare_movielens`` (its docstring gives the
checks, the exit statuses and the file's layout):

    .venv/bin/python scripts/prepare_movielens.py [--out data/movielens100k.npz] [--force]

This file runs that module's code as its own, so that this script is that module (its
functions read this namespace: tests/test_movielens_file.py patches the script's download).
"""

import importlib.util

_spec = importlib.util.find_spec("recpipe.train.prepare_movielens")
exec(_spec.loader.get_code(_spec.name))  # defines prepare, main...; runs main() as __main__
