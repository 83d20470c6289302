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

from tests.cluster import Cluster, KubernetesEmulator, podinit
from tests.cluster.images import container_argv
from tests.cluster.quantities import quantity_bytes
from tests.cluster.runtime import expand_references
from tests.cluster.security_context import DEFAULT_CAPABILITIES
from tests.cluster_platform_helpers import TRAIN_IMAGE, client_apis, create_rwo_claim
from tests.conftest import PROJECT_ROOT
from tests.waiting import wait_until

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


def test_a_container_runs_as_its_security_context_says_and_the_kernel_holds_it_to_that(emulator_claim: tuple) -> None:
    """runAsUser 1000 and runAsGroup 0, as laneflow's pods run: the process has those ids and the HOME of the
    image's passwd entry, writes the claim's root (a new ANF volume's root is 0770 root:root: group 0 may) and
    owns what it wrote, and cannot write a folder root made 0755 — the kernel refuses, not the emulator."""
    emulator, state, claim_dir = emulator_claim
    (claim_dir / "roots").mkdir(mode=0o755)
    pod, log = run_job(emulator, state, "as-user", {
        "command": ["sh", "-c", 'echo "ids=$(id -u):$(id -g):$(id -G) home=$HOME"; echo mine > /mnt/work/mine; '
                                'touch /mnt/work/roots/x 2>&1 | grep -o "Permission denied"; true'],
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 0},
        "volumeMounts": [{"name": "work", "mountPath": "/mnt/work"}]},
        volumes=[{"name": "work", "persistentVolumeClaim": {"claimName": "c"}}])
    assert exit_code(pod) == 0, log
    assert log.splitlines() == ["ids=1000:0:0 home=/home/laneflow", "Permission denied"], log
    assert (claim_dir / "mine").stat().st_uid == 1000 and not (claim_dir / "roots" / "x").exists()
    assert oct(claim_dir.stat().st_mode & 0o777) == oct(0o770) and claim_dir.stat().st_uid == 0


def test_a_root_container_has_the_runtimes_default_capabilities_and_what_its_context_adds_or_drops(
        cluster: tuple) -> None:
    """containerd's default set for root, not this machine's root's: no SYS_PTRACE (so laneflow-sshd cannot read
    the ranks' environment: training.mpi_entry reads their command lines), no SYS_ADMIN; ``drop: [ALL]`` leaves
    none, ``add`` adds."""
    emulator, state = cluster
    names = podinit.CAPABILITY_NAMES

    def effective(name: str, context: dict | None) -> set[str]:
        pod, log = run_job(emulator, state, name, {"command": ["sh", "-c", "grep CapEff /proc/self/status"],
                                                   **({"securityContext": context} if context else {})})
        assert exit_code(pod) == 0, log
        mask = int(log.split()[-1], 16)
        return {names[bit] for bit in range(len(names)) if mask >> bit & 1}

    assert effective("caps-default", None) == set(DEFAULT_CAPABILITIES)
    assert effective("caps-none", {"capabilities": {"drop": ["ALL"]}}) == set()
    assert effective("caps-some", {"capabilities": {"drop": ["NET_RAW"], "add": ["SYS_PTRACE"]}}) == \
        set(DEFAULT_CAPABILITIES) - {"NET_RAW"} | {"SYS_PTRACE"}


def test_runs_as_non_root_is_refused_for_a_container_that_would_run_as_root(cluster: tuple) -> None:
    """The kubelet's check before it creates the container: the training image sets no USER (root), so
    ``runAsNonRoot`` without a ``runAsUser`` is a CreateContainerConfigError naming why; nothing runs."""
    emulator, state = cluster
    client = kubernetes.config.new_client_from_config_dict(emulator.kubeconfig())
    kubernetes.client.BatchV1Api(client).create_namespaced_job("lanes", {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "rooted"},
        "spec": {"template": {"spec": {"restartPolicy": "Never", "securityContext": {"runAsNonRoot": True},
                                       "containers": [{"name": "main", "image": TRAIN_IMAGE, "command": ["true"]}]}}}})

    def refused() -> dict | None:
        with state.lock:
            for pod in state.objects["pods"].values():
                waiting = (pod["status"].get("containerStatuses") or [{}])[0].get("state", {}).get("waiting", {})
                if waiting.get("reason") == "CreateContainerConfigError":
                    return waiting
        return None

    waiting = wait_until("the kubelet's refusal", refused, timeout_s=60)
    assert waiting["message"].startswith("Error: container has runAsNonRoot and image will run as root (pod: "), \
        waiting
    assert not state.containers


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
