"""Which controller of the emulated cluster acts on what, as kube-controller-manager (and the MPI operator's
own manager) wire them: a new object goes to its kind's controller (``CONTROLLERS``: the PV binder, the
Job controller, the MPI operator, the snapshot controller), and a change of an owned object makes the
owner's controller sync the owner (``sync_owner``), as each controller's informers on the kinds it owns
do (the Job controller watches its pods; the MPI operator its pods and its launcher Job).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tests.cluster.job_controller import start_job, sync_job
from tests.cluster.mpi_operator import start_mpijob, sync_mpijob
from tests.cluster.network_policy import enforce
from tests.cluster.objects import resource_of
from tests.cluster.pv_binder import bind_pvc
from tests.cluster.snapshot_controller import start_snapshot

if TYPE_CHECKING:
    from tests.cluster.state import Cluster


def _owner_of(cluster: Cluster, obj: dict) -> dict | None:
    for reference in obj["metadata"].get("ownerReferences") or []:
        resource = resource_of(reference["kind"])
        owner = cluster.objects[resource].get((obj["metadata"].get("namespace", ""), reference["name"]))
        if owner and owner["metadata"]["uid"] == reference["uid"]:
            return owner
    return None


def sync_owner(cluster: Cluster, obj: dict) -> None:
    """``obj`` changed (a pod ended, a launcher Job finished): the controller of its owner syncs the owner."""
    owner = _owner_of(cluster, obj)
    if owner is None:
        return
    if owner["kind"] == "Job":
        sync_job(cluster, owner)
    elif owner["kind"] == "MPIJob":
        sync_mpijob(cluster, owner)


CONTROLLERS: dict[str, Callable[[Cluster, dict], None]] = {
    "persistentvolumeclaims": bind_pvc, "jobs": start_job, "mpijobs": start_mpijob, "volumesnapshots": start_snapshot,
    "networkpolicies": lambda cluster, _: enforce(cluster)}
