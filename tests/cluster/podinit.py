"""A container's first process, run by the pod runtime as ``unshare --pid --fork --mount --uts --ipc
--propagation private python podinit.py SPEC``: it becomes PID 1 of a PID namespace of its own, builds the
container's file system and then execs the container's command, which stays PID 1 (as under containerd: when
it ends, the kernel kills everything else in the container, sshd sessions and MPI ranks included).

The file system: an overlay whose lower layer is the image's root file system (``images.py``: built from the
project's Dockerfile) and whose upper layer is a private tmpfs, so nothing a container writes outside its
volumes reaches the image or the host. Into it go the pod's volumes at their ``mountPath`` (``readOnly``
honoured; a Secret's files copied onto a tmpfs of their own), ``/proc`` of the new PID namespace, a ``/dev``
with only the devices runc gives a container (``null zero full random urandom tty``, a private ``devpts``) and
a private 64 MiB ``/dev/shm`` (containerd's default for a pod, ``defaultShmSize``) unless a volume is mounted
there, ``/sys`` read-only, ``/etc/hosts`` and the host name. Then ``chroot``, the container's user and groups
(``switch_user``), ``chdir`` to the working directory, ``execvpe`` with exactly the container's environment.

Only the standard library: this file runs before anything is set up.
"""

from __future__ import annotations

import ctypes  # here: after chroot, only the container's files are there to import from
import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"mount {' '.join(args)}: {done.stderr.strip()}")


def inside(root: Path, path: str) -> Path:
    """``path`` in the container's file system, its symlinks resolved within ``root``: an absolute link
    (Debian's ``/var/run -> /run``) points into the container, never at this machine, as a container
    runtime resolves mount targets (runc's securejoin)."""
    parts = [part for part in path.split("/") if part]
    current, links = root, 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            current = current.parent if current != root else root
            continue
        candidate = current / part
        if candidate.is_symlink():
            links += 1
            if links > 40:
                raise OSError(f"too many levels of symbolic links in {path}")
            link = os.readlink(candidate)
            parts = [piece for piece in link.split("/") if piece] + parts
            if link.startswith("/"):
                current = root
            continue
        current = candidate
    return current


def make_target(target: Path, like_file: bool) -> None:
    """A mount point in the container's file system, as the runtime creates it (a file for a file)."""
    if like_file:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.touch()
    else:
        target.mkdir(parents=True, exist_ok=True)


#: The device nodes runc creates in a container's /dev (runc libcontainer/specconv ``AllowedDevices``, the
#: OCI runtime spec's default devices), bound here from this machine's.
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
#: containerd's /dev/shm for a pod sandbox (internal/cri/server ``defaultShmSize``).
SHM_BYTES = 64 * 2**20


def make_dev(root: Path, shm_from_volume: bool) -> None:
    """A container's /dev: a tmpfs with the allowed devices, ``/dev/pts`` of its own, the standard links, and a
    private ``/dev/shm`` unless the pod mounts a volume there."""
    dev = root / "dev"
    mount("-t", "tmpfs", "-o", "mode=755,size=65536k,nosuid", "tmpfs", str(dev))
    for name in DEVICES:
        (dev / name).touch()
        mount("--bind", f"/dev/{name}", str(dev / name))
    (dev / "pts").mkdir()
    mount("-t", "devpts", "-o", "newinstance,ptmxmode=0666,mode=620", "devpts", str(dev / "pts"))
    (dev / "ptmx").symlink_to("pts/ptmx")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        (dev / name).symlink_to(target)
    (dev / "shm").mkdir()
    if not shm_from_volume:
        mount("-t", "tmpfs", "-o", f"mode=1777,size={SHM_BYTES},nosuid,nodev,noexec", "shm", str(dev / "shm"))
    (dev / "mqueue").mkdir()


def build(spec: dict) -> Path:
    sandbox = Path(spec["sandbox"])
    sandbox.mkdir(parents=True, exist_ok=True)
    mount("-t", "tmpfs", "-o", "size=256m,mode=755", "tmpfs", str(sandbox))
    for part in ("upper", "work", "root"):
        (sandbox / part).mkdir()
    root = sandbox / "root"
    mount("-t", "overlay", "overlay", "-o",
          f"lowerdir={spec['rootfs']},upperdir={sandbox / 'upper'},workdir={sandbox / 'work'}", str(root))
    for folder in ("proc", "sys", "dev", "tmp", "run"):
        inside(root, folder).mkdir(parents=True, exist_ok=True)
    mount("-t", "proc", "proc", str(root / "proc"))
    mount("--rbind", "-o", "ro", "/sys", str(root / "sys"))
    volume_targets = {item["target"].rstrip("/") for key in ("binds", "tmpfs", "tmpfs_copies")
                      for item in spec.get(key, [])}
    make_dev(root, shm_from_volume="/dev/shm" in volume_targets)
    for item in spec.get("binds", []):  # the pod's volumes
        source, target = Path(item["source"]), inside(root, item["target"])
        make_target(target, source.is_file())
        mount("--bind", str(source), str(target))
        if item.get("readonly"):
            mount("-o", "remount,bind,ro", str(target))
    for item in spec.get("tmpfs", []):
        target = inside(root, item["target"])
        target.mkdir(parents=True, exist_ok=True)
        options = "mode=1777" + (f",size={item['size']}" if item.get("size") else "")
        mount("-t", "tmpfs", "-o", options, "tmpfs", str(target))
    for item in spec.get("tmpfs_copies", []):
        # A Secret volume (pkg/volume/secret wraps an emptyDir of medium Memory): a tmpfs mounted with no mode
        # option, so its root is 1777 (pkg/volume/emptydir ``setupTmpfs``), the atomic writer's files on it,
        # then read-only, as the kubelet mounts Secret volumes into containers.
        target = inside(root, item["target"])
        target.mkdir(parents=True, exist_ok=True)
        mount("-t", "tmpfs", "tmpfs", str(target))
        done = subprocess.run(["cp", "-a", "--no-preserve=ownership", f"{item['source']}/.", str(target)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"copying {item['source']} onto {target}: {done.stderr.strip()}")
        os.chmod(target, 0o1777)
        mount("-o", "remount,ro", str(target))
    for path, text in spec.get("files", {}).items():  # written into the private upper layer
        target = inside(root, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return root


def _entries(path: str) -> list[list[str]]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    return [line.split(":") for line in lines if line and not line.startswith("#")]


def switch_user(identity: dict, env: dict[str, str]) -> None:
    """Become the container's user, resolved in its own ``/etc/passwd`` and ``/etc/group`` (runc's
    ``GetExecUserPath``; see tests/cluster/security_context.py): groups first, then the gid, then the uid; and
    ``HOME`` from the passwd entry when the environment has none."""
    user, group = identity["user"], identity["group"]
    passwd = _entries("/etc/passwd")
    entry = next((e for e in passwd if len(e) >= 7 and (e[0] == user or (str(user).isdigit() and e[2] == str(user)))),
                 None)
    if entry is None and not str(user).isdigit():
        raise RuntimeError(f'unable to find user {user}: no matching entries in passwd file')
    uid = int(entry[2]) if entry is not None else int(user)
    if group is None:
        gid = int(entry[3]) if entry is not None else 0
    elif str(group).isdigit():
        gid = int(group)
    else:
        found = next((e for e in _entries("/etc/group") if len(e) >= 3 and e[0] == group), None)
        if found is None:
            raise RuntimeError(f"unable to find group {group}: no matching entries in group file")
        gid = int(found[2])
    name = entry[0] if entry is not None else None
    member_of = [int(e[2]) for e in _entries("/etc/group")
                 if name is not None and len(e) >= 4 and name in e[3].split(",")]
    os.setgroups(sorted({*member_of, *identity.get("supplemental", [])}))
    os.setgid(gid)
    os.setuid(uid)
    env.setdefault("HOME", entry[5] if entry is not None else "/")


#: Linux's capabilities by number (linux/capability.h), as container runtimes name them.
CAPABILITY_NAMES = ("CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
                    "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
                    "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
                    "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
                    "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
                    "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE")
PR_CAPBSET_DROP = 24


def keep_only_capabilities(kept: list[str]) -> None:
    """Drop every capability but ``kept`` from the bounding set: the command exec'd next (root, with no file
    capabilities) gets only those as its permitted and effective sets (capabilities(7), "Transformation of
    capabilities during execve()"); a process that changes to another user loses them all anyway."""
    libc = ctypes.CDLL(None, use_errno=True)
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for number in range(last + 1):
        name = CAPABILITY_NAMES[number] if number < len(CAPABILITY_NAMES) else f"CAP_{number}"
        if name not in kept and libc.prctl(PR_CAPBSET_DROP, number, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"could not drop capability {name}")


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    try:
        root = build(spec)
        socket.sethostname(spec["hostname"])
        os.chroot(root)
        cwd = spec.get("cwd") or "/"
        Path(cwd).mkdir(parents=True, exist_ok=True)  # as runc does for a working directory that is missing
        env = spec["env"]
        keep_only_capabilities(spec.get("capabilities", []))
        switch_user(spec["user"], env)
        os.chdir(cwd)
    except (OSError, RuntimeError) as exc:
        print(f"pod runtime: could not set up the container: {exc}", file=sys.stderr, flush=True)
        return 128
    argv = spec["argv"]
    try:
        os.execvpe(argv[0], argv, env)
    except FileNotFoundError:
        print(f'exec: "{argv[0]}": executable file not found in $PATH', file=sys.stderr, flush=True)
        return 127
    except PermissionError:
        print(f'exec: "{argv[0]}": permission denied', file=sys.stderr, flush=True)
        return 126
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
