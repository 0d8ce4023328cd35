"""recpipe as an installed library (issue 24, point 5): the wheel built from this checkout holds
the Hydra configs, the ``recpipe-train`` console script and ``python -m recpipe.train``, and
declares torch (torchrec only as an extra); run from the wheel's files, the training command
finds its configs and the MovieLens file goes to the user's cache, its error naming ``python -m
recpipe.train.prepare_movielens``; the resume command repeats how the run was started. Offline:
the wheel is built with this environment's setuptools (no build isolation, no index)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import zipfile
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_cli import COMPOSE_ERRORS, ENV

from recpipe.train import cli
from recpipe.train.torchrun import LAUNCHER_ENV

ROOT = Path(__file__).resolve().parents[1]
BAD = "trainer.stpes=3"  # a key typo: test_cli.COMPOSE_ERRORS's first case


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of the working tree (its files git does not ignore, copied: the build leaves
    build/ and *.egg-info beside its source)."""
    tmp = tmp_path_factory.mktemp("wheel")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():  # not a tracked file deleted here
            (tmp / "src" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / "src" / name).write_bytes((ROOT / name).read_bytes())
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check",
                        "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp / "dist"),
                        str(tmp / "src")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (built,) = (tmp / "dist").glob("recpipe-*.whl")
    return built


@pytest.fixture(scope="module")
def site(wheel: Path) -> Path:
    """The wheel's files as an install puts them (a wheel of pure Python is a zip of them)."""
    path = wheel.parent / "site"
    zipfile.ZipFile(wheel).extractall(path)
    return path


def _metadata(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(next(n for n in z.namelist() if n.endswith(f".dist-info/{name}"))).decode()


def test_the_wheel_holds_the_configs_the_commands_and_declares_torch(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"recpipe/configs/{p.relative_to(ROOT / 'configs')}" for p in (ROOT / "configs").rglob("*.yaml")}
    assert "recpipe/configs/train.yaml" in configs and len(configs) > 10
    assert configs <= names
    assert {"recpipe/train/__main__.py", "recpipe/train/cli.py", "recpipe/train/torchrun.py",
            "recpipe/train/prepare_movielens.py", "recpipe/py.typed"} <= names
    # nothing of the checkout around the package: recpipe.train.movielens tells a wheel by it
    assert not [n for n in names if n.startswith(("recpipe/pyproject", "recpipe/scripts/",
                                                  "recpipe/tests/", "recpipe/data/"))]
    entry_points = _metadata(wheel, "entry_points.txt")
    assert re.search(r"^\[console_scripts\]\nrecpipe-torchrun = recpipe\.train\.torchrun:main\n"
                     r"recpipe-train = recpipe\.train\.cli:main$", entry_points, re.M), entry_points
    requires = re.findall(r"^Requires-Dist: (.+)$", _metadata(wheel, "METADATA"), re.M)
    hard = [r for r in requires if "extra ==" not in r]
    assert "torch>=2.11" in hard and "numpy" in hard
    assert not [r for r in hard if r.startswith(("torchrec", "fbgemm", "hydra", "nvidia"))], hard
    assert 'torchrec>=1.6; extra == "torchrec"' in requires
    assert 'hydra-core>=1.3; extra == "train"' in requires


def test_python_m_recpipe_train_gives_a_bad_override_one_line() -> None:
    r = subprocess.run([sys.executable, "-m", "recpipe.train", BAD], env=ENV, capture_output=True,
                       text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (1, "", f"error: {COMPOSE_ERRORS[BAD]}\n")


def test_from_the_wheel_the_command_finds_its_configs_before_loading_torch(
        site: Path, tmp_path: Path) -> None:
    """Outside the checkout, recpipe imported from the wheel's files: a key typo (the configs
    as a folder) and a bad value (Hydra's composition, then the checks) fail with one line and
    no torch."""
    env = {**ENV, "PYTHONPATH": str(site)}
    for override, line in ((BAD, f"error: {COMPOSE_ERRORS[BAD]}"),
                           ("trainer.steps=0", "error: trainer.steps=0: must be > 0")):
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "recpipe.train", override],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and r.stdout == "", r.stderr[-3000:]
        assert r.stderr.splitlines()[-1] == line
        imported = re.findall(r"^import time:.*\| +(\S+)$", r.stderr, re.M)
        assert "recpipe.train.cli" in imported
        assert [m for m in imported if m.split(".")[0] in ("torch", "torchrec", "fbgemm_gpu")] == []


WHERE = ("from recpipe.train import movielens as m\n"
         "print(m.__file__, m.CHECKOUT, m.DEFAULT_PATH, sep='\\n')\n"
         "try:\n"
         "    m.read_arrays(m.DEFAULT_PATH, m.ARRAYS_SHA256)\n"
         "except m.DataFileError as e:\n"
         "    print(e)\n")


def test_from_the_wheel_the_movielens_file_goes_to_the_user_cache(site: Path, tmp_path: Path) -> None:
    """``$RECPIPE_DATA_DIR``, else ``$XDG_CACHE_HOME/recpipe``; the missing file's line names
    this interpreter's ``-m recpipe.train.prepare_movielens``."""
    python = shlex.quote(sys.executable)
    for extra, directory in (({"RECPIPE_DATA_DIR": str(tmp_path / "mine")}, tmp_path / "mine"),
                             ({"XDG_CACHE_HOME": str(tmp_path / "cache")}, tmp_path / "cache" / "recpipe")):
        env = {k: v for k, v in ENV.items() if k not in ("RECPIPE_DATA_DIR", "XDG_CACHE_HOME")}
        r = subprocess.run([sys.executable, "-c", WHERE], cwd=site, capture_output=True, text=True,
                           env={**env, "PYTHONPATH": str(site), **extra}, timeout=120)
        assert r.returncode == 0, r.stderr
        module, checkout, path, error = r.stdout.splitlines()
        assert Path(module).is_relative_to(site) and checkout == "False"
        assert path == str(directory.resolve() / "movielens100k.npz")
        assert error == f"{path} is missing: build it with {python} -m recpipe.train.prepare_movielens"


class _Overrides:
    """``HydraConfig.get()`` of a run started with ``data=synthetic trainer.resume=true``."""

    @staticmethod
    def get() -> SimpleNamespace:
        return SimpleNamespace(overrides=SimpleNamespace(task=["data=synthetic", "trainer.resume=true"]))


@pytest.mark.parametrize(
    "spec, argv0, torchrun, started",
    [
        (ModuleSpec("recpipe.train.__main__", None), "/src/recpipe/train/__main__.py", False,
         ["{python}", "-m", "recpipe.train"]),
        (None, "/venv/bin/recpipe-train", False, ["/venv/bin/recpipe-train"]),
        (None, "scripts/train.py", False, ["{python}", "scripts/train.py"]),
        (ModuleSpec("recpipe.train.__main__", None), "/src/recpipe/train/__main__.py", True,
         ["{python}", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
          "recpipe.train"]),
        (None, "/venv/bin/recpipe-train", True,
         ["{python}", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
          "/venv/bin/recpipe-train"]),
    ],
)
def test_the_resume_command_repeats_how_the_run_was_started(
        monkeypatch: pytest.MonkeyPatch, spec: ModuleSpec | None, argv0: str, torchrun: bool,
        started: list[str]) -> None:
    """``python -m recpipe.train``, the ``recpipe-train`` script, ``python scripts/train.py``;
    under torchrun its module (``-m``) or script."""
    monkeypatch.setitem(sys.modules, "__main__", SimpleNamespace(__spec__=spec))
    monkeypatch.setattr(sys, "argv", [argv0, "data=synthetic", "trainer.resume=true"])
    monkeypatch.setattr(cli, "HydraConfig", _Overrides)
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)  # (plain torchrun's command)
    world = "2" if torchrun else "1"
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", world)
    if torchrun:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    expected = [x.format(python=sys.executable) for x in started]
    assert shlex.split(cli._resume_command("/ck")) == [
        *expected, "data=synthetic", "trainer.checkpoint_dir=/ck", "trainer.resume=true"]


def test_pip_install_into_a_torchrec_environment_then_recpipe_train(wheel: Path, tmp_path: Path) -> None:
    """The README's install: plain ``pip install <wheel>[train]`` into a fresh venv that already
    holds torch and torchrec (this one's packages, seen through a .pth) installs only recpipe
    (no index: nothing to fetch), and its ``recpipe-train`` trains MovieLens from elsewhere."""
    import site as site_module
    import venv

    env_dir = tmp_path / "user"
    venv.create(env_dir, with_pip=False)
    (inner,) = env_dir.glob("lib/python*/site-packages")
    outer = [p for p in site_module.getsitepackages() if Path(p, "torchrec").is_dir()]
    (inner / "torchrec-env.pth").write_text("\n".join(outer) + "\n")
    python = env_dir / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                        "--disable-pip-version-check", "--no-index", f"{wheel}[train]"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name.split("-")[0] for p in inner.glob("*.dist-info")) == ["recpipe"]
    where = subprocess.run([python, "-c", "import recpipe; print(recpipe.__file__)"],
                           capture_output=True, text=True, timeout=60).stdout.strip()
    assert Path(where).is_relative_to(inner)  # the wheel's, not this checkout's
    r = subprocess.run([env_dir / "bin" / "recpipe-train", "trainer.steps=5", f"output_dir={tmp_path}/out"],
                       cwd=tmp_path, env={**ENV, "RECPIPE_DATA_DIR": str(ROOT / "data")},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done: loss" in r.stderr + r.stdout
