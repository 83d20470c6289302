"""The container runtime of the emulated cluster, which the kubelet (``kubelet.py``) starts containers
through: each pod's container runs its real command from its image's root file system, with the image's
configuration, its env, its working directory, its host name and every volume at its ``mountPath`` (laid out
by ``kubelet_volumes.py``), in namespaces of its own (``podinit.py`` builds the file system and execs the
command).

What runs for real and what is modelled:

- real: the image (``images.py``: built from ``deployments/Dockerfile.*`` by buildah; its root file system is
  the container's lower layer, so nothing of this machine is visible but what the pod mounts), the
  container's process tree (PID 1 of its own PID namespace; mount, UTS and IPC namespaces; a private overlay
  root), its ``limits.memory`` as a memory cgroup of the kernel (whose OOM killer decides, as it does under
  runc; ``MemoryCgroup``), bind-mounted PVC folders, Secret volumes on a tmpfs and ConfigMap volumes with the
  kubelet's modes (read-only, as the kubelet mounts them), ``emptyDir`` (``medium: Memory`` as a tmpfs of
  ``sizeLimit``), a private 64 MiB ``/dev/shm``, the container's exit code and its output as the pod log;
- modelled: the pod network (``network.py``: a network namespace per pod with an address of its own on a bridge of
  this machine, as the reference CNI ``bridge`` plugin sets a node up; NetworkPolicy ingress as
  ``network_policy.py`` says; no Services but the headless ones' DNS), cluster DNS (every pod's ``/etc/hosts`` names
  the pods of its namespace that have a subdomain, as the headless Service's DNS records would, as of the
  container's start), Ready = the container runs (no probes, as the kubelet reports a container without a readiness
  probe). ``KUBERNETES_SERVICE_*`` name the ``kubernetes`` Service's address as on a cluster, and a
  connection there reaches the emulated API server over TLS (``network.PodNetwork.route_service``).

Kubernetes behaviour followed: command replaces ENTRYPOINT and args replace CMD
(``images.container_argv``); ``$(VAR)`` references in command, args and env values are expanded from the
container's own env and the service variables — never the image's ``ENV``, which the kubelet does not know —
and ``$$`` escapes (pkg/kubelet/kuberuntime ``kubecontainer.ExpandContainerCommandAndArgs``,
pkg/kubelet/kubelet_pods.go ``makeEnvironmentVariables``, third_party/forked/golang/expansion); the runtime
adds ``HOSTNAME``; Secret and ConfigMap files default to mode 0644 (``defaultMode``), ``items`` map keys to
paths with their own ``mode`` (``kubelet_volumes.py``); a container is stopped with SIGTERM to its PID 1, then
SIGKILL after the pod's ``terminationGracePeriodSeconds`` (default 30); an exit by signal reports code 128 +
signal.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scripts import images as builder
from tests.cluster.images import ImageConfig, container_argv
from tests.cluster.security_context import capabilities

PODINIT = Path(__file__).with_name("podinit.py")
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][-._A-Za-z0-9]*)\)")
#: The ``kubernetes`` Service in ``default`` (the API server's ClusterIP: the first address of the service CIDR,
#: 10.96.0.0/12 by kubeadm's default) and its HTTPS port.
KUBERNETES_SERVICE = ("10.96.0.1", 443)


@functools.cache
def pod_runtime_missing() -> str | None:
    """Why the emulated cluster cannot run pods here, or None: namespaces (root, util-linux, iproute2), and
    the images pods run from (buildah, debootstrap)."""
    if os.geteuid() != 0:
        return "the pod runtime needs root (mount, UTS, PID and network namespaces; CI runs as root)"
    for tool, package in (("unshare", "util-linux"), ("nsenter", "util-linux"), ("ip", "iproute2"),
                          ("iptables", "iptables")):
        if shutil.which(tool) is None:
            return f"the pod runtime needs {tool} (Debian's {package})"
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--uts", "--ipc", "--net", "true"],
                          capture_output=True)
    if done.returncode != 0:
        return f"namespaces are refused here: {done.stderr.decode(errors='replace').strip()}"
    if missing := builder.missing_tools():
        return f"pods run from laneflow's images, which cannot be built here: {missing}"
    return None


def expand_references(value: str, env: dict[str, str]) -> str:
    """``$(VAR)`` from ``env`` (left as written when undefined), ``$$`` → ``$``."""
    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)
    return _REF.sub(replace, value)


@dataclass(frozen=True)
class Mount:
    """One volumeMount made concrete: a host folder or file bound there, or a tmpfs."""

    target: str
    source: Path | None = None
    readonly: bool = False
    tmpfs_bytes: int | None = None
    tmpfs: bool = False
    #: The source folder's contents copied onto a fresh tmpfs there (a Secret volume: memory, never disk).
    tmpfs_copy: bool = False


def hosts_file(ip: str, hostname: str, fqdn: str | None) -> str:
    """The kubelet's managed /etc/hosts (pkg/kubelet/kubelet_pods.go ``managedHostsFileContent``): the pod's
    own names only; every other pod's name is cluster DNS's to answer (``dns.py``)."""
    lines = ["# Kubernetes-managed hosts file.", "127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             "fe00::0\tip6-localnet", "fe00::0\tip6-mcastprefix", "fe00::1\tip6-allnodes", "fe00::2\tip6-allrouters"]
    lines.append(f"{ip}\t{fqdn}\t{hostname}" if fqdn else f"{ip}\t{hostname}")
    return "\n".join(lines) + "\n"


CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass
class MemoryCgroup:
    """A container's memory cgroup with its ``limits.memory``, as runc makes one (cgroup v2 ``memory.max``,
    v1 ``memory.limit_in_bytes``). Over the limit the kernel's OOM killer kills in the group and counts it
    (v2 ``memory.events``, v1 ``memory.oom_control``: ``oom_kill N``); the CRI reports such an exit with
    reason ``OOMKilled`` (containerd ``internal/cri/server/events.go`` ``handleContainerExit``: the task's
    exit carries the OOM event, which the kubelet shows as the terminated reason)."""

    path: Path
    v2: bool

    @classmethod
    def create(cls, name: str, limit_bytes: int) -> MemoryCgroup:
        v2 = (CGROUP_ROOT / "cgroup.controllers").exists()
        if v2:
            controllers = (CGROUP_ROOT / "cgroup.subtree_control").read_text().split()
            if "memory" not in controllers:
                (CGROUP_ROOT / "cgroup.subtree_control").write_text("+memory")
            path = CGROUP_ROOT / name
        else:
            path = CGROUP_ROOT / "memory" / name
        path.mkdir()
        group = cls(path, v2)
        try:
            (path / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit_bytes))
            if v2:
                # The kubelet (>= 1.28, singleProcessOOMKill false, the default) sets memory.oom.group on cgroup
                # v2, so the OOM killer ends every process of the container together (kubernetes#117793;
                # pkg/kubelet/kuberuntime/kuberuntime_container_linux.go ``generateLinuxContainerResources``).
                # AKS nodes are cgroup v2 (Ubuntu 22.04, Azure Linux). On a v1 host ``kill_together_on_oom``
                # does the same.
                (path / "memory.oom.group").write_text("1")
            # No swap for it (the kubelet's default, swapBehavior NoSwap): over the limit is a kill, not a crawl.
            swap = path / ("memory.swap.max" if v2 else "memory.memsw.limit_in_bytes")
            if swap.exists():
                swap.write_text("0" if v2 else str(limit_bytes))
        except OSError:
            group.remove()
            raise
        return group

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def oom_kills(self) -> int:
        text = (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", 0))

    def kill_together_on_oom(self) -> None:
        """On a cgroup v1 host, what ``memory.oom.group`` makes the kernel do on v2: once the OOM killer has
        killed a process of the group, every other one is killed too (v1's own behaviour, which only
        ``singleProcessOOMKill`` keeps, kills the biggest process alone). The kernel tells an eventfd
        registered on ``memory.oom_control`` when the group goes under OOM (cgroup-v1 memory.rst, "OOM
        Control"), as containerd's v1 OOM monitor listens; the kill is then read from the group's count. The
        eventfd also fires when the group is removed."""
        if self.v2:
            return
        event = os.eventfd(0)
        control = os.open(self.path / "memory.oom_control", os.O_RDONLY)
        try:
            (self.path / "cgroup.event_control").write_text(f"{event} {control}")
        except OSError:
            os.close(event)
            os.close(control)
            raise

        def watch() -> None:
            try:
                while True:
                    noticed, _, _ = select.select([event], [], [], 1.0)
                    if not self.path.exists():  # removed (the eventfd fires then too): nothing left to watch
                        return
                    if noticed:
                        os.eventfd_read(event)
                        if self._killed_after_notice():
                            break
                for _ in range(100):  # until none is left: a process may fork while its siblings are killed
                    pids = [int(pid) for pid in self.procs.read_text().split()]
                    if not pids:
                        return
                    for pid in pids:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    time.sleep(0.02)
            except OSError:  # the group was removed: nothing left to kill
                return
            finally:
                os.close(event)
                os.close(control)
        threading.Thread(target=watch, daemon=True, name=f"oom-group-{self.path.name}").start()

    def _killed_after_notice(self) -> bool:
        """After the kernel's OOM notice: True once its kill is counted. The notice comes as the group goes
        under OOM (memcontrol.c ``mem_cgroup_oom_notify``), before the OOM killer has chosen and counted."""
        for _ in range(100):
            if not self.path.exists():
                return False
            if self.oom_kills() > 0:
                return True
            time.sleep(0.02)
        return False

    def remove(self) -> None:
        """Once its processes are gone (an exited PID namespace's last processes may still be reaped)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


@functools.cache
def memory_limits_missing() -> str | None:
    """Why ``limits.memory`` cannot be enforced here (no writable memory cgroup), or None."""
    try:
        group = MemoryCgroup.create(f"laneflow-probe-{os.getpid()}", 64 * 2**20)
    except OSError as exc:
        return f"no writable memory cgroup under {CGROUP_ROOT} ({exc.strerror}): memory limits cannot be enforced"
    try:
        group.oom_kills()
        group.kill_together_on_oom()
    except (OSError, ValueError) as exc:
        return f"the memory cgroup does not count or tell OOM kills ({exc})"
    finally:
        group.remove()
    return None


@dataclass
class ContainerProcess:
    """A running container: ``unshare`` and, below it, the container's PID 1."""

    process: subprocess.Popen
    sandbox: Path
    grace_s: float
    memory: MemoryCgroup | None = None
    #: Set when it exited: the kernel's OOM killer killed in its memory cgroup.
    oom_killed: bool = False

    def init_pid(self) -> int | None:
        try:
            children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def pids(self) -> list[int]:
        """Every process of the container (its PID namespace)."""
        init = self.init_pid()
        if init is None:
            return []
        try:
            namespace = os.readlink(f"/proc/{init}/ns/pid")
        except OSError:
            return []
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.readlink(entry / "ns" / "pid") == namespace:
                        found.append(int(entry.name))
                except OSError:
                    continue
        return found

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM to the container's PID 1, SIGKILL (of the whole PID namespace) after the grace period."""
        grace = self.grace_s if grace_s is None else grace_s
        init = self.init_pid()
        if init is not None and grace > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(init, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while self.process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
        if self.process.poll() is None:
            init = self.init_pid()
            if init is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(init, signal.SIGKILL)  # PID 1 gone: the kernel kills the rest of the namespace
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    @staticmethod
    def exit_code(returncode: int) -> int:
        return 128 - returncode if returncode < 0 else returncode


def service_env() -> dict[str, str]:
    """The variables every container gets for the ``kubernetes`` Service in ``default``, whatever its
    ``enableServiceLinks`` (pkg/kubelet/kubelet_pods.go ``getServiceEnvVarMap``: the master service is always
    included; pkg/kubelet/envvars ``FromServices``)."""
    host, port = KUBERNETES_SERVICE
    url = f"tcp://{host}:{port}"
    return {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": str(port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(port), "KUBERNETES_PORT": url,
            f"KUBERNETES_PORT_{port}_TCP": url, f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
            f"KUBERNETES_PORT_{port}_TCP_PORT": str(port), f"KUBERNETES_PORT_{port}_TCP_ADDR": host}


def container_env(container: dict, pod: dict, ip: str,
                  lookup: Callable[[str, str, str], str | None]) -> dict[str, str]:
    """The env the kubelet gives the runtime: the service variables, then the container's ``env`` in order,
    ``$(VAR)`` expanded from what came before — the image's ``ENV`` is not part of it (the runtime merges that
    in later: ``process_env``). ``lookup(kind, name, key)`` reads a Secret or ConfigMap key."""
    env = service_env()
    fields = {"metadata.name": pod["metadata"]["name"], "metadata.namespace": pod["metadata"]["namespace"],
              "status.podIP": ip, "spec.nodeName": pod["spec"].get("nodeName", ""),
              "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default")}
    for item in container.get("env") or []:
        if "valueFrom" in item:
            source = item["valueFrom"]
            if "fieldRef" in source:
                value = fields.get(source["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in source or "configMapKeyRef" in source:
                kind = "secret" if "secretKeyRef" in source else "configmap"
                ref = source.get("secretKeyRef") or source.get("configMapKeyRef")
                value = lookup(kind, ref["name"], ref["key"])
            else:
                value = None
            if value is None:
                raise KeyError(f"env {item['name']}: cannot resolve {json.dumps(source)}")
        else:
            value = expand_references(item.get("value", ""), env)
        env[item["name"]] = value
    return env


def process_env(image: ImageConfig, kubelet_env: dict[str, str], hostname: str) -> dict[str, str]:
    """The container process's environment, as containerd builds the OCI spec: the image's ``Env``, then
    ``HOSTNAME``, then the kubelet's env over both (containerd ``internal/cri/server``
    ``containerSpecOpts``: ``WithEnv(image env)``, ``WithEnv(HOSTNAME)``, ``WithEnv(config envs)``)."""
    return {**image.env, "HOSTNAME": hostname, **kubelet_env}


def container_spec(image: ImageConfig, container: dict, *, sandbox: Path, hostname: str, hosts: str,
                   env: dict[str, str], mounts: list[Mount], user: dict, resolv_conf: str | None = None) -> dict:
    """What ``podinit.py`` needs to build the container and exec its command; ``env`` is the kubelet's
    (``container_env``), which alone ``$(VAR)`` in command and args is expanded from; ``resolv_conf`` the
    kubelet's for the pod's DNS policy (None: the image's own); ``user`` who the process runs as
    (``security_context.process_user``)."""
    argv = [expand_references(arg, env) for arg in container_argv(image, container.get("command"),
                                                                  container.get("args"))]
    if not argv:
        raise ValueError("no command specified: the image has no ENTRYPOINT or CMD and the container sets none")
    binds, tmpfs, copies = [], [], []
    for mount in mounts:
        if mount.tmpfs:
            tmpfs.append({"target": mount.target, "size": mount.tmpfs_bytes})
        elif mount.tmpfs_copy:
            copies.append({"source": str(mount.source), "target": mount.target})
        else:
            binds.append({"source": str(mount.source), "target": mount.target, "readonly": mount.readonly})
    return {"sandbox": str(sandbox), "rootfs": str(image.rootfs), "hostname": hostname, "binds": binds,
            "tmpfs": tmpfs, "tmpfs_copies": copies,
            "files": {"/etc/hosts": hosts, "/etc/hostname": hostname + "\n",
                      **({"/etc/resolv.conf": resolv_conf} if resolv_conf is not None else {})},
            "cwd": container.get("workingDir") or image.workdir, "env": process_env(image, env, hostname),
            "argv": argv, "user": user,
            "capabilities": capabilities(container)}


#: What util-linux 2.38's unshare prints, exiting 1, when its child (the container's PID 1) was killed by
#: SIGKILL: it mirrors a child's death by signal by unblocking that signal and sending it to itself, and
#: the unblock fails for SIGKILL. The container runtime reports such an exit as 137.
UNSHARE_SIGKILL_FAILURE = "unshare: sigprocmask unblock failed: Invalid argument"


def start(spec: dict, folder: Path, netns: str, grace_s: float, on_line: Callable[[str], None],
          on_exit: Callable[[int], None], memory_limit: int | None = None) -> ContainerProcess:
    """Run the container described by ``spec`` in the pod's network namespace ``netns`` (in a memory cgroup
    of ``memory_limit`` bytes when given); its output goes line by line to ``on_line``, its exit code
    (128 + signal when killed) to ``on_exit``, after ``oom_killed`` is set."""
    folder.mkdir(parents=True, exist_ok=True)
    spec_file = folder / "container.json"
    spec_file.write_text(json.dumps(spec))
    sandbox = Path(spec["sandbox"])
    sandbox.mkdir(parents=True, exist_ok=True)
    argv = ["nsenter", f"--net=/run/netns/{netns}",
            "unshare", "--pid", "--kill-child=SIGKILL", "--mount", "--uts", "--ipc", "--propagation", "private",
            sys.executable, "-I", str(PODINIT), str(spec_file)]
    memory = None
    if memory_limit is not None:
        memory = MemoryCgroup.create(f"laneflow-{os.getpid()}-{time.time_ns():x}", memory_limit)
        try:
            memory.kill_together_on_oom()
        except OSError:
            memory.remove()
            raise
        # Into the cgroup before anything of the container runs: everything it starts inherits it.
        argv = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(memory.procs), *argv]
    try:
        process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, errors="replace",
            start_new_session=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                         **{k: v for k, v in os.environ.items() if k == "LANEFLOW_TEST_SESSION"}})
    except OSError:
        if memory is not None:
            memory.remove()  # and with it the OOM watcher
        raise
    running = ContainerProcess(process, sandbox, grace_s, memory)

    def pump() -> None:
        assert process.stdout is not None
        held = None
        with (folder / "output.log").open("a", encoding="utf-8") as kept:  # for whoever debugs a test
            for line in process.stdout:
                kept.write(line)
                kept.flush()
                if held is not None:
                    on_line(held)
                    held = None
                if line.rstrip("\n") == UNSHARE_SIGKILL_FAILURE:
                    held = line
                    continue
                on_line(line)
        code = ContainerProcess.exit_code(process.wait())
        if held is not None and code == 1:
            code = 128 + signal.SIGKILL  # PID 1 was SIGKILLed; unshare could not die the same way
        elif held is not None:
            on_line(held)
        if memory is not None:
            running.oom_killed = memory.oom_kills() > 0
        on_exit(code)  # first: the kubelet reports an exit at once, whatever the runtime still tidies
        if memory is not None:
            memory.remove()

    threading.Thread(target=pump, daemon=True, name=f"container-{folder.name}").start()
    return running
