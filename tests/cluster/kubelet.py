"""The kubelet of the emulated cluster's one node (kubernetes ``pkg/kubelet``): it runs a scheduled pod's
container and reports its state.

Volumes before the image (``FailedMount`` for a missing Secret/ConfigMap or a refused NFS export,
retried; ``kubelet_volumes.py``), then the image pull (``ErrImagePull``, then ``ImagePullBackOff``),
then the container, through the container runtime (``runtime.py``) in the pod's network namespace
(``network.py``), with ``limits.memory`` as a memory cgroup (``OOMKilled``); its output is the pod's log
(``podlogs.py``). A failed container restarts in place through ``CrashLoopBackOff``; a deleted or evicted
pod's container is stopped, SIGTERM then SIGKILL after the grace period. (LimitRange defaults, the
LimitRanger admission plugin, are in ``admission.py``.)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from tests.cluster import runtime
from tests.cluster.dns import CLUSTER_DNS, resolv_conf
from tests.cluster.kubelet_volumes import (
    MountFailure,
    configmap_bytes,
    container_mounts,
    refresh_configmaps,
    secret_bytes,
)
from tests.cluster.network import PodNetwork
from tests.cluster.network_policy import enforce
from tests.cluster.objects import later, now, record_event
from tests.cluster.podlogs import append_log
from tests.cluster.quantities import quantity_bytes
from tests.cluster.runtime import container_env, container_spec, hosts_file, memory_limits_missing
from tests.cluster.scheduler import park, schedule
from tests.cluster.security_context import process_user, verify_run_as_non_root
from tests.cluster.state import ContainerLog
from tests.leaks import MARKER as SESSION_MARKER

if TYPE_CHECKING:
    from pathlib import Path

    from tests.cluster.state import Cluster


def _pod_network(cluster: Cluster, namespace: str, name: str) -> tuple[str, str]:
    """The pod's network namespace and IP, made when its first container starts (the CNI plugin's ADD)."""
    key = (namespace, name)
    if key not in cluster.pod_networks:
        netns, ip = PodNetwork.shared().attach()
        cluster.pod_networks[key] = (netns, ip)
        if cluster.service_endpoint is not None:  # the ``kubernetes`` Service, as kube-proxy routes it
            PodNetwork.route_service(netns, runtime.KUBERNETES_SERVICE, cluster.service_endpoint)
        if cluster.dns_endpoint is not None:  # the ``kube-dns`` Service's DNS port, to the cluster's DNS server
            PodNetwork.route_service(netns, (CLUSTER_DNS, 53), cluster.dns_endpoint, protocol="udp")
        enforce(cluster)  # the policy plugin's rules for the new pod, and the new pod as a peer of the others'
    return cluster.pod_networks[key]


def release_network(cluster: Cluster, namespace: str, name: str) -> None:
    """The CNI plugin's DEL: the namespace's name goes at once; the kernel frees it when its last process exits."""
    network = cluster.pod_networks.pop((namespace, name), None)
    if network is not None:
        cluster.policy_chains.pop(network[0], None)
        PodNetwork.detach(network[0])


def _resolv_conf(pod: dict) -> str | None:
    """The pod's /etc/resolv.conf for its ``dnsPolicy`` (pkg/kubelet/network/dns/dns.go ``getPodDNSType``):
    the cluster's DNS for ClusterFirst, the default, and for ClusterFirstWithHostNet (no pod here uses the host
    network); with Default or None the image's own file stays (the node's, or dnsConfig's, is not modelled)."""
    policy = pod["spec"].get("dnsPolicy") or "ClusterFirst"
    return resolv_conf(pod["metadata"]["namespace"]) if policy.startswith("ClusterFirst") else None


def _fqdn(pod: dict) -> str | None:
    spec, namespace = pod["spec"], pod["metadata"]["namespace"]
    if not spec.get("subdomain"):
        return None
    return f"{spec.get('hostname') or pod['metadata']['name']}.{spec['subdomain']}.{namespace}.svc.cluster.local"


def _lookup_key(cluster: Cluster, namespace: str) -> Callable[[str, str, str], str | None]:
    def lookup(kind: str, name: str, key: str) -> str | None:
        obj = cluster.objects["secrets" if kind == "secret" else "configmaps"].get((namespace, name))
        if obj is None:
            return None
        data = secret_bytes(obj) if kind == "secret" else configmap_bytes(obj)
        return data[key].decode() if key in data else None
    return lookup


def start_container(cluster: Cluster, pod: dict, on_exit: Callable[[dict], None]) -> None:
    """Mount the pod's volumes, pull its image and run its (first) container; its output becomes the pod's
    log, its exit the container's ``terminated`` state given to ``on_exit``. Volumes come first, as in the
    kubelet's SyncPod (WaitForAttachAndMount before the runtime starts anything): one that fails keeps the
    pod ContainerCreating, with a FailedMount Warning, retried. An image nobody builds fails to pull
    (ErrImagePull, a Warning event). ``limits.memory`` is a memory cgroup where this machine has one
    (``memory_limits_missing``): over it, the kernel kills and the reason is OOMKilled."""
    namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    container = pod["spec"]["containers"][0]
    if not schedule(cluster, pod):
        park(cluster, pod, lambda: start_container(cluster, pod, on_exit))
        return
    if pod["spec"].get("nodeName") in cluster.lost_nodes:
        return  # no kubelet there any more: a pod bound to it (a retry, a back-off's restart) never starts
    folder = cluster.root / "pods" / namespace / name
    try:
        mounts = container_mounts(cluster, pod, container, folder)
    except MountFailure as failure:
        record_event(cluster, pod, "Warning", "FailedMount", str(failure), "kubelet")

        def retry() -> None:
            if cluster.objects["pods"].get((namespace, name)) is pod and (namespace, name) not in cluster.containers:
                start_container(cluster, pod, on_exit)
        later(cluster, cluster.mount_retry_s, retry)
        return
    except LookupError as exc:
        mounts, mount_error = [], exc
    else:
        mount_error = None
    reference = container.get("image", "")
    record_event(cluster, pod, "Normal", "Pulling", f'Pulling image "{reference}"', "kubelet")
    image = cluster.images.pull(reference)
    if image is not None:  # pkg/kubelet/images/image_manager.go EnsureImageExists
        record_event(cluster, pod, "Normal", "Pulled", f'Successfully pulled image "{reference}" in '
                     f'{cluster.image_pull_s:.3f}s ({cluster.image_pull_s:.3f}s including waiting)', "kubelet")
    if image is None:
        # kubelet pkg/kubelet/images/image_manager.go: a failed pull is ErrImagePull with a Failed event, and
        # the next tries ImagePullBackOff with BackOff events (back-off from 10 s upstream; shortened here).
        reference = container.get("image")
        message = (f'Failed to pull image "{reference}": rpc error: code = NotFound desc = failed to '
                   f'pull and unpack image "{reference}": not found')
        set_container_state(pod, {"waiting": {"reason": "ErrImagePull", "message": message}}, ready=False)
        record_event(cluster, pod, "Warning", "Failed", message, "kubelet")

        def back_off() -> None:
            if cluster.objects["pods"].get((namespace, name)) is pod:
                waiting = f'Back-off pulling image "{reference}"'
                set_container_state(pod, {"waiting": {"reason": "ImagePullBackOff", "message": waiting}}, False)
                record_event(cluster, pod, "Normal", "BackOff", waiting, "kubelet")
        later(cluster, cluster.image_pull_backoff_s, back_off)
        return
    netns, ip = _pod_network(cluster, namespace, name)
    hostname = pod["spec"].get("hostname") or name
    instance = f"c{pod['status'].get('containerStatuses', [{}])[0].get('restartCount', 0)}"
    try:
        if mount_error is not None:
            raise mount_error
        env = container_env(container, pod, ip, _lookup_key(cluster, namespace))
        env[SESSION_MARKER] = os.environ.get(SESSION_MARKER, "")  # bookkeeping of the test suite, not the pod's
        verify_run_as_non_root(pod, container, image.user)
        spec = container_spec(image, container, sandbox=folder / instance / "fs", hostname=hostname,
                              hosts=hosts_file(ip, hostname, _fqdn(pod)), env=env, mounts=mounts,
                              resolv_conf=_resolv_conf(pod), user=process_user(pod, container, image.user))
    except (LookupError, ValueError) as exc:
        message = f"Error: {exc}"
        set_container_state(pod, {"waiting": {"reason": "CreateContainerConfigError", "message": message}}, False)
        record_event(cluster, pod, "Warning", "Failed", message, "kubelet")
        return
    log = ContainerLog()
    cluster.logs[(namespace, name)] = log
    pod["status"].update({"phase": "Running", "startTime": pod["status"].get("startTime") or now(),
                          "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": PodNetwork.shared().gateway})
    set_container_state(pod, {"running": {"startedAt": now()}}, ready=True)
    grace = float(pod["spec"].get("terminationGracePeriodSeconds", 30))

    def line(text: str) -> None:
        with cluster.lock:
            append_log(cluster, log, text)
            cluster.changed.notify_all()
        if cluster.on_log_line is not None:
            try:
                cluster.on_log_line(cluster, namespace, name, text)
            except Exception as exc:  # a test's hook must not stop the container's output (its writes would block)
                with cluster.lock:
                    cluster.controller_errors.append(exc)

    def exited(code: int) -> None:
        with cluster.lock:
            log.running = False
            ours = cluster.containers.get((namespace, name)) is running
            # A pod being deleted (its container already taken off by ``kill``) still gets its final status,
            # which is how an OOM shows on a worker the operator deletes right after; not on a lost node, whose
            # kubelet is gone, nor once a newer container of the pod runs.
            stopping = bool(pod["metadata"].get("deletionTimestamp")) and (namespace, name) not in cluster.containers \
                and cluster.objects["pods"].get((namespace, name)) is pod and \
                pod["spec"].get("nodeName") not in cluster.lost_nodes
            if ours or stopping:
                cluster.containers.pop((namespace, name), None)
                reason = "OOMKilled" if running.oom_killed else "Completed" if code == 0 else "Error"
                on_exit({"exitCode": code, "reason": reason, "finishedAt": now()})
            cluster.changed.notify_all()

    limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
    memory = quantity_bytes(str(limit)) if limit is not None and memory_limits_missing() is None else None
    running = runtime.start(spec, folder / instance, netns, grace, line, exited, memory_limit=memory)
    cluster.containers[(namespace, name)] = running
    _sync_configmaps(cluster, pod, container, folder, running)


def _sync_configmaps(cluster: Cluster, pod: dict, container: dict, folder: Path, running: object) -> None:
    """Every ``configmap_sync_s`` while the container runs, its ConfigMap volumes take the ConfigMaps' current
    data (``refresh_configmaps``); never on a lost node, whose kubelet is gone."""
    namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]

    def sync() -> None:
        if cluster.containers.get((namespace, name)) is not running or \
                pod["spec"].get("nodeName") in cluster.lost_nodes:
            return
        try:
            refresh_configmaps(cluster, pod, container, folder)
        except KeyError as exc:  # an item the ConfigMap lost: the files stay, the next sync tries again
            record_event(cluster, pod, "Warning", "FailedMount", f"MountVolume.SetUp failed: {exc.args[0]}",
                         "kubelet")
        later(cluster, cluster.configmap_sync_s, sync)

    if any("configMap" in volume for volume in pod["spec"].get("volumes") or []):
        later(cluster, cluster.configmap_sync_s, sync)


def set_container_state(pod: dict, state: dict, ready: bool, restarts: int | None = None) -> None:
    container = pod["spec"]["containers"][0]
    previous = (pod["status"].get("containerStatuses") or [{}])[0]
    pod["status"]["containerStatuses"] = [{
        "name": container["name"], "image": container.get("image", ""),
        "imageID": f"{container.get('image', '')}@sha256:{'0' * 64}", "ready": ready,
        "restartCount": previous.get("restartCount", 0) if restarts is None else restarts, "state": state}]
    # pkg/kubelet/status GeneratePodReadyCondition: not Ready says why (a reason and the containers).
    pod["status"]["conditions"] = [{"type": "Ready", "status": "True", "lastTransitionTime": now()} if ready else {
        "type": "Ready", "status": "False", "lastTransitionTime": now(), "reason": "ContainersNotReady",
        "message": f"containers with unready status: [{container['name']}]"}]


def crash_loop(cluster: Cluster, pod: dict, terminated: dict, restart: Callable[[], None]) -> int:
    """The kubelet restarts a failed container in place (restartPolicy OnFailure/Always) after a back-off:
    meanwhile it is Waiting with reason CrashLoopBackOff and a BackOff Warning is recorded
    (pkg/kubelet/kuberuntime ``doBackOff``; 10 s doubling to 300 s upstream). Returns the restart count."""
    namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    restarts = pod["status"]["containerStatuses"][0].get("restartCount", 0) + 1
    container = pod["spec"]["containers"][0]["name"]
    # The first restart is at once (no back-off entry yet), then 10 s, 20 s, ... (client-go flowcontrol.Backoff).
    delay = 0.0 if restarts == 1 else min(cluster.crash_backoff_s * 2 ** (restarts - 2), cluster.crash_backoff_s * 30)
    who = f"{name}_{namespace}({pod['metadata']['uid']})"
    if delay:
        set_container_state(pod, {"waiting": {"reason": "CrashLoopBackOff", "message": f"back-off {delay:g}s "
                                              f"restarting failed container={container} pod={who}"}},
                            ready=False, restarts=restarts)
        record_event(cluster, pod, "Warning", "BackOff", f"Back-off restarting failed container {container} in "
                                                         f"pod {who}", "kubelet")
    else:
        set_container_state(pod, {"terminated": terminated}, ready=False, restarts=restarts)
    pod["status"]["containerStatuses"][0]["lastState"] = {"terminated": terminated}

    def again() -> None:  # not for a pod being deleted
        if cluster.objects["pods"].get((namespace, name)) is pod and (namespace, name) not in cluster.containers \
                and not pod["metadata"].get("deletionTimestamp"):
            start_container(cluster, pod, restart)
    later(cluster, delay, again)
    return restarts


def kill(cluster: Cluster, namespace: str, pod: str, grace_s: float | None = None,
         on_stopped: Callable[[], None] | None = None) -> None:
    """The kubelet stops the pod's container: SIGTERM, SIGKILL after the grace period (in the background,
    as a DELETE returns before the pod is gone); then ``on_stopped``, under the cluster's lock."""
    container = cluster.containers.pop((namespace, pod), None)
    log = cluster.logs.get((namespace, pod))
    if log:
        log.running = False
    if container is None:
        stopping = cluster.kubelet_stops.get((namespace, pod))
        if on_stopped is not None and stopping is not None and stopping.is_alive():
            # The kubelet is stopping it already (its node shuts down): the API server only marks a graceful
            # delete, and the kubelet's status manager removes the pod once its containers have stopped
            # (pkg/kubelet/status/status_manager.go canBeDeleted / syncPod's final delete with grace 0).
            def when_stopped() -> None:
                stopping.join()
                with cluster.lock:
                    on_stopped()
                    cluster.changed.notify_all()
            threading.Thread(target=when_stopped, daemon=True, name=f"stopped-{pod}").start()
        elif on_stopped is not None:
            on_stopped()
        return
    cluster.terminating[:] = [c for c in cluster.terminating if c.process.poll() is None] + [container]

    def stop() -> None:
        container.stop(grace_s)
        if on_stopped is not None:
            with cluster.lock:
                on_stopped()
                cluster.changed.notify_all()
    threading.Thread(target=stop, daemon=True, name=f"stop-{pod}").start()
