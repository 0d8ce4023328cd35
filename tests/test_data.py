"""Data sources: MovieLens-100k (a stand-in .npz of the same layout, and the real file when
present) and Criteo TSV (a generated file); the explicit-layout model of recpipe.testing.synthetic."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from recpipe.train.config import DataConfig, ModelConfig
from recpipe.train.criteo_tsv import CriteoTSVSource
from recpipe.train.movielens import DEFAULT_PATH, FEATURES, MovieLensSource, auc, concat_ranges
from recpipe.testing.synthetic import Batch, ModelSpec, TableSpec, build_sharded, make_batch

# ---------------------------------------------------------------------------------------------
# helpers


def standin_arrays(seed: int = 0, n: int = 3000, users: int = 40, items: int = 60) -> dict:
    """A small random data set in data/movielens100k.npz's layout (prepare_movielens.py):
    timestamps with ties, ratings that depend on the item, items without genres or year."""
    g = np.random.default_rng(seed)
    quality = g.uniform(1.5, 5.0, items + 1)
    item = g.integers(1, items + 1, n)
    genres = (g.random((items + 1, 19)) < 0.15).astype(np.uint8)
    genres[:3] = 0
    year = g.integers(1930, 1999, items + 1).astype(np.int16)
    year[[0, 5, 7]] = 0
    return {
        "event_user": g.integers(1, users + 1, n).astype(np.int32),
        "event_item": item.astype(np.int32),
        "event_rating": np.clip(np.rint(quality[item] + g.normal(0, 1, n)), 1, 5).astype(np.int8),
        "event_time": g.integers(0, 150, n).astype(np.int64) * 1000,  # many ties
        "item_genres": genres,
        "item_year": year,
        "genre_names": np.asarray([f"g{i}" for i in range(19)]),
        "occupation_names": np.asarray(["artist", "doctor", "other", "writer"]),
        "user_age": g.integers(7, 73, users + 1).astype(np.int16),
        "user_gender": g.integers(0, 2, users + 1).astype(np.int8),
        "user_occupation": g.integers(0, 4, users + 1).astype(np.int16),
        "user_zip": np.asarray([g.choice(["02139", "94043", "T8H1N", "9", "V3N4P"])
                                for _ in range(users + 1)]),
    }


def standin(tmp_path: Path, batch_size: int = 16, max_history: int = 5, seed: int = 3,
            arrays: dict | None = None) -> MovieLensSource:
    path = tmp_path / "ml.npz"
    np.savez(path, **(arrays or standin_arrays()))
    data = DataConfig(path=str(path), batch_size=batch_size, max_history=max_history)
    return MovieLensSource.from_config(data, ModelConfig(dim=8), seed)


def same_batch(a: Batch, b: Batch) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in [(a.dense, b.dense), (a.labels, b.labels)]
        + [(a.sparse[k].values(), b.sparse[k].values()) for k in a.sparse]
        + [(a.sparse[k].lengths(), b.sparse[k].lengths()) for k in a.sparse]
    ) and a.sparse.keys() == b.sparse.keys()


# ---------------------------------------------------------------------------------------------
# MovieLens on the stand-in


def test_helpers() -> None:
    starts, lengths = np.array([5, 0, 9, 2]), np.array([2, 0, 3, 1])
    assert concat_ranges(starts, lengths).tolist() == [5, 6, 9, 10, 11, 2]
    g = np.random.default_rng(0)
    scores, labels = g.integers(0, 5, 300).astype(float), g.integers(0, 2, 300)
    pairs = [(s > t) + 0.5 * (s == t) for s, y in zip(scores, labels) if y
             for t, z in zip(scores, labels) if not z]
    assert auc(scores, labels) == pytest.approx(np.mean(pairs))


def test_time_ordered_split_and_eval_shares(tmp_path: Path) -> None:
    src = standin(tmp_path)
    n = len(src.time)
    assert src.n_train == n - round(0.2 * n)
    train = np.concatenate([src.train_positions(0, 1, s) for s in range(src.n_train // 16)])
    assert src.time[train].max() <= src.time[src.n_train:].min()
    world = 3
    shares = [src.eval_positions(r, world) for r in range(world)]
    assert len({len(s) for s in shares}) == 1  # the same number of eval steps on every rank
    assert all(0 < len(b) <= 16 for s in shares for b in s)
    assert np.concatenate([b for s in shares for b in s]).tolist() == list(range(src.n_train, n))
    batches = list(src.eval_batches(1, world))
    assert [len(b.labels) for b in batches] == [len(p) for p in shares[1]]
    assert torch.equal(batches[0].labels, torch.tensor(src.labels[shares[1][0]]))


def test_train_batches_deterministic_disjoint_resumable(tmp_path: Path) -> None:
    src, again = standin(tmp_path), standin(tmp_path)
    world, per_epoch = 2, src.n_train // 32
    steps = range(per_epoch + 3)  # into the second epoch
    for rank in range(world):
        full = list(src.train_batches(rank, world, 0, len(steps)))
        assert all(same_batch(a, b) for a, b in zip(full, again.train_batches(rank, world, 0, len(steps))))
        resumed = list(again.train_batches(rank, world, 5, len(steps)))
        assert len(resumed) == len(steps) - 5
        assert all(same_batch(a, b) for a, b in zip(full[5:], resumed))
    epoch = [np.concatenate([src.train_positions(r, world, s) for r in range(world)])
             for s in range(per_epoch)]
    seen = np.concatenate(epoch)
    assert len(np.unique(seen)) == len(seen) == per_epoch * 32  # disjoint within and across steps
    assert seen.max() < src.n_train
    assert not np.array_equal(src.train_positions(0, world, 0), src.train_positions(0, world, per_epoch))
    other = standin(tmp_path, seed=4)
    assert not np.array_equal(src.train_positions(0, world, 0), other.train_positions(0, world, 0))


def test_history_holds_the_users_strictly_earlier_items(tmp_path: Path) -> None:
    src = standin(tmp_path, max_history=5)
    batch = src.batch(np.arange(len(src.time)))
    features = batch.sparse["ebc"].to_dict()
    assert list(batch.sparse["ebc"].keys()) == list(FEATURES)
    users, items = features["user"].values().tolist(), features["item"].values().tolist()
    history = [h.tolist() for h in features["history"].to_dense()]
    earlier: dict[int, list[tuple[int, int]]] = {}
    for p, (u, i) in enumerate(zip(users, items)):
        expected = [j for t, j in earlier.get(u, []) if t < src.time[p]][-5:]
        assert history[p] == expected, p
        earlier.setdefault(u, []).append((src.time[p], i))
    assert max(map(len, history)) == 5 and min(map(len, history)) == 0


def test_features_read_no_own_or_later_label(tmp_path: Path) -> None:
    """Ratings of the eval events from time T on are changed: no event up to T (the first of
    them included) may see it; with label_scope="train" no event at all."""
    arrays = standin_arrays()
    changed = dict(arrays)
    cutoff = np.sort(arrays["event_time"])[-300]  # an eval event's time, shared by others
    later = arrays["event_time"] >= cutoff
    changed["event_rating"] = np.where(later, 6 - arrays["event_rating"], arrays["event_rating"])
    for scope in ("earlier", "train"):
        before, after = (MovieLensSource(a, batch_size=16, eval_fraction=0.2, max_history=5,
                                         seed=0, dim=8, label_scope=scope) for a in (arrays, changed))
        assert not np.array_equal(before.labels, after.labels)
        unseen = before.time <= cutoff if scope == "earlier" else np.ones(len(before.time), bool)
        assert np.array_equal(before._dense[unseen], after._dense[unseen])
        # the rates of the events after T do read the changed labels (the check above can fail)
        assert np.array_equal(before._dense[~unseen], after._dense[~unseen]) == (scope == "train")


def test_baseline_on_standin(tmp_path: Path) -> None:
    src = standin(tmp_path)
    base = src.baseline()
    assert 0.6 < base["auc"] < 0.95  # ratings follow the item's quality
    assert 0.3 < base["logloss"] < math.log(2)
    src.baseline()["auc"] = 0
    assert src.baseline() == base


@pytest.fixture
def gloo():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_explicit_layout_model_trains_through_the_pipeline(tmp_path: Path, gloo) -> None:
    from recpipe.pipeline.sparse_dist import TrainPipelineSparseDist

    src = standin(tmp_path)
    model, opt = build_sharded(src.spec, ["table_wise", "column_wise"], torch.device("cpu"),
                               gloo, lr=0.1, optimizer="sgd")
    pipeline = TrainPipelineSparseDist(model, opt, torch.device("cpu"))
    it = src.train_batches(0, 1, 0, 40)
    losses = [pipeline.progress(it)[0].item() for _ in range(40)]
    assert all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-10:]) < np.mean(losses[:10])


def test_synthetic_layout_and_default_spec() -> None:
    spec = ModelSpec()
    assert spec.modules() == ["ebc", "wbc", "ec"]
    assert spec.tables("wbc") == ["wbc_t0", "wbc_t1", "wbc_t2", "wbc_t3"]
    assert spec.features("ec") == ["s0", "s1", "s2", "s3"] and spec.width() == 3 * 4 * 16
    layout = ModelSpec(batch_size=8, layout={"ebc": (
        TableSpec("a", 3, 4, ("x", "y"), "mean"), TableSpec("b", 50, 8, ("z",)))})
    assert layout.modules() == ["ebc"] and layout.features("ebc") == ["x", "y", "z"]
    assert layout.width() == 4 + 4 + 8
    kjt = make_batch(layout, seed=1).sparse["ebc"].to_dict()
    assert kjt["x"].values().max() < 3 and kjt["y"].values().max() < 3
    assert kjt["z"].values().max() < 50 and kjt["z"].values().max() >= 3


# ---------------------------------------------------------------------------------------------
# MovieLens-100k itself

needs_movielens = pytest.mark.skipif(
    not DEFAULT_PATH.exists(),
    reason=f"{DEFAULT_PATH} is absent: run scripts/prepare_movielens.py (setup_venv.sh does)",
)


@needs_movielens
def test_movielens100k() -> None:
    src = MovieLensSource.from_config(DataConfig(batch_size=256), ModelConfig(dim=16), seed=0)
    assert len(src.time) == 100_000 and src.n_train == 80_000
    assert src.time[:80_000].max() <= src.time[80_000:].min()
    base = src.baseline()
    assert 0.68 < base["auc"] < 0.72 and 0.6 < base["logloss"] < 0.65
    rows = {t.name: t.rows for t in src.spec.layout["ebc"]}
    assert rows["user"] == 944 and rows["item"] == 1683 and rows["genre"] == 19
    kjt = next(src.train_batches(0, 1, 0, 1)).sparse["ebc"].to_dict()
    assert kjt["history"].lengths().max() == 20 and kjt["genres"].lengths().min() >= 1
    for name, table in (("user", "user"), ("item", "item"), ("history", "item"), ("zip", "zip")):
        assert 0 <= kjt[name].values().min() and kjt[name].values().max() < rows[table]


# ---------------------------------------------------------------------------------------------
# Criteo TSV


def write_criteo(path: Path, lines: int, seed: int = 0) -> list[list[str]]:
    """``lines`` random Criteo lines, about 20% of the values missing, except the first integer:
    the line's number (to find each sample's line); returns the fields."""
    r = random.Random(seed)
    rows = []
    for i in range(lines):
        ints = [str(i)] + ["" if r.random() < 0.2 else str(r.randint(-3, 5000)) for _ in range(12)]
        cats = ["" if r.random() < 0.2 else f"{r.getrandbits(32):08x}" for _ in range(26)]
        rows.append([str(r.randint(0, 1)), *ints, *cats])
    path.write_text("".join("\t".join(row) + "\n" for row in rows))
    return rows


def line_numbers(batch: Batch) -> list[int]:
    return torch.expm1(batch.dense[:, 0]).round().long().tolist()


def criteo(path: Path, batch_size: int = 32, seed: int = 0) -> CriteoTSVSource:
    return CriteoTSVSource.from_config(DataConfig(path=str(path), batch_size=batch_size),
                                       ModelConfig(rows=97, dim=8), seed)


def test_criteo_reader_parses_labels_dense_hashed_ids_missing(tmp_path: Path) -> None:
    rows = write_criteo(tmp_path / "day_0.tsv", 1000)
    src = criteo(tmp_path / "day_0.tsv")
    assert (src.n_train, src.n_eval) == (800, 200)
    assert src.baseline() is None
    got = list(src.eval_batches(0, 1))
    assert [len(b.labels) for b in got] == [29] * 4 + [28] * 3  # 7 batches of at most 32
    labels = torch.cat([b.labels for b in got])
    dense = torch.cat([b.dense for b in got])
    want = rows[800:]
    assert labels.tolist() == [float(r[0]) for r in want]
    assert torch.allclose(dense, torch.tensor(
        [[math.log1p(max(int(v), 0)) if v else 0.0 for v in r[1:14]] for r in want]))
    first = got[0].sparse["ebc"].to_dict()
    for f in range(26):
        jt = first[f"f{f}"]
        column = [r[14 + f] for r in want[:29]]
        assert jt.lengths().tolist() == [int(bool(v)) for v in column]
        assert jt.values().tolist() == [int(v, 16) % 97 for v in column if v]
    assert (dense >= 0).all() and 0 < (dense == 0).float().mean() < 0.5


def test_criteo_train_batches_deterministic_disjoint_resumable(tmp_path: Path) -> None:
    write_criteo(tmp_path / "day_0.tsv", 1000)
    src = criteo(tmp_path / "day_0.tsv", batch_size=16)
    world, per_epoch = 2, 800 // 32
    seen = [i for r in range(world) for b in src.train_batches(r, world, 0, per_epoch)
            for i in line_numbers(b)]
    assert sorted(seen) == list(range(800))  # disjoint over ranks and steps, the whole epoch
    for rank in range(world):
        full = list(src.train_batches(rank, world, 0, per_epoch + 4))
        again = criteo(tmp_path / "day_0.tsv", batch_size=16).train_batches(rank, world, 0, per_epoch + 4)
        assert all(same_batch(a, b) for a, b in zip(full, again, strict=True))
        resumed = list(src.train_batches(rank, world, per_epoch - 2, per_epoch + 4))
        assert len(resumed) == 6
        assert all(same_batch(a, b) for a, b in zip(full[per_epoch - 2:], resumed))
        assert line_numbers(full[0]) != line_numbers(full[per_epoch])  # the next epoch reshuffled
    other = criteo(tmp_path / "day_0.tsv", batch_size=16, seed=1)
    assert line_numbers(next(other.train_batches(0, world, 0, 1))) != line_numbers(full[0])


def test_criteo_directory_counts_lines_across_files(tmp_path: Path) -> None:
    rows = write_criteo(tmp_path / "one.tsv", 1000)
    (tmp_path / "days").mkdir()
    for day, part in enumerate((rows[:300], rows[300:850], rows[850:])):
        text = "".join("\t".join(r) + "\n" for r in part)
        (tmp_path / "days" / f"day_{day}").write_text(text[:-1] if day == 2 else text)
    one, days = criteo(tmp_path / "one.tsv"), criteo(tmp_path / "days")
    assert (days.n_train, days.n_eval) == (800, 200)
    for a, b in itertools.zip_longest(one.eval_batches(1, 2), days.eval_batches(1, 2)):
        assert same_batch(a, b)
    assert all(same_batch(a, b) for a, b in zip(one.train_batches(0, 1, 20, 30),
                                                days.train_batches(0, 1, 20, 30)))


def test_criteo_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data.path"):
        CriteoTSVSource.from_config(DataConfig(path=None), ModelConfig(), 0)
    with pytest.raises(FileNotFoundError, match="no such file"):
        criteo(tmp_path / "absent.tsv")
    (tmp_path / "bad.tsv").write_text("1\t2\t3\n" * 10)
    with pytest.raises(ValueError, match="expected 40"):
        next(criteo(tmp_path / "bad.tsv", batch_size=2).eval_batches(0, 1))


@pytest.mark.parametrize("seed", [0, 7, 123456789])
def test_synthetic_eval_batches_are_not_training_batches(seed: int) -> None:
    """torch keeps the low 32 bits of a seed: an eval seed of (1 << 62) + k made eval batch k a
    training batch. No eval batch equals any training batch of the first steps, on 2 ranks."""
    from recpipe.train.data import SyntheticSource
    from recpipe.testing.synthetic import ModelSpec

    source = SyntheticSource(ModelSpec(batch_size=8), seed)
    for rank in (0, 1):
        train = list(source.train_batches(rank, 2, 0, 64))
        for held_out in source.eval_batches(rank, 2):
            assert not any(torch.equal(held_out.dense, b.dense) for b in train)
