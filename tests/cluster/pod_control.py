"""How a controller creates a pod from its template (kubernetes ``pkg/controller/controller_utils.go``
``PodControl.CreatePods``), through the API server's admission: the ServiceAccount plugin refuses a pod
whose service account does not exist (a Warning event on the owner), LimitRanger gives its containers
the namespace's defaults; the new pod waits ContainerCreating. The Job controller and the MPI operator
make their pods here.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from tests.cluster.admission import limit_range_defaults
from tests.cluster.kubelet import set_container_state
from tests.cluster.objects import controller_ref, record_event, stamp_metadata
from tests.cluster.state import OPERATOR

if TYPE_CHECKING:
    from tests.cluster.state import Cluster


def make_pod(cluster: Cluster, owner: dict, name: str, template: dict, extra_labels: dict) -> dict | None:
    """A pod from a template, admitted as the API server admits it: its service account must exist."""
    namespace = owner["metadata"]["namespace"]
    spec = copy.deepcopy(template.get("spec") or {})
    limit_range_defaults(cluster, namespace, spec)
    account = spec.get("serviceAccountName", "default")
    if cluster.rbac_enforced and account != "default" and \
            (namespace, account) not in cluster.objects["serviceaccounts"]:
        component = OPERATOR if owner["kind"] == "MPIJob" else "job-controller"
        reason = "MPIJobFailed" if owner["kind"] == "MPIJob" else "FailedCreate"
        record_event(cluster, owner, "Warning", reason,
                     f'Error creating: pods "{name}" is forbidden: error looking up service account '
                     f'{namespace}/{account}: serviceaccount "{account}" not found', component)
        return None
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": namespace,
                        "labels": {**((template.get("metadata") or {}).get("labels") or {}), **extra_labels},
                        "ownerReferences": [controller_ref(owner)]},
           "spec": spec, "status": {"phase": "Pending"}}
    stamp_metadata(cluster, pod, namespace)
    set_container_state(pod, {"waiting": {"reason": "ContainerCreating"}}, ready=False)
    cluster.objects["pods"][(namespace, name)] = pod
    return pod
