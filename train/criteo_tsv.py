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

Files that cannot be used raise :class:`DataError`, one line naming the file, its 1-based line
(and column) and the fix. Before training, every file (in a directory: every visible one) must
be ASCII text throughout, hold a line, and parse in its first ``HEAD_BYTES``; a line further on
that does not parse fails when its batch is made.
"""

from __future__ import annotations

import csv
import io
import logging
import re
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT, CriteoIterDataPipe
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.train.config import DataConfig, ModelConfig, UsageError
from recpipe.train.movielens import eval_shares
from recpipe.testing.synthetic import Batch, ModelSpec

log = logging.getLogger(__name__)

COLUMNS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
LAYOUT = (f"label, {INT_FEATURE_COUNT} integers, {CAT_FEATURE_COUNT} categorical ids, "
          "tab-separated")
SHUFFLE_LINES = 1 << 16
HEAD_BYTES = 1 << 16  # the start of each file parsed when the source is made
FIX_LINE = "fix or remove the line"


class DataError(UsageError, ValueError):
    """A data file the source cannot use. The message is one line, ``data.path: FILE[:LINE]:
    what is wrong: the fix``; ``scripts/train.py`` prints it as one ``error:`` line (a
    :class:`UsageError`)."""


def count_lines(path: Path) -> int:
    """Lines in ``path`` (a last line without a newline counts). Raises :class:`DataError` if
    a byte is not ASCII (gzip, an image...), naming its line: Criteo TSV is ASCII text."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            if not chunk.isascii():
                raise DataError(_not_text(path, chunk, n))
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def _not_text(path: Path, chunk: bytes, lines_before: int) -> str:
    """The message for ``chunk`` of ``path``, which follows ``lines_before`` lines and holds a
    byte that is not ASCII."""
    if lines_before == 0 and chunk.startswith(b"\x1f\x8b"):
        return f"data.path: {path}: gzip-compressed: decompress it (gunzip) and use the TSV file"
    at = re.search(rb"[\x80-\xff]", chunk).start()
    line = lines_before + chunk.count(b"\n", 0, at) + 1
    return (f"data.path: {path}:{line}: byte 0x{chunk[at]:02x} is not ASCII text, so this is no "
            f"Criteo TSV file: remove it (a directory's visible files are all read) or convert it")


def row_problem(row: list[str]) -> str | None:
    """Why ``row`` (a split line) does not parse as :meth:`CriteoTSVSource._batch` parses it:
    its column count, or the first bad value (1-based column) and the fix; None if it parses."""
    if len(row) != COLUMNS:
        return f"{len(row)} columns, expected {COLUMNS} ({LAYOUT}): {FIX_LINE}"
    for column, value in enumerate(row, 1):
        if column > 1 and not value:
            continue
        integer = 1 < column <= 1 + INT_FEATURE_COUNT
        try:
            x = float(value) if column == 1 else int(value, 10 if integer else 16)
        except ValueError:
            return f"column {column}: {value[:24]!r} is not {_kind(column)}: {FIX_LINE}"
        if integer and not -(1 << 63) <= x < 1 << 63:
            return f"column {column}: {value[:24]!r} exceeds a 64-bit integer: {FIX_LINE}"
    return None


def _kind(column: int) -> str:
    """What column ``column`` (1-based) of a line holds."""
    if column == 1:
        return "a label (column 1: 0 or 1)"
    if column <= 1 + INT_FEATURE_COUNT:
        return f"an integer (columns 2-{1 + INT_FEATURE_COUNT}: integers, empty if missing)"
    return (f"a hex id (columns {2 + INT_FEATURE_COUNT}-{COLUMNS}: categorical ids, empty if "
            "missing)")


def check_head(path: Path) -> None:
    """Parse the whole lines in the first ``HEAD_BYTES`` of ``path`` (ASCII: see
    :func:`count_lines`), split as torchrec's reader splits them; raises :class:`DataError`
    at the first that does not parse, so a file that is not Criteo TSV fails before training."""
    with open(path, "rb") as f:
        head = f.read(HEAD_BYTES)
    if len(head) == HEAD_BYTES:
        head = head[:head.rfind(b"\n") + 1]
        if not head:
            raise DataError(f"data.path: {path}:1: no line end in the first {HEAD_BYTES} bytes, so "
                            f"this is no Criteo TSV file ({LAYOUT}): remove it or convert it")
    rows = csv.reader(io.TextIOWrapper(io.BytesIO(head), encoding="ascii"), delimiter="\t")
    for line, row in enumerate(rows, 1):
        if problem := row_problem(row):
            raise DataError(f"data.path: {path}:{line}: {problem}")


def scan(path: Path) -> int:
    """Lines in ``path``, once it is checked as Criteo TSV (:func:`count_lines`,
    :func:`check_head`, not empty); else :class:`DataError`."""
    n = count_lines(path)
    if n == 0:
        raise DataError(f"data.path: {path}: the file is empty: remove it or give Criteo TSV "
                        f"lines ({LAYOUT})")
    check_head(path)
    return n


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
        counts = [scan(p) for p in paths]
        self._file_start = np.cumsum([0, *counts])
        total = int(self._file_start[-1])
        n_eval = round(total * eval_fraction)
        if not 0 < n_eval < total:
            raise DataError(f"data.eval_fraction={eval_fraction} of {total} lines leaves no "
                            f"train or no eval part: give more lines or change data.eval_fraction")
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
            raise DataError("data.path: give the Criteo TSV file or directory (data=criteo_tsv)")
        return cls(tsv_files(Path(data.path)), rows=model.rows, dim=model.dim,
                   batch_size=data.batch_size, eval_fraction=data.eval_fraction, seed=seed)

    def _lines(self, start: int) -> Iterator[list[str]]:
        """Split lines from global line ``start`` to the end of the last file."""
        f = int(np.searchsorted(self._file_start, start, side="right")) - 1
        rows = CriteoIterDataPipe([str(p) for p in self.paths[f:]], row_mapper=None)
        return islice(rows, start - int(self._file_start[f]), None)

    def _where(self, line: int) -> str:
        """``FILE:LINE`` (1-based, within the file) of global line ``line`` (0-based)."""
        f = int(np.searchsorted(self._file_start, line, side="right")) - 1
        return f"{self.paths[f]}:{line - int(self._file_start[f]) + 1}"

    def train_batches(self, rank: int, world: int, start: int, stop: int) -> Iterator[Batch]:
        """Batches ``start .. stop-1`` of ``rank`` (global step numbers): step ``s`` of an epoch
        covers ``world * batch_size`` lines of its shuffled window, rank ``r`` taking slice
        ``r``; the lines after the last whole step of an epoch are left out."""
        per_step = world * self.batch_size
        steps_per_epoch = self.n_train // per_step
        if steps_per_epoch == 0:
            raise DataError(f"{world} x data.batch_size={self.batch_size} exceeds the "
                            f"{self.n_train} train lines: lower data.batch_size or give more lines")
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
            yield self._batch([lines[j] for j in mine], lo + mine)

    def eval_batches(self, rank: int, world: int) -> Iterator[Batch]:
        """The eval lines, disjointly over ranks, as many batches on every rank
        (:func:`~recpipe.train.movielens.eval_shares`)."""
        batches = eval_shares(self.n_eval, rank, world, self.batch_size)
        reader = self._lines(self.n_train + int(batches[0][0]))
        for positions in batches:
            yield self._batch(list(islice(reader, len(positions))), self.n_train + positions)

    def baseline(self) -> None:
        """No baseline for Criteo."""

    def _batch(self, rows: list[list[str]], lines: Sequence[int]) -> Batch:
        """The batch of ``rows``, split lines ``lines`` (global, 0-based); a row that does not
        parse raises :class:`DataError` naming its file, line and column."""
        try:
            return self._parse(rows)
        except ValueError:
            for row, line in zip(rows, lines):
                if problem := row_problem(row):
                    raise DataError(f"data.path: {self._where(int(line))}: {problem}") from None
            raise

    def _parse(self, rows: list[list[str]]) -> Batch:
        """The batch of ``rows``; ValueError if one does not parse (see :func:`row_problem`)."""
        if any(len(row) != COLUMNS for row in rows):
            raise ValueError(f"a line without {COLUMNS} columns")
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
