"""The emulated API server changes and deletes objects as kube-apiserver and its controllers do (issue 19):
DELETE propagation, graceful pod deletion, the TTL-after-finished controller, PATCH media types and
immutable fields. Each is asserted through the real ``kubernetes`` client, as a user of the API sees it."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from tests.cluster import JOB_DELETE_WARNING
from tests.cluster_platform_helpers import DATA_IMAGE, client_apis, cluster_platform

#: A container that takes 10 s to stop on SIGTERM, so a deletion's grace period is observable on any load.
SLOW_TO_STOP = ["python", "-c", "import signal, sys, time\n"
                                "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(10), sys.exit(0)))\n"
                                "print('up', flush=True)\ntime.sleep(600)"]


def _apis(emu: Any) -> tuple[kubernetes.client.CoreV1Api, kubernetes.client.BatchV1Api,
                             kubernetes.client.CustomObjectsApi]:
    core, custom = client_apis(emu)
    return core, kubernetes.client.BatchV1Api(core.api_client), custom


def _job(name: str, command: list[str], **spec: Any) -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"backoffLimit": 0, **spec, "template": {"spec": {"restartPolicy": "Never", "containers": [
                {"name": "main", "image": DATA_IMAGE, "command": command}]}}}}


def _until(condition: Callable[[], Any], what: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


def _running_pod(core: kubernetes.client.CoreV1Api, job: str) -> Any:
    """Its pod once the container said it is up (its SIGTERM handler set: a PID 1 without one ignores it)."""
    def running() -> Any:
        pods = core.list_namespaced_pod("lanes", label_selector=f"job-name={job}").items
        return next((p for p in pods if p.status.phase == "Running"
                     and "up" in core.read_namespaced_pod_log(p.metadata.name, "lanes")), None)
    return _until(running, f"a running pod of {job}")


def _gone(read: Callable[[], Any]) -> bool:
    try:
        read()
    except ApiException as exc:
        return exc.status == 404
    return False


def _body(exc: ApiException) -> dict:
    return json.loads(exc.body)


def _sleeper(emu: Any) -> tuple[kubernetes.client.CoreV1Api, kubernetes.client.BatchV1Api, Any]:
    """A Job 'sleeper' whose pod runs SLOW_TO_STOP, once its container is up."""
    core, batch, _ = _apis(emu)
    cluster_platform(emu)
    batch.create_namespaced_job("lanes", _job("sleeper", SLOW_TO_STOP))
    return core, batch, _running_pod(core, "sleeper")


def test_a_job_deleted_without_a_policy_orphans_its_running_pod_and_says_so(emulator: tuple) -> None:
    emu, _cluster = emulator
    core, batch, pod = _sleeper(emu)
    _, _, headers = batch.delete_namespaced_job_with_http_info("sleeper", "lanes")  # (data, status, headers)
    assert JOB_DELETE_WARNING in headers["Warning"]
    assert _gone(lambda: batch.read_namespaced_job("sleeper", "lanes"))
    orphan = core.read_namespaced_pod(pod.metadata.name, "lanes")
    assert orphan.status.phase == "Running" and not orphan.metadata.owner_references
    core.delete_namespaced_pod(pod.metadata.name, "lanes")
    _until(lambda: _gone(lambda: core.read_namespaced_pod(pod.metadata.name, "lanes")), "the orphan deleted")


def test_foreground_deletion_keeps_the_job_readable_until_its_pod_has_stopped(emulator: tuple) -> None:
    """What laneflow's replacement of a failed Job waits for: the old pod no longer writing to the volume."""
    emu, cluster = emulator
    core, batch, pod = _sleeper(emu)
    batch.delete_namespaced_job("sleeper", "lanes", propagation_policy="Foreground")
    job = batch.read_namespaced_job("sleeper", "lanes")  # still there: its pod is stopping (10 s on SIGTERM)
    assert job.metadata.deletion_timestamp and "foregroundDeletion" in job.metadata.finalizers
    stopping = core.read_namespaced_pod(pod.metadata.name, "lanes")
    assert stopping.metadata.deletion_timestamp and stopping.metadata.deletion_grace_period_seconds == 30
    _until(lambda: _gone(lambda: batch.read_namespaced_job("sleeper", "lanes")), "the job gone")
    assert _gone(lambda: core.read_namespaced_pod(pod.metadata.name, "lanes"))
    assert not cluster.containers  # the container stopped before the Job went


def test_background_deletion_removes_the_job_at_once_and_its_pod_after_its_grace(emulator: tuple) -> None:
    emu, _cluster = emulator
    core, batch, pod = _sleeper(emu)
    batch.delete_namespaced_job("sleeper", "lanes", propagation_policy="Background")
    assert _gone(lambda: batch.read_namespaced_job("sleeper", "lanes"))
    assert core.read_namespaced_pod(pod.metadata.name, "lanes").metadata.deletion_timestamp
    _until(lambda: _gone(lambda: core.read_namespaced_pod(pod.metadata.name, "lanes")), "the pod gone")
    batch.create_namespaced_job("lanes", _job("quick", ["python", "-c", "pass"]))
    with pytest.raises(ApiException) as refused:
        batch.delete_namespaced_job("quick", "lanes", propagation_policy="Sometimes")
    assert refused.value.status == 422 and 'propagationPolicy: Unsupported value: "Sometimes"' in \
        _body(refused.value)["message"]
    batch.delete_namespaced_job("quick", "lanes", propagation_policy="Background")


def test_the_ttl_controller_deletes_a_finished_job_and_its_pod_when_its_ttl_has_passed(emulator: tuple) -> None:
    emu, cluster = emulator
    core, batch, _ = _apis(emu)
    cluster_platform(emu)
    batch.create_namespaced_job("lanes", _job("done", ["python", "-c", "print('ok')"], ttlSecondsAfterFinished=86400))
    _until(lambda: batch.read_namespaced_job("done", "lanes").status.succeeded, "the job succeeded")
    cluster.advance(86400 - 60)
    assert batch.read_namespaced_job("done", "lanes").status.succeeded == 1
    assert len(core.list_namespaced_pod("lanes", label_selector="job-name=done").items) == 1
    cluster.advance(120)
    _until(lambda: _gone(lambda: batch.read_namespaced_job("done", "lanes")), "the job removed")
    assert core.list_namespaced_pod("lanes", label_selector="job-name=done").items == []


def test_a_ttl_removed_dataset_job_does_not_stop_the_stage_from_running_again(
        emulator: tuple, served_archive: tuple[str, str]) -> None:
    """The day after: the Job laneflow would adopt is gone; running the stage again makes a new one."""
    from training.data.sources import Artifact

    emu, cluster = emulator
    platform = cluster_platform(emu)
    volume = platform.ensure_volume("data")
    first = platform.prepare_dataset(volume, [Artifact(*served_archive)], lambda _: None)
    (job,) = cluster.objects["jobs"].values()
    cluster.advance(86400 + 1)
    _until(lambda: cluster.count("jobs") == 0, "the TTL controller removed the dataset Job")
    again = platform.prepare_dataset(volume, [Artifact(*served_archive)], lambda _: None)
    assert again["dataset_dir"] == first["dataset_dir"]
    (replacement,) = cluster.objects["jobs"].values()
    assert replacement["metadata"]["uid"] != job["metadata"]["uid"]


def test_patches_are_applied_by_media_type_as_the_api_server_applies_them(emulator: tuple) -> None:
    emu, _cluster = emulator
    core, _, custom = _apis(emu)
    core.create_namespaced_service_account("lanes", {"metadata": {"name": "robot"}, "secrets": [{"name": "a"}]})
    # A dict body is a strategic merge (the client's choice): ServiceAccount.secrets merges by name.
    core.patch_namespaced_service_account("robot", "lanes", {"secrets": [{"name": "b"}]})
    assert [s.name for s in core.read_namespaced_service_account("robot", "lanes").secrets] == ["a", "b"]
    core.patch_namespaced_service_account("robot", "lanes", {"secrets": [{"name": "c"}]},
                                          _content_type="application/merge-patch+json")  # RFC 7386: replaced
    assert [s.name for s in core.read_namespaced_service_account("robot", "lanes").secrets] == ["c"]
    core.patch_namespaced_service_account("robot", "lanes",
                                          [{"op": "add", "path": "/secrets/0", "value": {"name": "z"}}])
    assert [s.name for s in core.read_namespaced_service_account("robot", "lanes").secrets] == ["z", "c"]
    with pytest.raises(ApiException) as failed:  # a failing test operation refuses the whole patch
        core.patch_namespaced_service_account("robot", "lanes", [
            {"op": "remove", "path": "/secrets/0"}, {"op": "test", "path": "/secrets/0/name", "value": "nope"}])
    assert failed.value.status == 422
    assert [s.name for s in core.read_namespaced_service_account("robot", "lanes").secrets] == ["z", "c"]
    with pytest.raises(ApiException) as unsupported:
        core.patch_namespaced_service_account("robot", "lanes", {"secrets": []}, _content_type="application/json")
    assert unsupported.value.status == 415
    request = urllib.request.Request(f"{emu.url}/api/v1/namespaces/lanes/serviceaccounts/robot", method="PATCH",
                                     data=b"secrets: []", headers={"Content-Type": "text/plain"})
    with pytest.raises(urllib.error.HTTPError) as plain:
        urllib.request.urlopen(request, timeout=30)
    assert plain.value.code == 415 and "unknown format" in json.loads(plain.value.read())["message"]
    with pytest.raises(ApiException) as apply_without_manager:
        core.patch_namespaced_service_account("robot", "lanes", {"apiVersion": "v1", "kind": "ServiceAccount"},
                                              _content_type="application/apply-patch+yaml")
    assert apply_without_manager.value.status == 422
    assert "fieldManager: Required value: is required for apply patch" in _body(apply_without_manager.value)["message"]
    # Custom resources take JSON and merge patches but no strategic merge (apiextensions-apiserver).
    snapshot = {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "s"},
                "spec": {"volumeSnapshotClassName": "csi-anf-snapclass", "source": {"persistentVolumeClaimName": "x"}}}
    group = ("snapshot.storage.k8s.io", "v1", "lanes", "volumesnapshots")
    custom.create_namespaced_custom_object(*group, snapshot)
    with pytest.raises(ApiException) as strategic:
        custom.patch_namespaced_custom_object(*group, "s", {"metadata": {"labels": {"a": "b"}}},
                                              _content_type="application/strategic-merge-patch+json")
    assert strategic.value.status == 415 and _body(strategic.value)["message"] == (
        "the body of the request was in an unknown format - accepted media types include: "
        "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml")
    custom.patch_namespaced_custom_object(*group, "s", {"metadata": {"labels": {"a": "b"}}},
                                          _content_type="application/merge-patch+json")
    assert custom.get_namespaced_custom_object(*group, "s")["metadata"]["labels"] == {"a": "b"}


def test_updates_may_not_change_immutable_fields(emulator: tuple) -> None:
    emu, _cluster = emulator
    core, batch, custom = _apis(emu)
    platform = cluster_platform(emu)
    volume = platform.ensure_volume("data")
    platform.ensure_shared_access(volume)  # the seed's step: the PV's access modes may change
    pv_name = core.read_namespaced_persistent_volume_claim("data", "lanes").spec.volume_name
    assert "ReadWriteMany" in core.read_persistent_volume(pv_name).spec.access_modes
    with pytest.raises(ApiException) as claim:  # a claim's access modes may not
        core.patch_namespaced_persistent_volume_claim("data", "lanes", {"spec": {"accessModes": ["ReadWriteOnce"]}})
    assert claim.value.status == 422
    assert "spec: Forbidden: spec is immutable after creation except resources.requests and " \
           "volumeAttributesClassName for bound claims" in _body(claim.value)["message"]
    with pytest.raises(ApiException) as shrink:
        core.patch_namespaced_persistent_volume_claim("data", "lanes",
                                                      {"spec": {"resources": {"requests": {"storage": "1Mi"}}}})
    assert "field can not be less than previous value" in _body(shrink.value)["message"]
    with pytest.raises(ApiException) as grow:  # the shipped class does not allow expansion
        core.patch_namespaced_persistent_volume_claim("data", "lanes",
                                                      {"spec": {"resources": {"requests": {"storage": "1Ti"}}}})
    assert grow.value.status == 403 and "must support resize" in _body(grow.value)["message"]
    with pytest.raises(ApiException) as source:
        core.patch_persistent_volume(pv_name, {"spec": {"csi": {"driver": "other", "volumeHandle": "h"}}})
    assert "spec.persistentvolumesource: Forbidden: spec.persistentvolumesource is immutable after creation" in \
        _body(source.value)["message"]
    batch.create_namespaced_job("lanes", _job("quick", ["python", "-c", "pass"]))
    with pytest.raises(ApiException) as template:
        batch.patch_namespaced_job("quick", "lanes", {"spec": {"template": {"spec": {"containers": [
            {"name": "main", "image": "other"}]}}}})
    assert template.value.status == 422 and "spec.template: Invalid value: " in _body(template.value)["message"] \
        and "field is immutable" in _body(template.value)["message"]
    group = ("snapshot.storage.k8s.io", "v1", "lanes", "volumesnapshots")
    custom.create_namespaced_custom_object(*group, {
        "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "s"},
        "spec": {"volumeSnapshotClassName": "csi-anf-snapclass", "source": {"persistentVolumeClaimName": "data"}}})
    with pytest.raises(ApiException) as snapshot:
        custom.patch_namespaced_custom_object(*group, "s", {"spec": {"source": {"persistentVolumeClaimName": "b"}}},
                                              _content_type="application/merge-patch+json")
    assert 'spec.source.persistentVolumeClaimName: Invalid value: "b": persistentVolumeClaimName is immutable' in \
        _body(snapshot.value)["message"]
    stale = core.read_persistent_volume(pv_name)
    core.patch_persistent_volume(pv_name, {"metadata": {"labels": {"tier": "premium"}}})
    stale.metadata.labels = {"tier": "standard"}
    with pytest.raises(ApiException) as conflict:  # a PUT of an old read: optimistic concurrency
        core.replace_persistent_volume(pv_name, stale)
    assert conflict.value.status == 409 and "the object has been modified" in _body(conflict.value)["message"]
    batch.delete_namespaced_job("quick", "lanes", propagation_policy="Background")
