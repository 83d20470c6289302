"""The emulated cluster's pods run what they say (tests/cluster/runtime.py): a batch Job's container runs its
real command resolved against the image's Dockerfile, with the pod's env, working directory and volumes at
their mountPath — and nothing that is not in the pod spec or the image."""

from __future__ import annotations

import base64
import os
import sys
import time
from pathlib import Path

import kubernetes
import pytest

from tests.cluster import Cluster, KubernetesEmulator
from tests.cluster.images import container_argv
from tests.cluster.quantities import quantity_bytes
from tests.cluster.runtime import expand_references
from tests.cluster_platform_helpers import TRAIN_IMAGE, client_apis, create_rwo_claim
from tests.conftest import PROJECT_ROOT

pytestmark = pytest.mark.slow


def test_the_training_image_is_the_one_its_dockerfile_builds(cluster: tuple) -> None:
    """The registry's training image is the built one: its config as the Dockerfile set it, its files as its
    COPY and RUN lines made them — and no host key (each worker makes its own)."""
    _, state = cluster
    image = state.images.pull(TRAIN_IMAGE)
    assert image is not None and image.workdir == "/opt/laneflow"
    assert image.env["PATH"].startswith("/opt/venv/bin:") and image.env["PYTHONUNBUFFERED"] == "1"
    assert (image.rootfs / "etc/ssh/ssh_config.d/laneflow.conf").read_text() == \
        (PROJECT_ROOT / "deployments" / "ssh" / "ssh_config.conf").read_text()
    assert (image.rootfs / "opt/laneflow/training/train.py").is_file()
    assert (image.rootfs / "usr/sbin/sshd").is_file() and (image.rootfs / "usr/bin/mpirun").exists()
    assert not list((image.rootfs / "etc/ssh").glob("ssh_host_*"))
    # Kubernetes: command replaces ENTRYPOINT, args replace CMD (no ENTRYPOINT in this image; the base's CMD).
    assert container_argv(image, ["python", "-V"], None) == ["python", "-V"]
    assert container_argv(image, None, ["-V"]) == ["-V"]


def test_references_and_quantities_as_kubernetes_reads_them() -> None:
    env = {"A": "1", "B": "two"}
    assert expand_references("$(A)-$(B)-$(C)-$$(A)", env) == "1-two-$(C)-$(A)"
    assert quantity_bytes("8Gi") == 8 * 2**30 and quantity_bytes("500M") == 500 * 10**6
    with pytest.raises(ValueError, match="quantities must match"):
        quantity_bytes("8GB")


@pytest.fixture
def cluster(emulator: tuple[KubernetesEmulator, Cluster]) -> tuple[KubernetesEmulator, Cluster]:
    """The emulated cluster with the training image built from its Dockerfile."""
    emulator[1].images.add(TRAIN_IMAGE, "train")
    return emulator


def run_job(emulator: KubernetesEmulator, cluster: Cluster, name: str, container: dict,
            volumes: list[dict] | None = None, timeout_s: float = 120) -> tuple[dict, str]:
    """A batch Job with this container, created through the API; its pod once finished, and its log."""
    client = kubernetes.config.new_client_from_config_dict(emulator.kubeconfig())
    kubernetes.client.BatchV1Api(client).create_namespaced_job("lanes", {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
        "spec": {"backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never", "containers": [{"name": "main", "image": TRAIN_IMAGE, **container}],
            "volumes": volumes or []}}}})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with cluster.lock:
            pods = [p for p in cluster.objects["pods"].values() if p["metadata"]["labels"].get("job-name") == name]
            if pods and pods[0]["status"].get("phase") in ("Succeeded", "Failed"):
                log = cluster.logs.get(("lanes", pods[0]["metadata"]["name"]))
                return pods[0], "".join(text for _, text in (log.lines if log else []))
        time.sleep(0.2)
    raise AssertionError(f"job {name} did not finish within {timeout_s} s")


def exit_code(pod: dict) -> int:
    return pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"]


def test_a_container_gets_its_env_its_working_directory_and_nothing_of_this_machine(cluster: tuple) -> None:
    emulator, state = cluster
    pod, log = run_job(emulator, state, "env", {
        "command": ["sh", "-c", 'echo "greeting=$GREETING home=$HOME_DIR"; pwd; hostname; echo "path=$PATH"; '
                                'echo "session=${PREFECT_API_URL:-unset}"; echo "tmp=$(ls -A /tmp)"; '
                                'echo "api=$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT"; echo "$PATH_COPY"; '
                                f'ls -d {PROJECT_ROOT} /etc/ssh/ssh_host_ed25519_key {sys.prefix} 2>&1; '
                                'ls /dev; df -k /dev/shm | tail -1; readlink /proc/self/ns/ipc'],
        "env": [{"name": "GREETING", "value": "hello"}, {"name": "HOME_DIR", "value": "$(GREETING)-world"},
                {"name": "PATH_COPY", "value": "[$(PATH)]"}],
        "workingDir": "/opt/laneflow/tasks"})
    assert exit_code(pod) == 0, log
    lines = log.splitlines()
    assert lines[0] == "greeting=hello home=hello-world"  # $(VAR) expanded from the env before it
    assert lines[1] == "/opt/laneflow/tasks"  # workingDir over the image's WORKDIR
    assert lines[2] == pod["metadata"]["name"]  # the pod's host name
    assert lines[3].startswith("path=/opt/venv/bin:")  # the image's ENV PATH
    assert lines[4] == "session=unset"  # this machine's environment does not leak into containers
    assert lines[5] == "tmp="  # the image's empty /tmp
    assert lines[6] == "api=10.96.0.1:443"  # the kubernetes Service, as every pod gets it
    assert lines[7] == "[$(PATH)]"  # the image's ENV is not the kubelet's: $(PATH) stays as written
    # Nothing of this machine: not the checkout, not its host keys, not the project's environment.
    assert lines[8:11] == [f"ls: cannot access '{path}': No such file or directory"
                           for path in (PROJECT_ROOT, "/etc/ssh/ssh_host_ed25519_key", sys.prefix)]
    devices = set(lines[11:-2])
    assert {"null", "zero", "urandom", "pts", "shm"} <= devices and not devices & {"vda", "sda", "kmsg", "mem"}
    assert " 65536 " in lines[-2]  # a private 64 MiB /dev/shm (containerd's default)
    assert lines[-1].startswith("ipc:[") and lines[-1] != os.readlink("/proc/self/ns/ipc")  # its own IPC namespace


def test_a_missing_env_var_is_missing_in_the_container(cluster: tuple) -> None:
    emulator, state = cluster
    pod, log = run_job(emulator, state, "no-env", {"command": ["sh", "-c", 'test -n "$GREETING" || exit 3']})
    assert exit_code(pod) == 3 and pod["status"]["phase"] == "Failed", log


def test_volumes_are_where_their_mount_path_says_read_only_where_marked(emulator_claim: tuple) -> None:
    emulator, state, claim_dir = emulator_claim
    (claim_dir / "in.txt").write_text("from the claim\n")
    pod, log = run_job(emulator, state, "mounts", {
        "command": ["sh", "-c", "cat /mnt/work/in.txt && echo written > /mnt/work/out.txt && ls /data 2>&1; "
                                "echo x > /mnt/ro/y 2>&1 || echo read-only refused; "
                                "stat -L -c '%a' /etc/creds/token; df -k /dev/shm | tail -1; "
                                "echo creds $(stat -c '%a' /etc/creds) $(stat -f -c '%T' /etc/creds); "
                                "echo creds-write $(touch /etc/creds/x 2>&1 | grep -o 'Read-only file system')"],
        "volumeMounts": [{"name": "work", "mountPath": "/mnt/work"}, {"name": "work", "mountPath": "/mnt/ro",
                                                                      "readOnly": True},
                         {"name": "creds", "mountPath": "/etc/creds"}, {"name": "shm", "mountPath": "/dev/shm"}]},
        volumes=[{"name": "work", "persistentVolumeClaim": {"claimName": "c"}},
                 {"name": "creds", "secret": {"secretName": "creds", "defaultMode": 0o400}},
                 {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Mi"}}])
    assert exit_code(pod) == 0, log
    assert log.startswith("from the claim\n") and (claim_dir / "out.txt").read_text() == "written\n"
    assert "ls: cannot access '/data': No such file or directory" in log  # only what the pod spec mounts
    assert "read-only refused" in log and "400" in log.split()
    assert " 32768 " in log  # the emptyDir's sizeLimit, in 1 KiB blocks: the volume, not the default /dev/shm
    # A Secret volume as the kubelet makes it: a tmpfs whose root is 1777 (sshd's StrictModes refuses such a
    # folder: hence `StrictModes no` in the training image), mounted read-only.
    assert "creds 1777 tmpfs" in log and "creds-write Read-only file system" in log


@pytest.fixture
def emulator_claim(cluster: tuple) -> tuple[KubernetesEmulator, Cluster, Path]:
    emulator, state = cluster
    create_rwo_claim(emulator, "c")
    core, _ = client_apis(emulator)
    core.create_namespaced_secret("lanes", {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds"},
                                            "data": {"token": base64.b64encode(b"s3cret").decode()}})
    return emulator, state, state.claim_dir("lanes", "c")


def test_an_image_nobody_builds_cannot_be_pulled(cluster: tuple) -> None:
    emulator, state = cluster
    client = kubernetes.config.new_client_from_config_dict(emulator.kubeconfig())
    kubernetes.client.BatchV1Api(client).create_namespaced_job("lanes", {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "typo"},
        "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [
            {"name": "main", "image": "registry.example.org/laneflow-trian:0.1.0", "command": ["true"]}]}}}})
    deadline = time.monotonic() + 60
    while not any(e["reason"] == "Failed" for e in state.objects["events"].values()):
        assert time.monotonic() < deadline, "no pull failure reported"
        time.sleep(0.2)
    (pod,) = state.objects["pods"].values()
    assert pod["status"]["phase"] == "Pending" and not state.containers
    assert pod["status"]["containerStatuses"][0]["state"]["waiting"]["reason"] == "ErrImagePull"
