"""The kubelet's volumes (kubernetes ``pkg/kubelet/volumemanager`` and the volume plugins of
``pkg/volume``): a container's ``volumeMounts`` made concrete before it starts, as host folders the
container runtime binds (``runtime.Mount``). PVCs are their PV's folder (``readOnly`` honoured); Secret
and ConfigMap volumes are files laid out as the kubelet's atomic writer lays them out, with their modes,
mounted read-only (a Secret's on a tmpfs whose root is 1777, a ConfigMap's in a 0777 folder, as the kubelet's
emptyDir makes them); ``emptyDir`` is a folder of the pod, or a tmpfs of ``sizeLimit`` for ``medium: Memory``.
A Secret or ConfigMap that does not exist, or an NFS export that refuses the node, fails the mount
(``MountFailure``: the pod stays ContainerCreating with a ``FailedMount`` event, retried).
"""

from __future__ import annotations

import base64
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tests.cluster.quantities import quantity_bytes
from tests.cluster.runtime import Mount

if TYPE_CHECKING:
    from tests.cluster.state import Cluster


class MountFailure(Exception):
    """A volume the kubelet cannot set up: the pod stays ContainerCreating, a FailedMount Warning says why."""

    def __init__(self, volume: str, detail: str) -> None:
        super().__init__(f'MountVolume.SetUp failed for volume "{volume}" : {detail}')


def container_mounts(cluster: Cluster, pod: dict, container: dict, folder: Path) -> list[Mount]:
    """The container's volumeMounts made concrete, as the kubelet's volume manager would. A Secret or
    ConfigMap that does not exist, or an NFS export that refuses the node, is a ``MountFailure``
    (pkg/volume/secret ``SetUpAt``: ``secret "<name>" not found``; the CSI driver's NodePublishVolume error
    for NFS) — not a CreateContainerConfigError, which is for env references."""
    namespace = pod["metadata"]["namespace"]
    volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    mounts = []
    for mount in container.get("volumeMounts") or []:
        volume = volumes.get(mount["name"])
        if volume is None:
            raise LookupError(f'volumeMount "{mount["name"]}" names no volume of the pod')
        if mount.get("subPath"):
            raise LookupError(f'volumeMount "{mount["name"]}": subPath is not emulated')
        target, readonly = mount["mountPath"], bool(mount.get("readOnly"))
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            pvc = cluster.objects["persistentvolumeclaims"].get((namespace, claim))
            if pvc is None or (pvc.get("status") or {}).get("phase") != "Bound":
                raise LookupError(f'persistentvolumeclaim "{claim}" not found or not bound')
            readonly = readonly or bool(volume["persistentVolumeClaim"].get("readOnly"))
            if (namespace, claim) in cluster.nfs_refused:
                pv = pvc["spec"]["volumeName"]
                raise MountFailure(pv, f"rpc error: code = Internal desc = error mounting NFS volume "
                                       f"10.0.0.4:/{pv} on mountpoint /var/lib/kubelet/pods/{pod['metadata']['uid']}"
                                       f"/volumes/kubernetes.io~csi/{pv}/mount: exit status 32: mount.nfs: access "
                                       f"denied by server while mounting 10.0.0.4:/{pv}")
            mounts.append(Mount(target, cluster.claim_dir(namespace, claim), readonly))
        elif "secret" in volume or "configMap" in volume:
            kind, source = ("secrets", volume["secret"]) if "secret" in volume else ("configmaps", volume["configMap"])
            name = source.get("secretName") or source.get("name")
            obj = cluster.objects[kind].get((namespace, name))
            if obj is None:
                raise MountFailure(mount["name"], f'{kind[:-1]} "{name}" not found')
            data = secret_bytes(obj) if kind == "secrets" else configmap_bytes(obj)
            try:
                staged = stage_files(folder / "volumes" / mount["name"], data, source.get("items"),
                                     source.get("defaultMode", 0o644))
            except KeyError as exc:
                raise MountFailure(mount["name"], str(exc.args[0])) from None
            if kind == "secrets":  # pkg/volume/secret: an emptyDir of medium Memory, a tmpfs (root mode 1777)
                mounts.append(Mount(target, staged, readonly=True, tmpfs_copy=True))
            else:  # pkg/volume/configmap: an emptyDir on the node's disk, made 0777 (emptydir ``setupDir``)
                os.chmod(staged, 0o777)
                mounts.append(Mount(target, staged, readonly=True))  # the kubelet mounts these read-only
        elif "projected" in volume:
            data, items = projected_payload(cluster, pod, volume["name"], volume["projected"])
            staged = stage_files(folder / "volumes" / mount["name"], data, items,
                                 volume["projected"].get("defaultMode", 0o644))
            # pkg/volume/projected: an emptyDir of medium Memory (a tmpfs), mounted read-only like a Secret's.
            mounts.append(Mount(target, staged, readonly=True, tmpfs_copy=True))
        elif "emptyDir" in volume:
            empty = volume["emptyDir"] or {}
            if empty.get("medium") == "Memory":
                limit = empty.get("sizeLimit")
                mounts.append(Mount(target, tmpfs=True, tmpfs_bytes=quantity_bytes(limit) if limit else None))
            else:
                directory = folder / "empty-dirs" / mount["name"]
                directory.mkdir(parents=True, exist_ok=True)
                mounts.append(Mount(target, directory, readonly))
        else:
            raise LookupError(f'volume "{mount["name"]}": {sorted(volume)} is not emulated')
    return mounts


def projected_payload(cluster: Cluster, pod: dict, volume: str, projected: dict) -> tuple[dict[str, bytes], list]:
    """A projected volume's files (pkg/volume/projected ``collectData``): a service-account token the
    kubelet requests for the pod (TokenRequest, bound to it), ConfigMap keys and downward-API fields. A
    ConfigMap that does not exist fails the mount, unless the source is ``optional``."""
    # Imported here: authentication imports the state this module's callers hold.
    from tests.cluster.authentication import issue_token

    namespace = pod["metadata"]["namespace"]
    data: dict[str, bytes] = {}
    items: list[dict] = []
    for source in projected.get("sources") or []:
        if "serviceAccountToken" in source:
            token = source["serviceAccountToken"]
            account = pod["spec"].get("serviceAccountName", "default")
            data[token["path"]] = issue_token(cluster, namespace, account, pod=pod,
                                              seconds=token.get("expirationSeconds", 3600)).encode()
            items.append({"key": token["path"], "path": token["path"]})
        elif "configMap" in source:
            ref = source["configMap"]
            obj = cluster.objects["configmaps"].get((namespace, ref["name"]))
            if obj is None:
                if ref.get("optional"):
                    continue
                raise MountFailure(volume, f'configmap "{ref["name"]}" not found')
            values = configmap_bytes(obj)
            for item in ref.get("items") or [{"key": key, "path": key} for key in values]:
                data[item["path"]] = values[item["key"]]
                items.append({"key": item["path"], "path": item["path"], **({"mode": item["mode"]}
                                                                             if "mode" in item else {})})
        elif "downwardAPI" in source:
            fields = {"metadata.namespace": namespace, "metadata.name": pod["metadata"]["name"],
                      "metadata.uid": pod["metadata"]["uid"]}
            for item in source["downwardAPI"].get("items") or []:
                data[item["path"]] = fields[item["fieldRef"]["fieldPath"]].encode()
                items.append({"key": item["path"], "path": item["path"]})
        else:
            raise LookupError(f'volume "{volume}": projected source {sorted(source)} is not emulated')
    return data, items


def stage_files(folder: Path, data: dict[str, bytes], items: list[dict] | None, default_mode: int) -> Path:
    """A Secret or ConfigMap volume's files as the kubelet's atomic writer lays them out
    (pkg/volume/util/atomic_writer.go): the payload in a timestamped ``..<time>`` directory, ``..data`` a
    symlink to it, and each top-level name a symlink into ``..data``. Every key (or the ``items`` chosen, at
    their ``path``) with ``defaultMode`` or the item's ``mode`` (volume/secret, volume/configmap)."""
    if folder.exists():
        shutil.rmtree(folder)
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S", time.gmtime()) + f".{time.time_ns() % 10**9:09d}"
    payload = folder / stamp
    payload.mkdir(parents=True)
    chosen = items if items else [{"key": key, "path": key} for key in data]
    for item in chosen:
        if item["key"] not in data:
            raise KeyError(f"couldn't find key {item['key']} in the volume's source")
        target = payload / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data[item["key"]])
        os.chmod(target, item.get("mode", default_mode))
    (folder / "..data").symlink_to(stamp)
    for top in sorted({Path(item["path"]).parts[0] for item in chosen}):
        (folder / top).symlink_to(f"..data/{top}")
    return folder


def refresh_configmaps(cluster: Cluster, pod: dict, container: dict, folder: Path) -> list[str]:
    """A running pod's ConfigMap volumes brought up to date, as the kubelet's pod sync does (every
    ``--sync-frequency``, 1 min, through its ConfigMap cache: "the total delay from the moment when the ConfigMap is
    updated to the moment when new keys are projected to the Pod can be as long as the kubelet sync period + cache
    propagation delay", kubernetes.io "ConfigMaps", Mounted ConfigMaps are updated automatically). The files change
    atomically (``update_files``). A ConfigMap gone keeps the files as they were. The volumes it updated."""
    namespace = pod["metadata"]["namespace"]
    volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    updated = []
    for mount in container.get("volumeMounts") or []:
        source = (volumes.get(mount["name"]) or {}).get("configMap")
        configmap = cluster.objects["configmaps"].get((namespace, source.get("name"))) if source else None
        if configmap is None:
            continue
        if update_files(folder / "volumes" / mount["name"], configmap_bytes(configmap), source.get("items"),
                        source.get("defaultMode", 0o644)):
            updated.append(mount["name"])
    return updated


def update_files(folder: Path, data: dict[str, bytes], items: list[dict] | None, default_mode: int) -> bool:
    """A staged volume given new content the way the kubelet's atomic writer does it
    (pkg/volume/util/atomic_writer.go ``Write``): nothing when the payload is unchanged; else the new payload in a
    fresh ``..<time>`` directory, a ``..data_tmp`` symlink to it renamed over ``..data`` (one atomic step: a reader
    sees the old files or the new ones), new top-level names linked, the links of keys gone removed, and the old
    directory removed. Whether it changed anything."""
    current = (folder / "..data").resolve()
    chosen = items if items else [{"key": key, "path": key} for key in data]
    if missing := [item["key"] for item in chosen if item["key"] not in data]:
        # The kubelet's volume manager logs the error and tries again at its next sync; the files stay as they were.
        raise KeyError(f"couldn't find key {missing[0]} in the volume's source")
    unchanged = all((current / item["path"]).is_file() and item["key"] in data and
                    (current / item["path"]).read_bytes() == data[item["key"]] for item in chosen) and \
        sorted(str(path.relative_to(current)) for path in current.rglob("*") if path.is_file()) == \
        sorted(item["path"] for item in chosen)
    if unchanged:
        return False
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S", time.gmtime()) + f".{time.time_ns() % 10**9:09d}"
    payload = folder / stamp
    payload.mkdir()
    for item in chosen:
        target = payload / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data[item["key"]])
        os.chmod(target, item.get("mode", default_mode))
    (folder / "..data_tmp").symlink_to(stamp)
    os.replace(folder / "..data_tmp", folder / "..data")
    tops = {Path(item["path"]).parts[0] for item in chosen}
    for top in sorted(tops):
        if not (folder / top).is_symlink():
            (folder / top).symlink_to(f"..data/{top}")
    for stale in folder.iterdir():  # a key the ConfigMap no longer has
        if stale.is_symlink() and not stale.name.startswith("..") and stale.name not in tops:
            stale.unlink()
    shutil.rmtree(current)
    return True


def secret_bytes(secret: dict) -> dict[str, bytes]:
    return {key: base64.b64decode(value) for key, value in (secret.get("data") or {}).items()} | \
        {key: value.encode() for key, value in (secret.get("stringData") or {}).items()}


def configmap_bytes(configmap: dict) -> dict[str, bytes]:
    return {key: value.encode() for key, value in (configmap.get("data") or {}).items()}
