"""What is refused before it runs: names the API server or the MPI operator would refuse, by the block
before any call; and what the API server refuses, by the emulator the other cluster tests rely on."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.exceptions import ApiException

from tasks.names import InvalidName
from tests.cluster_platform_helpers import client_apis, cluster_platform, spec_for

pytestmark = pytest.mark.slow


def test_invalid_names_are_refused_before_any_call(emulator: tuple) -> None:
    emu, cluster = emulator
    platform = cluster_platform(emu)
    with pytest.raises(InvalidName):
        platform.ensure_volume("Bad_Name")
    with pytest.raises(InvalidName):
        platform.restore_snapshot("snap", "-restored")
    with pytest.raises(InvalidName):
        platform.restore_snapshot("Not A Snapshot", "restored")
    # Names the MPI operator would refuse (with only a Warning event): a leading digit (DNS-1035), and a
    # last worker host name '<name>-worker-<N-1>' over 63 characters.
    with pytest.raises(InvalidName, match="DNS-1035"):
        platform.submit_training(spec_for("data", job="7d2eaa95c8df-train"))
    with pytest.raises(InvalidName, match=r"host name 'x{54}-worker-11' has 64 characters"):
        platform.submit_training(spec_for("data", job="x" * 54, workers=12))
    assert cluster.requests == []


def test_the_emulator_refuses_what_the_api_server_refuses(emulator: tuple) -> None:
    """The strictness the other tests rely on, seen by the real client: 422 with field causes, 400 for an
    unknown field under fieldValidation=Strict, the field dropped with a warning otherwise."""
    emu, cluster = emulator
    core, custom = client_apis(emu)
    broken = {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "s1"},
              "spec": {"source": {}, "volumeSnapshotClassName": ""}}
    with pytest.raises(ApiException) as refused:
        custom.create_namespaced_custom_object("snapshot.storage.k8s.io", "v1", "lanes", "volumesnapshots", broken)
    body = json.loads(refused.value.body)
    assert refused.value.status == 422 and body["reason"] == "Invalid"
    assert {c["field"] for c in body["details"]["causes"]} == {"spec.source", "spec.volumeSnapshotClassName"}
    typo = {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "s2"},
            "spec": {"source": {"persistentVolumeClaimName": "c"}, "snapshotClassName": "typo"}}
    with pytest.raises(ApiException) as strict:
        custom.create_namespaced_custom_object("snapshot.storage.k8s.io", "v1", "lanes", "volumesnapshots", typo,
                                               field_validation="Strict")
    assert strict.value.status == 400 and 'unknown field \\"spec.snapshotClassName\\"' in strict.value.body
    stored = custom.create_namespaced_custom_object("snapshot.storage.k8s.io", "v1", "lanes", "volumesnapshots",
                                                    typo)  # the server's default (Warn): the field is dropped
    assert stored["spec"] == {"source": {"persistentVolumeClaimName": "c"}}
    no_modes = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "c1"},
                "spec": {"resources": {"requests": {"storage": "1Gi"}}}}
    with pytest.raises(ApiException) as invalid:
        core.create_namespaced_persistent_volume_claim("lanes", no_modes)
    assert invalid.value.status == 422
    assert json.loads(invalid.value.body)["details"]["causes"] == [
        {"reason": "FieldValueRequired", "message": "Required value: at least 1 access mode is required",
         "field": "spec.accessModes"}]
    assert cluster.count("persistentvolumeclaims") == 0 and cluster.count("volumesnapshots") == 1
