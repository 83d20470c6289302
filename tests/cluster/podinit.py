"""A container's first process, run by the pod runtime as ``unshare --pid --fork --mount --uts --propagation
private python podinit.py SPEC``: it becomes PID 1 of a PID namespace of its own, builds the container's
file system and then execs the container's command, which stays PID 1 (as under containerd: when it ends,
the kernel kills everything else in the container, sshd sessions and MPI ranks included).

The file system: an overlay whose lower layer is this machine's ``/`` (the project's environment stands
for the image's contents; see ``images.py``) and whose upper layer is a private tmpfs, so nothing a
container writes outside its volumes reaches the host. Into it go the image's files (read-only binds of
the project's ``COPY`` sources and virtual environment), the pod's volumes at their ``mountPath``
(``readOnly`` honoured), a private ``/tmp``, an empty ``/run``, ``/proc`` of the new PID namespace,
``/dev``, ``/etc/hosts`` and the host name. Then ``chroot``, ``chdir`` to the working directory,
``execvpe`` with exactly the container's environment.

Only the standard library: this file runs before anything is set up.
"""

from __future__ import annotations

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


def build(spec: dict) -> Path:
    sandbox = Path(spec["sandbox"])
    sandbox.mkdir(parents=True, exist_ok=True)
    mount("-t", "tmpfs", "-o", "size=256m,mode=755", "tmpfs", str(sandbox))
    for part in ("upper", "work", "root"):
        (sandbox / part).mkdir()
    root = sandbox / "root"
    mount("-t", "overlay", "overlay", "-o", f"lowerdir=/,upperdir={sandbox / 'upper'},workdir={sandbox / 'work'}",
          str(root))
    mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", str(root / "tmp"))
    # /run as an image has it: empty. What this machine's services made there at run time (sshd's
    # privilege separation directory, say) is not in an image; the Dockerfile must make it.
    mount("-t", "tmpfs", "-o", "mode=755", "tmpfs", str(root / "run"))
    mount("--rbind", "/dev", str(root / "dev"))
    mount("-t", "proc", "proc", str(root / "proc"))
    mount("--rbind", "-o", "ro", "/sys", str(root / "sys"))
    for directory in spec.get("dirs", []):
        inside(root, directory).mkdir(parents=True, exist_ok=True)
    for item in spec.get("binds", []):  # in order: image files first, then the pod's volumes
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
    for path, text in spec.get("files", {}).items():  # written into the private upper layer
        target = inside(root, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return root


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    try:
        root = build(spec)
        socket.sethostname(spec["hostname"])
        os.chroot(root)
        cwd = spec.get("cwd") or "/"
        Path(cwd).mkdir(parents=True, exist_ok=True)  # as runc does for a working directory that is missing
        os.chdir(cwd)
    except (OSError, RuntimeError) as exc:
        print(f"pod runtime: could not set up the container: {exc}", file=sys.stderr, flush=True)
        return 128
    argv, env = spec["argv"], spec["env"]
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
