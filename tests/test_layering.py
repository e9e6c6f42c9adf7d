"""The import graph follows the floor plan: no circles, no arrow running back up.

Inside rl_engine, the floors are the ones rl_engine/__init__.py documents (parsed from its
docstring, so the plan and this check cannot drift apart); every import counts, the lazy ones
inside functions included. Above it: tasks -> flows -> deployments / cli, bench and harness never
import tests, and rl_engine never imports Prefect.

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


# The dispatchers that still name the demos (rl_engine.demos sits above them) until registries
# replace them (issue 43): each (module, imported module) here may run back up. Empty it then.
DEMO_DISPATCHERS = {"rl_engine.rewards.scoring", "rl_engine.rollout.workflow", "rl_engine.rewards.make_tasks"}


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


def imports(path: Path, known: set[str] = frozenset()) -> set[str]:
    """Every module `path` imports, at the top or inside a function: `from pkg import sub` is
    module pkg.sub when `known` has it, else pkg."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.update(
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
            )
    return out


def engine_graph() -> dict[str, set[str]]:
    """rl_engine's module graph: an edge per imported module (a name imported from a module
    counts as that module)."""
    mods = modules("rl_engine")
    graph: dict[str, set[str]] = defaultdict(set)
    for m, p in mods.items():
        for name in imports(p, set(mods)):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != m:
                graph[m].add(name)
    return graph


def floor_of(module: str, plan: dict[str, int]) -> int | None:
    name = module.removeprefix("rl_engine.")
    while name:
        if name in plan:
            return plan[name]
        name = name.rpartition(".")[0]
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
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


def test_the_floor_plan_names_every_engine_module():
    plan = floors()
    assert plan and min(plan.values()) == 0, "rl_engine/__init__.py's docstring lost its floor list"
    # A package's __init__ that imports nothing (a docstring) needs no floor.
    unplaced = [m for m, p in modules("rl_engine").items() if floor_of(m, plan) is None and imports(p)]
    assert not unplaced, f"modules on no floor: add them to the floor list in rl_engine/__init__.py: {unplaced}"
    stale = [
        n
        for n in plan
        if not any(m == f"rl_engine.{n}" or m.startswith(f"rl_engine.{n}.") for m in modules("rl_engine"))
    ]
    assert not stale, f"the floor list names modules that do not exist: {stale}"


def test_no_engine_import_runs_back_up():
    plan = floors()
    up = [
        f"{m} (floor {floor_of(m, plan)}) imports {t} (floor {floor_of(t, plan)})"
        for m, targets in sorted(engine_graph().items())
        for t in sorted(targets)
        if (floor_of(t, plan) or 0) > (floor_of(m, plan) or 0)
        and not (m in DEMO_DISPATCHERS and t.startswith("rl_engine.demos."))
    ]
    assert not up, "imports running back up the floors of rl_engine/__init__.py:\n" + "\n".join(up)


def test_no_engine_import_circle():
    found = cycles(engine_graph())
    assert not found, f"import circles in rl_engine: {found}"


def test_the_packages_import_downwards_only():
    wrong = []
    for package, allowed in ALLOWED.items():
        for m, p in modules(package).items():
            for name in imports(p):
                top = name.split(".")[0]
                if top in TOP and top != package and top not in allowed:
                    wrong.append(f"{m} imports {name}")
                if package == "rl_engine" and top == "prefect":
                    wrong.append(f"{m} imports {name} (rl_engine never imports Prefect)")
    assert not wrong, (
        "imports against the layering (rl_engine <- tasks <- flows <- deployments / cli; bench, harness never import tests):\n"
        + "\n".join(wrong)
    )


def test_the_checks_catch_what_they_look_for():
    """The checks themselves: a circle and a back-arrow in a made-up graph are found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    plan = {"storage": 2, "roles": 8, "run.context": 5}
    assert floor_of("rl_engine.roles.explorer", plan) == 8 and floor_of("rl_engine.run.context", plan) == 5
    assert floor_of("rl_engine.run.lease", plan) is None
