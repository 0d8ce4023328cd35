"""A checkpoint records what its data files hold (issue 40, case 2): a resume on other data (a
``data.path`` file, or the default MovieLens file, replaced by another valid file) is refused in
one line naming both and the key that accepts it; the identity is hashed once and a resume of
unchanged files reads none of their bytes."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_data import standin_arrays
from test_train import config, gloo  # noqa: F401 (gloo: a fixture)

from recpipe.train import checkpoint, movielens
from recpipe.train.checkpoint import CheckpointError
from recpipe.train.config import DataConfig
from recpipe.train.trainer import train

STANDIN = ("data=movielens", "model=movielens", "data.batch_size=16", "model.dim=8",
           "trainer.log_interval=2", "trainer.eval=false")


def _write(path: Path, seed: int) -> str:
    """Write a MovieLens-format file (the stand-in of ``seed``: another seed, other ratings and
    users' features, the same table sizes); its identity as a refusal shows it."""
    np.savez(path, **standin_arrays(seed))
    sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    return f"{path}: {path.stat().st_size} bytes, sha256 {sha256[:12]}"


@pytest.mark.parametrize("where", ["data.path", "default file"])
def test_a_resume_on_other_data_is_refused_unless_accepted(
    gloo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    path = tmp_path / "ml.npz"
    before = _write(path, 0)
    data = [f"data.path={path}"]
    if where == "default file":  # the stand-in is the default file, its arrays' sha256 recorded
        monkeypatch.setattr(movielens, "DEFAULT_PATH", path)
        monkeypatch.setattr(movielens, "ARRAYS_SHA256", movielens.arrays_sha256(standin_arrays(0)))
        data = []
    ck = f"trainer.checkpoint_dir={tmp_path / 'ck'}"
    train(config(*STANDIN, *data, ck, "trainer.steps=2"), gloo, str(tmp_path / "a"))
    after = _write(path, 1)
    resume = (*STANDIN, *data, ck, "trainer.resume=true", "trainer.steps=4")
    with pytest.raises(CheckpointError) as e:
        train(config(*resume), gloo, str(tmp_path / "b"))
    assert str(e.value) == (
        f"{tmp_path / 'ck' / 'step_2'} was trained on other data ({before}; now {after}): put "
        "that data back, or pass trainer.resume_other_data=true to continue on this data")
    if where == "data.path":  # accepted: it trains on the new file from step 2
        rows = train(config(*resume, "trainer.resume_other_data=true"), gloo, str(tmp_path / "c"))
        assert [r["step"] for r in rows] == [4]
        assert (tmp_path / "ck" / "latest").read_text() == "4"


def test_the_identity_is_the_content_hashed_once_wherever_it_lies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file's is its sha256 (``sha256sum``'s); the stat key recorded spares the hash while the
    file is unchanged; a copy elsewhere is hashed again and is the same data (``data.path`` is
    no config key a resume compares); a directory's files (criteo_tsv) are hashed together."""
    from recpipe.train.checkpoint import data_identity, identity

    movielens = ("data=movielens", "model=movielens")
    assert identity(config(*movielens, "data.path=a.npz")) == identity(config(*movielens))

    path = tmp_path / "ml.npz"
    _write(path, 0)
    ml = DataConfig(schema="movielens", path=str(path))
    first = data_identity(ml)
    assert first.sha256 == checkpoint._sha256(str(path)) and first.size == path.stat().st_size
    assert data_identity(DataConfig(schema="synthetic")) is None  # the config keys decide it
    assert data_identity(DataConfig(schema="movielens", path=str(tmp_path / "no.npz"))) is None

    def no_hash(path: str) -> str:
        raise AssertionError(f"hashed {path}")

    with monkeypatch.context() as m:
        m.setattr(checkpoint, "_sha256", no_hash)
        assert data_identity(ml, first) == first  # unchanged: not read
    copy = tmp_path / "copy.npz"
    shutil.copy(path, copy)
    other = data_identity(DataConfig(schema="movielens", path=str(copy)), first)
    assert other.same_content(first) and other.stats != first.stats
    os.utime(path, ns=(0, path.stat().st_mtime_ns))  # ctime moves: hashed again, the same
    assert data_identity(ml, first).stats != first.stats

    tsv = tmp_path / "tsv"
    tsv.mkdir()
    for name in ("a", "b"):
        (tsv / name).write_text(f"{name}\n")
    both = data_identity(DataConfig(schema="criteo_tsv", path=str(tsv)))
    (tsv / "b").write_text("c\n")
    changed = data_identity(DataConfig(schema="criteo_tsv", path=str(tsv)))
    assert both.size == changed.size == 4 and not changed.same_content(both)
