"""MovieLens-100k as a click-through task: label = rating >= 4, time-ordered train/eval split.

The data is the file :data:`DEFAULT_PATH` (made by ``python -m recpipe.train.prepare_movielens``,
or ``scripts/prepare_movielens.py`` in a checkout; its docstring gives the layout): in a source
checkout ``data/movielens100k.npz``; installed from a wheel ``movielens100k.npz`` in
``$RECPIPE_DATA_DIR`` if set, else in ``$XDG_CACHE_HOME/recpipe`` (``~/.cache/recpipe``).
Events are sorted by timestamp (stable); the last ``eval_fraction`` of them is the eval part.
Each sample has, in one ``EmbeddingBagCollection`` (module ``ebc``, features :data:`FEATURES`):

- ``user``, ``item``, ``occupation``, ``age`` (7 buckets), ``zip`` (first two characters): one
  id each; ``genres``: the item's genres (multi-hot, mean-pooled);
- ``history``: the user's items rated strictly earlier in time (the latest ``max_history``),
  mean-pooled in the ``item`` table, which ``item`` and ``history`` share.

Dense features (:data:`DENSE`, standardized with training-part statistics): the item's release
year, the user's age and gender, the log of the number of the user's and of the item's
strictly earlier ratings, and the smoothed positive rate of the user's and of the item's
strictly earlier events. No sample sees its own label or a later one. ``label_scope`` says
whose labels the positive rates read: ``"earlier"`` (default) all strictly earlier events, eval
part included, as a feature store holds them when an event is served; ``"train"`` only the
training part's (an eval sample's features then read no eval label at all; most eval events
come from users with no training event, so this loses the user's rate: eval AUC ~0.70 instead
of ~0.74).

The baseline (:meth:`MovieLensSource.baseline`) scores an eval sample with its item's smoothed
mean label over the training part. numpy and torch only.

The file is checked before use (:func:`read_arrays`): one that is missing, is no readable .npz
(empty, truncated, bytes changed: zip's CRC) or lacks an array raises :class:`DataFileError`,
one line naming the file and the command that rebuilds it; the default file's arrays must also
hash to the recorded :data:`ARRAYS_SHA256` (a ``data.path`` file of one's own has no recorded
checksum). ``recpipe.train.prepare_movielens`` imports this module for the same check and must
stay fast: importing it loads neither torch nor torchrec (they load where a source first uses
them).
"""

from __future__ import annotations

import hashlib
import math
import os
import shlex
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from recpipe.train.config import DataConfig, ModelConfig, UsageError

if TYPE_CHECKING:
    from recpipe.testing.synthetic import Batch


#: the ``recpipe`` package's folder: in a source checkout (editable install, or scripts/gpu_env.sh's
#: symlinks, resolved here) the checkout's root
ROOT = Path(__file__).resolve().parents[1]
#: a source checkout (its pyproject.toml beside the package's files), not an installed wheel
CHECKOUT = all((ROOT / f).is_file() for f in ("pyproject.toml", "scripts/prepare_movielens.py"))
#: where ``python -m recpipe.train.prepare_movielens`` writes the file from a wheel, if set
DATA_DIR_ENV = "RECPIPE_DATA_DIR"
FILE_NAME = "movielens100k.npz"


def _default_path() -> Path:
    """``<checkout>/data/movielens100k.npz`` in a checkout; from a wheel, in ``$RECPIPE_DATA_DIR``
    if set, else in ``$XDG_CACHE_HOME/recpipe`` (``~/.cache/recpipe``)."""
    if CHECKOUT:
        return ROOT / "data" / FILE_NAME
    directory = os.environ.get(DATA_DIR_ENV)
    if not directory:
        directory = os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "recpipe")
    return (Path(directory).expanduser() / FILE_NAME).resolve()


#: the MovieLens file training reads unless ``data.path`` is set (:func:`_default_path`)
DEFAULT_PATH = _default_path()
#: the script that makes it, in a checkout (from a wheel: ``python -m`` :data:`PREPARE_MODULE`)
PREPARE = ROOT / "scripts" / "prepare_movielens.py"
PREPARE_MODULE = "recpipe.train.prepare_movielens"
#: the arrays of the file (recpipe.train.prepare_movielens's docstring gives their layout)
ARRAYS = ("event_user", "event_item", "event_rating", "event_time", "item_genres", "item_year",
          "user_age", "user_gender", "user_occupation", "user_zip", "genre_names",
          "occupation_names")
#: :func:`arrays_sha256` of MovieLens-100k as recpipe.train.prepare_movielens converts it: the
#: recorded checksum of DEFAULT_PATH (of the arrays, not of the .npz's bytes, which also
#: depend on numpy's and zlib's versions)
ARRAYS_SHA256 = "4c6a6ee1d10242cbb377696ea12ffd3fb80338f14545eee84ba589c7f7c65ae2"
MISSING = "is missing"  # DataFileError's problem for a file that is not there
AGE_EDGES = (18, 25, 35, 45, 50, 56)  # MovieLens-1M's age groups
FEATURES = ("user", "item", "history", "genres", "occupation", "age", "zip")
DENSE = ("release_year", "age", "gender", "log_user_events", "log_item_events",
         "user_prior_rate", "item_prior_rate")
PRIOR = 10.0  # pseudo-count of the global positive rate in every smoothed rate
TABLES = {  # name: (features, pooling); every table has model.dim columns
    "user": (("user",), "sum"), "item": (("item", "history"), "mean"),
    "genre": (("genres",), "mean"), "occupation": (("occupation",), "sum"),
    "age": (("age",), "sum"), "zip": (("zip",), "sum"),
}
LABEL_SCOPES = ("earlier", "train")


def data_path(data: DataConfig) -> Path:
    """The file the source reads: ``data.path``, else :data:`DEFAULT_PATH`."""
    return Path(data.path) if data.path else DEFAULT_PATH


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])``, vectorized."""
    ends = np.cumsum(lengths)
    return np.repeat(starts - ends + lengths, lengths) + np.arange(ends[-1] if len(ends) else 0)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (tied scores count one half)."""
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    mid_rank = np.cumsum(counts) - (counts - 1) / 2.0  # mean 1-based rank of each value
    pos = labels.astype(bool)
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((mid_rank[inverse][pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def log_loss(p: np.ndarray, labels: np.ndarray) -> float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log1p(-p)))


def eval_shares(n: int, rank: int, world: int, batch_size: int) -> list[np.ndarray]:
    """Rank ``rank``'s batches of positions ``0 .. n-1``: contiguous, disjoint shares that
    together cover everything, each split into the same number of batches (that of the largest
    share at ``batch_size``), so every rank runs as many eval steps. No batch exceeds
    ``batch_size``; sizes within a share differ by at most one."""
    if n < world:
        raise ValueError(f"{n} eval samples cannot be split over {world} ranks")
    shares = np.array_split(np.arange(n), world)
    return np.array_split(shares[rank], math.ceil(len(shares[0]) / batch_size))


class DataFileError(UsageError):
    """A MovieLens file that cannot be used. ``problem`` says why (:data:`MISSING`, ``"is
    empty"``, ``"is corrupt (...)"``, ``"holds other data than MovieLens-100k (...)"``); the
    message is one line: the file, the problem, and the command that (re)builds the file with
    this interpreter (the training command line prints it as ``error: ...``)."""

    def __init__(self, path: Path, problem: str) -> None:
        self.path, self.problem = path, problem
        verb = "build" if problem == MISSING else "rebuild"
        super().__init__(f"{_shown(path)} {problem}: {verb} it with {prepare_command(path)}")


def _shown(path: Path) -> str:
    """``path`` as a shell word: relative to the working directory if it lies under it."""
    cwd = Path.cwd()
    return shlex.quote(os.path.relpath(path, cwd) if path.is_relative_to(cwd) else str(path))


def prepare_command(out: Path) -> str:
    """The command that writes the MovieLens file ``out`` with this interpreter, e.g.
    ``.venv/bin/python scripts/prepare_movielens.py`` in a checkout, ``/venv/bin/python -m
    recpipe.train.prepare_movielens`` from a wheel (``--out`` unless ``out`` is the default
    path)."""
    program = _shown(PREPARE) if CHECKOUT else f"-m {PREPARE_MODULE}"
    command = f"{_shown(Path(sys.executable))} {program}"
    return command if out.resolve() == DEFAULT_PATH else f"{command} --out {_shown(out)}"


def arrays_sha256(arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over ``arrays`` in name order: each one's name, dtype, shape and bytes (C order);
    the same however an .npz stores them."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        digest.update(f"{name} {a.dtype.str} {a.shape}\n".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()


def _one_line(e: Exception, width: int = 80) -> str:
    """``e`` as ``Type: message`` on one line of at most ``width`` characters, the type
    qualified unless built in (``zipfile.BadZipFile``, ``zlib.error``, ``EOFError``)."""
    kind = type(e)
    name = kind.__qualname__
    if kind.__module__ != "builtins":
        name = f"{kind.__module__}.{name}"
    text = " ".join(f"{name}: {e}".split())
    return text if len(text) <= width else text[:width - 3] + "..."


def read_arrays(path: Path, sha256: str | None) -> dict[str, np.ndarray]:
    """The arrays of the .npz file ``path``. Raises :class:`DataFileError` if it is missing or
    empty, is no readable .npz (truncated, bytes changed: zip's CRC-32...), lacks one of
    :data:`ARRAYS`, or, given ``sha256``, if its :func:`arrays_sha256` differs from it (a
    readable file of other data: not called corrupt)."""
    if not path.exists():
        raise DataFileError(path, MISSING)
    if path.is_file() and path.stat().st_size == 0:
        raise DataFileError(path, "is empty")
    try:
        with np.load(path) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as e:  # damage surfaces as any of zipfile's, zlib's, numpy's, OSError...
        raise DataFileError(path, f"is corrupt ({_one_line(e)})") from None
    missing = [k for k in ARRAYS if k not in arrays]
    if missing:
        raise DataFileError(path, f"is corrupt (no array {', '.join(missing)})")
    if sha256 is not None and (found := arrays_sha256(arrays)) != sha256:  # readable, other data
        raise DataFileError(path, f"holds other data than MovieLens-100k (its arrays hash to "
                                  f"{found[:12]}..., recorded {sha256[:12]}...)")
    return arrays


class _Earlier:
    """Events (time-ordered) grouped by a key: per event, which events of the same key happened
    strictly earlier. ``order`` lists the events by key, then time; event ``e``'s strictly
    earlier events are ``order[end[e] - count[e]:end[e]]``."""

    def __init__(self, key: np.ndarray, time: np.ndarray) -> None:
        self.order = np.argsort(key, kind="stable")
        k, t = key[self.order], time[self.order]
        self._start = _group_starts(k != np.roll(k, 1))
        self._first = _group_starts((k != np.roll(k, 1)) | (t != np.roll(t, 1)))
        self.end, self.count = np.empty_like(self.order), np.empty_like(self.order)
        self.end[self.order] = self._first
        self.count[self.order] = self._first - self._start

    def sum(self, values: np.ndarray) -> np.ndarray:
        """Per event: the sum of ``values`` over its strictly earlier events."""
        c = np.concatenate([[0.0], np.cumsum(values[self.order], dtype=np.float64)])
        out = np.empty(len(values))
        out[self.order] = c[self._first] - c[self._start]
        return out


def _group_starts(new: np.ndarray) -> np.ndarray:
    """Per element, the index of the latest element at or before it where ``new`` is set
    (the first element always starts a group)."""
    new = new.copy()
    new[:1] = True
    return np.maximum.accumulate(np.where(new, np.arange(len(new)), 0))


def _standardize(x: np.ndarray, train: np.ndarray) -> np.ndarray:
    mean, std = x[train].mean(), x[train].std()
    return (x - mean) / (std if std > 0 else 1.0)


def _dense_columns(
    arrays: Mapping[str, np.ndarray], user: np.ndarray, item: np.ndarray, labels: np.ndarray,
    train: np.ndarray, known: np.ndarray, by_user: _Earlier, by_item: _Earlier,
) -> dict[str, np.ndarray]:
    """The :data:`DENSE` columns, unstandardized; positive rates read ``labels`` where
    ``known`` only, smoothed toward the training part's rate."""
    rate = float(labels[train].mean())
    year = arrays["item_year"][item].astype(np.float64)
    year[year == 0] = year[(year > 0) & train].mean()
    rates = {
        name: (by.sum(labels * known) + PRIOR * rate) / (by.sum(known) + PRIOR) - rate
        for name, by in (("user", by_user), ("item", by_item))
    }
    return {
        "release_year": year, "age": arrays["user_age"][user].astype(np.float64),
        "gender": arrays["user_gender"][user].astype(np.float64),
        "log_user_events": np.log1p(by_user.count), "log_item_events": np.log1p(by_item.count),
        "user_prior_rate": rates["user"], "item_prior_rate": rates["item"],
    }


def item_mean_baseline(item: np.ndarray, labels: np.ndarray, n_train: int) -> dict[str, float]:
    """AUC and log loss on events ``n_train:`` of each item's training mean label (events
    ``:n_train``), smoothed toward the training part's rate with :data:`PRIOR`."""
    y, n = labels, n_train
    rate = float(y[:n].mean())
    pos = np.bincount(item[:n], weights=y[:n], minlength=item.max() + 1)
    count = np.bincount(item[:n], minlength=item.max() + 1)
    score = ((pos + PRIOR * rate) / (count + PRIOR))[item[n:]]
    return {"auc": auc(score, y[n:]), "logloss": log_loss(score, y[n:])}


class MovieLensSource:
    """Train and eval batches of MovieLens-100k (see the module docstring) for one model spec.

    ``time`` and ``labels`` are per event, time-ordered; the first ``n_train`` events are the
    training part. Batches are deterministic in (seed, rank, step)."""

    def __init__(
        self, arrays: Mapping[str, np.ndarray], *, batch_size: int, eval_fraction: float,
        max_history: int, seed: int, dim: int, over_arch: tuple[int, ...] = (64, 32),
        label_scope: str = "earlier",
    ) -> None:
        if label_scope not in LABEL_SCOPES:
            raise ValueError(f"label_scope={label_scope!r}: expected one of {', '.join(LABEL_SCOPES)}")
        order = np.argsort(arrays["event_time"], kind="stable")
        self.time = arrays["event_time"][order]
        self.labels = (arrays["event_rating"][order] >= 4).astype(np.float32)
        n = len(order)
        n_eval = round(n * eval_fraction)
        if not 0 < n_eval < n:
            raise ValueError(f"data.eval_fraction={eval_fraction} leaves no train or no eval part")
        self.n_train = n - n_eval
        if self.n_train < batch_size:
            raise ValueError(f"data.batch_size={batch_size} exceeds the {self.n_train} train samples")
        self.batch_size, self.seed = batch_size, seed
        self._epoch, self._perm = -1, np.empty(0, np.int64)  # the last epoch's permutation

        user = arrays["event_user"][order].astype(np.int64)
        item = arrays["event_item"][order].astype(np.int64)
        by_user, by_item = _Earlier(user, self.time), _Earlier(item, self.time)
        self._history_items = item[by_user.order]
        self._history_len = np.minimum(by_user.count, max_history)
        self._history_start = by_user.end - self._history_len
        zips, zip_code = np.unique(np.char.ljust(arrays["user_zip"], 2).astype("<U2"),
                                   return_inverse=True)
        self._ids = {
            "user": user, "item": item,
            "occupation": arrays["user_occupation"].astype(np.int64)[user],
            "age": np.digitize(arrays["user_age"], AGE_EDGES)[user], "zip": zip_code[user],
        }
        genres = arrays["item_genres"].astype(bool)
        self._genre_len = genres.sum(1)
        self._genre_start = np.cumsum(self._genre_len) - self._genre_len
        self._genre_ids = np.nonzero(genres)[1]

        train = np.arange(n) < self.n_train
        known = train if label_scope == "train" else np.ones(n, bool)
        columns = _dense_columns(arrays, user, item, self.labels, train, known, by_user, by_item)
        self._dense = np.stack([_standardize(columns[c], train) for c in DENSE], 1).astype(np.float32)
        rows = {"user": len(arrays["user_age"]), "item": len(arrays["item_year"]),
                "genre": genres.shape[1], "occupation": len(arrays["occupation_names"]),
                "age": len(AGE_EDGES) + 1, "zip": len(zips)}
        from recpipe.testing.synthetic import ModelSpec, TableSpec  # torchrec: module docstring

        self.spec = ModelSpec(
            dim=dim, dense_in=len(DENSE), batch_size=batch_size, over_arch=over_arch,
            layout={"ebc": tuple(TableSpec(name, rows[name], dim, feats, pooling)
                                 for name, (feats, pooling) in TABLES.items())},
        )
        self._baseline = item_mean_baseline(item, self.labels, self.n_train)

    @classmethod
    def from_config(cls, data: DataConfig, model: ModelConfig, seed: int) -> MovieLensSource:
        """Load ``data.path`` (default :data:`DEFAULT_PATH`, checked against
        :data:`ARRAYS_SHA256`) with :func:`read_arrays`; ``seed`` orders the training part (the
        trainer passes ``data.seed``); every table has ``model.dim``."""
        path = data_path(data)
        arrays = read_arrays(path, ARRAYS_SHA256 if path.resolve() == DEFAULT_PATH else None)
        return cls(arrays, batch_size=data.batch_size, eval_fraction=data.eval_fraction,
                   max_history=data.max_history, seed=seed, dim=model.dim,
                   over_arch=tuple(model.over_arch), label_scope=data.label_scope)

    def train_positions(self, rank: int, world: int, step: int) -> np.ndarray:
        """Events (time-ordered positions) of ``rank``'s batch at global ``step``: each epoch
        is a permutation of the training part, seeded by (seed, epoch), cut into
        ``world * batch_size`` consecutive slices (the tail is dropped), rank ``r`` taking
        slice ``r`` of each."""
        per_step = self.batch_size * world
        steps_per_epoch = self.n_train // per_step
        if steps_per_epoch == 0:
            raise ValueError(f"{world} x data.batch_size={self.batch_size} exceeds the "
                             f"{self.n_train} train samples")
        epoch, i = divmod(step, steps_per_epoch)
        start = i * per_step + rank * self.batch_size
        return self._permutation(epoch)[start:start + self.batch_size]

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._epoch != epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_train)
        return self._perm

    def eval_positions(self, rank: int, world: int) -> list[np.ndarray]:
        """Events of ``rank``'s eval batches (:func:`eval_shares` over the eval part)."""
        n = len(self.time) - self.n_train
        return [self.n_train + b for b in eval_shares(n, rank, world, self.batch_size)]

    def train_batches(self, rank: int, world: int, start: int, stop: int) -> Iterator[Batch]:
        """Batches ``start .. stop-1`` of ``rank`` (global step numbers)."""
        for step in range(start, stop):
            yield self.batch(self.train_positions(rank, world, step))

    def eval_batches(self, rank: int, world: int) -> Iterator[Batch]:
        """The eval part, disjointly over ranks, the same number of batches on every rank."""
        for positions in self.eval_positions(rank, world):
            yield self.batch(positions)

    def baseline(self) -> dict[str, float]:
        """``{"auc", "logloss"}`` on the eval part of the item's smoothed training mean label."""
        return dict(self._baseline)

    def batch(self, positions: np.ndarray) -> Batch:
        """The batch of the given events (time-ordered positions)."""
        import torch  # here, not at the top: see the module docstring
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        from recpipe.testing.synthetic import Batch

        item = self._ids["item"][positions]
        jagged = {
            "history": (self._history_items, self._history_start[positions],
                        self._history_len[positions]),
            "genres": (self._genre_ids, self._genre_start[item], self._genre_len[item]),
        }
        lengths, values = [], []
        for f in FEATURES:
            if f in jagged:
                source, starts, n = jagged[f]
                values.append(source[concat_ranges(starts, n)])
                lengths.append(n)
            else:
                values.append(self._ids[f][positions])
                lengths.append(np.ones(len(positions), np.int64))
        kjt = KeyedJaggedTensor.from_lengths_sync(  # torch-owned (resizable) storage throughout
            keys=list(FEATURES), values=torch.tensor(np.concatenate(values)),
            lengths=torch.tensor(np.concatenate(lengths)),
        )
        return Batch(torch.tensor(self._dense[positions]), {"ebc": kjt},
                     torch.tensor(self.labels[positions]))
