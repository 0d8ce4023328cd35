"""recpipe's TrainPipelineSparseDist is a drop-in for torchrec's: a job written against
torchrec's class runs unchanged with the import swapped, generic subscripts and all."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist as TorchrecPipeline

import recpipe
from recpipe.pipeline import TrainPipelineSparseDist

# A user's job, written against torchrec (as torchrec's own pipeline tests annotate it).
JOB = '''
import torch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from recpipe.testing.synthetic import Batch, ModelSpec, batches, build_sharded


def job(device: torch.device, steps: int) -> list[float]:
    spec = ModelSpec()
    model, optimizer = build_sharded(spec, ["table_wise", "column_wise"], device,
                                     torch.distributed.group.WORLD, seed=1)
    pipeline: TrainPipelineSparseDist[Batch, torch.Tensor] = TrainPipelineSparseDist[
        Batch, torch.Tensor
    ](model, optimizer, device, execute_all_batches=True)
    it = batches(spec, steps, torch.distributed.get_rank(), seed=2)
    return [pipeline.progress(it)[0].item() for _ in range(steps)]
'''
SWAP = ("from torchrec.distributed.train_pipeline import TrainPipelineSparseDist",
        "from recpipe.pipeline import TrainPipelineSparseDist")


def _job(rank: int, world: int, device: torch.device, source: str) -> list[float]:
    namespace: dict = {}
    exec(compile(source, "job.py", "exec"), namespace)
    return namespace["job"](device, 6)


def test_torchrec_job_runs_with_the_import_swapped() -> None:
    theirs = run_ranks(1, _job, JOB)
    ours = run_ranks(1, _job, JOB.replace(*SWAP))
    assert ours == theirs and len(ours[0]) == 6


def test_generic_and_signature_match_torchrec() -> None:
    assert TrainPipelineSparseDist[int, torch.Tensor] is not None  # subscriptable like torchrec's
    mine = inspect.signature(TrainPipelineSparseDist.__init__).parameters
    theirs = inspect.signature(TorchrecPipeline.__init__).parameters
    assert list(theirs) == [p for p in mine if p in theirs]  # same order
    for name, p in theirs.items():
        assert mine[name].default == p.default, name


def test_option_missing_from_installed_torchrec_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torchrec without ``clear_data_dist_inputs`` (1.6): the default is dropped, a set value
    is refused with one line naming the option."""
    from recpipe.pipeline import compat

    params = dict(compat._PIPELINE_PARAMS)
    params.pop("clear_data_dist_inputs", None)  # as on torchrec 1.6
    monkeypatch.setattr(compat, "_PIPELINE_PARAMS", params)
    assert "clear_data_dist_inputs" not in compat.pipeline_options(clear_data_dist_inputs=False)
    with pytest.raises(TypeError, match="clear_data_dist_inputs=True needs a torchrec"):
        compat.pipeline_options(clear_data_dist_inputs=True)


def test_version_and_typed() -> None:
    assert recpipe.__version__.count(".") == 2
    assert (Path(recpipe.__file__).parent / "py.typed").is_file()
