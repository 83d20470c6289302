"""The soak's pure parts (tests/soak.py): a seed's plan, the resumptions read from a run's record, and the
invariants — each shown to catch what it is for."""

from __future__ import annotations

from tests.soak import DISRUPTIONS, ONCE, RunRecord, broken_invariants, plan, resumptions


def test_a_seed_draws_the_same_plan_every_time_and_seeds_differ() -> None:
    assert plan(4, 2, 2) == plan(4, 2, 2) and plan(4, 2, 2) != plan(5, 2, 2)
    drawn = plan(1, 3, 6)
    assert len(drawn.runs) == 3 and len(drawn.disruptions) == 6 and drawn.replay() == "make soak SEED=1"
    assert all(hit.kind in DISRUPTIONS and 0 <= hit.run < 3 and 2 <= hit.at_step < 12 for hit in drawn.disruptions)


def test_a_seed_runs_at_most_one_sweep_and_one_nightly() -> None:
    """A second nightly would be refused by its deployment's limit of one, a second sweep of the study by its lease:
    each kind is drawn once at most, and a seed draws every kind sooner or later."""
    plans = [plan(seed, 6, 1) for seed in range(40)]
    assert all(sum(kind == once for kind in drawn.runs) <= 1 for drawn in plans for once in ONCE)
    assert {kind for drawn in plans for kind in drawn.runs} == {"plain", "elastic", "single", "sweep", "nightly"}


def test_resumptions_pair_each_resumed_start_with_the_last_checkpoint_before_it() -> None:
    record = [{"event": "start", "step": 0, "resumed": False}, {"event": "checkpoint", "step": 4},
              {"event": "step", "step": 5}, {"event": "checkpoint", "step": 6}, {"event": "preempted", "step": 6},
              {"event": "start", "step": 6, "resumed": True}, {"event": "checkpoint", "step": 8},
              {"event": "start", "step": 4, "resumed": True}]
    assert resumptions(record) == [(6, 6), (4, 8)]


def test_each_invariant_is_broken_by_what_it_guards_against() -> None:
    good = RunRecord(0, "plain", "id0", "Completed", resumptions=[(6, 6), (9, 8)])
    assert broken_invariants([good], 0, [], []) == []
    lost = RunRecord(1, "plain", "id1", "Completed", resumptions=[(4, 8)])
    bare = RunRecord(2, "single", "id2", "Failed", "MPIJob x failed (training failed with exit code 1); pods: none")
    classified = RunRecord(3, "elastic", "id3", "Failed", "StageBlocked: pod x is not running (Unschedulable: ...); "
                                                          "add nodes with those resources")
    crashed = RunRecord(4, "plain", "id4", "Crashed", "No active or succeeded pods found for any job")
    broken = broken_invariants([lost, bare, classified, crashed], 1, ["train-x-worker-0"], ["mpijobs/train-x"],
                               ["tusimple on pool-premium"], ["soak.journal: trial(s) [1] still RUNNING"])
    assert [line.split(" ")[0:2] for line in broken] == [["run", "1"], ["run", "2"], ["run", "4"], ["1", "'gpu'"],
                                                         ["still", "running"], ["left", "past"], ["ANF", "volume"],
                                                         ["study", "not"]], broken
