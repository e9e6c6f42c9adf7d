"""Registries of the extension points: a name for each estimator, loss, reward, workflow and task
maker, and the import path of what it names.

The built-ins are listed here by import path and imported on first use, so every built-in is
registered in any process whatever it has imported (`rft validate` in a fresh one sees them all)
and this module stays on the lowest floor. User code registers with the decorators of
`rl_engine.api` (imported by a config's `plugins:` list before it is validated), or is named
without registering by `type: python` + `function: package.module:name`.

    LOSSES.names()          # ['cispo', 'gspo', 'kimi', 'ppo_clip', ...]
    LOSSES.get("gspo")      # the function
    LOSSES.path("gspo")     # 'rl_engine.algorithms.losses:gspo_token_loss'
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from rl_engine.errors import UserError

IMPORT_PATH = r"^[\w.]+:[\w.]+$"  # package.module:name (a dotted name reaches into a class)
T = TypeVar("T")


def load_object(spec: str, field: str) -> Any:
    """The object at import path `package.module:name`; a UserError naming `field` (the config
    field that gave the path) when the module cannot be imported or has no such name."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UserError(f"{field} = {spec!r}: an import path is `package.module:name`")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - ImportError, or the module failing at import
        raise UserError(
            f"{field} = {spec!r}: cannot import module {module_name!r} ({type(e).__name__}: {e}); "
            "is it installed or on PYTHONPATH?"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(
                f"{field} = {spec!r}: module {module_name!r} has no attribute {attr!r}; check the name after the colon"
            )
        obj = getattr(obj, part)
    return obj


def import_path(obj: Any) -> str:
    """`package.module:qualname` of a module-level function or class (what `load_object` reads)."""
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not name or "<locals>" in name:
        raise ValueError(f"{obj!r} is not importable by path: register module-level functions and classes only")
    if module == "__main__":
        module = _main_module_name() or module
    return f"{module}:{name}"


def _main_module_name() -> str | None:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None)


class Registry:
    """Names of one kind of extension (`kind`, e.g. "loss"), selected by config field `field`."""

    def __init__(self, kind: str, field: str, builtins: dict[str, str]):
        self.kind, self.field = kind, field
        self._paths = dict(builtins)  # name -> import path
        self._builtins = frozenset(builtins)
        self._objects: dict[str, Any] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: `@LOSSES.register("my_loss")` names a module-level function or class."""

        def add(obj: T) -> T:
            path = import_path(obj)
            if name == "python" or (name in self._paths and self._paths[name] != path):
                raise ValueError(
                    f"{self.kind} {name!r} is already registered ({self._paths.get(name, 'the python variant')}); pick another name"
                )
            self._paths[name], self._objects[name] = path, obj
            return obj

        return add

    def names(self) -> list[str]:
        return sorted(self._paths)

    def builtin(self, name: str) -> bool:
        return name in self._builtins

    def __contains__(self, name: object) -> bool:
        return name in self._paths

    def path(self, name: str) -> str:
        self._check(name)
        return self._paths[name]

    def get(self, name: str) -> Any:
        """The registered object (a built-in is imported here, once)."""
        self._check(name)
        if name not in self._objects:
            self._objects[name] = load_object(self._paths[name], f"{self.field}.type")
        return self._objects[name]

    def build(self, cfg: Any) -> Callable[..., Any]:
        """The function a config variant selects with its parameters bound: a built-in's are its
        variant's fields, a plugin's or a `type: python` function's its `kwargs`."""
        if cfg.type == "python":
            fn, params = load_object(cfg.function, f"{self.field}.function"), cfg.kwargs
        else:
            fn = self.get(cfg.type)
            params = cfg.model_dump(exclude={"type"}) if self.builtin(cfg.type) else cfg.kwargs
        if not callable(fn):
            raise UserError(f"{self.field_of(cfg)} ({cfg.type!r}): {fn!r} is not callable; name a function")
        return functools.partial(fn, **params)

    def field_of(self, cfg: Any) -> str:
        """The config field that names `cfg`'s code: its `function` (type python) or its `type`."""
        return f"{self.field}.{'function' if cfg.type == 'python' else 'type'}"

    def _check(self, name: str) -> None:
        if name not in self._paths:
            raise UserError(self.unknown(name))

    def unknown(self, name: str) -> str:
        """The error for a name nobody registered: what exists and how to add one."""
        return (
            f"{self.field}.type = {name!r}: no {self.kind} of that name; registered: {', '.join(self.names())}. "
            f"Register one with @register_{self.kind.replace(' ', '_')}({name!r}) in a module the config's `plugins:` lists, "
            f"or use type: python with function: package.module:name"
        )


def bound(registry: Registry, cfg: Any, args: tuple[str, ...]) -> Callable[..., Any]:
    """`registry.build(cfg)`, checked to take the positional `args` (their names are what the
    contract passes) with the config's parameters; a UserError naming the field otherwise."""
    fn = registry.build(cfg)
    field = registry.field_of(cfg)
    target = fn.func
    try:
        inspect.signature(target).bind(*args, **fn.keywords)
    except TypeError as e:
        raise UserError(
            f"{field} ({cfg.type!r}): {getattr(target, '__qualname__', target)!r} cannot be called as "
            f"({', '.join(args)}, **{sorted(fn.keywords)}) ({e}); see rl_engine.api for the {registry.kind}'s contract"
        ) from None
    except ValueError:
        pass  # no signature to read (a builtin written in C): called as it is
    return fn


ESTIMATORS = Registry(
    "estimator",
    "algorithm.advantage",
    {
        name: f"rl_engine.algorithms.advantages:{name}_advantages"
        for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp")
    },
)
LOSSES = Registry(
    "loss",
    "algorithm.loss",
    {name: f"rl_engine.algorithms.losses:{name}_token_loss" for name in ("ppo_clip", "gspo", "cispo", "kimi")},
)
REWARDS = Registry(
    "reward",
    "taskset.reward",
    {
        "arithmetic": "rl_engine.demos.arithmetic:ArithmeticRewardFn",
        "countdown": "rl_engine.demos.countdown:CountdownRewardFn",
        "final_answer": "rl_engine.demos.word_arithmetic:FinalAnswerRewardFn",
        "code_tests": "rl_engine.rewards.code_tests:CodeTestsRewardFn",
        "model": "rl_engine.rewards.reward_model:ModelRewardFn",
        "judge": "rl_engine.rewards.judge:JudgeRewardFn",
    },
)
WORKFLOWS = Registry(
    "workflow",
    "taskset.workflow",
    {
        "calculator": "rl_engine.demos.calculator:calculator_workflow",
        "guess_number": "rl_engine.demos.guess_number:guess_number_workflow",
    },
)
TASKS = Registry(
    "task",
    "taskset.make",
    {
        "arithmetic": "rl_engine.demos.arithmetic:make_arithmetic_tasks",
        "countdown": "rl_engine.demos.countdown:make_countdown_tasks",
        "word-arithmetic": "rl_engine.demos.word_arithmetic:make_word_arithmetic_tasks",
        "calculator": "rl_engine.demos.calculator:make_calculator_tasks",
        "guess_number": "rl_engine.demos.guess_number:make_guess_number_tasks",
        "python-functions": "rl_engine.demos.python_functions:make_python_functions_tasks",
    },
)
