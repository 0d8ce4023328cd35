"""Where the training job's batches come from: a :class:`DataSource` per ``data.schema``.

- ``synthetic`` / ``criteo``: :class:`SyntheticSource`, Zipf ids and random labels
  (:mod:`recpipe.testing.synthetic`); ``criteo`` is its 13-dense + 26-sparse layout.
- ``movielens``: ``recpipe.train.movielens.MovieLensSource``.
- ``criteo_tsv``: ``recpipe.train.criteo_tsv.CriteoTSVSource``.

The real-data modules are imported only when their schema is chosen.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from recpipe.train.config import DataConfig, TrainConfig, UsageError
from recpipe.testing.synthetic import Batch, ModelSpec, make_batch

_PRIME = 1_000_003
# torch's CPU generator uses only the low 32 bits of a seed: training batches get seeds below
# 2**31, held-out batches seeds at or above it, so that no eval batch is a training batch
_TRAIN_SEEDS = (1 << 31) - 1
_EVAL_BIT = 1 << 31


class DataSource(Protocol):
    """A data set as the trainer sees it. ``spec`` describes the model to build
    (``build_sharded(spec, ...)``) and each rank's batch size."""

    spec: ModelSpec

    def train_batches(self, rank: int, world: int, start: int, stop: int) -> Iterator[Batch]:
        """Rank ``rank``'s batches for global steps ``start .. stop-1``; batch ``s`` depends only
        on (seed, rank, s), so a run resumed at step k sees what an uninterrupted run sees."""
        ...

    def eval_batches(self, rank: int, world: int) -> Iterator[Batch]:
        """The held-out batches of ``rank``: finite, the same number on every rank."""
        ...

    def baseline(self) -> dict[str, float] | None:
        """``{"auc", "logloss"}`` of a simple baseline on the eval part, or None."""
        ...


@dataclass
class SyntheticSource:
    """Zipf-id batches with random labels (AUC ~0.5 by construction): batch ``s`` of rank ``r``
    is ``make_batch(spec, seed=((seed * P + r) * P + s) mod 2**31)``, P = 1000003. ``eval_steps``
    held-out batches per rank come from seeds in [2**31, 2**32), which training never uses (torch
    keeps the low 32 bits of a seed)."""

    spec: ModelSpec
    seed: int
    eval_steps: int = 4

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> SyntheticSource:
        m, d = cfg.model, cfg.data
        if d.schema == "criteo":  # 13 dense + 26 sparse features, one EmbeddingBagCollection
            spec = ModelSpec(num_tables=26, rows=m.rows, dim=m.dim, dense_in=13,
                             batch_size=d.batch_size, pooling=d.pooling, zipf=d.zipf,
                             weighted=False, sequence=False, over_arch=tuple(m.over_arch))
        else:
            spec = ModelSpec(num_tables=m.num_tables, rows=m.rows, dim=m.dim, dense_in=d.dense_in,
                             batch_size=d.batch_size, pooling=d.pooling, zipf=d.zipf,
                             weighted=m.weighted, sequence=m.sequence,
                             over_arch=tuple(m.over_arch))
        return cls(spec, d.seed)

    def _seed(self, rank: int, index: int) -> int:
        return ((self.seed * _PRIME + rank) * _PRIME + index) & _TRAIN_SEEDS

    def train_batches(self, rank: int, world: int, start: int, stop: int) -> Iterator[Batch]:
        for step in range(start, stop):
            yield make_batch(self.spec, seed=self._seed(rank, step))

    def eval_batches(self, rank: int, world: int) -> Iterator[Batch]:
        for i in range(self.eval_steps):
            yield make_batch(self.spec, seed=_EVAL_BIT | self._seed(rank, i))

    def baseline(self) -> dict[str, float] | None:
        return None


#: the model and data keys each ``data.schema``'s source reads, the rest being unused with it:
#: what a resumed run must share with its checkpoint (``checkpoint.identity``). Keep in step
#: with the sources' ``from_config``. Not ``data.path``: what the files hold matters, not where
#: they lie (:func:`data_files`, ``checkpoint.data_identity``).
SOURCE_KEYS: dict[str, tuple[str, ...]] = {
    "synthetic": ("model.num_tables", "model.rows", "model.dim", "model.weighted",
                  "model.sequence", "model.over_arch", "data.batch_size", "data.pooling",
                  "data.zipf", "data.dense_in"),
    "criteo": ("model.rows", "model.dim", "model.over_arch", "data.batch_size", "data.pooling",
               "data.zipf"),
    "movielens": ("model.dim", "model.over_arch", "data.batch_size", "data.eval_fraction",
                  "data.max_history", "data.label_scope"),
    "criteo_tsv": ("model.rows", "model.dim", "data.batch_size", "data.eval_fraction"),
}


def source_keys(schema: str) -> tuple[str, ...]:
    """The config keys that shape ``schema``'s batches and model: :data:`SOURCE_KEYS`, and
    ``data.schema`` and ``data.seed`` (every source's)."""
    return ("data.schema", "data.seed", *SOURCE_KEYS[schema])


def data_files(data: DataConfig) -> list[Path] | None:
    """The files ``data.schema``'s source reads, in its order; None for generated data, which
    its config keys alone decide. FileNotFoundError where ``data.path`` is no such file or a
    directory without files (a missing MovieLens file is returned: the source names it)."""
    if data.schema == "movielens":
        from recpipe.train.movielens import data_path

        return [data_path(data)]
    if data.schema == "criteo_tsv":
        from recpipe.train.criteo_tsv import tsv_files

        return tsv_files(Path(data.path))
    return None


def make_source(cfg: TrainConfig) -> DataSource:
    """The data source of ``cfg.data.schema`` (validated by ``config.validate``). ``data.seed``
    orders every source's batches (``trainer.seed`` initializes the model). A data file that
    is not there raises :class:`~.config.UsageError` with the source's message."""
    schema = cfg.data.schema
    try:
        if schema == "movielens":
            from recpipe.train.movielens import MovieLensSource

            return MovieLensSource.from_config(cfg.data, cfg.model, cfg.data.seed)
        if schema == "criteo_tsv":
            from recpipe.train.criteo_tsv import CriteoTSVSource

            return CriteoTSVSource.from_config(cfg.data, cfg.model, cfg.data.seed)
    except FileNotFoundError as e:
        raise UsageError(f"data.schema={schema}: {e}") from None
    return SyntheticSource.from_config(cfg)
