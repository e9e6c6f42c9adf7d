"""The rendezvous and decoupled schedules against the table in DESIGN.md, worked by hand."""

from __future__ import annotations

import pytest

from rl_engine.schedule import (
    max_rendezvous_staleness,
    rendezvous_syncs,
    rendezvous_version,
    staleness_ok,
    trainer_sync_versions,
)

# (k, m): generating version of explorer steps 1..8, written out from the DESIGN.md pictures.
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


def test_decoupled_staleness_gate():
    assert staleness_ok(0, 10, None)
    assert staleness_ok(3, 5, 2) and not staleness_ok(2, 5, 2)


def test_resumed_plan_pairs_up_and_skips_passed_versions():
    # k=1, m=1, T=8: the explorer had committed steps 1..5, the trainer state is at version 3.
    # Left: syncs after e=5.. delivering e-1 > 3, i.e. {5: 4, 6: 5, 7: 6}.
    from rl_engine.schedule import resumed_rendezvous_syncs

    assert resumed_rendezvous_syncs(8, 1, 1, trainer_version=3, first_step=6) == {6: 5, 7: 6}
    assert resumed_rendezvous_syncs(8, 1, 1, trainer_version=3, first_step=5) == {5: 4, 6: 5, 7: 6}
    # Nothing was lost: a fresh start is the full plan.
    assert resumed_rendezvous_syncs(8, 2, 1, trainer_version=0, first_step=1) == rendezvous_syncs(8, 2, 1)
