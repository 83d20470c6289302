"""The MPI operator's leader election, as it shows on the API: a ``coordination.k8s.io/v1`` Lease named
``mpi-operator`` in the operator's ``--lock-namespace`` (default ``mpi-operator``), held by the running replica and
renewed while it runs (kubeflow/mpi-operator ``cmd/mpi-operator/app/server.go``: ``resourcelock.LeaseLock``, lease
duration 15 s, retry period 3 s; client-go ``leaderelection`` renews every retry period). An operator that stopped
leaves the Lease as it was, its ``renewTime`` growing old: what ``laneflow doctor`` reads to tell a running
controller from a CRD alone. The emulator's operator renews it on its one-second tick while
``Cluster.mpi_operator_installed``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tests.cluster.objects import stamp_metadata

if TYPE_CHECKING:
    from tests.cluster.state import Cluster

LOCK_NAMESPACE = "mpi-operator"
LEASE_NAME = "mpi-operator"
LEASE_DURATION_S = 15
RETRY_PERIOD_S = 3
#: The holder's identity: the pod's hostname and a uuid (server.go ``id = hostname + "_" + uuid``).
HOLDER = "mpi-operator-7f5c9d8b6-x2kqp_3f1b5a9e-0c4d-4e8a-9b1f-2d6c7a8e9f01"


def micro_time(at: float) -> str:
    """metav1.MicroTime as the API writes it (RFC 3339 with microseconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1e6):06d}Z"


def renew_leader_lease(cluster: Cluster) -> None:
    """While the operator runs: its Lease taken (first time) or renewed (every retry period). Under the lock."""
    if not cluster.mpi_operator_installed:
        return
    if ("", LOCK_NAMESPACE) not in cluster.objects["namespaces"]:
        cluster.add_namespace(LOCK_NAMESPACE)
    lease = cluster.objects["leases"].get((LOCK_NAMESPACE, LEASE_NAME))
    now = time.time()
    if lease is None:
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": LEASE_NAME, "namespace": LOCK_NAMESPACE},
                 "spec": {"holderIdentity": HOLDER, "leaseDurationSeconds": LEASE_DURATION_S,
                          "acquireTime": micro_time(now), "renewTime": micro_time(now), "leaseTransitions": 0}}
        stamp_metadata(cluster, lease, LOCK_NAMESPACE)
        cluster.objects["leases"][(LOCK_NAMESPACE, LEASE_NAME)] = lease
        cluster.lease_renewed_at[(LOCK_NAMESPACE, LEASE_NAME)] = now
        return
    renewed = cluster.lease_renewed_at.get((LOCK_NAMESPACE, LEASE_NAME), 0.0)
    if now - renewed >= RETRY_PERIOD_S:
        lease = {**lease, "spec": {**lease["spec"], "renewTime": micro_time(now)}}
        cluster.objects["leases"][(LOCK_NAMESPACE, LEASE_NAME)] = lease
        cluster.lease_renewed_at[(LOCK_NAMESPACE, LEASE_NAME)] = now
