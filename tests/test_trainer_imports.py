"""trainer/ has no import cycle, the task registry and the reward package import one way:
verifiers and the judge <- the task registry (trainer.tasks) <- dispatch <- the pool and its workers,
and the rollout mechanism and the engines never import the pilot that advises on them.

The graph is read from every module's syntax tree, imports inside functions included, with the
checker of tests/web/test_import_graph.py. The registry and reward modules are also each
imported first in a fresh interpreter: a package that re-exports a module which imports back
into a package still being initialised fails only in some import orders.

The layout shows the architecture: nothing at trainer/'s root but the entry point, every package
says its job in its docstring, and no module of trainer/ or webapp/ outgrows a reading."""
from __future__ import annotations

import ast
import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKER = ROOT / "tests" / "web" / "test_import_graph.py"


@functools.cache
def _checker():
    """tests/web/test_import_graph.py, loaded as a module of its own and pointed at trainer/."""
    spec = importlib.util.spec_from_file_location("_trainer_import_graph", CHECKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.PACKAGE = "trainer"
    return module


def trainer_graph() -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    return _checker().parsed_graph()


def test_trainer_has_no_import_cycle():
    graph, modules = trainer_graph()
    assert "trainer.tasks" in graph and "trainer.rewards.pool" in graph   # it read the tree
    checker = _checker()
    cycles = checker.find_cycles(graph)
    assert not cycles, "import cycles in trainer/:\n" + "\n".join(
        checker.describe(c, graph, modules, ROOT) for c in cycles)


def test_the_registry_sits_between_the_verifiers_and_the_pool():
    graph, _ = trainer_graph()
    tasks = [m for m in graph if m.startswith("trainer.tasks.")]
    assert tasks and not [m for m in tasks if "trainer.tasks" in graph[m]], \
        "a task module imports the registry that imports it"
    for low in ("trainer.rewards.judge", "trainer.rewards.verifiers"):
        assert not [d for d in graph[low] if d.startswith("trainer.tasks")], f"{low} imports a task"
    assert "trainer.rewards.verifiers" in graph["trainer.tasks"]
    assert not [d for d in graph["trainer.tasks"] if d.startswith("trainer.rewards.")
                and d != "trainer.rewards.verifiers"], "the registry imports more than the verifiers"
    assert "trainer.tasks" in graph["trainer.rewards.dispatch"]
    assert graph["trainer.rewards"] == {}, "trainer/rewards/__init__.py must re-export nothing"


def test_the_rollout_mechanism_and_the_engines_do_not_import_the_pilot():
    """The pilot (trainer/pilot/) advises by reading what the rollout and the engines report:
    the mechanism never depends on its advisor (async.auto_staleness's verdict lives in
    trainer/rollout/auto_staleness.py, and the pilot's eta rules read it from there)."""
    graph, modules = trainer_graph()
    assert "trainer.rollout.asynchronous" in graph and "trainer.pilot.staleness" in graph
    wrong = [f"{modules[m].relative_to(ROOT)}:{line} imports {d}"
             for m in sorted(graph) if m.split(".")[:2] in (["trainer", "rollout"], ["trainer", "engine"])
             for d, line in sorted(graph[m].items())
             if d == "trainer.pilot" or d.startswith("trainer.pilot.")]
    assert not wrong, "the rollout mechanism imports its advisor:\n" + "\n".join(wrong)


@pytest.mark.parametrize("module", sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for pkg in ("tasks", "rewards") for p in (ROOT / "trainer" / pkg).glob("*.py")))
def test_each_registry_and_reward_module_imports_first_in_a_fresh_interpreter(module):
    out = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


# The trainer's root holds only the entry point; everything else lives in a package named for its
# job (run/, rollout/, algo/, engine/, cluster/, observe/, ...), each saying that job first.
ROOT_MODULES = {"__init__.py", "__main__.py"}
DATA_DIRS = {"assets", "presets", "__pycache__"}
MAX_MODULE_LINES = 600


def test_the_trainer_root_holds_no_module_beyond_its_entry_point():
    found = {p.name for p in (ROOT / "trainer").glob("*.py")}
    assert "__main__.py" in found   # it looked in the right place
    assert found <= ROOT_MODULES, (
        f"modules at trainer/'s root: {sorted(found - ROOT_MODULES)}; put each in the package of its job")


def test_every_trainer_package_says_its_job_in_its_docstring():
    packages = [p for p in (ROOT / "trainer").rglob("*") if p.is_dir() and not DATA_DIRS & set(p.parts)]
    assert len(packages) >= 10   # it walked the tree
    missing = [str(p.relative_to(ROOT)) for p in packages
               if not (p / "__init__.py").exists() or not ast.get_docstring(ast.parse((p / "__init__.py").read_text()))]
    assert not missing, "packages without a docstring in __init__.py: " + ", ".join(missing)


def test_no_python_module_is_over_the_size_a_reader_takes_in():
    sources = [p for top in ("trainer", "webapp") for p in (ROOT / top).rglob("*.py") if "migrations" not in p.parts]
    assert len(sources) > 100
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sources
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, f"over {MAX_MODULE_LINES} lines, split by job:\n" + "\n".join(long)
