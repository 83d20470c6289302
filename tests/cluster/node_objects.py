"""The nodes as the API serves them (``GET /api/v1/nodes``): v1 Node objects rendered from the emulator's
``Node`` records, which stay the truth (the scheduler, drains and spot preemptions change those).

Read-only here: on a real cluster the kubelet writes its Node's status and administrators patch labels, taints
and ``spec.unschedulable`` (``kubectl cordon``); here tests change ``cluster.nodes`` instead, and a write through the
API answers 405 (the emulator's limit, not kube-apiserver's). Rendered as the kubelet reports them
(pkg/kubelet/nodestatus/setters.go: ``capacity``/``allocatable`` quantities, the ``Ready`` condition) and as
``kubectl cordon`` leaves them (``spec.unschedulable``, and the ``node.kubernetes.io/unschedulable:NoSchedule``
taint the node lifecycle controller adds, pkg/controller/nodelifecycle ``taintNodeByCondition``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.cluster.state import Cluster, Node

UNSCHEDULABLE_TAINT = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
NOT_READY_TAINT = {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"}


def _quantity(resource: str, amount: int) -> str:
    """A resource amount as a quantity string: CPU in millicores (``7820m``), the rest as plain integers."""
    return f"{amount}m" if resource == "cpu" else str(amount)


def node_object(node: Node, created: str) -> dict:
    """``node`` as a v1 Node."""
    taints = [dict(taint) for taint in node.taints]
    if node.unschedulable:
        taints.append(dict(UNSCHEDULABLE_TAINT))
    if not node.ready:
        taints.append(dict(NOT_READY_TAINT))
    quantities = {resource: _quantity(resource, amount) for resource, amount in node.capacity.items()}
    ready = {"type": "Ready", "status": "True" if node.ready else "Unknown",
             "reason": "KubeletReady" if node.ready else "NodeStatusUnknown",
             "message": "kubelet is posting ready status" if node.ready else "Kubelet stopped posting node status."}
    spec: dict = {"taints": taints} if taints else {}
    if node.unschedulable:
        spec["unschedulable"] = True
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node.name, "uid": f"node-{node.name}", "labels": dict(node.labels),
                         "creationTimestamp": created},
            "spec": spec, "status": {"capacity": quantities, "allocatable": dict(quantities), "conditions": [ready]}}


def sync_node_objects(cluster: Cluster, created: str) -> None:
    """Bring ``cluster.objects["nodes"]`` up to date with ``cluster.nodes`` (under the cluster's lock): a node
    whose rendering changed is replaced (the watch cache gives it a new resourceVersion), a node gone is removed."""
    store = cluster.objects["nodes"]
    for name, node in cluster.nodes.items():
        current = store.get(("", name))
        rendered = node_object(node, current["metadata"]["creationTimestamp"] if current else created)
        if current is None or {k: v for k, v in current.items() if k != "metadata"} != \
                {k: v for k, v in rendered.items() if k != "metadata"} or \
                current["metadata"]["labels"] != rendered["metadata"]["labels"]:
            store[("", name)] = rendered
    for key in [key for key in store if key[1] not in cluster.nodes]:
        del store[key]
