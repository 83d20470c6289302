"""PVC binding: kube-controller-manager's PV controller (``pkg/controller/volume/persistentvolume``) with
the CSI driver's external-provisioner (kubernetes-csi/external-provisioner ``pkg/controller/controller.go``).
A PVC binds to a new PV (a folder here) of its class; a PVC restored from a VolumeSnapshot is provisioned
only from a ready snapshot (a copy of its folder); a class that does not exist, or a snapshot that is
not ready, is a ``ProvisioningFailed`` Warning.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from tests.cluster.objects import record_event, stamp_metadata
from tests.cluster.quantities import quantity_bytes
from tests.cluster.state import STORAGE_CLASS

if TYPE_CHECKING:
    from tests.cluster.state import Cluster


def bind_pvc(cluster: Cluster, pvc: dict) -> None:
    namespace, name = pvc["metadata"]["namespace"], pvc["metadata"]["name"]
    pvc["status"] = {"phase": "Pending"}
    storage_class = pvc["spec"].get("storageClassName")
    if storage_class and ("", storage_class) not in cluster.objects["storageclasses"]:
        # kube-controller-manager's PV controller (pkg/controller/volume/persistentvolume/pv_controller.go
        # provisionClaimOperation -> findProvisionablePlugin): the class lister's NotFound, as a Warning.
        record_event(cluster, pvc, "Warning", "ProvisioningFailed",
                     f'storageclass.storage.k8s.io "{storage_class}" not found', "persistentvolume-controller")
        return
    source = pvc["spec"].get("dataSource")
    if source and source.get("kind") == "VolumeSnapshot":
        # external-provisioner getSnapshotSource: same namespace, bound and readyToUse, big enough.
        snapshot = cluster.objects["volumesnapshots"].get((namespace, source["name"]))
        problem = None
        if snapshot is None or not (snapshot.get("status") or {}).get("boundVolumeSnapshotContentName"):
            problem = f"snapshot {source['name']} not bound"
        elif not snapshot["status"].get("readyToUse"):
            problem = f"snapshot {source['name']} is not Ready"
        else:
            requested = quantity_bytes(str(pvc["spec"]["resources"]["requests"]["storage"]))
            restore_size = quantity_bytes(str(snapshot["status"]["restoreSize"]))
            if requested < restore_size:
                problem = (f"requested volume size {requested} is less than the size {restore_size} for the source "
                           f"snapshot {source['name']}")
        if problem:
            record_event(cluster, pvc, "Warning", "ProvisioningFailed", f"failed to provision volume with "
                         f"StorageClass \"{pvc['spec'].get('storageClassName')}\": error getting handle for "
                         f"DataSource Type VolumeSnapshot by Name {source['name']}: {problem}",
                         "csi.trident.netapp.io")
            return
    pv_name = f"pvc-{pvc['metadata']['uid']}"
    folder = cluster.root / "pv" / pv_name
    if source and source.get("kind") == "VolumeSnapshot":
        copy_volume_tree(cluster.root / "snapshots" / namespace / source["name"], folder)
    else:
        # A new ANF volume's root directory: owned by root, ``0770`` (Azure NetApp Files "Configure Unix
        # permissions": "The Unix permissions setting is set to 0770 by default"): a pod writes to it as root or
        # with group 0, which is why laneflow's non-root pods run with runAsGroup 0.
        folder.mkdir(parents=True)
        folder.chmod(0o770)
    modes = list(pvc["spec"].get("accessModes") or cluster.initial_pv_modes)
    if pvc["spec"].get("storageClassName") is None:
        modes = list(cluster.initial_pv_modes)
    # Trident's CSI volume (NetApp/trident frontend/csi/controller_server.go getCSIVolumeFromTridentVolume): the
    # handle is the Trident volume's name (the PV's), the attributes name its backend and internal name, and
    # since 23.01 ``internalID``, the storage's own id (for ANF: the volume's Azure resource id,
    # storage_drivers/azure/azure_anf.go Create). The external-provisioner adds its identity.
    attributes = {"backendUUID": "8b1a3f56-2c1e-4b8e-9f0d-5a7c1e2d3b4f", "name": pv_name, "internalName": pv_name,
                  "protocol": "file", "storage.kubernetes.io/csiProvisionerIdentity": "1700000000000-8081-"
                                                                                       "csi.trident.netapp.io"}
    if cluster.anf_backend is not None:
        attributes["internalID"] = cluster.anf_backend(
            namespace, name, pv_name, quantity_bytes(str(pvc["spec"]["resources"]["requests"]["storage"])))
        attributes["internalName"] = attributes["internalID"].rsplit("/", 1)[-1]
    pv = {"apiVersion": "v1", "kind": "PersistentVolume",
          "metadata": {"name": pv_name},
          "spec": {"accessModes": modes, "capacity": pvc["spec"]["resources"]["requests"],
                   "claimRef": {"namespace": namespace, "name": name, "uid": pvc["metadata"]["uid"]},
                   "persistentVolumeReclaimPolicy": "Retain",
                   "storageClassName": pvc["spec"].get("storageClassName") or STORAGE_CLASS,
                   "csi": {"driver": "csi.trident.netapp.io", "volumeHandle": pv_name,
                           "volumeAttributes": attributes}},
          "status": {"phase": "Bound"}}
    stamp_metadata(cluster, pv, None)
    cluster.objects["persistentvolumes"][("", pv_name)] = pv
    pvc["spec"]["volumeName"] = pv_name
    pvc["status"] = {"phase": "Bound", "accessModes": modes, "capacity": pvc["spec"]["resources"]["requests"]}


def copy_volume_tree(source: Path, target: Path) -> None:
    """A whole volume's files, with their owners, modes and links (a snapshot, a volume made from one): what
    the storage keeps, so a non-root pod can go on writing what it wrote before."""
    target.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["cp", "-a", "--", str(source), str(target)], capture_output=True, text=True)
    problems = [line for line in done.stderr.splitlines() if not _VANISHED.match(line)]
    if done.returncode != 0 and (problems or not done.stderr.strip()):
        raise OSError(f"copying {source} to {target}: {done.stderr.strip()}")


#: A file that pods removed or renamed while ``cp`` walked the volume (a checkpoint's temporary file). A
#: storage snapshot is taken at one instant; this copy is not, so what vanished mid-copy is left out, as a
#: snapshot taken a moment later would have; everything else is copied (cp goes on after such a file).
_VANISHED = re.compile(r"^cp: cannot (stat|open|access) '.*': No such file or directory$")
