"""The packages' layering, read from the source (``ast``, nothing imported): every import of one of our packages, at
the top of a module or inside a function (a lazy import is still a dependency), absolute or relative, must follow
``MAY_IMPORT``, and no modules may import each other in a circle.

An import names the module it imports (``from workers.evals import suites``: ``workers.evals.suites``; ``from
workers.evals.suites import run_suite``: ``workers.evals.suites``), not the packages above it whose ``__init__``
Python also runs. Tests are not checked as importers. Imports made by name at run time (``importlib``) are not seen.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Who may import whom: a package may import its own modules and those of the packages in its set, no other of ours.
# No set holds benchmarks or tests: production code never imports them.
MAY_IMPORT: dict[str, set[str]] = {
    "benchmarks": {"dashboard", "orchestrator", "workers", "db", "kernels"},   # on top: scripts over everything
    "dashboard": {"db"},
    "orchestrator": {"workers", "db", "kernels"},
    "workers": {"kernels", "db"},
    "db": set(),
    "kernels": set(),
}
OURS = set(MAY_IMPORT) | {"tests"}          # imports of anything else (the standard library, third parties) are free



# --------------------------------------------------------------------------------------------- the checker
def find_modules(root: Path, packages=tuple(MAY_IMPORT)) -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, is a package's __init__)} of every .py file under ``root``'s ``packages``."""
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            is_init = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_init else parts)] = (f, is_init)
    return out


def imports_of(name: str, path: Path, is_init: bool, modules) -> list[tuple[str, int]]:
    """(imported module, line) of every import of one of our packages in a module, at any depth (a module that is
    not there keeps its name: the rules still apply to it)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:                                  # relative: from the module's own package upwards
                base = name.split(".")[:len(name.split(".")) - node.level + is_init]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for a in node.names:                            # ``from pkg import mod`` imports the module pkg.mod
                sub = f"{target}.{a.name}"
                out.append((sub if sub in modules else target, node.lineno))
    return [(t, line) for t, line in out if t.split(".")[0] in OURS]


def import_graph(root: Path, packages=tuple(MAY_IMPORT)) -> dict[str, dict[str, int]]:
    """{importer: {imported: first line}} over the modules of ``packages`` (imports of ourselves only)."""
    modules = find_modules(root, packages)
    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_init) in modules.items():
        edges = graph.setdefault(name, {})
        for target, line in imports_of(name, path, is_init, modules):
            if target != name:
                edges[target] = min(line, edges.get(target, line))
    return graph


def back_imports(graph) -> dict[tuple[str, str], int]:
    """{(importer, imported): line} of every import ``MAY_IMPORT`` does not allow."""
    out = {}
    for src, edges in graph.items():
        mine = src.split(".")[0]
        for dst, line in edges.items():
            theirs = dst.split(".")[0]
            if theirs != mine and theirs not in MAY_IMPORT.get(mine, ()):
                out[(src, dst)] = line
    return out


def cycles(graph) -> set[frozenset[str]]:
    """The modules that import each other in a circle, one set per strongly connected component (of 2 or more)."""
    def reach(start: str) -> set[str]:
        seen, todo = set(), list(graph.get(start, ()))
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        return seen

    reachable = {m: reach(m) for m in graph}
    return {frozenset({m} | {o for o in reachable[m] if m in reachable.get(o, ())})
            for m in graph if m in reachable[m]}


def _describe_cycle(graph, members) -> str:
    return "; ".join(f"{a} -> {b} (line {line})" for a in sorted(members)
                     for b, line in sorted(graph[a].items()) if b in members)


@functools.cache
def _ours():
    return import_graph(REPO)


# --------------------------------------------------------------------------------------------- the tests
def test_every_package_is_scanned():
    graph = _ours()
    assert {m.split(".")[0] for m in graph} == set(MAY_IMPORT)
    assert "workers.evals.items" in graph["workers.evals.suites"]          # at the top
    assert "workers.evals.scoring_lm" in graph["workers.evals.suites"]     # inside a function


def test_imports_follow_the_layer_order():
    found = back_imports(_ours())
    bad = [f"{src} imports {dst} (line {line})" for (src, dst), line in sorted(found.items())]
    assert not bad, "imports against the layer order (MAY_IMPORT):\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = _ours()
    found = cycles(graph)
    bad = [_describe_cycle(graph, c) for c in sorted(found, key=sorted)]
    assert not bad, "modules that import each other (top-level or lazily):\n" + "\n".join(bad)


def test_the_checker_finds_a_back_import_and_a_cycle(tmp_path):
    """A made-up tree with kernels importing workers (lazily), db importing tests, and two workers modules importing
    each other (one relatively, one lazily), beside allowed imports: each break is reported, nothing else."""
    files = {
        "kernels/__init__.py": "",
        "kernels/ops.py": "def f():\n    from workers.evals import tasks\n",
        "workers/__init__.py": "",
        "workers/evals/__init__.py": "",
        "workers/evals/suites.py": "import kernels\nfrom . import cache\n",
        "workers/evals/cache.py": "def g():\n    from workers.evals.suites import run\n",
        "workers/evals/tasks.py": "from .cache import g\nfrom ..evals import suites\n",
        "db/__init__.py": "from tests import helpers\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path, ("kernels", "workers", "db"))
    assert graph["workers.evals.tasks"] == {"workers.evals.cache": 1, "workers.evals.suites": 2}
    assert back_imports(graph) == {("kernels.ops", "workers.evals.tasks"): 2, ("db", "tests"): 1}
    assert cycles(graph) == {frozenset({"workers.evals.suites", "workers.evals.cache"})}
