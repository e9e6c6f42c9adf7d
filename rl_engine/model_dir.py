"""The one check that a path is a local Hugging Face model directory (config.json in it), or a
tokenizer directory (only that it exists), with the error a user gets when it is not.

Used wherever a model directory is opened: the rollout engine, the trainer, preflight (which
then checks the files inside) and `rft demo` (which builds the model when it is missing).
"""

from __future__ import annotations

from pathlib import Path

from rl_engine.errors import UserError


def is_model_dir(path: str | Path) -> bool:
    """A directory holding a config.json."""
    return (Path(path).expanduser() / "config.json").is_file()


def require_model_dir(path: str, what: str = "model.path", config: bool = True) -> str:
    """The expanded `path` of the directory `what` names; UserError unless it exists and, with
    `config` (a model, not only a tokenizer), holds a config.json."""
    p = Path(path).expanduser()
    if not p.is_dir():
        problem = "does not exist (model directory not found or has no config.json)" if config else "does not exist"
    elif config and not is_model_dir(p):
        problem = "has no config.json: it is not a Hugging Face model directory"
    else:
        return str(p)
    build = f"build one with `rft make-tiny-model {path}` or `rft warmstart {path}`, or " if config else ""
    raise UserError(f"{what} = {path!r} {problem}; {build}point {what} at a local Hugging Face model directory")
