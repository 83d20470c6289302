"""The cluster platform's API calls under faults: 429, 5xx, resets and lost answers are retried until
the pipeline succeeds with one object of each kind; a hung call times out and is tried again; a 403 is
not retried and names the permission (tasks/platforms/cluster/api.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from flows.train import train_pipeline
from tests.cluster import Fault
from tests.cluster_platform_helpers import cluster_platform, create_rwo_claim, saved
from tests.test_pipeline import params_for

pytestmark = pytest.mark.slow


def test_faults_per_call_type_end_in_success_with_one_of_each(prefect_server: dict, laneflow_home: Path,
                                                              served_archive: tuple[str, str],
                                                              emulator: tuple) -> None:
    emu, cluster = emulator
    # An existing ReadWriteOnce claim, as the seed had it: adopted, and its PV patched to RWX.
    create_rwo_claim(emu, "legacy")
    cluster.requests.clear()
    reset = Fault(status=0)
    lost_answer = Fault(status=0, after_effect=True)
    throttled = Fault(status=429, retry_after=1)
    for call in [("GET", "persistentvolumeclaims"), ("POST", "mpijobs"), ("POST", "volumesnapshots"),
                 ("GET", "mpijobs"), ("PATCH", "persistentvolumes"), ("POST", "jobs"), ("GET", "pods/log")]:
        cluster.inject(*call, throttled, Fault(status=500), reset)
    cluster.inject("POST", "mpijobs", lost_answer)
    cluster.inject("POST", "volumesnapshots", lost_answer)
    # The backoff's shape, without its 0.5 s start; the seed's claim named as one to adopt.
    name = saved(emu, "emu-faults", api_retry_delay_s=0.05, adopt_claims=["legacy"])
    # One worker for two steps: the faults are on the orchestration's calls, not in the ranks.
    result = train_pipeline(**params_for(served_archive, platform=name, volume="legacy", workers=1, max_steps=2))
    assert result["steps"] == 2
    assert (cluster.count("persistentvolumeclaims"), cluster.count("mpijobs"), cluster.count("volumesnapshots")) \
        == (1, 1, 1)
    (pv,) = cluster.objects["persistentvolumes"].values()
    assert pv["spec"]["accessModes"] == ["ReadWriteMany"]
    assert not any(queue for queue in cluster.faults.values())  # every injected fault was met


def test_a_hung_api_call_times_out_and_is_tried_again_instead_of_blocking(emulator: tuple) -> None:
    # The tasks set no Prefect timeout (it cannot interrupt a worker thread): the client's own must hold.
    emu, cluster = emulator
    create_rwo_claim(emu, "legacy")
    cluster.requests.clear()
    released = threading.Event()
    cluster.inject("GET", "persistentvolumeclaims", Fault(hang=released))
    platform = cluster_platform(emu, api_timeout_s=1.0, adopt_claims=["legacy"])
    outcome: list = []
    caller = threading.Thread(target=lambda: outcome.append(platform.ensure_volume("legacy")), daemon=True)
    try:
        caller.start()
        caller.join(timeout=120)  # a liveness bound, not a speed check: without a timeout it never returns
        assert not caller.is_alive(), "ensure_volume is still blocked on the unanswered call"
    finally:
        released.set()
    assert outcome and not outcome[0].created  # the claim was found by the second try
    assert [r.verb for r in cluster.requests if r.resource == "persistentvolumeclaims"] == ["get", "get"]


def test_forbidden_is_not_retried_and_names_the_permission(prefect_server: dict, laneflow_home: Path,
                                                           served_archive: tuple[str, str],
                                                           emulator: tuple) -> None:
    emu, cluster = emulator
    cluster.inject("PATCH", "persistentvolumes", Fault(status=403))
    create_rwo_claim(emu, "legacy")
    name = saved(emu, "emu-403", adopt_claims=["legacy"])
    state = train_pipeline(**params_for(served_archive, platform=name, volume="legacy"), return_state=True)
    assert state.is_failed()
    said = str(state.result(raise_on_failure=False))
    assert "may not 'patch' persistentvolumes" in said and "kubectl apply -k deployments/rwo-claims" in said
    assert sum(1 for r in cluster.requests if (r.method, r.resource) == ("PATCH", "persistentvolumes")) == 1
    assert cluster.count("mpijobs") == 0
