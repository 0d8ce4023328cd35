"""torchrec's own TrainPipelineSparseDist tests, run against torchrec's class and against recpipe's.

    python scripts/torchrec_pipeline_tests.py --tests DIR
    python scripts/torchrec_pipeline_tests.py --tests DIR --pipeline recpipe -k test_custom_fwd
    python scripts/torchrec_pipeline_tests.py --tests DIR -- -x -v        # more pytest arguments

The test files are torchrec's, not recpipe's, and torchrec's wheel ships none of them: fetch them
yourself from torchrec's source tree at the commit of the installed torchrec, keep them out of
recpipe's git tree (their licence is torchrec's) and lay them out under DIR as in that tree (no
__init__.py needed):

    DIR/torchrec/distributed/train_pipeline/tests/test_train_pipelines.py
    DIR/torchrec/distributed/train_pipeline/tests/test_train_pipelines_base.py
    DIR/torchrec/distributed/tests/test_fp_embeddingbag_utils.py
    DIR/torchrec/distributed/tests/test_sequence_model.py  (the wheel's test_sharding imports it)

Each pipeline runs pytest on test_train_pipelines.py in a fresh process (default -k: the test
classes that build TrainPipelineSparseDist itself). In those processes, and in the multiprocessing
workers of the multi-GPU tests (they re-run this file as their main module), the two test packages
import from DIR; in recpipe's run, importing them first rebinds TrainPipelineSparseDist in
torchrec.distributed, torchrec.distributed.train_pipeline and its train_pipelines module to
recpipe's class, so the tests import and build recpipe's (a line per run shows the torchrec it
imported and where the name points). torchrec's subclasses (PrefetchTrainPipelineSparseDist,
TrainPipelineSemiSync, ...) still derive from torchrec's class: only tests that build
TrainPipelineSparseDist itself test recpipe.
Hypothesis runs derandomized without its example database, so both runs draw the same examples.

Then a table of each test's outcome per pipeline. Exit status: 1 where a test's outcome differs
between the pipelines (with one --pipeline: where a test failed), 2 on a usage error such as a
missing test file.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import subprocess
import sys
import tempfile
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

TESTS = Path("torchrec/distributed/train_pipeline/tests")
TEST_FILE = TESTS / "test_train_pipelines.py"
#: what --tests must hold: the tests, their base class, and the wheel-less modules they import
REQUIRED = (TEST_FILE, TESTS / "test_train_pipelines_base.py",
            Path("torchrec/distributed/tests/test_fp_embeddingbag_utils.py"),
            Path("torchrec/distributed/tests/test_sequence_model.py"))
#: torchrec's test packages (absent from its wheel), imported from their folders under --tests
PACKAGES = {"torchrec.distributed.tests": Path("torchrec/distributed/tests"),
            "torchrec.distributed.train_pipeline.tests": TESTS}
TEST_MODULE = "torchrec.distributed.train_pipeline.tests.test_train_pipelines"
BASE_MODULE = "torchrec.distributed.train_pipeline.tests.test_train_pipelines_base"
#: the modules whose name TrainPipelineSparseDist recpipe's run rebinds
HOLDERS = ("torchrec.distributed", "torchrec.distributed.train_pipeline",
           "torchrec.distributed.train_pipeline.train_pipelines")
NAME = "TrainPipelineSparseDist"
#: the classes whose tests build TrainPipelineSparseDist itself (the -k substring
#: TrainPipelineSparseDistTest also matches PrefetchTrainPipelineSparseDistTest: left out)
DEFAULT_K = ("(TrainPipelineSparseDistTest or TrainPipelineSparseDist2DShardingTest"
             " or TrainPipelineAttachDetachTest or TrainPipelineGPUTest) and not Prefetch")
PIPELINES = ("torchrec", "recpipe")
ENV_DIR = "RECPIPE_TORCHREC_TESTS"
ENV_PIPELINE = "RECPIPE_TORCHREC_TESTS_PIPELINE"


def swap_in_recpipe() -> None:
    """Rebind torchrec's name ``TrainPipelineSparseDist`` to recpipe's class (which subclasses
    torchrec's, imported here before the rebinding)."""
    from recpipe.pipeline import TrainPipelineSparseDist

    for name in HOLDERS:
        setattr(importlib.import_module(name), NAME, TrainPipelineSparseDist)


class _TestsPackage(importlib.abc.Loader):
    """One of torchrec's test packages, over its folder under --tests; in recpipe's run, executing
    it (which precedes importing any module in it) first swaps recpipe's class in."""

    def __init__(self, recpipe: bool) -> None:
        self.recpipe = recpipe

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module

    def exec_module(self, module: object) -> None:
        if self.recpipe:
            swap_in_recpipe()


class _TestsFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path, recpipe: bool) -> None:
        self.root, self.recpipe = root, recpipe

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        folder = PACKAGES.get(fullname)
        if folder is None:
            return None
        loader = _TestsPackage(self.recpipe)
        spec = importlib.machinery.ModuleSpec(fullname, loader, is_package=True)
        spec.submodule_search_locations = [str(self.root / folder)]
        return spec


def install(root: str, pipeline: str) -> None:
    """Import torchrec's test packages from ``root`` (recpipe's class swapped in where asked)."""
    if not any(isinstance(f, _TestsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TestsFinder(Path(root), pipeline == "recpipe"))


if os.environ.get(ENV_DIR):  # a run's pytest process, or a multiprocessing worker of it
    install(os.environ[ENV_DIR], os.environ.get(ENV_PIPELINE, "torchrec"))


def _message(report: object) -> str:
    """A report's one-line reason: a skip's reason, or a failure's crash message."""
    longrepr = getattr(report, "longrepr", None)
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        text = str(longrepr[2])
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(longrepr or "")
    lines = text.strip().splitlines()
    return lines[0][:200] if lines else ""


class _Outcomes:
    """pytest plugin: each test's outcome (a setup or teardown failure counts as an error)."""

    def __init__(self) -> None:
        self.tests: dict[str, dict[str, str]] = {}

    def pytest_collectreport(self, report: object) -> None:
        if report.failed:
            self.tests[report.nodeid] = dict(outcome="error", message=_message(report))

    def pytest_runtest_logreport(self, report: object) -> None:
        test = self.tests.setdefault(report.nodeid, dict(outcome="passed", message=""))
        if report.when == "call":
            if hasattr(report, "wasxfail"):
                outcome = "xfailed" if report.skipped else "xpassed"
            else:
                outcome = report.outcome
            if test["outcome"] == "passed":
                test["outcome"] = outcome
        elif report.failed:
            outcome = "error"
            test["outcome"] = "error"
        elif report.skipped:
            outcome = test["outcome"] = "skipped"
        else:
            return
        if outcome != "passed" and not test["message"]:
            test["message"] = _message(report)


def where_the_name_points() -> dict[str, str]:
    """For the test modules and torchrec's modules: the class ``TrainPipelineSparseDist`` names."""
    found = {}
    for name in (TEST_MODULE, BASE_MODULE, *HOLDERS):
        cls = getattr(sys.modules[name], NAME)
        found[name] = f"{cls.__module__}.{cls.__qualname__}"
    return found


def run_one(a: argparse.Namespace, root: Path) -> int:
    """One pipeline's pytest run, in this process; writes the outcomes to ``--report``."""
    import pytest
    from hypothesis import settings

    settings.register_profile("recpipe-compare", database=None, derandomize=True)
    settings.load_profile("recpipe-compare")  # before the tests' @settings read it
    report: dict = dict(pipeline=a.run_one, tests={}, swap={}, error=None, exit=None)
    try:
        importlib.import_module(TEST_MODULE)  # by torchrec's name, as spawned workers import it
        report["swap"] = where_the_name_points()
        torchrec = sys.modules["torchrec"]  # what the tests imported (PYTHONPATH may shadow)
        report["torchrec"] = f"torchrec {torchrec.__version__} ({Path(torchrec.__file__).parent})"
    except Exception:
        report["error"] = traceback.format_exc()
        Path(a.report).write_text(json.dumps(report))
        print(report["error"], file=sys.stderr)
        return 3
    points = set(report["swap"].values())
    ok = all(p.startswith("recpipe.") == (a.run_one == "recpipe") for p in points)
    print(f"[{a.run_one}] {report['torchrec']}; {NAME} is {', '.join(sorted(points))} in "
          f"{', '.join(report['swap'])}{'' if ok else ': NOT the class asked for'}", flush=True)
    if not ok:
        report["error"] = f"{NAME} is {', '.join(sorted(points))} in the {a.run_one} run"
        Path(a.report).write_text(json.dumps(report))
        return 3
    plugin = _Outcomes()
    with tempfile.TemporaryDirectory() as tmp:
        ini = Path(tmp) / "pytest.ini"  # none of the repo's settings: torchrec's tests as they are
        ini.write_text("[pytest]\nfilterwarnings =\n"  # pytest's notes on torchrec's Test* classes
                       "    ignore::pytest.PytestCollectionWarning\n"
                       "    ignore::pytest.PytestAssertRewriteWarning\n")
        # importlib mode with rootdir DIR: pytest names the test module as torchrec does, finds
        # it imported above and uses it
        args = [str(root / TEST_FILE), "-k", a.k, "-c", str(ini), f"--rootdir={root}",
                f"--confcutdir={root}", "--import-mode=importlib", "-p", "no:cacheprovider", "-q",
                "-rfE", *a.pytest_args]
        report["exit"] = int(pytest.main(args, plugins=[plugin]))
    report["tests"] = plugin.tests
    Path(a.report).write_text(json.dumps(report))
    return report["exit"]


def installed_torchrec() -> str:
    """"torchrec X.Y.Z" as installed, for the errors."""
    try:
        return f"torchrec {version('torchrec')}"
    except PackageNotFoundError:
        return "the installed torchrec"


def tests_root(arg: str | None) -> tuple[Path | None, str]:
    """The folder holding torchrec's test files, or None and the one-line error naming the fix."""
    source = f"torchrec's source tree at {installed_torchrec()}"
    if not arg:
        return None, (f"error: --tests DIR is required: a folder holding torchrec's test files "
                      f"from {source} (see --help for the files)")
    d = Path(arg).resolve()
    if d.is_dir() and d.parts[-len(TESTS.parts):] == TESTS.parts and (d / TEST_FILE.name).is_file():
        d = d.parents[len(TESTS.parts) - 1]  # DIR given as the tests folder itself
    if not d.is_dir():
        return None, (f"error: --tests {arg}: no such directory: fetch torchrec's test files "
                      f"from {source} into it (see --help for the files)")
    missing = [str(p) for p in REQUIRED if not (d / p).is_file()]
    if missing:
        return None, f"error: --tests {arg} lacks {', '.join(missing)}: copy from {source}"
    return d, ""


def table(results: dict[str, dict]) -> tuple[list[str], int, int]:
    """Markdown rows of each test's outcome per pipeline, a count per outcome, and how many
    tests there are and how many of them differ."""
    names = list(results)
    ids = sorted({t for r in results.values() for t in r["tests"]})
    prefix = f"{TEST_FILE.as_posix()}::"
    rows = [f"| test | {' | '.join(names)} |" + (" differs |" if len(names) > 1 else ""),
            "|---" * (len(names) + 1 + (len(names) > 1)) + "|"]
    differing, notes = 0, []
    for t in ids:
        outcomes = [results[n]["tests"].get(t, {}).get("outcome", "absent") for n in names]
        differs = len(set(outcomes)) > 1
        differing += differs
        rows.append(f"| {t.removeprefix(prefix)} | {' | '.join(outcomes)} |"
                    + ((" **yes** |" if differs else " |") if len(names) > 1 else ""))
        if differs:
            for n, o in zip(names, outcomes):
                why = results[n]["tests"].get(t, {}).get("message", "")
                notes.append(f"  {t.removeprefix(prefix)} [{n}] {o}" + (f": {why}" if why else ""))
    counts = []
    for n in names:
        tally: dict[str, int] = {}
        for t in results[n]["tests"].values():
            tally[t["outcome"]] = tally.get(t["outcome"], 0) + 1
        counts.append(f"{n}: {len(results[n]['tests'])} tests"
                      + "".join(f", {k} {v}" for k, v in sorted(tally.items())))
    lines = rows + [""] + counts + (["", "where they differ:", *notes] if notes else [])
    return lines, len(ids), differing


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tests", default=None, metavar="DIR",
                   help="the folder holding torchrec's test files (torchrec/distributed/...), "
                        "or that tests folder itself")
    p.add_argument("--pipeline", default="both", choices=(*PIPELINES, "both"),
                   help="whose TrainPipelineSparseDist the tests build; both: one run each, then "
                        "the outcomes compared (default: both)")
    p.add_argument("-k", default=DEFAULT_K, metavar="EXPR",
                   help="pytest -k expression selecting the tests (default: %(default)s)")
    p.add_argument("--run-one", default=None, choices=PIPELINES,
                   help="internal: run one pipeline's pytest in this process")
    p.add_argument("--report", default=None, help="internal: --run-one writes its outcomes here")
    p.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARGS",
                   help="more arguments for pytest, after --, e.g. -- -x -v")
    a = p.parse_args()
    root, error = tests_root(a.tests)
    if root is None:
        print(error, file=sys.stderr)
        sys.exit(2)
    if a.run_one:
        sys.exit(run_one(a, root))
    names = list(PIPELINES) if a.pipeline == "both" else [a.pipeline]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out = Path(tmp) / f"{name}.json"
            env = {**os.environ, ENV_DIR: str(root), ENV_PIPELINE: name}
            env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device notes)
            env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
            print(f"== {name}: pytest {root / TEST_FILE} -k '{a.k}'", flush=True)
            cmd = [sys.executable, str(Path(__file__).resolve()), f"--run-one={name}",
                   f"--tests={root}", "-k", a.k, f"--report={out}", "--", *a.pytest_args]
            try:
                rc = subprocess.run(cmd, env=env).returncode
            except KeyboardInterrupt:  # (the run got the Ctrl-C too and stopped)
                sys.exit(f"interrupted during the {name} run: no outcomes compared; run it again")
            if not out.exists():
                sys.exit(f"error: the {name} run exited {rc} before writing its outcomes")
            results[name] = json.loads(out.read_text())
            if results[name]["error"]:
                sys.exit(f"error: the {name} run could not import the tests (above); "
                         f"{results[name]['error'].strip().splitlines()[-1]}")
    lines, n_tests, differing = table(results)
    imported = sorted({r["torchrec"] for r in results.values()})
    print(f"\n{' and '.join(imported)}, {root / TEST_FILE}\n" + "\n".join(lines))
    if not any(r["tests"] for r in results.values()):
        sys.exit(f"error: -k '{a.k}' selected no test")
    if len(names) > 1:
        print(f"\n{differing} of {n_tests} tests' outcomes differ between "
              f"{' and '.join(names)}" if differing else
              f"\nevery test's outcome is the same for {' and '.join(names)}")
        sys.exit(1 if differing else 0)
    bad = [t for t in results[names[0]]["tests"].values() if t["outcome"] in ("failed", "error")]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
