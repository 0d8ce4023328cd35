"""The checkout and the test log after the README's own commands (issue 40): what those commands
write into the checkout is git-ignored; the test log shows recpipe's own warnings, not
torchrec's, fbgemm's or DCP's; the multi-rank tests' rendezvous cannot lose its port to another
test worker."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import dist_utils
import pytest
import torch.distributed as dist
from dist_utils import run_ranks

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

#: written by the set-up, train and test commands wherever their folders are not given
DEFAULT_OUTPUTS = {".venv", ".venv-1.8", ".venv-1.8.log", "data/movielens100k.npz", "outputs",
                   "multirun", ".pytest_cache", ".hypothesis"}


def readme_written_paths() -> set[str]:
    """The relative paths that the README's shell lines name as where they write: pip's wheel
    folder (``-w``), the training app's checkpoint and output folders (absolute paths and
    ``$VARIABLES`` are the user's)."""
    lines = re.findall(r"^    (\S.*)$", README, re.M)
    pattern = r"(?:\s-w\s+|\b(?:checkpoint|output)_dir=)([^\s/$][^\s]*)"
    return {m for line in lines for m in re.findall(pattern, line)}


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="not a git checkout")
def test_what_the_readme_commands_write_is_git_ignored() -> None:
    """``git status`` stays clean after the README's commands: ``dist/`` (the wheel) and ``ck/``
    (the stop-and-resume example's checkpoints) were left untracked."""
    written = readme_written_paths()
    assert {"dist", "ck"} <= written  # the README's wheel and checkpoint commands were found
    # a file inside each: a folder pattern (``dist/``) matches a path below it
    paths = [f"{p}/x" for p in written | DEFAULT_OUTPUTS]
    r = subprocess.run(["git", "check-ignore", "--no-index", "--verbose", "--non-matching",
                        *paths], cwd=ROOT, capture_output=True, text=True)
    # one line per path: "SOURCE:LINE:PATTERN<tab>PATH", "::<tab>PATH" where none matches
    lines = dict(line.split("\t")[::-1] for line in r.stdout.splitlines())
    assert sorted(lines) == sorted(paths), r.stderr
    assert [p for p, rule in lines.items() if rule == "::"] == []


def test_the_readme_opens_with_what_where_and_how_to_install() -> None:
    """Its first screen says what recpipe is, shows one table and one plot against torchrec's
    pipelines, then how to install it; the figures' provenance (commits, runs, caveats) is in a
    linked report, not there."""
    first = README[:README.index("\n## Install")]
    lines = first.splitlines()
    assert len(lines) <= 40
    (rule,) = [i for i, line in enumerate(lines) if line.startswith("|---")]  # one table
    for name in ("`TrainPipelineSparseDist`", "`TrainPipelineBase`",
                 "`TrainPipelineSparseDistLite`", "recpipe"):
        assert name in lines[rule - 1]
    assert first.count("![") == 1
    assert re.findall(r"\b[0-9a-f]{7,40}\b", first) == []  # no commit hashes
    links = re.findall(r"\]\(([^)#]+)\)", first)
    assert any(link.startswith("docs/results/") and link.endswith(".md") for link in links)
    assert [link for link in links if not (ROOT / link).exists()] == []


#: a test that imports and runs what warns in the suite (fbgemm's import, torchrec's planner,
#: DistributedModelParallel and optimizer-in-backward, DCP on ShardedTensors, torchmetrics),
#: then warns as recpipe would
PROBE = '''
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torchmetrics  # noqa: F401 (its import warns about distutils)
from recpipe.testing.synthetic import ModelSpec, build_sharded


def test_third_party_warnings_and_ours(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, _ = build_sharded(ModelSpec(), ["table_wise"], torch.device("cpu"), dist.group.WORLD)
        dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "ck"))
        dcp.load(model.state_dict(), checkpoint_id=str(tmp_path / "ck"))
    finally:
        dist.destroy_process_group()
    warnings.warn_explicit("recpipe's own warning", FutureWarning, "sparse_dist.py", 1,
                           module="recpipe.pipeline.sparse_dist")
'''


def test_the_test_log_shows_recpipes_own_warnings_only(tmp_path: Path) -> None:
    """pytest under this checkout's settings (pyproject.toml's ``filterwarnings``): of the
    probe's warnings only recpipe's is in the log; no third-party file, no colour code."""
    (tmp_path / "test_probe.py").write_text(PROBE)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
         str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert "FutureWarning: recpipe's own warning" in log and "1 passed, 1 warning" in log
    assert "site-packages" not in log and "\x1b[" not in log, log[-3000:]


def _world_size(rank: int, world: int, device: object) -> int:
    return dist.get_world_size()


def test_the_rank_pool_binds_its_own_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks' rendezvous (a TCPStore on port 0, opened by the test's process) binds its port
    itself: a port that another test worker takes between a pick and the bind (``EADDRINUSE``
    under ``pytest -n 4``) cannot reach it. Here every port picked is taken already."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(dist_utils, "free_port", lambda: taken.getsockname()[1])
        assert run_ranks(1, _world_size, timeout=120) == [1]


def test_free_port_is_below_the_ephemeral_range() -> None:
    """``free_port`` (a port that a program binds later: torchrun's rendezvous, an example's
    ``MASTER_PORT``) draws outside the range the kernel gives ``bind(0)`` and outgoing
    connections, from which the other test workers take theirs."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {dist_utils.free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1
