"""How a controller creates a pod from its template (kubernetes ``pkg/controller/controller_utils.go``
``PodControl.CreatePods``), through the API server's admission: the ServiceAccount plugin refuses a pod
whose service account does not exist (a Warning event on the owner), LimitRanger gives its containers
the namespace's defaults; the new pod waits ContainerCreating. The Job controller and the MPI operator
make their pods here.
"""

from __future__ import annotations

import copy
import secrets
from typing import TYPE_CHECKING

from tests.cluster.admission import limit_range_defaults
from tests.cluster.authentication import POD_TOKEN_SECONDS
from tests.cluster.kubelet import set_container_state
from tests.cluster.objects import controller_ref, record_event, stamp_metadata
from tests.cluster.state import OPERATOR

if TYPE_CHECKING:
    from tests.cluster.state import Cluster


#: Where the ServiceAccount admission plugin mounts a pod's API credentials (plugin/pkg/admission/serviceaccount
#: admission.go ``DefaultAPITokenMountPath``), and what in-cluster clients read there.
TOKEN_MOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def mount_token(cluster: Cluster, namespace: str, spec: dict, account: str) -> None:
    """The ServiceAccount admission plugin's projected volume (``kube-api-access-<random>``: a bound token
    of 3607 s, the cluster's CA from the ``kube-root-ca.crt`` ConfigMap, the pod's namespace; defaultMode
    0644), mounted read-only in every container — unless the pod or its service account sets
    ``automountServiceAccountToken: false``, or a container already mounts something there."""
    sa = cluster.objects["serviceaccounts"].get((namespace, account)) or {}
    if spec.get("automountServiceAccountToken", sa.get("automountServiceAccountToken", True)) is False:
        return
    name = f"kube-api-access-{secrets.token_hex(3)[:5]}"
    spec.setdefault("volumes", []).append({"name": name, "projected": {"defaultMode": 420, "sources": [
        {"serviceAccountToken": {"expirationSeconds": POD_TOKEN_SECONDS, "path": "token"}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"},
                                    "path": "namespace"}]}}]}})
    for container in spec.get("containers") or []:
        mounts = container.setdefault("volumeMounts", [])
        if not any(mount.get("mountPath") == TOKEN_MOUNT_PATH for mount in mounts):
            mounts.append({"name": name, "readOnly": True, "mountPath": TOKEN_MOUNT_PATH})


def make_pod(cluster: Cluster, owner: dict, name: str, template: dict, extra_labels: dict) -> dict | None:
    """A pod from a template, admitted as the API server admits it: its service account must exist."""
    namespace = owner["metadata"]["namespace"]
    spec = copy.deepcopy(template.get("spec") or {})
    limit_range_defaults(cluster, namespace, spec)
    account = spec.get("serviceAccountName", "default")
    if cluster.rbac_enforced and account != "default" and \
            (namespace, account) not in cluster.objects["serviceaccounts"]:
        error = (f'pods "{name}" is forbidden: error looking up service account {namespace}/{account}: '
                 f'serviceaccount "{account}" not found')
        if owner["kind"] == "MPIJob":  # mpi_job_controller.go getOrCreateWorker
            record_event(cluster, owner, "Warning", "MPIJobFailed", f"worker pod created failed: {error}", OPERATOR)
        else:  # controller_utils.go CreatePods: FailedCreate "Error creating: <error>"
            record_event(cluster, owner, "Warning", "FailedCreate", f"Error creating: {error}", "job-controller")
        return None
    mount_token(cluster, namespace, spec, account)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": namespace,
                        "labels": {**((template.get("metadata") or {}).get("labels") or {}), **extra_labels},
                        "ownerReferences": [controller_ref(owner)]},
           "spec": spec, "status": {"phase": "Pending"}}
    stamp_metadata(cluster, pod, namespace)
    set_container_state(pod, {"waiting": {"reason": "ContainerCreating"}}, ready=False)
    cluster.objects["pods"][(namespace, name)] = pod
    return pod
