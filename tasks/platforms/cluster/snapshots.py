"""Snapshots of the claim, with the run's lineage: CSI VolumeSnapshots, or ANF snapshots through Azure.

Separate because the two snapshotters keep lineage differently and everything here is about that: a
VolumeSnapshot carries it in its labels and an annotation, and restores into a new claim; an ANF snapshot
carries no labels, so the lineage goes into the run's ``lineage.json`` on the volume before the snapshot
is taken and is read back from there by a Job (readiness and time come from Azure).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from typing import TYPE_CHECKING, Any

from kubernetes.client.exceptions import ApiException

from tasks.anf import AnfVolume
from tasks.k8s.manifests import MANAGED_BY, render_pvc, render_snapshot
from tasks.k8s.quantity import larger_size
from tasks.names import validate_name
from tasks.platforms.base import SnapshotRef, StageDeadlineExceeded, VolumeRef, refuse_other_data
from tasks.platforms.cluster.api import STRICT, apis, call, create_or_adopt
from tasks.platforms.cluster.jobs import file_job, last_event
from tasks.platforms.cluster.volumes import anf_volume_of

if TYPE_CHECKING:
    from tasks.platforms.cluster import ClusterPlatform

SNAPSHOTS = ("snapshot.storage.k8s.io", "v1", "volumesnapshots")
LINEAGE_ANNOTATION = "laneflow.io/lineage"
#: laneflow's ANF snapshot names: <volume>-<run> (tasks.names.snapshot_name).
_ANF_SNAPSHOT_NAME = re.compile(r"^(?P<volume>.+)-(?P<run>[a-z]+-[0-9a-f]{12})$")


def create(platform: ClusterPlatform, volume: VolumeRef, name: str, data_dir: str, run_dir: str,
           lineage: dict[str, Any]) -> SnapshotRef:
    if platform.snapshotter == "anf":
        # A retry adopts the snapshot of its name, but only one of the same data: its record on the volume says
        # (read by a Job only when Azure has a snapshot of that name).
        for existing in _anf_snapshots(platform, only=name):
            refuse_other_data(name, existing.lineage.get("dataset_version"), lineage.get("dataset_version"))
        # ANF snapshots carry no labels: the lineage goes into the run's record, inside the snapshot.
        # Written before the snapshot, so inside it: what it was made from, never whether it is ready
        # (that is Azure's to say: list_snapshots and find_lineage read it from the snapshot).
        record = {**lineage, "snapshot": name, "data_dir": data_dir, "run_dir": run_dir, "volume": volume.name,
                  "snapshotter": "anf"}
        platform.write_text(volume, f"{run_dir}/lineage.json", json.dumps(record, sort_keys=True))
        snapshot_id = _anf(platform, volume).create_snapshot(name)  # awaits Azure's long-running operation
        return SnapshotRef(name=name, volume=volume.name, ready=True, location=snapshot_id,
                           lineage={**record, "ready": True})
    _, _, custom = apis(platform)
    namespace = platform.effective_namespace()
    group, version, plural = SNAPSHOTS
    labels = platform.job_labels(lineage.get("run", name), {
        "flow-run": str(lineage.get("flow_run_id", "")), "dataset-version": str(lineage.get("dataset_version")),
        "code-version": str(lineage.get("code_version"))})
    record = {**lineage, "data_dir": data_dir, "run_dir": run_dir, "volume": volume.name}
    body = render_snapshot(name, platform.layout(), volume.name, labels,
                           {LINEAGE_ANNOTATION: json.dumps(record, sort_keys=True)})
    snapshot, created = create_or_adopt(
        platform, "volumesnapshots",
        lambda: custom.create_namespaced_custom_object(group, version, namespace, plural, body,
                                                       field_validation=STRICT),
        lambda: custom.get_namespaced_custom_object(group, version, namespace, plural, name),
        lambda found: found["metadata"].get("labels", {}).get("laneflow.io/run") == labels["laneflow.io/run"],
        name)
    if not created:
        refuse_other_data(name, snapshot["metadata"].get("labels", {}).get("laneflow.io/dataset-version"),
                          labels.get("laneflow.io/dataset-version"))
    return _snapshot_ref(snapshot)


def wait(platform: ClusterPlatform, snapshot: SnapshotRef, timeout_s: float) -> SnapshotRef:
    """Until ``readyToUse``. ``status.error`` is only the last error the snapshot controller saw: it
    retries and clears it on success (external-snapshotter's VolumeSnapshot CRD), so an error fails
    the wait only when it is still there at the timeout."""
    if platform.snapshotter == "anf":  # create awaited the long-running operation already
        return snapshot
    _, _, custom = apis(platform)
    group, version, plural = SNAPSHOTS
    deadline = time.monotonic() + timeout_s
    while True:
        found = call(platform, "get", "volumesnapshots", custom.get_namespaced_custom_object, group, version,
                     platform.effective_namespace(), plural, snapshot.name)
        status = found.get("status") or {}
        if status.get("readyToUse"):
            return _snapshot_ref(found)
        if time.monotonic() > deadline:
            error = (status.get("error") or {}).get("message")
            if error:
                raise RuntimeError(f"VolumeSnapshot {snapshot.name} failed: the snapshot controller still "
                                   f"reports '{error}' after {timeout_s:.0f} s")
            raise StageDeadlineExceeded(f"VolumeSnapshot {snapshot.name} not ready within {timeout_s:.0f} s")
        time.sleep(platform.poll_interval_s)


def list_all(platform: ClusterPlatform) -> list[SnapshotRef]:
    """Every snapshot laneflow made, oldest first."""
    if platform.snapshotter == "anf":
        return _anf_snapshots(platform)
    _, _, custom = apis(platform)
    group, version, plural = SNAPSHOTS
    found = call(platform, "list", "volumesnapshots", custom.list_namespaced_custom_object, group, version,
                 platform.effective_namespace(), plural, label_selector="app.kubernetes.io/managed-by=laneflow")
    refs = [_snapshot_ref(item) for item in found.get("items", [])]
    return sorted(refs, key=lambda ref: ref.lineage.get("created_at", "") or "")


def restore(platform: ClusterPlatform, snapshot_name: str, volume_name: str) -> VolumeRef:
    """A new claim whose dataSource is the VolumeSnapshot, at least as large as the snapshot."""
    core, _, _ = apis(platform)
    validate_name(snapshot_name, "snapshot")
    validate_name(volume_name, "volume")
    if platform.snapshotter == "anf":
        raise ValueError(f"'{snapshot_name}' is an ANF snapshot: create a volume from it in Azure (or revert the "
                         "volume) and adopt that volume; laneflow restores CSI VolumeSnapshots only")
    namespace = platform.effective_namespace()
    snapshot = _read_snapshot(platform, snapshot_name)  # KeyError naming it when it does not exist
    restore_size = (snapshot.get("status") or {}).get("restoreSize")
    if restore_size is None:
        raise RuntimeError(f"VolumeSnapshot {namespace}/{snapshot_name} is not ready to use yet (no restoreSize):"
                           " wait until its readyToUse is true, then restore again")
    # The CSI provisioner refuses a claim smaller than the snapshot: a volume grown after the block's
    # volume_size was set is restored at its own size.
    size = larger_size(platform.volume_size, str(restore_size))
    body = render_pvc(volume_name, dataclasses.replace(platform.layout(), volume_size=size), {**MANAGED_BY},
                      from_snapshot=snapshot_name)

    def restored_from_it(claim: Any) -> bool:
        source = claim.spec.data_source
        return bool(source and source.kind == "VolumeSnapshot" and source.name == snapshot_name)

    _, created = create_or_adopt(
        platform, "persistentvolumeclaims",
        lambda: core.create_namespaced_persistent_volume_claim(namespace, body, field_validation=STRICT),
        lambda: core.read_namespaced_persistent_volume_claim(volume_name, namespace), restored_from_it,
        volume_name)
    return VolumeRef(name=volume_name, location=f"{namespace}/{volume_name}", created=created)


def find_lineage(platform: ClusterPlatform, name: str) -> dict[str, Any]:
    if platform.snapshotter == "anf":
        found = _anf_snapshots(platform, only=name)
        if not found:
            raise KeyError(f"no ANF snapshot named '{name}' (laneflow names them <claim>-<run>, and looks for it on "
                           "that claim's ANF volume)")
        return found[0].lineage
    return _snapshot_ref(_read_snapshot(platform, name)).lineage


def _anf(platform: ClusterPlatform, volume: VolumeRef) -> AnfVolume:
    """The claim's own ANF volume (read from its PV)."""
    if platform.anf is None:
        raise ValueError("snapshotter 'anf' needs the platform's 'anf' account to be configured")
    return anf_volume_of(platform, volume)


def _anf_snapshots(platform: ClusterPlatform, only: str | None = None) -> list[SnapshotRef]:
    """ANF snapshots with their lineage: readiness and time from Azure, the record from each run's
    ``lineage.json`` on the volume (ANF snapshots carry no labels), all read by one Job. One snapshot is looked
    for on the volume of the claim its name starts with; all of them, on every volume of the block's pools."""
    if platform.anf is None:
        raise ValueError("snapshotter 'anf' needs the platform's 'anf' account to be configured")
    if only is not None:
        named = _ANF_SNAPSHOT_NAME.match(only)
        if named is None:
            return []
        claim = VolumeRef(name=named["volume"], location=f"{platform.effective_namespace()}/{named['volume']}")
        try:
            volumes = [anf_volume_of(platform, claim)]
        except ApiException as exc:
            if exc.status == 404:
                raise KeyError(f"no ANF snapshot named '{only}': its claim '{claim.location}' does not exist") \
                    from None
            raise
    else:
        volumes = [platform.anf.for_volume(name) for name in platform.anf.pools_volumes()]
    snapshots = [s for volume in volumes for s in volume.list_snapshots() if only is None or s.name == only]
    by_volume: dict[str, list[tuple[Any, str]]] = {}
    for snapshot in snapshots:
        match = _ANF_SNAPSHOT_NAME.match(snapshot.name)
        if match:  # laneflow's own snapshots: <volume>-<run>
            by_volume.setdefault(match["volume"], []).append((snapshot, match["run"]))
    refs = []
    for volume_name, items in by_volume.items():
        volume = VolumeRef(name=volume_name, location=f"{platform.effective_namespace()}/{volume_name}")
        records = _read_lineages(platform, volume, [run for _, run in items])
        for snapshot, run in items:
            lineage = {**records.get(run, {}), "snapshot": snapshot.name, "ready": snapshot.ready,
                       "created_at": snapshot.created}
            refs.append(SnapshotRef(name=snapshot.name, volume=volume_name, ready=snapshot.ready,
                                    location=snapshot.id, lineage=lineage))
    return sorted(refs, key=lambda ref: ref.lineage.get("created_at") or "")


def _read_lineages(platform: ClusterPlatform, volume: VolumeRef, runs: list[str]) -> dict[str, dict[str, Any]]:
    """``runs/<run>/lineage.json`` of each run that has one, by run, in one throwaway Job."""
    script = ("import json, pathlib, sys\n"
              "root = pathlib.Path(sys.argv[1])\n"
              "found = {run: json.loads((root / run / 'lineage.json').read_text()) for run in sys.argv[2:]\n"
              "         if (root / run / 'lineage.json').is_file()}\n"
              "print(json.dumps({'event': 'lineages', 'records': found}))\n")
    lines = file_job(platform, "lineage", volume, "runs", script, *runs)
    return last_event(lines, "lineages", f"lineage reader of volume {volume.name}")["records"]


def _read_snapshot(platform: ClusterPlatform, name: str) -> dict[str, Any]:
    _, _, custom = apis(platform)
    group, version, plural = SNAPSHOTS
    try:
        return call(platform, "get", "volumesnapshots", custom.get_namespaced_custom_object, group, version,
                    platform.effective_namespace(), plural, name)
    except ApiException as exc:
        if exc.status == 404:
            raise KeyError(f"no VolumeSnapshot named '{name}' in namespace '{platform.effective_namespace()}'") \
                from None
        raise


def _snapshot_ref(snapshot: dict) -> SnapshotRef:
    metadata = snapshot["metadata"]
    lineage = json.loads((metadata.get("annotations") or {}).get(LINEAGE_ANNOTATION, "{}"))
    lineage.setdefault("created_at", metadata.get("creationTimestamp"))
    ready = bool((snapshot.get("status") or {}).get("readyToUse"))
    lineage["ready"] = ready
    return SnapshotRef(name=metadata["name"], volume=snapshot["spec"]["source"].get("persistentVolumeClaimName", ""),
                       ready=ready, location=f"{metadata.get('namespace')}/{metadata['name']}", lineage=lineage)
