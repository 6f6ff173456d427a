"""trainer/'s packages stand on floors and import only downward (FLOORS: config at the bottom, the
command line on top; the exceptions, each with its reason, only shrink); there is no import cycle;
the task registry and the reward package import one way:
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


# The floors of trainer/, bottom first: a module imports only from its own floor or below (imports
# inside functions included). A module's floor is the longest entry naming its package or itself;
# an entry below its package's (rewards.verifiers) is a part of that package that sits lower.
FLOORS = (
    "config",             # the one schema; a value's own syntax is its parameter type (values.py)
    "observe",            # recording: metric names and sinks, the timeline, clocks, telemetry
    "sandbox",            # where model-written code runs
    "models",             # local models, LoRA, tensors bound for a file
    "engine",             # the rollout engines (which one a run gets: run/engines.py)
    "cluster",            # torchrun's process group, FSDP2, launching
    "algo",               # what is learnt from scored groups (reads them as data, imports no driver)
    "episode",            # multi-turn episodes around an engine
    "rewards.judge",      # the code reward's verdict (the sandbox runs the code) ...
    "rewards.verifiers",  # ... and the verifiers: below the task registry that names them
    "tasks",              # the problems, their prompts, the one registry
    "rewards",            # dispatch and the reward pool, above the registry they score with
    "rollout",            # how a step's groups are produced (the scorer shapes rewards with algo/)
    "agents",             # agents' episodes over an OpenAI-compatible endpoint (a driver of groups)
    "invariants",         # the bounds checked on what a step trained, the data accounting
    "accounting",         # the accounts kept from the records: cost, forecast, estimate, inspector
    "pilot",              # the advisor, reading the metrics the others report
    "run",                # one run assembled and driven: engines, ranks, the step loop, warm-up
    "bench",              # the benchmarks, each a few runs side by side
    "cli",                # the command line, on top
)

# arrows up the floors that remain, each with its reason: (importer, imported) -> why. The list
# only shrinks: an entry that no longer occurs fails the test as well.
UPWARD_EXCEPTIONS: dict[tuple[str, str], str] = {}


def floor(module: str) -> int | None:
    """The index in FLOORS of `module`'s floor (None: trainer's root, the entry point above every
    floor, or a package on none)."""
    rest = module.removeprefix("trainer").lstrip(".")
    best = None
    for i, name in enumerate(FLOORS):
        if rest == name or rest.startswith(name + "."):
            if best is None or len(name) > len(FLOORS[best]):
                best = i
    return best


def test_every_trainer_package_stands_on_a_floor():
    graph, modules = trainer_graph()
    root = ROOT / "trainer"
    unplaced = sorted(m for m in graph if floor(m) is None and modules[m].parent != root)
    assert not unplaced, "modules on no floor (add their package to FLOORS): " + ", ".join(unplaced)
    assert len(FLOORS) == len(set(FLOORS))


def upward_imports() -> dict[tuple[str, str], str]:
    """{(importer, imported): "file:line"} for every import up the floors."""
    graph, modules = trainer_graph()
    out = {}
    for m in sorted(graph):
        for d, line in sorted(graph[m].items()):
            a, b = floor(m), floor(d)
            if a is not None and b is not None and b > a:
                out[(m, d)] = f"{modules[m].relative_to(ROOT)}:{line}"
    return out


def test_each_floor_imports_only_downward():
    """config at the bottom, the command line on top: no module imports from a floor above its
    own, lazy imports included, but for the documented exceptions."""
    up = upward_imports()
    wrong = [f"{where}: {a} (floor {FLOORS[floor(a)]}) imports {b} (floor {FLOORS[floor(b)]})"
             for (a, b), where in up.items() if (a, b) not in UPWARD_EXCEPTIONS]
    assert not wrong, "imports up the floors:\n" + "\n".join(wrong)
    gone = sorted(set(UPWARD_EXCEPTIONS) - set(up))
    assert not gone, f"exceptions that no longer occur (remove them): {gone}"


def test_the_floor_rule_can_fail():
    """The rule reads the floors the way the test means: an arrow up is one."""
    assert floor("trainer.config.values") == 0 and floor("trainer.cli.main") == len(FLOORS) - 1
    assert floor("trainer.rewards.verifiers") < floor("trainer.tasks") < floor("trainer.rewards.pool")
    assert floor("trainer.engine.sglang.client") < floor("trainer.run.engines")
    assert floor("trainer") is None


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
