"""The import graph follows the floor plan: no circles, no arrow running back up, in the whole
repository.

Inside rl_engine, a folder (package) is one floor: the floors are the ones rl_engine/__init__.py
documents (parsed from its docstring, so the plan and this check cannot drift apart), one name per
folder or top-level module, and a module's floor is its folder's. A module imports only from its
own floor or below; the folders and top-level modules never import in a circle, nor do the
modules inside a folder. Above rl_engine the top-level packages keep their order (tasks -> flows
-> deployments / cli; harness, then bench, above them; nothing but tests imports tests), and
inside each of them (tests too) no modules import in a circle. rl_engine never imports Prefect,
and nothing in rl_engine outside rl_engine/demos imports the demos.

Every import counts, the lazy ones inside functions included; only those under
`if TYPE_CHECKING:` do not (they never run: they name types for annotations, as rl_engine/api.py's
contracts on floor 0 name the types of the floors above).

    .venv/bin/python -m pytest tests/test_layering.py -q
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import rl_engine

REPO = Path(__file__).resolve().parents[1]
TOP = ("rl_engine", "tasks", "flows", "deployments", "cli", "harness", "bench", "tests")
# Which top-level packages each may import (besides itself and third-party code).
ALLOWED = {
    "rl_engine": {"rl_engine"},
    "tasks": {"rl_engine"},
    "flows": {"rl_engine", "tasks"},
    "deployments": {"rl_engine", "tasks", "flows"},
    "cli": {"rl_engine", "tasks", "flows", "deployments"},
    "harness": {"rl_engine", "tasks", "flows", "deployments", "cli"},  # the run harness tests and bench share
    "bench": {"rl_engine", "tasks", "flows", "deployments", "cli", "harness"},
}

# The modules of rl_engine outside rl_engine/demos that may import rl_engine.demos (an import
# running back up the floors). Empty since the registries replaced the dispatchers that named the
# demos (build_reward, build_workflow, `rft make-tasks`; issue 43): rl_engine/registry.py lists the
# built-ins by import path, imported on first use. Nothing may join it.
DEMO_DISPATCHERS: set[str] = set()


def floors() -> dict[str, int]:
    """`{name: floor}` from the floor list of rl_engine/__init__.py's docstring."""
    out = {}
    for floor, names in re.findall(r"^\s+(\d+)\s+([a-z_. ]+)$", rl_engine.__doc__ or "", re.MULTILINE):
        out.update({n: int(floor) for n in names.split()})
    return out


def modules(package: str) -> dict[str, Path]:
    out = {}
    for p in sorted((REPO / package).rglob("*.py")):
        parts = list(p.relative_to(REPO).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _typing_only(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `if typing.TYPE_CHECKING:`)."""
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imports(path: Path, known: set[str] = frozenset(), module: str = "") -> set[str]:
    """Every module `path` (module `module`) imports, at the top or inside a function, except under
    `if TYPE_CHECKING:`: `from pkg import sub` is module pkg.sub when `known` has it, else pkg."""
    out: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            if base:
                out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
        children = list(ast.iter_child_nodes(node))
        if _typing_only(node):
            children = node.orelse
        for child in children:
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return out


def module_graph(package: str) -> dict[str, set[str]]:
    """`package`'s module graph: an edge per module of the package imported (a name imported
    from a module counts as that module)."""
    mods = modules(package)
    graph: dict[str, set[str]] = defaultdict(set)
    for m, p in mods.items():
        for name in imports(p, set(mods), m):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != m:
                graph[m].add(name)
    return graph


def engine_graph() -> dict[str, set[str]]:
    return module_graph("rl_engine")


def unit(module: str) -> str:
    """The folder or top-level module of rl_engine that `module` belongs to ("" for rl_engine's
    own __init__): rl_engine.run.context -> run, rl_engine.board -> board."""
    return module.split(".")[1] if module.count(".") else ""


def floor_of(module: str, plan: dict[str, int]) -> int | None:
    """A module's floor: its folder's (or, for a top-level module, its own)."""
    return plan.get(unit(module))


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph of rl_engine's folders and top-level modules (a unit imports another when one of
    its modules does), without the allow-listed demo dispatchers' edges."""
    out: dict[str, set[str]] = defaultdict(set)
    for m, targets in graph.items():
        for t in targets:
            if unit(m) and unit(t) and unit(m) != unit(t) and not demo_dispatch(m, t):
                out[unit(m)].add(unit(t))
    return out


def demo_dispatch(module: str, target: str) -> bool:
    return module in DEMO_DISPATCHERS and unit(target) == "demos"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def upward(graph: dict[str, set[str]], plan: dict[str, int]) -> list[str]:
    """The imports of rl_engine that run back up the floors (or leave them: a unit on no floor)."""
    return [
        f"{m} (floor {floor_of(m, plan)}) imports {t} (floor {floor_of(t, plan)})"
        for m, targets in sorted(graph.items())
        for t in sorted(targets)
        if unit(m)
        and unit(t)
        and unit(m) != unit(t)
        and (floor_of(m, plan) is None or floor_of(t, plan) is None or floor_of(t, plan) > floor_of(m, plan))
        and not demo_dispatch(m, t)
    ]


def test_the_floor_plan_names_every_engine_folder():
    plan = floors()
    assert plan and min(plan.values()) == 0, "rl_engine/__init__.py's docstring lost its floor list"
    dotted = [n for n in plan if "." in n]
    assert not dotted, (
        f"the floor list names modules inside a folder: a folder is one floor, name the folder only (or move the module): {dotted}"
    )
    # A package's __init__ that imports nothing (a docstring) needs no floor.
    unplaced = [m for m, p in modules("rl_engine").items() if unit(m) and unit(m) not in plan and imports(p)]
    assert not unplaced, f"modules on no floor: add their folder to the floor list in rl_engine/__init__.py: {unplaced}"
    units = {unit(m) for m in modules("rl_engine")}
    stale = [n for n in plan if n not in units]
    assert not stale, f"the floor list names folders or modules that do not exist: {stale}"


def test_no_engine_import_runs_back_up():
    up = upward(engine_graph(), floors())
    assert not up, "imports running back up the floors of rl_engine/__init__.py:\n" + "\n".join(up)


def test_no_engine_folder_circle():
    found = cycles(folder_graph(engine_graph()))
    assert not found, f"import circles between rl_engine's folders and top-level modules: {found}"


def test_no_import_circle_in_any_package():
    found = {package: cycles(module_graph(package)) for package in TOP}
    found = {package: c for package, c in found.items() if c}
    assert not found, f"modules importing in a circle: {found}"


def test_nothing_outside_the_demos_imports_them():
    wrong = [
        f"{m} imports {t}"
        for m, targets in sorted(engine_graph().items())
        for t in sorted(targets)
        if unit(t) == "demos" and unit(m) != "demos" and m not in DEMO_DISPATCHERS
    ]
    assert not wrong, "rl_engine imports the demos (register them instead, rl_engine/api.py):\n" + "\n".join(wrong)
    stale = [m for m in DEMO_DISPATCHERS if not any(unit(t) == "demos" for t in engine_graph().get(m, ()))]
    assert not stale, f"DEMO_DISPATCHERS names modules that no longer import the demos: remove them: {stale}"


def test_the_packages_import_downwards_only():
    wrong = []
    for package, allowed in ALLOWED.items():
        for m, p in modules(package).items():
            for name in imports(p, module=m):
                top = name.split(".")[0]
                if top in TOP and top != package and top not in allowed:
                    wrong.append(f"{m} imports {name}")
                if package == "rl_engine" and top == "prefect":
                    wrong.append(f"{m} imports {name} (rl_engine never imports Prefect)")
    assert not wrong, (
        "imports against the layering (rl_engine <- tasks <- flows <- deployments / cli; bench, harness never import tests):\n"
        + "\n".join(wrong)
    )


def test_the_checks_catch_what_they_look_for(tmp_path):
    """The checks themselves: a circle, a back-arrow and a typing-only import in made-up code."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    plan = {"storage": 2, "roles": 8, "run": 7, "board": 3}
    assert floor_of("rl_engine.roles.explorer", plan) == 8 and floor_of("rl_engine.run.context", plan) == 7
    assert floor_of("rl_engine.storage", plan) == 2 and floor_of("rl_engine.lease", plan) is None
    graph = {"rl_engine.board": {"rl_engine.run.context"}, "rl_engine.run.context": {"rl_engine.board"}}
    assert upward(graph, plan) == ["rl_engine.board (floor 3) imports rl_engine.run.context (floor 7)"]
    assert cycles(folder_graph(graph)) == [["board", "run"]]
    # Two modules of one folder importing each other: a circle inside the folder, not between folders.
    inside = {"rl_engine.run.a": {"rl_engine.run.b"}, "rl_engine.run.b": {"rl_engine.run.a"}}
    assert cycles(folder_graph(inside)) == [] and cycles(inside) == [["rl_engine.run.a", "rl_engine.run.b"]]
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
        "def f():\n    from c import d\n    from .e import g\n"
    )
    assert imports(src, {"c.d"}, "pkg.m") == {"typing", "b", "c.d", "pkg.e"}
