"""Criteo TSV files the source cannot use end in one line naming the file, its 1-based line (and
column) and the fix (issue 23, case 3): before training where the file's start or bytes show it,
else when the bad line's batch is made."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from test_data import criteo, write_criteo

from recpipe.train.config import UsageError, register
from recpipe.train.criteo_tsv import HEAD_BYTES, DataError
from recpipe.train.data import make_source

ROOT = Path(__file__).resolve().parents[1]
register()
LAYOUT = "label, 13 integers, 26 categorical ids, tab-separated"
FIX = "fix or remove the line"
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8


def edit_line(path: Path, line: int, edit: Callable[[list[str]], list[str]]) -> None:
    """Replace the fields of ``path``'s line ``line`` (1-based) by ``edit(fields)``."""
    lines = path.read_text().split("\n")
    lines[line - 1] = "\t".join(edit(lines[line - 1].split("\t")))
    path.write_text("\n".join(lines))


def beyond_head(path: Path, line: int) -> bool:
    """Whether line ``line`` (1-based) of ``path`` starts after its first HEAD_BYTES."""
    return len(b"".join(path.read_bytes().split(b"\n")[:line - 1])) > HEAD_BYTES


def set_value(column: int, value: str) -> Callable[[list[str]], list[str]]:
    """An edit setting column ``column`` (1-based) to ``value``."""
    return lambda fields: [value if c == column else v for c, v in enumerate(fields, 1)]


def refusal(make: Callable[[], object]) -> str:
    """The message of the DataError ``make()`` raises, checked to be one line."""
    with pytest.raises(DataError) as e:
        make()
    assert isinstance(e.value, UsageError) and "\n" not in str(e.value)
    return str(e.value)


def with_png(directory: Path) -> str:
    """A day of Criteo lines and a PNG image in ``directory``; the refusal's message."""
    write_criteo(directory / "day_0.tsv", 100)
    (directory / "plot.png").write_bytes(PNG)
    return (f"data.path: {directory / 'plot.png'}:1: byte 0x89 is not ASCII text, so this is no "
            "Criteo TSV file: remove it (a directory's visible files are all read) or convert it")


def test_a_non_text_file_in_the_directory_is_refused_before_training(tmp_path: Path) -> None:
    message = with_png(tmp_path)
    assert refusal(lambda: criteo(tmp_path)) == message


def test_the_app_gets_the_refusal_as_a_usage_error(tmp_path: Path) -> None:
    """The trainer's ``make_source``: scripts/train.py prints a UsageError as ``error: ...``."""
    message = with_png(tmp_path)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = OmegaConf.to_object(compose("train", ["data=criteo_tsv", f"data.path={tmp_path}"]))
    with pytest.raises(UsageError, match=f"^{re.escape(message)}$"):
        make_source(cfg)


def test_a_non_ascii_byte_deep_in_a_file_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "day_0.tsv"
    write_criteo(path, 1000)
    edit_line(path, 900, set_value(20, "caf\u00e9"))
    assert beyond_head(path, 900)
    assert refusal(lambda: criteo(path)).startswith(
        f"data.path: {path}:900: byte 0xc3 is not ASCII text")


def test_a_gzip_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "day_0.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(128, 256)))
    assert refusal(lambda: criteo(tmp_path / "day_0.gz")) == (
        f"data.path: {tmp_path / 'day_0.gz'}: gzip-compressed: decompress it (gunzip) and use the "
        "TSV file")


@pytest.mark.parametrize("edit, problem", [
    (lambda fields: fields[:38], f"38 columns, expected 40 ({LAYOUT}): {FIX}"),
    (lambda fields: [" ".join(fields)], f"1 columns, expected 40 ({LAYOUT}): {FIX}"),
    (set_value(20, "zz12"), "column 20: 'zz12' is not a hex id (columns 15-40: categorical ids, "
                            f"empty if missing): {FIX}"),
    (set_value(3, "4.5"), "column 3: '4.5' is not an integer (columns 2-14: integers, empty if "
                          f"missing): {FIX}"),
    (set_value(3, "9" * 20), f"column 3: '{'9' * 20}' exceeds a 64-bit integer: {FIX}"),
    (set_value(1, "yes"), f"column 1: 'yes' is not a label (column 1: 0 or 1): {FIX}"),
])
def test_a_bad_line_at_the_start_is_refused_before_training(
        tmp_path: Path, edit: Callable[[list[str]], list[str]], problem: str) -> None:
    path = tmp_path / "day_0.tsv"
    write_criteo(path, 100)
    edit_line(path, 17, edit)
    assert refusal(lambda: criteo(path)) == f"data.path: {path}:17: {problem}"


def bad_second_day(tmp_path: Path, line: int) -> Path:
    """Two days of 1000 lines, ``day_1``'s line ``line`` (beyond its first HEAD_BYTES) with a
    non-hex id in column 20: the source is made."""
    for day in range(2):
        write_criteo(tmp_path / f"day_{day}", 1000, seed=day)
    edit_line(tmp_path / "day_1", line, set_value(20, "zz12"))
    assert beyond_head(tmp_path / "day_1", line)
    return tmp_path / "day_1"


def test_a_bad_eval_line_names_its_file_and_line(tmp_path: Path) -> None:
    day_1 = bad_second_day(tmp_path, 900)  # eval: the last 400 lines, day_1's 601 .. 1000
    src = criteo(tmp_path)
    assert refusal(lambda: list(src.eval_batches(0, 1))).startswith(
        f"data.path: {day_1}:900: column 20: 'zz12' is not a hex id")


def test_a_bad_train_line_names_its_file_and_line(tmp_path: Path) -> None:
    day_1 = bad_second_day(tmp_path, 300)
    src = criteo(tmp_path)
    assert refusal(lambda: list(src.train_batches(0, 1, 0, 1600 // 32))).startswith(
        f"data.path: {day_1}:300: column 20: 'zz12' is not a hex id")


def test_an_empty_file_is_named_not_eval_fraction(tmp_path: Path) -> None:
    write_criteo(tmp_path / "day_0", 100)
    (tmp_path / "day_1").write_text("")
    message = (f"data.path: {tmp_path / 'day_1'}: the file is empty: remove it or give Criteo TSV "
               f"lines ({LAYOUT})")
    assert refusal(lambda: criteo(tmp_path)) == message
    assert refusal(lambda: criteo(tmp_path / "day_1")) == message
