"""Criteo click logs in their TSV layout, streamed: one file or a directory of files.

Each line: label, 13 integer columns, 26 categorical columns (hex-hashed ids), tab-separated;
any integer or categorical value may be empty. Lines are read through torchrec's
``torchrec.datasets.criteo.CriteoIterDataPipe`` (raw rows, no row mapper). A sample has

- dense: ``log(1 + max(x, 0))`` of the 13 integers (missing: 0);
- sparse: one KJT (module ``ebc``, features ``f0 .. f25``, as the synthetic Criteo schema):
  categorical ``c`` is ``int(c, 16) % rows``; a missing value is an empty bag (length 0).

Lines are numbered across the files (sorted names, in a directory); the last ``eval_fraction``
of them is the eval part, the rest the training part. The line count is taken once, when the
source is made (one pass over the bytes). Epochs over the training part cycle; within an epoch,
windows of at least ``SHUFFLE_LINES`` lines (whole steps) are shuffled, seeded by
(seed, epoch, window), so a batch depends on (seed, rank, step) only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT, CriteoIterDataPipe
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.train.config import DataConfig, ModelConfig
from recpipe.train.movielens import eval_shares
from recpipe.testing.synthetic import Batch, ModelSpec

log = logging.getLogger(__name__)

COLUMNS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
SHUFFLE_LINES = 1 << 16


def count_lines(path: Path) -> int:
    """Lines in ``path`` (a last line without a newline counts)."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def tsv_files(path: Path) -> list[Path]:
    """``path`` itself, or a directory's visible files in name order."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        if not files:
            raise FileNotFoundError(f"data.path={path}: the directory holds no files")
        return files
    if not path.exists():
        raise FileNotFoundError(f"data.path={path}: no such file or directory")
    return [path]


class CriteoTSVSource:
    """Train and eval batches from Criteo TSV files (see the module docstring)."""

    def __init__(
        self, paths: list[Path], *, rows: int, dim: int, batch_size: int, eval_fraction: float,
        seed: int,
    ) -> None:
        self.paths = paths
        counts = [count_lines(p) for p in paths]
        self._file_start = np.cumsum([0, *counts])
        total = int(self._file_start[-1])
        n_eval = round(total * eval_fraction)
        if not 0 < n_eval < total:
            raise ValueError(f"data.eval_fraction={eval_fraction} of {total} lines leaves no "
                             f"train or no eval part")
        self.n_train, self.n_eval = total - n_eval, n_eval
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.spec = ModelSpec(num_tables=CAT_FEATURE_COUNT, rows=rows, dim=dim,
                              dense_in=INT_FEATURE_COUNT, batch_size=batch_size,
                              weighted=False, sequence=False)
        self._keys = self.spec.features("ebc")
        log.info("criteo_tsv: %d files, %d train + %d eval lines", len(paths), self.n_train, n_eval)

    @classmethod
    def from_config(cls, data: DataConfig, model: ModelConfig, seed: int) -> CriteoTSVSource:
        """``data.path`` (required): a TSV file or a directory of them; ids hashed into
        ``model.rows`` buckets; ``seed`` orders the training part (the trainer passes
        ``data.seed``)."""
        if data.path is None:
            raise ValueError("data.path: give the Criteo TSV file or directory (data=criteo_tsv)")
        return cls(tsv_files(Path(data.path)), rows=model.rows, dim=model.dim,
                   batch_size=data.batch_size, eval_fraction=data.eval_fraction, seed=seed)

    def _lines(self, start: int) -> Iterator[list[str]]:
        """Split lines from global line ``start`` to the end of the last file."""
        f = int(np.searchsorted(self._file_start, start, side="right")) - 1
        rows = CriteoIterDataPipe([str(p) for p in self.paths[f:]], row_mapper=None)
        return islice(rows, start - int(self._file_start[f]), None)

    def train_batches(self, rank: int, world: int, start: int, stop: int) -> Iterator[Batch]:
        """Batches ``start .. stop-1`` of ``rank`` (global step numbers): step ``s`` of an epoch
        covers ``world * batch_size`` lines of its shuffled window, rank ``r`` taking slice
        ``r``; the lines after the last whole step of an epoch are left out."""
        per_step = world * self.batch_size
        steps_per_epoch = self.n_train // per_step
        if steps_per_epoch == 0:
            raise ValueError(f"{world} x data.batch_size={self.batch_size} exceeds the "
                             f"{self.n_train} train lines")
        window_steps = max(1, SHUFFLE_LINES // per_step)
        lines: list[list[str]] = []
        order = np.empty(0, np.int64)
        reader, at, window = iter(()), -1, None  # `reader` yields line `at` next
        for step in range(start, stop):
            epoch, i = divmod(step, steps_per_epoch)
            w, k = divmod(i, window_steps)
            if (epoch, w) != window:
                lo = w * window_steps * per_step
                hi = min((w + 1) * window_steps, steps_per_epoch) * per_step
                if at != lo:
                    reader = self._lines(lo)
                lines, at, window = list(islice(reader, hi - lo)), hi, (epoch, w)
                order = np.random.default_rng([self.seed, epoch, w]).permutation(hi - lo)
            mine = order[k * per_step + rank * self.batch_size:][:self.batch_size]
            yield self._batch([lines[j] for j in mine])

    def eval_batches(self, rank: int, world: int) -> Iterator[Batch]:
        """The eval lines, disjointly over ranks, as many batches on every rank
        (:func:`~recpipe.train.movielens.eval_shares`)."""
        batches = eval_shares(self.n_eval, rank, world, self.batch_size)
        reader = self._lines(self.n_train + int(batches[0][0]))
        for positions in batches:
            yield self._batch(list(islice(reader, len(positions))))

    def baseline(self) -> None:
        """No baseline for Criteo."""

    def _batch(self, rows: list[list[str]]) -> Batch:
        for row in rows:
            if len(row) != COLUMNS:
                raise ValueError(f"criteo_tsv: a line has {len(row)} tab-separated columns, "
                                 f"expected {COLUMNS}: {row[:3]}...")
        columns = list(zip(*rows))
        labels = torch.tensor([float(v) for v in columns[0]])
        ints = torch.tensor([[int(v) if v else 0 for v in c] for c in columns[1:1 + INT_FEATURE_COUNT]])
        dense = ints.clamp(min=0).T.contiguous().float().log1p()
        cats = columns[1 + INT_FEATURE_COUNT:]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self._keys,
            values=torch.tensor([int(v, 16) % self.rows for c in cats for v in c if v], dtype=torch.int64),
            lengths=torch.tensor([bool(v) for c in cats for v in c], dtype=torch.int64),
        )
        return Batch(dense, {"ebc": kjt}, labels)
