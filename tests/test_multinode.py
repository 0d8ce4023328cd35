"""Past one host: the training job (recpipe's pipeline) under torchrun as two "nodes" of 1
process on this machine (c10d rendezvous on localhost) trains to the losses of one node of 2
(torchrec's pipeline)
(the layouts: tests/test_topology.py; recpipe against torchrec on 4 ranks:
tests/test_pipeline_parity.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dist_utils import free_port
from test_train import ROOT, SYNTHETIC

RUN = (*SYNTHETIC, "trainer.steps=20", "trainer.log_interval=5", "trainer.eval=false",
       "trainer.checkpoint=false")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}



def _torchrun(*launch: str, out: Path) -> subprocess.Popen:
    """recpipe-torchrun with ``launch``: its options, then overrides (``pipeline=...``)."""
    options = [x for x in launch if x.startswith("--")]
    overrides = [x for x in launch if not x.startswith("--")]
    return subprocess.Popen(
        [sys.executable, "-m", "recpipe.train.torchrun", *options,
         str(ROOT / "scripts/train.py"), *RUN, *overrides, f"output_dir={out}"],
        cwd=out.parent, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _losses(out: Path) -> list[float]:
    (run,) = out.iterdir()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_recpipe_on_two_nodes_matches_torchrec_on_one_node(tmp_path: Path) -> None:
    """recpipe on two torchrun "nodes" of 1 process, torchrec on one node of 2: the same losses
    (torchrun, the node layout and the pipelines' parity in one run: CI's time)."""
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        _torchrun("--nnodes=2", f"--node-rank={i}", "--nproc-per-node=1", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint={endpoint}", "--rdzv-id=multinode-test",
                  out=tmp_path / "two")
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in nodes]
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-3000:] for o in outputs)
    assert "(world size 2: 2 nodes x 1 rank(s), cpu)" in outputs[0]  # rank 0's log: the layout
    one = _torchrun("--standalone", "--nproc-per-node=2", "pipeline=torchrec", out=tmp_path / "one")
    output = one.communicate(timeout=600)[0]
    assert one.returncode == 0, output[-3000:]
    two_nodes, one_node = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    assert len(two_nodes) == 4 and two_nodes == one_node and two_nodes[-1] < two_nodes[0]
