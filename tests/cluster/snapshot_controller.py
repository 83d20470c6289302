"""The snapshot controller (kubernetes-csi/external-snapshotter v8.6 ``pkg/common-controller``): a
VolumeSnapshot of a PVC becomes a copy of the claim's folder and ``readyToUse``; it retries, keeps only the
last error in ``status.error`` and clears it when ``readyToUse`` turns true.
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

from tests.cluster.objects import later, now, record_event
from tests.cluster.pv_binder import copy_volume_tree

if TYPE_CHECKING:
    from tests.cluster.state import Cluster


def start_snapshot(cluster: Cluster, snapshot: dict) -> None:
    namespace, name = snapshot["metadata"]["namespace"], snapshot["metadata"]["name"]
    snapshot["status"] = {"readyToUse": False}
    attempts = {"n": 0}

    def attempt() -> None:
        if cluster.objects["volumesnapshots"].get((namespace, name)) is not snapshot:
            return
        attempts["n"] += 1
        error = _snapshot_problem(cluster, snapshot, attempts["n"])
        if error:
            # updateSnapshotErrorStatusWithEvent: the last error, with an event; retried with back-off.
            if (snapshot["status"].get("error") or {}).get("message") != error:
                snapshot["status"]["error"] = {"message": error, "time": now()}
                record_event(cluster, snapshot, "Warning", "SnapshotCreationFailed", error, "snapshot-controller")
            later(cluster, 0.3, attempt)
            return
        claim = snapshot["spec"]["source"]["persistentVolumeClaimName"]
        target = cluster.root / "snapshots" / namespace / name
        try:
            shutil.rmtree(target, ignore_errors=True)  # what a failed attempt left
            copy_volume_tree(cluster.claim_dir(namespace, claim), target)  # the whole volume
        except OSError as failed:  # the CSI driver's CreateSnapshot failed: an error, retried as any other
            snapshot["status"]["error"] = {"message": f"Failed to create snapshot: {failed}", "time": now()}
            record_event(cluster, snapshot, "Warning", "SnapshotCreationFailed", str(failed), "snapshot-controller")
            later(cluster, 0.3, attempt)
            return
        # restoreSize: the size the CSI driver reports for the snapshot (CreateSnapshot's size_bytes); for a
        # filesystem volume as ANF's, the source volume's size (external-snapshotter sets it from the driver).
        pv = cluster.objects["persistentvolumes"][("", cluster.objects["persistentvolumeclaims"][(namespace, claim)]
                                                   ["spec"]["volumeName"])]
        snapshot["status"] = {"readyToUse": True, "creationTime": now(),
                              "restoreSize": pv["spec"]["capacity"]["storage"],
                              "boundVolumeSnapshotContentName": f"snapcontent-{snapshot['metadata']['uid']}"}

    later(cluster, 0.05, attempt)


def _snapshot_problem(cluster: Cluster, snapshot: dict, attempt: int) -> str | None:
    namespace = snapshot["metadata"]["namespace"]
    if cluster.snapshot_error:
        return cluster.snapshot_error
    class_name = snapshot["spec"].get("volumeSnapshotClassName")
    if class_name and ("", class_name) not in cluster.objects["volumesnapshotclasses"]:
        return (f"Failed to get snapshot class with error volumesnapshotclass.snapshot.storage.k8s.io "
                f"\"{class_name}\" not found")
    claim = snapshot["spec"]["source"].get("persistentVolumeClaimName")
    if (namespace, claim) not in cluster.objects["persistentvolumeclaims"]:
        return f"PVC source for snapshot {namespace}/{snapshot['metadata']['name']} is missing"
    if attempt <= cluster.snapshot_conflicts:
        content = f"snapcontent-{snapshot['metadata']['uid']}"
        return (f"Failed to create snapshot: failed to add VolumeSnapshotBeingCreated annotation on the content "
                f"{content}: \"snapshot controller failed to update {content} on API server: Operation cannot be "
                f"fulfilled on volumesnapshotcontents.snapshot.storage.k8s.io \\\"{content}\\\": the object has "
                "been modified; please apply your changes to the latest version and try again\"")
    return None
