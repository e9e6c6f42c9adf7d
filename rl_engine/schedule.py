"""The sync schedules (docs/concepts/modes.md) as pure functions: who syncs when, and which version generates what.

Rendezvous schedule (modes synchronous / one_step_off_policy), knobs k = sync_interval >= 1 and
m = sync_offset >= 0: the explorer syncs after explorer step e iff e > m and (e - m) % k == 0,
receiving version t = e - m; the trainer, after trainer step t with t % k == 0, waits for that sync.
Trainer step t trains on the experiences of explorer step t.

A run of T trainer steps has T explorer steps; the sync after the last explorer step would feed
no rollout, so neither side does it (both sides read this from `rendezvous_syncs`, so they agree).

Decoupled schedule (fully_async / multi_explorer): the trainer publishes every k trainer steps;
explorers pick up the newest between their steps and wait only when admission control requires
it (`admission_wait`: `max_staleness`, or the backlog bound when there is none).

    python -m rl_engine.schedule 4 0 8     # print the rendezvous plan for k=4, m=0, T=8
"""

from __future__ import annotations

import sys


def syncs_after_explorer_step(e: int, k: int, m: int) -> bool:
    """True iff the rendezvous explorer syncs after explorer step e (the rendezvous rule)."""
    return e > m and (e - m) % k == 0


def rendezvous_syncs(total_steps: int, k: int, m: int) -> dict[int, int]:
    """{explorer step e: version t it receives after e} for a run of `total_steps` (T) steps.

    The sync after step T itself is left out: no rollout follows it.
    """
    return {e: e - m for e in range(1, total_steps) if syncs_after_explorer_step(e, k, m)}


def trainer_sync_versions(total_steps: int, k: int, m: int) -> set[int]:
    """Trainer steps t after which the trainer sends version t and waits for the explorer to load it."""
    return set(rendezvous_syncs(total_steps, k, m).values())


def resumed_rendezvous_syncs(total_steps: int, k: int, m: int, trainer_version: int, first_step: int) -> dict[int, int]:
    """The sync points left after a resume, when the trainer restarts at `trainer_version` and
    the explorer at `first_step` (one past its last committed step).

    A resumed explorer first loads the trainer's restored version (one catch-up sync, done iff
    first_step <= total_steps); after that only syncs delivering newer versions remain.
    Trainer and explorer both derive their plan from this, so they pair up exactly.
    """
    return {e: v for e, v in rendezvous_syncs(total_steps, k, m).items() if e >= first_step and v > trainer_version}


def resume_catch_up(k: int, m: int, trainer_version: int, first_step: int) -> int:
    """The version a resumed rendezvous explorer loads before its first step: the one the schedule
    says generates that step, or the restored trainer's if that is newer (its older weights are
    gone). The trainer publishes it once it has trained up to it, so the staleness bound of the
    mode holds across a resume."""
    return max(trainer_version, rendezvous_version(first_step, k, m))


def rendezvous_version(e: int, k: int, m: int) -> int:
    """The policy version that generates explorer step e under the rendezvous schedule.

    It is the version received at the last sync before step e: syncs happen after steps m + i*k
    (i >= 1) and deliver version i*k, so the count of syncs before e is floor((e - 1 - m) / k).
    """
    return max(0, (e - 1 - m) // k) * k


def max_rendezvous_staleness(k: int, m: int) -> int:
    """Largest (trainer version at training) - (generating version): k - 1 + m (the modes' table in docs/concepts/modes.md)."""
    return k - 1 + m


def batch_number(explorer_id: int, step: int, explorers: int) -> int:
    """Decoupled modes: the number (from 1) of explorer `explorer_id`'s step `step` among all the
    explorers' batches, which the trainer consumes in this order: round robin, (step - 1) * N +
    explorer_id + 1 for N explorers. Known in advance, so admission control and the trainer's
    reader agree on it without counting what the other explorers started."""
    return (step - 1) * explorers + explorer_id + 1


def admission_wait(
    batches_before: int,
    version: int,
    trainer_version: int,
    explorer_batch: int,
    train_batch: int,
    max_staleness: int | None,
    max_backlog: int | None,
) -> str | None:
    """Decoupled admission control: why the explorers may not start their next batch yet, or None.

    The trainer consumes batches in order, so batch b = batches_before + 1 (counted over all
    explorers, each of `explorer_batch` experiences) is trained at trainer step
    t_b = ceil(b * explorer_batch / train_batch), i.e. by version t_b - 1. With max_staleness η
    an explorer holding `version` may start it only while t_b - 1 - version <= η (AReaL's rule:
    nothing generated is ever too stale to train). Without a bound, it may start it only while
    fewer than `max_backlog` batches are started but not yet consumed (`trainer_version` steps
    consumed trainer_version * train_batch experiences).
    """
    b = batches_before + 1
    if max_staleness is not None:
        trained_by = -(-b * explorer_batch // train_batch) - 1
        if trained_by - version > max_staleness:
            return f"version {trained_by - max_staleness} or newer (batch {b} is trained by version {trained_by}; max_staleness {max_staleness})"
        return None
    consumed = trainer_version * train_batch // explorer_batch
    if max_backlog is not None and batches_before - consumed >= max_backlog:
        return f"the trainer to consume a batch ({batches_before - consumed} batches unconsumed; buffer.max_backlog_steps {max_backlog})"
    return None


def batches_needed(total_steps: int, explorer_batch: int, train_batch: int, lost_rows: int = 0) -> int:
    """How many explorer batches (counted over all explorers) the run's trainer consumes:
    ceil((total_steps * train_batch + lost_rows) / explorer_batch), where `lost_rows` are the
    experiences its reader dropped as stale or skipped as corrupt, which later batches replace.
    A decoupled explorer starts no batch past it: nothing would ever train it."""
    return -(-(total_steps * train_batch + lost_rows) // explorer_batch)


def decoupled_publish(t: int, k: int) -> bool:
    """Decoupled schedule: the trainer publishes version t after trainer step t iff t % k == 0."""
    return t % k == 0


def main(argv: list[str]) -> None:
    k, m, total = (int(x) for x in argv[:3])
    syncs = rendezvous_syncs(total, k, m)
    print(f"k={k} m={m} T={total}: max staleness {max_rendezvous_staleness(k, m)}")
    for e in range(1, total + 1):
        after = f"  -> sync v{syncs[e]}" if e in syncs else ""
        print(f"explorer step {e}: generated by v{rendezvous_version(e, k, m)}, trained at trainer step {e}{after}")


if __name__ == "__main__":
    main(sys.argv[1:])
