"""Does a class implement a Protocol? Members and call signatures, checked without building one.

`isinstance(x, P)` for a `runtime_checkable` Protocol only asks whether the names exist, and
only on an instance (which for a trainer means a DeepSpeed engine). `mismatches(cls, P)` reads
the class: every method of P exists on cls and accepts every parameter P declares (same name,
same kind; extra parameters of cls need defaults), every property of P is a property of cls, and
every data attribute P annotates is annotated on cls, set in its `__init__`, or a class attribute.

    from rl_engine.conformance import mismatches
    assert mismatches(CostModelTrainer, Trainer) == []     # tests/rl_engine/test_conformance.py
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

_MISSING = object()


def _members(proto: type) -> tuple[dict[str, Any], set[str]]:
    """(methods and properties, data attribute names) that `proto` declares, its bases included."""
    calls: dict[str, Any] = {}
    data: set[str] = set()
    for base in reversed(proto.__mro__):
        if base is object or not getattr(base, "_is_protocol", False) or base.__name__ in ("Protocol", "Generic"):
            continue
        data |= set(inspect.get_annotations(base))
        calls |= {
            k: v for k, v in base.__dict__.items() if not k.startswith("_") and (callable(v) or isinstance(v, property))
        }
    return calls, data - set(calls)


def _init_assigns(cls: type) -> set[str]:
    """Names `cls` (or a base) assigns as `self.<name> = ...` in `__init__`."""
    names: set[str] = set()
    for base in cls.__mro__:
        init = base.__dict__.get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                else []
            )
            for t in targets:
                for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                        names.add(el.attr)
    return names


def _signature_problems(name: str, want: Any, have: Any) -> list[str]:
    want_sig, have_sig = inspect.signature(want), inspect.signature(have)
    params = dict(have_sig.parameters)
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in params.values())
    problems = []
    for p in want_sig.parameters.values():
        got = params.pop(p.name, None)
        if got is None:
            if not (var_kw if p.kind is p.KEYWORD_ONLY else var_pos and var_kw):
                problems.append(f"{name}() has no parameter {p.name!r}")
        elif got.kind != p.kind:
            problems.append(
                f"{name}() parameter {p.name!r} is {got.kind.description}, the protocol's is {p.kind.description}"
            )
        elif p.default is not p.empty and got.default is p.empty:
            problems.append(f"{name}() parameter {p.name!r} needs a default, as in the protocol")
    for p in params.values():
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            problems.append(f"{name}() requires {p.name!r}, which the protocol does not pass")
    return problems


def mismatches(cls: type, proto: type) -> list[str]:
    """What `cls` lacks to implement `proto` (empty when it conforms), one line per problem."""
    calls, data = _members(proto)
    assigned = _init_assigns(cls)
    problems = []
    for name in sorted(data):
        if (
            name not in assigned
            and not hasattr(cls, name)
            and not any(name in getattr(b, "__annotations__", {}) for b in cls.__mro__)
        ):
            problems.append(f"no attribute {name!r}")
    for name, want in sorted(calls.items()):
        have = inspect.getattr_static(cls, name, _MISSING)
        if have is _MISSING:
            if not (isinstance(want, property) and name in assigned):
                problems.append(f"no {'property' if isinstance(want, property) else 'method'} {name!r}")
        elif isinstance(want, property):
            if not isinstance(have, property) and name not in assigned:
                problems.append(f"{name!r} is not a property or attribute")
        elif not callable(have):
            problems.append(f"{name!r} is not a method")
        else:
            problems += _signature_problems(name, want, have)
    return [f"{cls.__qualname__}: {p} ({proto.__qualname__})" for p in problems]
