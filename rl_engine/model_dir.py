"""The one check that a path is a local Hugging Face model directory (config.json in it), or a
tokenizer directory (only that it is a directory), with the error a user gets when it is not.

Used wherever a model directory is opened or checked: the rollout engine, the trainer, preflight
and `rft validate` (`check_model_paths`), and `rft demo` (which builds the model when it is missing).
"""

from __future__ import annotations

from pathlib import Path

from rl_engine.config.base import ConfigError


def is_model_dir(path: str | Path) -> bool:
    """A directory holding a config.json."""
    return (Path(path).expanduser() / "config.json").is_file()


def require_model_dir(path: str, what: str = "model.path", config: bool = True) -> str:
    """The expanded `path` of the directory the field `what` names; ConfigError (a UserError)
    naming the field and the fix unless it is a directory and, with `config` (a model, not only
    a tokenizer), holds a config.json."""
    p = Path(path).expanduser()
    if p.is_file():
        problem = (
            f"{path!r} is a file, not a directory; point {what} at the directory that holds the model's config.json, "
            f"*.safetensors and tokenizer files (this file's directory is {str(p.parent)!r})"
        )
    elif not p.is_dir():
        problem = (
            f"model directory {path!r} does not exist (not found or has no config.json); build one with `rft make-tiny-model {path}` "
            f"(or `rft warmstart`) or point {what} at a local Hugging Face model directory"
        )
    elif config and not is_model_dir(p):
        problem = f"{path!r} has no config.json; {what} must be a Hugging Face model directory"
    else:
        return str(p)
    raise ConfigError(f"{what} = {path!r}: {problem}")
