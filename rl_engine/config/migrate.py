"""Migration: a config written for an older version, rewritten into today's shape before validation.

`validate_config` (so `load_config`, a run's stored config.yaml, a lineage's record) applies
`migrate` to every config it reads, so old files and runs keep loading; `rft config migrate FILE`
(`migrate_file`) rewrites a file in place once. Each step rewrites only what keeps its meaning:

- `buffer.max_backlog_steps` moved to `synchronizer.max_backlog_steps` (a decoupled mode's field);
  in a rendezvous mode, where it never did anything, it is dropped;
- the synchronizer became a union on `mode`: `sync_offset: 0` in a decoupled mode and
  `max_staleness: null` in a rendezvous mode (what every run's saved config held) are dropped;
- the algorithm became knobs (issue 22): `type: grpo` is dropped (the default preset),
  `std_normalize` became `advantage: {type: grpo, std: group | none}`, `clip_eps_low/high` moved
  into `loss: {type: ppo_clip}`, `old_logprobs` became `proximal`, `loss_agg: seq-mean` became
  `aggregation: seq-mean-token-mean`.

A value that never had a meaning in its mode (`sync_offset: 3` in fully_async, was refused before
too) is left as it is: validation refuses it, naming the field and the fix (`misplaced`).
"""

from __future__ import annotations

import copy
from typing import Any

from rl_engine.config.base import ConfigError
from rl_engine.config.synchronizer import DECOUPLED_MODES, RENDEZVOUS_MODES


def migrate(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(a copy of `data` in today's shape, one note per change made); `data` itself is not modified."""
    out, notes = copy.deepcopy(data), []
    if isinstance(out.get("algorithm"), dict):
        notes += _algorithm_knobs(out["algorithm"])
    sync = out.get("synchronizer") if out.get("synchronizer") is not None else {}
    buffer = out.get("buffer")
    if not isinstance(sync, dict):
        return out, notes  # not a section: validation names it
    mode = sync.get("mode", "synchronous")
    if isinstance(buffer, dict) and "max_backlog_steps" in buffer and mode in RENDEZVOUS_MODES + DECOUPLED_MODES:
        notes.append(_move_backlog(buffer, sync, mode))
    if mode in DECOUPLED_MODES and "sync_offset" in sync and sync["sync_offset"] == 0:
        del sync["sync_offset"]
        notes.append(f"synchronizer.sync_offset: 0 removed: mode {mode!r} has no sync_offset")
    if mode in RENDEZVOUS_MODES and "max_staleness" in sync and sync["max_staleness"] is None:
        del sync["max_staleness"]
        notes.append(f"synchronizer.max_staleness: null removed: mode {mode!r} has no max_staleness")
    if sync and notes:
        out["synchronizer"] = sync
    return out, notes


def _move_backlog(buffer: dict[str, Any], sync: dict[str, Any], mode: str) -> str:
    """Take `buffer.max_backlog_steps` out of `buffer`: into `sync` for a decoupled mode; the note saying what happened."""
    value = buffer.pop("max_backlog_steps")
    if mode in RENDEZVOUS_MODES:
        return f"buffer.max_backlog_steps: {value!r} removed: mode {mode!r} never used it"
    if "max_backlog_steps" in sync and sync["max_backlog_steps"] != value:
        raise ConfigError(
            f"buffer.max_backlog_steps = {value!r} and synchronizer.max_backlog_steps = {sync['max_backlog_steps']!r}: the setting moved to synchronizer.max_backlog_steps; "
            "delete buffer.max_backlog_steps and keep the value you mean there"
        )
    sync["max_backlog_steps"] = value
    return "buffer.max_backlog_steps moved to synchronizer.max_backlog_steps"


_AGGREGATIONS = {"token-mean": "token-mean", "seq-mean": "seq-mean-token-mean"}


def _algorithm_knobs(algo: dict[str, Any]) -> list[str]:
    """Rewrite the flat GRPO fields of `algo` (in place) into today's knobs; one note per field."""
    notes = []
    if algo.get("type") == "grpo":
        del algo["type"]
        notes.append("algorithm.type: grpo removed: GRPO is the default preset (algorithm.preset)")
    if "std_normalize" in algo and isinstance(algo["std_normalize"], bool) and "advantage" not in algo:
        algo["advantage"] = {"type": "grpo", "std": "group" if algo.pop("std_normalize") else "none"}
        notes.append(f"algorithm.std_normalize became algorithm.advantage = {algo['advantage']}")
    clips = {k: algo.pop(k) for k in ("clip_eps_low", "clip_eps_high") if k in algo}
    if clips and "loss" not in algo:
        algo["loss"] = {"type": "ppo_clip", **clips}
        notes.append(f"algorithm.{' and algorithm.'.join(clips)} moved into algorithm.loss = {algo['loss']}")
    elif clips:
        algo.update(clips)  # both shapes at once: left for validation to name
    if "old_logprobs" in algo and "proximal" not in algo:
        algo["proximal"] = algo.pop("old_logprobs")
        notes.append(f"algorithm.old_logprobs became algorithm.proximal = {algo['proximal']!r}")
    if algo.get("loss_agg") in _AGGREGATIONS and "aggregation" not in algo:
        algo["aggregation"] = _AGGREGATIONS[algo.pop("loss_agg")]
        notes.append(f"algorithm.loss_agg became algorithm.aggregation = {algo['aggregation']!r}")
    return notes
