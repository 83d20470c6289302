"""What a client that runs in the cluster, or watches it, gets from the emulated API server (issue 33), as
kube-apiserver gives it: watches with resourceVersions, bookmarks and 410 Gone after compaction; label
selectors of every form; discovery; bearer tokens (401 for a bad one, nothing for anonymous under RBAC);
and in a pod, the service account's projected token and CA at /var/run/secrets/kubernetes.io/serviceaccount
with ``KUBERNETES_SERVICE_HOST`` reaching the API server over TLS — the real ``kubernetes`` client's
in-cluster configuration, authorized against the namespace's Role."""

from __future__ import annotations

import json
import ssl
import threading
import urllib.error
import urllib.request
from typing import Any

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from tests.cluster_platform_helpers import TRAIN_IMAGE, client_apis
from tests.waiting import wait_until


def _configmap(name: str, labels: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels}, "data": {"k": "v"}}


def _collect(core: kubernetes.client.CoreV1Api, events: list, stop: threading.Event, **options: Any) -> None:
    watch = kubernetes.watch.Watch()
    for event in watch.stream(core.list_namespaced_config_map, "lanes", timeout_seconds=30, **options):
        events.append((event["type"], event["raw_object"]))
        if stop.is_set():
            watch.stop()


def test_a_watch_from_a_listed_version_sees_each_change_once_and_selector_moves_as_added_or_deleted(
        emulator: tuple) -> None:
    emu, _ = emulator
    core, _ = client_apis(emu)
    core.create_namespaced_config_map("lanes", _configmap("before", {"app": "lanes"}))
    listed = core.list_namespaced_config_map("lanes", label_selector="app=lanes")
    assert [item.metadata.name for item in listed.items] == ["before"]
    events: list = []
    stop = threading.Event()
    watcher = threading.Thread(target=_collect, args=(core, events, stop), daemon=True, kwargs={
        "resource_version": listed.metadata.resource_version, "label_selector": "app in (lanes),tier!=cache"})
    watcher.start()
    core.create_namespaced_config_map("lanes", _configmap("a", {"app": "lanes"}))
    core.create_namespaced_config_map("lanes", _configmap("other", {"app": "else"}))  # never matches
    core.patch_namespaced_config_map("a", "lanes", {"data": {"k": "w"}})
    core.patch_namespaced_config_map("a", "lanes", {"metadata": {"labels": {"tier": "cache"}}})  # leaves
    core.patch_namespaced_config_map("other", "lanes", {"metadata": {"labels": {"app": "lanes"}}})  # joins
    core.delete_namespaced_config_map("other", "lanes")
    stop.set()
    core.create_namespaced_config_map("lanes", _configmap("last", {"app": "lanes"}))
    watcher.join(timeout=60)
    assert not watcher.is_alive()
    seen = [(kind, obj["metadata"]["name"]) for kind, obj in events]
    assert seen == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a"), ("ADDED", "other"), ("DELETED", "other"),
                    ("ADDED", "last")]
    versions = [int(obj["metadata"]["resourceVersion"]) for _, obj in events]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert events[1][1]["data"] == {"k": "w"}
    assert "tier" not in events[2][1]["metadata"]["labels"]  # the one that left: as it was before, at a new version
    # What the watch said last is what a GET says now.
    assert core.read_namespaced_config_map("last", "lanes").metadata.resource_version == \
        events[-1][1]["metadata"]["resourceVersion"]


def test_a_watch_without_a_version_starts_with_what_exists_and_bookmarks_keep_it_current(emulator: tuple) -> None:
    emu, cluster = emulator
    cluster.bookmark_interval_s = 0.5
    core, _ = client_apis(emu)
    core.create_namespaced_config_map("lanes", _configmap("one", {"app": "lanes"}))
    response = core.list_namespaced_config_map("lanes", label_selector="app", watch=True, allow_watch_bookmarks=True,
                                               timeout_seconds=3, _preload_content=False)
    lines = [json.loads(line) for line in response.read().decode().splitlines() if line.strip()]
    assert lines[0]["type"] == "ADDED" and lines[0]["object"]["metadata"]["name"] == "one"
    bookmarks = [line for line in lines if line["type"] == "BOOKMARK"]
    assert bookmarks and bookmarks[0]["object"]["kind"] == "ConfigMap"
    assert set(bookmarks[0]["object"]["metadata"]) == {"resourceVersion"}
    assert int(bookmarks[-1]["object"]["metadata"]["resourceVersion"]) >= \
        int(lines[0]["object"]["metadata"]["resourceVersion"])


def test_a_watch_from_a_compacted_version_gets_410_expired_and_a_fresh_list_resumes(emulator: tuple) -> None:
    emu, cluster = emulator
    core, _ = client_apis(emu)
    old = core.list_namespaced_config_map("lanes").metadata.resource_version
    core.create_namespaced_config_map("lanes", _configmap("after", {}))
    with cluster.lock:
        cluster.watch_cache.compact(cluster)
    with pytest.raises(ApiException) as expired:
        for _ in kubernetes.watch.Watch().stream(core.list_namespaced_config_map, "lanes", resource_version=old,
                                                 timeout_seconds=5):
            pass
    assert expired.value.status == 410 and "too old resource version" in expired.value.reason
    fresh = core.list_namespaced_config_map("lanes").metadata.resource_version
    response = core.list_namespaced_config_map("lanes", watch=True, resource_version=fresh, timeout_seconds=1,
                                               _preload_content=False)
    assert response.status == 200 and b"ERROR" not in response.read()


def test_an_unparsable_label_selector_is_refused_as_the_api_server_refuses_it(emulator: tuple) -> None:
    emu, _ = emulator
    core, _ = client_apis(emu)
    with pytest.raises(ApiException) as refused:
        core.list_namespaced_pod("lanes", label_selector="app in lanes")
    assert refused.value.status == 400 and "unable to parse requirement" in json.loads(refused.value.body)["message"]


def _get(url: str, token: str | None, context: ssl.SSLContext | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def test_tokens_are_checked_and_rbac_grants_the_anonymous_caller_nothing(emulator: tuple) -> None:
    emu, cluster = emulator
    cluster.load([{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                   "metadata": {"name": "reader", "namespace": "lanes"},
                   "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]},
                  {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader", "namespace": "lanes"}},
                  {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": "reader", "namespace": "lanes"},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "reader"},
                   "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": "lanes"}]}])
    context = ssl.create_default_context(cadata=cluster.ca.cert_pem.bytes().decode())
    token = emu.token("lanes", "reader")
    pods = f"{emu.secure_url}/api/v1/namespaces/lanes/pods"
    assert _get(pods, token, context)[0] == 200
    assert _get(pods, token + "x", context) == (401, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                                      "status": "Failure", "message": "Unauthorized",
                                                      "reason": "Unauthorized", "code": 401})
    code, body = _get(pods, None, context)
    assert code == 403 and 'User "system:anonymous" cannot list resource "pods"' in body["message"]
    code, body = _get(f"{emu.secure_url}/api/v1/namespaces/lanes/secrets", token, context)
    assert code == 403 and 'User "system:serviceaccount:lanes:reader" cannot list resource "secrets"' \
        in body["message"]
    assert _get(f"{emu.secure_url}/apis/batch/v1", token, context)[1]["resources"][0]["name"] == "jobs"
    assert _get(f"{emu.secure_url}/api", None, context)[0] == 403  # discovery is for authenticated callers
    assert _get(f"{emu.secure_url}/version", None, context)[0] == 200


#: Run in a pod of the training image: the in-cluster configuration of the real ``kubernetes`` client.
IN_CLUSTER = """
import json, os, kubernetes
from kubernetes.client.exceptions import ApiException
kubernetes.config.load_incluster_config()
core = kubernetes.client.CoreV1Api()
secrets_dir = "/var/run/secrets/kubernetes.io/serviceaccount"
found = {"host": os.environ["KUBERNETES_SERVICE_HOST"],
         "files": sorted(f for f in os.listdir(secrets_dir) if not f.startswith("..")),
         "namespace": open(secrets_dir + "/namespace").read(),
         "pods": [p.metadata.name for p in core.list_namespaced_pod("lanes").items]}
try:
    core.create_namespaced_secret("lanes", {"metadata": {"name": "stolen"}, "stringData": {"a": "b"}})
except ApiException as exc:
    found["secret"] = [exc.status, json.loads(exc.body)["message"]]
print("RESULT " + json.dumps(found), flush=True)
"""


def test_a_pod_reaches_the_api_server_with_its_service_account_token_and_is_refused_outside_its_role(
        emulator: tuple) -> None:
    emu, cluster = emulator
    cluster.images.add(TRAIN_IMAGE, "train")
    cluster.load([{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "lister", "namespace": "lanes"}},
                  {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                   "metadata": {"name": "lister", "namespace": "lanes"},
                   "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]},
                  {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": "lister", "namespace": "lanes"},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "lister"},
                   "subjects": [{"kind": "ServiceAccount", "name": "lister", "namespace": "lanes"}]},
                  # the test's own account, to create the Job and read its log
                  {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                   "metadata": {"name": "admin-for-test"},
                   "rules": [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]},
                  {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                   "metadata": {"name": "admin-for-test"},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                               "name": "admin-for-test"},
                   "subjects": [{"kind": "ServiceAccount", "name": cluster.user[1], "namespace": cluster.user[0]}]}])
    core, _ = client_apis(emu)
    batch = kubernetes.client.BatchV1Api(core.api_client)
    batch.create_namespaced_job("lanes", {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "in-cluster"},
        "spec": {"backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never", "serviceAccountName": "lister",
            "containers": [{"name": "main", "image": TRAIN_IMAGE, "command": ["python", "-c", IN_CLUSTER]}]}}}})

    def result() -> dict | None:
        pods = core.list_namespaced_pod("lanes", label_selector="job-name=in-cluster").items
        if not pods or pods[0].status.phase == "Pending":
            return None
        log = core.read_namespaced_pod_log(pods[0].metadata.name, "lanes")
        pod = pods[0]
        assert pod.status.phase != "Failed", log
        line = next((line for line in log.splitlines() if line.startswith("RESULT ")), None)
        return json.loads(line.removeprefix("RESULT ")) if line else None
    found = wait_until("the in-cluster client's result", result, timeout_s=180, every_s=0.5)
    assert found["host"] == "10.96.0.1" and found["namespace"] == "lanes"
    assert found["files"] == ["ca.crt", "namespace", "token"]
    assert any(name.startswith("in-cluster-") for name in found["pods"])
    assert found["secret"][0] == 403
    assert 'User "system:serviceaccount:lanes:lister" cannot create resource "secrets"' in found["secret"][1]
    assert ("list", "pods", "system:serviceaccount:lanes:lister") in {
        (r.verb, r.resource, r.user) for r in cluster.requests}
