"""Config keys as the command line sees them (issue 40, cases 5 and 11): a key added with ``+``
that the schema lacks fails in one line naming the closest key, before torch is imported; and
``--help`` lists the groups without Hydra's ``*_schema`` entries and every key with this command
line's value and its help (the dataclass fields' ``help`` metadata)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from recpipe.train.config import (DataConfig, HardwareConfig, ModelConfig, PipelineConfig,
                                  ShardingConfig, TrainConfig, TrainerConfig, composition_error,
                                  register)

register()  # the schemas the configs extend
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "scripts" / "train.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
GROUPS = {"model": ModelConfig, "data": DataConfig, "sharding": ShardingConfig,
          "pipeline": PipelineConfig, "hardware": HardwareConfig, "trainer": TrainerConfig}

ADDED = {  # a key added with + or ++: the line composition_error gives
    "+trainer.stepz=3": "no config key 'trainer.stepz': did you mean trainer.steps?",
    "++model.dimm=8": "no config key 'model.dimm': did you mean model.dim?",
    "+data.zzz=1": "no config key 'data.zzz': the keys are data.batch_size, data.dense_in, "
                   "data.eval_fraction, data.label_scope, data.max_history, data.path, "
                   "data.pooling, data.schema, data.seed, data.zipf",
    "+outptu_dir=x": "no top-level config key 'outptu_dir': did you mean output_dir?",
}


def test_a_key_added_with_plus_fails_naming_the_closest_key_before_torch_loads() -> None:
    for override, message in ADDED.items():
        assert composition_error(str(ROOT / "configs"), "train", [override]) == message
    assert composition_error(str(ROOT / "configs"), "train", ["++trainer.steps=3"]) is None
    run = ("import sys; from recpipe.train.cli import main; sys.argv[1:] = ['+trainer.stepz=3']\n"
           "try: main()\nexcept SystemExit as e: print(e.code, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", run], env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert (r.stdout, r.stderr) == ("1 False\n", f"error: {ADDED['+trainer.stepz=3']}\n")


def test_help_lists_the_options_and_every_key_with_its_help() -> None:
    r = subprocess.run([sys.executable, SCRIPT, "data=synthetic", "trainer.steps=7", "--help"],
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "_schema" not in r.stdout, r.stdout
    lines = r.stdout.splitlines()
    keys = [(f.name, f.metadata["help"]) for f in fields(TrainConfig) if f.name not in GROUPS]
    keys += [(f"{group}.{f.name}", f.metadata["help"])
             for group, schema in GROUPS.items() for f in fields(schema)]
    for key, help in keys:  # KEY=VALUE, then its help, on one line
        assert help and "\n" not in help, key
        assert any(re.fullmatch(rf"{re.escape(key)}=\S+ +{re.escape(help)}", x) for x in lines), key
    for shown in ("data=synthetic ", "trainer.steps=7 ", "data.schema=synthetic ",  # this command
                  "model.over_arch=[64,32] ", "trainer.checkpoint_dir=null "):  # line's values
        assert any(x.startswith(shown) for x in lines), shown
    data = next(x for x in lines if x.startswith("data="))
    assert data.endswith(": criteo, criteo_tsv, large_batch, movielens, synthetic"), data
