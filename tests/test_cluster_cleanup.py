"""Finished jobs do not pile up: the MPI operator gives ``runPolicy.ttlSecondsAfterFinished`` to the launcher
Job only, so laneflow removes its own finished MPIJobs once they are older than the block's ``finished_ttl_s``
(a day by default), and never a younger one, nor one that is still running or being deleted. (Through the
emulated cluster, with the ssh key Secret and ConfigMap going with the MPIJob: the RBAC pipeline test in
``tests/test_cluster_pipeline.py``.)"""

from __future__ import annotations

from datetime import UTC, datetime

from tasks.platforms.cluster.training import expired


def test_only_jobs_finished_longer_ago_than_the_ttl_and_not_being_deleted_expire() -> None:
    def job(name: str, condition: str | None, finished: str | None, deleting: bool = False) -> dict:
        status = {"conditions": [{"type": condition, "status": "True"}] if condition else []}
        if finished:
            status["completionTime"] = finished
        metadata = {"name": name, **({"deletionTimestamp": "2026-12-01T00:00:00Z"} if deleting else {})}
        return {"metadata": metadata, "status": status}

    now = datetime(2026, 12, 3, 12, 0, 0, tzinfo=UTC)
    jobs = [job("done-long-ago", "Succeeded", "2026-12-02T11:59:00Z"), job("failed-long-ago", "Failed",
            "2026-12-01T00:00:00Z"), job("done-just-now", "Succeeded", "2026-12-03T11:00:00Z"),
            job("running", "Running", None), job("no-completion-yet", "Failed", None),
            job("being-deleted", "Succeeded", "2026-11-01T00:00:00Z", deleting=True)]
    assert expired(jobs, now, 86400) == ["done-long-ago", "failed-long-ago"]
