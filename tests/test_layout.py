"""The house: the product packages (recpipe.pipeline, .kjt, .ops) stand alone, the app, the
test model and the benchmarks import them and never the other way; no file edits sys.path;
values that several packages need are defined once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_product_loads_no_hydra_no_app_no_bench_no_test_model() -> None:
    bad = ("sorted(m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf')"
           " or m.startswith(('recpipe.train', 'recpipe.bench', 'recpipe.testing')))")
    code = (  # then the app, in the same process (CI's time): the check can fail, Hydra loads
        f"import sys, recpipe.pipeline, recpipe.kjt, recpipe.ops\nprint(','.join({bad}))\n"
        f"import recpipe.train.config\nprint(','.join({bad}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    product, app = r.stdout.splitlines()
    assert product == "", f"the product imported {product}"
    assert "hydra" in app


def test_no_file_edits_sys_path() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for folder in ("tests", "scripts", "examples", "bench", "train", "testing")
        for p in (ROOT / folder).rglob("*.py")
        if "sys.path" + ".insert" in p.read_text() or "sys.path" + ".append" in p.read_text()
    ]
    assert offenders == []


def test_scripts_are_entry_points_importing_no_sibling_script() -> None:
    """What several scripts share lives in recpipe.bench, never in a script imported as a
    module (which only works when Python happens to put scripts/ on its path)."""
    import re

    siblings = {p.stem for p in (ROOT / "scripts").glob("*.py")}
    for p in (ROOT / "scripts").glob("*.py"):
        imported = set(re.findall(r"^(?:from|import) (\w+)", p.read_text(), re.M))
        assert imported & siblings == set(), p.name


def test_link_bandwidth_defaults_are_the_topology_module_s() -> None:
    from recpipe.pipeline.topology import INTER_NODE_GB_S, INTRA_NODE_GB_S
    from recpipe.train.config import HardwareConfig

    assert (HardwareConfig.intra_node_gb_s, HardwareConfig.inter_node_gb_s) == (
        INTRA_NODE_GB_S, INTER_NODE_GB_S)


def test_hydra_model_presets_are_the_bench_configs() -> None:
    """``model=NAME`` trains the tables of ``recpipe.bench.configs.CONFIGS[NAME]`` (batch and
    pooling are the data's in the app)."""
    import yaml

    from recpipe.bench.configs import CONFIGS

    keys = ("num_tables", "rows", "dim", "weighted", "sequence")
    for name, spec in CONFIGS.items():
        preset = yaml.safe_load((ROOT / "configs" / "model" / f"{name}.yaml").read_text())
        assert {k: preset[k] for k in keys} == {k: getattr(spec, k) for k in keys}, name
        assert tuple(preset.get("over_arch", [64])) == spec.over_arch, name


def test_hot_path_names_what_the_code_has_in_short_rows() -> None:
    """docs/hot_path.md: every recpipe function, class or plan field it names in backticks exists
    (in pipeline/ or kjt/), and each row of its table fits in three 100-character lines."""
    import re

    text = (ROOT / "docs" / "hot_path.md").read_text()
    code = "\n".join(p.read_text() for d in ("pipeline", "kjt") for p in (ROOT / d).glob("*.py"))
    rows = [line for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    recpipes = " ".join(row.split(" | ")[2] for row in rows)  # the column "recpipe acts in"
    names = set(re.findall(r"`(_?[A-Z][A-Za-z]+|_[a-z_]+)`", recpipes))
    assert len(names) >= 8, names
    missing = [n for n in names if not re.search(rf"\b(def|class) {n}\b", code)]
    assert missing == []
    assert rows and max(len(r) for r in rows) <= 300
