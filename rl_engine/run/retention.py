"""Trainer-state retention: a run keeps its last `trainer.keep_last_states` trainer states, never one still needed.

    trainer_state/step=<t>/      every trainer.checkpoint_interval steps   COMMITTED marks it whole

After each save the trainer role deletes committed states beyond the newest
`trainer.keep_last_states` (null: keep all), except the newest committed one (a resume loads it)
and the one a lineage's `latest.json` model points at, if it points into this run. The rules and
the marker-first delete are `rl_engine.pruning`'s; weight checkpoints (checkpoints/version=*, and
with delta sync checkpoints/delta=*) are the checkpoint sender's to prune (`rl_engine.sync.checkpoint`,
`rl_engine.sync.delta`: never a full checkpoint or delta a kept version's chain needs), which gets
`lineage_model` here to keep the one a lineage points at.
"""

from __future__ import annotations

from rl_engine.pruning import Kind, pointer_target, prune
from rl_engine.run.context import RunContext
from rl_engine.run.state import STATE_DIR
from rl_engine.trainer.checkpoint import COMMIT_MARKER

STATES = Kind(STATE_DIR, "step=", COMMIT_MARKER)


def lineage_model(run: RunContext) -> str | None:
    """The model URL the run's lineage's latest.json points at (None without a lineage or a latest model)."""
    name = run.cfg.lineage.name
    if name is None:
        return None
    from rl_engine.run.lineage import lineage_url, read_latest

    latest = read_latest(lineage_url(run.cfg.buffer.storage.url, name), run.storage_options) or {}
    return latest.get("model")


def prune_states(run: RunContext) -> list[int]:
    """After a trainer state was committed: delete states beyond `trainer.keep_last_states`
    (never the newest committed one). Returns the steps deleted."""
    fs, root = run.fs()

    def protect(committed: list[int]) -> set[int]:
        pinned = pointer_target(lineage_model(run), run.url, STATES)
        return set(committed[-1:]) | ({pinned} if pinned is not None else set())

    return prune(fs, root, STATES, run.cfg.trainer.keep_last_states, protect)
