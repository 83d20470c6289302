"""How often the ranks agree on a stop: by time, not by a count of steps, and at the same steps on every rank."""

from __future__ import annotations

import itertools
import json
import math
import sys
import textwrap
from pathlib import Path

import pytest

from tasks.processes import run_to_end
from training.stop_request import STOP_CHECK_MOST_EVERY, STOP_HEARD_WITHIN_S, steps_between_checks

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(("seconds_per_step", "steps"), [
    (7.0, 1),  # a slow step (a CPU run, a drained node's neighbour): every step, or the grace period runs out first
    (STOP_HEARD_WITHIN_S, 1),
    (0.5, 4),
    (0.001, STOP_CHECK_MOST_EVERY),  # fast steps: as often as ever, never less often
    (0.0, 1),  # a clock that did not move: no pace known, so the next step
    (math.nan, 1),
])
def test_steps_between_checks_fit_the_time_a_stop_may_take(seconds_per_step: float, steps: int) -> None:
    assert steps_between_checks(seconds_per_step) == steps


#: Two ranks at different paces (rank 0, whose pace decides, is the slower one; in training the gradients' allreduce
#: keeps them in step): each prints the steps it agreed at and what it heard. A stop is raised on rank 1 alone from
#: step 5 on.
TWO_RANKS = textwrap.dedent("""
    import json, time
    from training.stop_request import StopCadence
    from training.run_parts import Distributed

    dist = Distributed()
    cadence, agreed = StopCadence(0), []
    for step in range(1, 17):
        time.sleep(0.5 if dist.rank == 0 else 0.05)
        if cadence.due(step):
            (stopping,) = cadence.agree(dist, step, (dist.rank == 1 and step >= 5,))
            agreed.append([step, stopping])
    print("AGREED " + json.dumps({"rank": dist.rank, "agreed": agreed}), flush=True)
""")


def test_ranks_at_different_paces_agree_at_the_same_steps_and_hear_a_stop_within_the_time(tmp_path: Path) -> None:
    script = tmp_path / "cadence.py"
    script.write_text(TWO_RANKS)
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    done = run_to_end([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                       str(script)], timeout_s=300, env=env, cwd=REPO)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    said = {report["rank"]: report["agreed"] for report in
            (json.loads(line.split("AGREED ", 1)[1]) for line in done.stdout.splitlines() if "AGREED " in line)}
    assert set(said) == {0, 1}, done.stdout[-3000:]
    assert said[0] == said[1]  # the same steps and counts: a rank calling the collective alone would hang the job
    steps = [step for step, _ in said[0]]
    assert steps[0] == 1  # no pace known at the start: the first step checks
    # Every step of rank 0 takes at least 0.5 s, so no more than 4 go by unchecked (rank 1 alone would say 5).
    assert all(later - earlier <= int(STOP_HEARD_WITHIN_S // 0.5) for earlier, later in itertools.pairwise(steps))
    assert [stopping for _, stopping in said[0]] == [int(step >= 5) for step in steps]
