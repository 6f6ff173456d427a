"""webapp/ has no import cycle: every module imports, and the graph of webapp.*
imports -- read from each module's syntax tree, so imports inside functions count too (an import
moved into a function to dodge a cycle is still a cycle) -- is a DAG."""
from __future__ import annotations

import ast
import functools
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "webapp"


def module_names(root: Path, package: str) -> dict[str, Path]:
    """{dotted module name: file} for every .py file under root/package."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module `name` names, or the longest known module it is inside of."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(root: Path, package: str) -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    """{module: {imported module: line of the first such import}}, webapp.* modules only; every
    import statement anywhere in a module (top level, functions, classes, conditionals)."""
    modules = module_names(root, package)
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:   # relative: from the module's package, `level` dots up
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                # `from a import b`: the module a.b when b is one, else the module a
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in modules else src for a in node.names]
            for t in targets:
                if t == package or t.startswith(package + "."):
                    dep = _resolve(t, modules)
                    if dep is not None:
                        graph[mod].setdefault(dep, node.lineno)
    return graph, modules


@functools.cache
def parsed_graph() -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    """import_graph(ROOT, PACKAGE), computed in a child interpreter. In CPython 3.11 ast.parse keeps
    its recursion counter in process-wide state (gh-106905, fixed in 3.12): a traceback formatted on
    another thread of this test process (3.11 parses source lines for its ^^^ markers) at the same
    moment makes it raise a spurious SystemError, as a CI run did while a live server logged."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
            "from test_import_graph import import_graph; g, m = import_graph(Path(sys.argv[2]), sys.argv[3]); "
            "print(json.dumps([g, {k: str(v) for k, v in m.items()}]))")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(ROOT), PACKAGE],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    graph, modules = json.loads(out.stdout)
    return graph, {k: Path(v) for k, v in modules.items()}


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Import cycles as paths a -> ... -> a: the strongly connected components (Tarjan), and in
    each one the shortest cycle through every one of its imports (self-imports count), so a
    tangle of modules is reported import by import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[set[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, {}):
                sccs.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)

    def shortest(src: str, dst: str, members: set[str]) -> list[str]:
        prev, queue = {src: None}, [src]
        for v in queue:
            if v == dst:
                break
            for w in sorted(graph.get(v, {})):
                if w in members and w not in prev:
                    prev[w] = v
                    queue.append(w)
        path, v = [], dst
        while v is not None:
            path.append(v)
            v = prev[v]
        return path[::-1]

    cycles: list[list[str]] = []
    for comp in sccs:
        for u in sorted(comp):
            for w in sorted(x for x in graph[u] if x in comp):
                loop = [u] + (shortest(w, u, comp) if w != u else [u])   # u -> w -> ... -> u
                ring = loop[:-1]
                k = ring.index(min(ring))
                canon = ring[k:] + ring[:k] + [min(ring)]
                if canon not in cycles:
                    cycles.append(canon)
    return sorted(cycles)


def describe(cycle: list[str], graph, modules, root: Path = ROOT) -> str:
    hops = []
    for a, b in zip(cycle, cycle[1:]):
        rel = modules[a].relative_to(root)
        hops.append(f"  {a} imports {b}  ({rel}:{graph[a][b]})")
    return " -> ".join(cycle) + "\n" + "\n".join(hops)


def test_every_module_of_webapp_imports():
    graph, modules = parsed_graph()
    assert "webapp.dashboard.actions" in modules and "webapp.settings" in modules
    for name in modules:
        importlib.import_module(name)


def test_webapp_has_no_import_cycle():
    graph, modules = parsed_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in webapp/:\n" + "\n".join(describe(c, graph, modules) for c in cycles)


def test_the_layers_import_one_way():
    """The actions layer imports no module that calls it; the checks it calls import no layer above."""
    graph, _ = parsed_graph()
    d = "webapp.dashboard."

    def members(name: str) -> list[str]:
        """The module `name`, or every module of the package `name`."""
        return [m for m in graph if m == d + name or m.startswith(d + name + ".")]

    def imports(name: str) -> set[str]:
        """What the module or package `name` imports from outside itself."""
        inside = members(name)
        return set().union(*(graph[m] for m in inside)) - set(inside)

    # the actions package: what any of its modules imports, outside the package
    actions = imports("actions")
    for caller in ("worker.alerts", "worker.telemetry", "worker.tasks", "worker.sweep", "pages", "api",
                   "live.consumers", "reports"):
        assert members(caller) and not set(members(caller)) & actions, f"actions imports {caller}"
    for checks in ("access.validation", "access.policy", "access.throttle", "errors"):
        assert d + "actions" not in graph[d + checks], f"{checks} imports actions"
    # the checks (access/) import no layer above them: not the actions, the worker, the live feed, the reports
    for above in ("actions", "worker", "live", "reports", "pages", "api", "rows"):
        assert not set(members(above)) & imports("access"), f"access/ imports {above}"
    # validation is pure (settings and the config schema) and throttling stands alone: no webapp module
    assert not set(graph[d + "access.validation"]) and not set(graph[d + "access.throttle"])
    assert d + "actions" in graph[d + "worker.alerts"] and d + "worker.alerts" not in actions
    assert set(graph[d + "doorbell"]) == set() and d + "doorbell" in actions
    assert d + "doorbell" in graph[d + "worker.telemetry"]
    # the server's text (numbers, event lines) is pure: the pages, reports and live feed all use it
    assert not set(graph[d + "formatting"])
    assert not set(graph["webapp.settings"]) - {"webapp.env"}


# --- the checker itself finds cycles -----------------------------------------------------------------

def test_the_checker_finds_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("import os\n\ndef f():\n    from pkg.sub.c import g\n    return g\n")
    (pkg / "sub" / "c.py").write_text("from .. import a\n\ndef g():\n    pass\n")
    (pkg / "d.py").write_text("from pkg.a import something\nfrom . import d\n")
    graph, modules = import_graph(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg.sub.c": 4} and graph["pkg.sub.c"] == {"pkg.a": 1}
    assert graph["pkg.d"] == {"pkg.a": 1, "pkg.d": 2}
    cycles = sorted(find_cycles(graph))
    assert cycles == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"], ["pkg.d", "pkg.d"]]
    text = describe(cycles[0], graph, modules, tmp_path)
    assert "pkg.b imports pkg.sub.c  (pkg/b.py:4)" in text and text.startswith("pkg.a -> pkg.b")


@pytest.mark.parametrize("edges, expect", [
    ({"a": ["b"], "b": ["c"], "c": []}, []),
    ({"a": ["b"], "b": ["a"]}, [["a", "b", "a"]]),
    ({"a": ["b", "c"], "b": ["d"], "c": ["d"], "d": []}, []),          # a diamond is no cycle
    ({"a": ["b"], "b": ["c"], "c": ["b"]}, [["b", "c", "b"]]),
])
def test_find_cycles(edges, expect):
    graph = {k: {v: 1 for v in vs} for k, vs in edges.items()}
    assert find_cycles(graph) == expect
