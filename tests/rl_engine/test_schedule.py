"""The rendezvous and decoupled schedules against the modes' table (docs/concepts/modes.md), worked by hand."""

from __future__ import annotations

import pytest

from rl_engine.schedule import (
    max_rendezvous_staleness,
    rendezvous_syncs,
    rendezvous_version,
    trainer_sync_versions,
)

# (k, m): generating version of explorer steps 1..8, written out by hand from the rule.
TABLE = {
    (1, 0): [0, 1, 2, 3, 4, 5, 6, 7],  # (a) synchronous
    (1, 1): [0, 0, 1, 2, 3, 4, 5, 6],  # (b) one-step off-policy
    (4, 0): [0, 0, 0, 0, 4, 4, 4, 4],  # rollouts 1-4 with v0, sync v4, rollouts 5-8 with v4
    (1, 4): [0, 0, 0, 0, 0, 1, 2, 3],  # explorer 4 steps ahead, then a sync after every step
    (2, 1): [0, 0, 0, 2, 2, 4, 4, 6],  # syncs after e=3 (v2), 5 (v4), 7 (v6)
}


@pytest.mark.parametrize("k,m", list(TABLE))
def test_generating_version_matches_table(k, m):
    assert [rendezvous_version(e, k, m) for e in range(1, 9)] == TABLE[(k, m)]


@pytest.mark.parametrize("k,m", list(TABLE))
def test_staleness_bound_is_reached_and_never_exceeded(k, m):
    # Explorer step e is trained at trainer step e, when the trainer holds version e - 1.
    stale = [(e - 1) - rendezvous_version(e, k, m) for e in range(1, 9)]
    assert max(stale) == max_rendezvous_staleness(k, m)
    assert min(stale) >= 0


def test_sync_points_pair_explorer_step_with_version():
    assert rendezvous_syncs(8, 1, 0) == {e: e for e in range(1, 8)}
    assert rendezvous_syncs(8, 4, 0) == {4: 4}  # the sync after step 8 would feed no rollout
    assert rendezvous_syncs(8, 1, 4) == {5: 1, 6: 2, 7: 3}
    assert rendezvous_syncs(8, 2, 1) == {3: 2, 5: 4, 7: 6}
    assert trainer_sync_versions(8, 2, 1) == {2, 4, 6}
    assert rendezvous_syncs(3, 1, 4) == {}  # offset beyond the run: never syncs


def test_versions_are_consistent_with_sync_points():
    # The version generating step e is the one received at the last sync before e.
    for k in (1, 2, 3, 4):
        for m in (0, 1, 2, 5):
            syncs = rendezvous_syncs(20, k, m)
            for e in range(1, 21):
                before = [v for s, v in syncs.items() if s < e]
                assert rendezvous_version(e, k, m) == (before[-1] if before else 0)


def test_admission_control_with_a_staleness_bound():
    from rl_engine.schedule import admission_wait

    # Equal batches: batch b is trained by version b - 1, so with η = 2 an explorer at v0 may start
    # batches 1..3 and must wait before batch 4 until it holds v1.
    assert [admission_wait(n, 0, 0, 4, 4, 2, None) is None for n in range(5)] == [True, True, True, False, False]
    assert admission_wait(3, 1, 0, 4, 4, 2, None) is None
    assert "version 1 or newer" in admission_wait(3, 0, 0, 4, 4, 2, None)
    # η = 0 is fully on-policy: batch b needs version b - 1 exactly.
    assert admission_wait(5, 5, 5, 4, 4, 0, None) is None and admission_wait(5, 4, 4, 4, 4, 0, None) is not None
    # A trainer batch of two explorer batches: batches 3 and 4 are both trained at step 2 (by v1).
    assert admission_wait(3, 0, 0, 4, 8, 0, None) is not None and admission_wait(3, 1, 1, 4, 8, 0, None) is None
    assert admission_wait(2, 0, 0, 4, 8, 0, None) is not None and admission_wait(1, 0, 0, 4, 8, 0, None) is None
    # The backlog bound is ignored when a staleness bound is set (it implies one).
    assert admission_wait(3, 1, 0, 4, 4, 2, max_backlog=1) is None


def test_admission_control_without_a_bound_caps_the_backlog():
    from rl_engine.schedule import admission_wait

    assert admission_wait(10**6, 0, 0, 4, 4, None, None) is None  # no bound, no backlog cap: never waits
    # At most 3 unconsumed batches: with 5 started and 2 consumed, a 6th may not start.
    assert admission_wait(4, 0, 2, 4, 4, None, 3) is None
    assert "3 batches unconsumed" in admission_wait(5, 0, 2, 4, 4, None, 3)
    # Consumption counts in explorer batches: trainer step 1 of 8 experiences consumed two batches of 4.
    assert admission_wait(4, 0, 1, 4, 8, None, 3) is None and admission_wait(4, 0, 0, 4, 8, None, 3) is not None


def test_batches_needed_covers_the_trainer_steps_and_what_its_reader_lost():
    from rl_engine.schedule import batches_needed

    assert batches_needed(6, 4, 4) == 6  # one explorer batch per trainer step
    assert batches_needed(6, 4, 8) == 12 and batches_needed(6, 8, 4) == 3  # two per step; one per two steps
    assert batches_needed(5, 8, 4) == 3  # 20 experiences: the third batch is trained in part
    assert (
        batches_needed(6, 4, 4, lost_rows=4) == 7 and batches_needed(6, 4, 4, lost_rows=5) == 8
    )  # dropped rows are made up


def test_resumed_plan_pairs_up_and_skips_passed_versions():
    # k=1, m=1, T=8: the explorer had committed steps 1..5, the trainer state is at version 3.
    # Left: syncs after e=5.. delivering e-1 > 3, i.e. {5: 4, 6: 5, 7: 6}.
    from rl_engine.schedule import resumed_rendezvous_syncs

    assert resumed_rendezvous_syncs(8, 1, 1, trainer_version=3, first_step=6) == {6: 5, 7: 6}
    assert resumed_rendezvous_syncs(8, 1, 1, trainer_version=3, first_step=5) == {5: 4, 6: 5, 7: 6}
    # Nothing was lost: a fresh start is the full plan.
    assert resumed_rendezvous_syncs(8, 2, 1, trainer_version=0, first_step=1) == rendezvous_syncs(8, 2, 1)


def test_resumed_explorer_catches_up_to_its_first_steps_version():
    from rl_engine.schedule import resume_catch_up

    # k=1, m=0 (synchronous): trainer state at 2, explorer committed 1..4 (the crashed trainer
    # reached 3): step 5 must be generated by v4, not by the restored v2 (staleness 2 > bound 0).
    assert resume_catch_up(1, 0, trainer_version=2, first_step=5) == 4
    # k=1, m=1: trainer consumed everything committed (state at 6, explorer at 6): v5 is gone, use v6.
    assert resume_catch_up(1, 1, trainer_version=6, first_step=7) == 6
    # k=4, m=0: steps 5..8 are generated by v4.
    assert resume_catch_up(4, 0, trainer_version=0, first_step=7) == 4
    for k in (1, 2, 4):
        for m in (0, 1, 3):
            for t in range(6):
                for first in range(t + 1, t + 2 + k + m):
                    v = resume_catch_up(k, m, t, first)
                    assert v >= t and v <= first - 1  # the trainer can reach it from data already committed


def test_batch_numbers_are_round_robin_over_the_explorers():
    from rl_engine.schedule import batch_number

    assert [batch_number(0, s, 1) for s in (1, 2, 3)] == [1, 2, 3]  # one explorer: its step
    assert [(i, s) for s in (1, 2, 3) for i in (0, 1, 2)] == sorted(
        ((i, s) for i in range(3) for s in (1, 2, 3)), key=lambda x: batch_number(x[0], x[1], 3)
    )
    assert {batch_number(i, s, 3) for i in range(3) for s in range(1, 5)} == set(range(1, 13))  # dense, no number twice


def test_the_readme_command_prints_the_plan(capsys):
    """`python -m rl_engine.schedule 4 0 8` (docs/guides/inspecting.md)."""
    from rl_engine.schedule import main

    main(["4", "0", "8"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "k=4 m=0 T=8: max staleness 3"
    assert lines[4] == "explorer step 4: generated by v0, trained at trainer step 4  -> sync v4"
    assert lines[5] == "explorer step 5: generated by v4, trained at trainer step 5" and len(lines) == 9
