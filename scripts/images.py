#!/usr/bin/env python3
"""Build laneflow's container images from ``deployments/Dockerfile.*`` with buildah, and hand them to the
emulated cluster's pods.

``make image`` runs ``python scripts/images.py build``: the training image and the data image, CPU flavour,
on a Debian bookworm base that this script makes once with debootstrap from Debian's own packages (base
images cannot be pulled here). Every ``RUN`` line of the Dockerfiles is executed; nothing of this machine
goes into an image but what the Dockerfile copies from the build context. ``make image-gpu`` runs ``build
--flavour gpu``: the training image's GPU flavour (``localhost/laneflow-train:gpu``, CUDA and NCCL from PyPI
wheels, Horovod compiled for NCCL) on the same base; the data image has one flavour. Not part of ``make
test``: it downloads several GB and compiles Horovod for GPUs.

Cached by content: an image is tagged ``localhost/laneflow-<name>:<key>`` where the key hashes its
Dockerfile, build arguments, base image and every file of the build context that ``.dockerignore`` lets
through, so an unchanged tree finds its image and builds nothing; a changed one rebuilds from the first
layer that changed (``buildah bud --layers``). ``localhost/laneflow-<name>:<flavour>`` names the newest.

One build at a time per flavour (a lock file each, ``lock_path``): the CPU builds (``make test``'s, the suite's
workers', ``make image``) wait for each other, never for a GPU build's tens of minutes; a GPU build takes the
CPU lock only while it makes sure the shared base exists.

What the build borrows from this machine, as build-time mounts that never become a layer (buildah ``-v``):
its CA bundle and pip's package sources (the registries answer only through them here), and the Horovod
wheel cache of ``scripts/install_horovod.sh``, so the wheel the bootstrap built for the same Debian, Python,
torch and OpenMPI is installed instead of compiled a second time (12 minutes on 2 cores).

Only the standard library: it runs before the project's environment is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as `python scripts/images.py`: the `scripts` folder's modules by their package name
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts import image_gc

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "laneflow"
WHEEL_CACHE = Path(os.environ.get("LANEFLOW_WHEEL_CACHE") or CACHE / "wheels")
LOCK = CACHE / "images.lock"
#: Which images running processes use (a test session's pods run from their root file systems): ``prune``
#: leaves them alone.
IN_USE = image_gc.InUse(CACHE / "images" / "in-use")
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("LANEFLOW_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_IMAGE = f"localhost/laneflow-base:{DEBIAN_SUITE}"
#: The flavour the tests' pods run and ``make image`` builds; ``make image-gpu`` builds the training image's GPU
#: flavour, the Dockerfile's default and what a cluster runs (docs/getting-started/images.md).
FLAVOUR = "cpu"
FLAVOURS = ("cpu", "gpu")
#: Working containers whose mounted root file system pods run from (``rootfs``).
ROOTFS_PREFIX = "laneflow-rootfs-"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
#: Where a build sees what it borrows from this machine (its CA bundle, local package sources): one folder,
#: beside the image's own files, not over them (Debian's ca-certificates rewrites
#: /etc/ssl/certs/ca-certificates.crt when it is installed, which a bind mount there refuses).
BUILD_INPUTS = "/run/laneflow-build"


@dataclass(frozen=True)
class ImageSpec:
    """One of laneflow's images in one flavour: its Dockerfile and build arguments."""

    name: str
    dockerfile: str
    build_args: dict[str, str] = field(default_factory=dict)
    flavour: str = FLAVOUR

    @property
    def tag(self) -> str:
        return f"localhost/laneflow-{self.name}:{self.flavour}"


#: The CPU flavour of every image, by name: what ``make image`` and the tests build.
IMAGES = {
    # TORCH_INDEX_URL empty: torch's CPU build comes from the package sources pip is configured with here.
    "train": ImageSpec("train", "deployments/Dockerfile.train", {"FLAVOUR": FLAVOUR, "TORCH_INDEX_URL": ""}),
    "data": ImageSpec("data", "deployments/Dockerfile.data"),
}
#: The images that have a GPU flavour: the training image (the data image has no GPU stack). CUDA_ARCHS is the
#: Dockerfile's default (80,90), so ``make image-gpu`` builds what ``docker build`` builds.
GPU_IMAGES = {
    "train": ImageSpec("train", "deployments/Dockerfile.train", {"FLAVOUR": "gpu"}, flavour="gpu"),
}


def image_spec(name: str, flavour: str = FLAVOUR) -> ImageSpec:
    """``name``'s image in ``flavour``; a ``KeyError`` saying why when there is no such image or flavour."""
    if flavour not in FLAVOURS:
        raise KeyError(f"no flavour {flavour!r}; laneflow's are {', '.join(FLAVOURS)}")
    specs = IMAGES if flavour == FLAVOUR else GPU_IMAGES
    if name not in specs:
        raise KeyError(f"no image {name!r} in the {flavour} flavour; it has {', '.join(specs)}")
    return specs[name]


def lock_path(flavour: str = FLAVOUR) -> Path:
    """The lock file of ``flavour``'s builds: ``images.lock`` for the CPU flavour (as ever), its own for the GPU
    flavour, so a GPU build (tens of minutes) never holds the lock a CPU build waits on."""
    return LOCK if flavour == FLAVOUR else CACHE / f"images-{flavour}.lock"


class ImageBuildError(RuntimeError):
    """An image could not be built; the message says which step and why."""


def missing_tools() -> str | None:
    """Why images cannot be built here, or None."""
    if os.geteuid() != 0:
        return "building images needs root (buildah without a user namespace set up; CI runs as root)"
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            return f"building images needs {tool} (Debian: apt-get install -y buildah debootstrap)"
    return None


def run(argv: list[str], what: str) -> str:
    """``argv``'s output; an ``ImageBuildError`` naming ``what`` and ending with its stderr when it fails."""
    done = subprocess.run(argv, text=True, capture_output=True)
    if done.returncode != 0:
        raise ImageBuildError(f"{what} failed (exit {done.returncode}): {done.stderr.strip()[-4000:]}")
    return done.stdout.strip()


@contextlib.contextmanager
def locked(flavour: str = FLAVOUR) -> Iterator[None]:
    """One builder of ``flavour`` at a time on this machine (the suite's xdist workers, a `make image` beside
    them); the flavours' locks are apart (``lock_path``)."""
    path = lock_path(flavour)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def locked_unless_busy(flavour: str) -> Iterator[bool]:
    """``flavour``'s build lock if nobody holds it (True), else nothing (False): for work that can wait for
    another time rather than for a GPU build's tens of minutes."""
    path = lock_path(flavour)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def image_id(reference: str) -> str | None:
    """The local image's ID, or None when there is no such image."""
    done = subprocess.run(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", reference],
                          capture_output=True, text=True)
    return done.stdout.strip() or None if done.returncode == 0 else None


# --- the base ---------------------------------------------------------------------------------------------
def ensure_base(log=print) -> str:
    """``localhost/laneflow-base:bookworm``: Debian bookworm from debootstrap (``--variant=minbase``), with
    the apt sources and the defaults of Docker Hub's ``debian:bookworm`` (updates and security suites,
    ``PATH``, ``CMD ["bash"]``). Made once per machine."""
    found = image_id(BASE_IMAGE)
    if found:
        return found
    log(f"images: making {BASE_IMAGE} with debootstrap ({DEBIAN_MIRROR})")
    container = run(["buildah", "from", "scratch"], "buildah from scratch")
    try:
        root = Path(run(["buildah", "mount", container], "buildah mount"))
        run(["debootstrap", "--variant=minbase", DEBIAN_SUITE, str(root), DEBIAN_MIRROR],
            f"debootstrap {DEBIAN_SUITE}")
        (root / "etc/apt/sources.list").unlink(missing_ok=True)
        (root / "etc/apt/sources.list.d/debian.sources").write_text(
            f"Types: deb\nURIs: {DEBIAN_MIRROR}\nSuites: {DEBIAN_SUITE} {DEBIAN_SUITE}-updates\n"
            "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
            f"Types: deb\nURIs: {DEBIAN_MIRROR}-security\nSuites: {DEBIAN_SUITE}-security\n"
            "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (root / leftover).glob("*"):
                if path.is_file():
                    path.unlink()
        run(["buildah", "config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
             "--cmd", '["bash"]', "--label", f"org.opencontainers.image.description=Debian {DEBIAN_SUITE} "
             "minbase from debootstrap (laneflow scripts/images.py)", container], "buildah config")
        run(["buildah", "unmount", container], "buildah unmount")
        run(["buildah", "commit", "--rm", container, BASE_IMAGE], f"buildah commit {BASE_IMAGE}")
    except BaseException:
        subprocess.run(["buildah", "rm", container], capture_output=True)
        raise
    return image_id(BASE_IMAGE) or ""


# --- what goes into a build -------------------------------------------------------------------------------
def ignore_patterns(context: Path) -> list[str]:
    path = context / ".dockerignore"
    if not path.is_file():
        return []
    return [line.strip().rstrip("/") for line in path.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def ignored(relative: str, patterns: list[str]) -> bool:
    """Whether ``.dockerignore`` keeps ``relative`` out of the context: a pattern matches the path or one of
    its parent folders; ``**/`` matches at any depth (Docker's rules, for the patterns this project uses)."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        if pattern.startswith("**/"):
            tail = pattern[3:]
            if any(fnmatch.fnmatchcase(part, tail) for part in parts):
                return True
        elif any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes):
            return True
    return False


def context_files(context: Path) -> list[str]:
    """The build context as the builder sends it: every file that ``.dockerignore`` does not exclude."""
    patterns = ignore_patterns(context)
    found = []
    for folder, dirs, files in os.walk(context):
        rel_folder = os.path.relpath(folder, context)
        rel_folder = "" if rel_folder == "." else rel_folder + "/"
        dirs[:] = sorted(d for d in dirs if not ignored(rel_folder + d, patterns))
        found += [rel_folder + f for f in sorted(files) if not ignored(rel_folder + f, patterns)]
    return found


def content_key(dockerfile: bytes, build_args: dict[str, str], base_id: str, context: Path | None) -> str:
    """What the image is made of, hashed: the Dockerfile, its arguments, the base image and the context."""
    digest = hashlib.sha256()
    digest.update(dockerfile)
    digest.update(json.dumps(sorted(build_args.items())).encode())
    digest.update(base_id.encode())
    for relative in context_files(context) if context else []:
        path = context / relative
        digest.update(relative.encode() + b"\0" + oct(path.stat().st_mode & 0o111).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest() if not path.is_symlink()
                      else os.readlink(path).encode())
    return digest.hexdigest()[:16]


def pip_sources() -> tuple[str, dict[str, Path]]:
    """A pip configuration for inside the build with this machine's package sources (index, extra indexes,
    find-links, CA bundle), and the local folders and files it names: {path inside the build: path here},
    all under ``BUILD_INPUTS``, mounted read-only."""
    done = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    values: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        key, _, raw = line.partition("=")
        name = key.split(".", 1)[-1].strip()
        if name in ("index-url", "extra-index-url", "find-links", "trusted-host"):
            values.setdefault(name, []).extend(raw.strip().strip("'\"").split())
    mounts: dict[str, Path] = {}
    config: dict[str, list[str]] = {}
    for kind in ("index-url", "extra-index-url", "find-links", "trusted-host"):
        for location in dict.fromkeys(values.get(kind, [])):
            local = None if "://" in location and not location.startswith("file://") else \
                Path(location.removeprefix("file://"))
            if kind == "trusted-host" or local is None:
                config.setdefault(kind, []).append(location)
                continue
            # A local index's pages link files beside it (``<index>/../../files/...``): its parent goes in too.
            folder = local.parent if kind != "find-links" else local
            if not folder.exists():
                continue
            inside = f"{BUILD_INPUTS}/source-{len(mounts)}"
            mounts[inside] = folder
            where = inside + ("/" + local.name if kind != "find-links" else "")
            config.setdefault(kind, []).append(f"file://{where}" if kind != "find-links" else where)
    lines = ["[global]"]
    for kind, locations in config.items():
        lines.append(f"{kind} = {' '.join(locations[:1] if kind == 'index-url' else locations)}")
    if CA_BUNDLE.is_file():
        mounts[f"{BUILD_INPUTS}/ca-certificates.crt"] = CA_BUNDLE
        lines.append(f"cert = {BUILD_INPUTS}/ca-certificates.crt")
    return "\n".join(lines) + "\n", mounts


def build_volumes() -> list[str]:
    """``buildah bud -v`` arguments: build-time mounts, none of whose contents becomes part of the image
    (buildah leaves the empty mount points: ``/etc/pip.conf``, ``BUILD_INPUTS`` and the wheel cache's folder)."""
    conf, mounts = pip_sources()
    conf_file = CACHE / "images" / "pip.conf"
    conf_file.parent.mkdir(parents=True, exist_ok=True)
    if not conf_file.is_file() or conf_file.read_text() != conf:
        # Replaced whole, never rewritten in place: a build of the other flavour may be reading it right now.
        partial = conf_file.with_name(f".pip.conf.{os.getpid()}")
        partial.write_text(conf)
        os.replace(partial, conf_file)
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    volumes = [f"{conf_file}:/etc/pip.conf:ro", f"{WHEEL_CACHE}:/root/.cache/laneflow/wheels"]
    volumes += [f"{here}:{inside}:ro" for inside, here in mounts.items()]
    return [argument for volume in volumes for argument in ("-v", volume)]


# --- building ---------------------------------------------------------------------------------------------
def build_dockerfile(dockerfile: Path, tag: str, *, context: Path, build_args: dict[str, str] | None = None,
                     base_id: str = "", log=print, no_cache: bool = False) -> str:
    """Build ``dockerfile`` with ``context`` unless an image of the same content exists; tag it ``tag``
    (and ``<repository>:<content key>``). Its image ID. A failed build leaves no working container behind
    (``--force-rm``: the GPU flavour's hold GBs). ``no_cache``: build every layer again even so (buildah
    ``--no-cache``), e.g. to time a build from scratch."""
    build_args = dict(build_args or {})
    key = content_key(dockerfile.read_bytes(), build_args, base_id, context)
    repository = tag.rsplit(":", 1)[0]
    keyed = f"{repository}:{key}"
    found = None if no_cache else image_id(keyed)
    if found is None:
        log_file = CACHE / "images" / f"{repository.rsplit('/', 1)[-1]}-{key}.log"
        log(f"images: building {tag} from {dockerfile.name} (content {key}; log {log_file})")
        argv = ["buildah", "bud", "--layers", "--force-rm", "--isolation", "chroot", "--network", "host",
                "--format", "docker", "-f", str(dockerfile), "-t", keyed, *build_volumes()]
        if no_cache:
            argv.append("--no-cache")
        for name, value in sorted(build_args.items()):
            argv += ["--build-arg", f"{name}={value}"]
        # Written as the build goes (a GPU build runs for tens of minutes: `tail -f` it).
        (CACHE / "images").mkdir(parents=True, exist_ok=True)
        with log_file.open("w+") as output:
            done = subprocess.run([*argv, str(context)], stdout=output, stderr=subprocess.STDOUT, text=True)
            output.seek(0)
            text = output.read()
        if done.returncode != 0:
            raise ImageBuildError(f"building {tag} from {dockerfile} failed (exit {done.returncode}); the build's "
                                  f"output ends:\n{text[-6000:]}")
        found = image_id(keyed)
        if found is None:
            raise ImageBuildError(f"buildah built {keyed} but cannot find it")
    run(["buildah", "tag", keyed, tag], f"buildah tag {tag}")
    IN_USE.hold(found)  # the caller is about to use it: no prune beside this process removes it meanwhile
    return found


def build(name: str, log=print, flavour: str = FLAVOUR, no_cache: bool = False) -> str:
    """One of laneflow's images (``IMAGES``; ``GPU_IMAGES`` for ``flavour="gpu"``), built on the local base; its
    image ID. ``no_cache``: every layer built again (``build_dockerfile``)."""
    spec = image_spec(name, flavour)
    build_args = {"BASE_IMAGE": BASE_IMAGE, **spec.build_args}
    if flavour == FLAVOUR:
        with locked():
            base_id = ensure_base(log)
            return build_dockerfile(PROJECT_ROOT / spec.dockerfile, spec.tag, context=PROJECT_ROOT,
                                    build_args=build_args, base_id=base_id, log=log, no_cache=no_cache)
    with locked():  # the base is the CPU builds': made under their lock, then theirs again
        base_id = ensure_base(log)
    with locked(flavour):
        return build_dockerfile(PROJECT_ROOT / spec.dockerfile, spec.tag, context=PROJECT_ROOT,
                                build_args=build_args, base_id=base_id, log=log, no_cache=no_cache)


def build_derived(parent: str, lines: list[str], tag: str, log=print) -> str:
    """An image made from the local image ``parent`` (a reference or an ID) by a few more Dockerfile lines (no
    build context): how a test gets, say, the training image without openssh-server. Its image ID."""
    parent_id = image_id(parent)
    if parent_id is None:
        raise ImageBuildError(f"no image {parent} to build {tag} from")
    with locked(), tempfile.TemporaryDirectory() as folder:
        dockerfile = Path(folder) / "Dockerfile"
        dockerfile.write_text("\n".join([f"FROM {parent_id}", *lines]) + "\n")
        return build_dockerfile(dockerfile, tag, context=Path(folder), base_id=parent_id, log=log)


# --- what a container runtime needs ---------------------------------------------------------------------
def image_config(reference: str) -> dict | None:
    """The image's OCI config (``Entrypoint``, ``Cmd``, ``Env``, ``WorkingDir``, ``User``...), or None when
    there is no such image."""
    done = subprocess.run(["buildah", "inspect", "--type", "image", reference], capture_output=True, text=True)
    if done.returncode != 0:
        return None
    inspected = json.loads(done.stdout)
    return {"id": inspected["FromImageID"], **(inspected.get("OCIv1", {}).get("config") or {})}


def rootfs(image: str) -> Path:
    """The image's root file system, read-only for the caller: a buildah working container of that image,
    mounted, kept for as long as the image is tagged (a container runtime's snapshot of the image)."""
    with locked():
        found = image_id(image)
        if found is None:
            raise ImageBuildError(f"no image {image}")
        name = ROOTFS_PREFIX + found[:16]
        if name not in {listed["containername"] for listed in image_gc.list_containers()}:
            run(["buildah", "from", "--pull=never", "--name", name, found], f"buildah from {image}")
        IN_USE.hold(found)  # pods of this process run from it until the process ends
        return Path(run(["buildah", "mount", name], f"buildah mount {name}"))


def prune(log=print) -> image_gc.Removed | None:
    """Remove laneflow's images that nothing needs any more (``image_gc``): older builds of changed sources,
    their build cache and mounted root file systems, images tests derived. The flavour tags' images, images
    a running process uses and anything a user tagged stay. None when it had to wait for another time (a GPU
    build is running, or there is no base yet)."""
    with locked(), locked_unless_busy("gpu") as free:
        base_id = image_id(BASE_IMAGE)
        if not free or base_id is None:
            return None
        keep = {spec.tag for spec in [*IMAGES.values(), *GPU_IMAGES.values()]}
        try:
            return image_gc.collect(base_id=base_id, keep_names=keep, in_use=IN_USE, rootfs_prefix=ROOTFS_PREFIX,
                                    log=log)
        except RuntimeError as exc:
            raise ImageBuildError(f"removing stale images: {exc}") from exc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build_cmd = sub.add_parser("build", help="build laneflow's images (CPU flavour) unless they are up to date")
    build_cmd.add_argument("names", nargs="*", metavar="NAME",
                           help=f"{', '.join(IMAGES)} (default: all that the flavour has)")
    build_cmd.add_argument("--flavour", choices=FLAVOURS, default=FLAVOUR,
                           help=f"cpu (default; the tests' pods) or gpu (the training image with CUDA and NCCL: "
                                f"{GPU_IMAGES['train'].tag}; several GB and a Horovod build the first time)")
    build_cmd.add_argument("--no-cache", action="store_true",
                           help="build every layer again, even where an image of the same content exists (to time "
                                "a build from scratch, or to take new package releases)")
    build_cmd.add_argument("--if-possible", action="store_true",
                           help="where images cannot be built (no root, no buildah), say so and exit 0: the "
                                "cluster tests then skip, saying why")
    build_cmd.add_argument("--keep-stale", action="store_true",
                           help="leave older builds in place (by default a build ends by removing laneflow's "
                                "images that nothing needs any more: see `prune`)")
    sub.add_parser("prune", help="remove laneflow's images that nothing needs any more: older builds, their build "
                                 "cache and mounted root file systems (the :cpu/:gpu images, images a running "
                                 "test session uses and images you tagged stay)")
    sub.add_parser("list", help="the images and their IDs")
    args = parser.parse_args()
    if missing := missing_tools():
        print(f"images: {missing}", file=sys.stderr)
        return 0 if getattr(args, "if_possible", False) else 2
    flavour = getattr(args, "flavour", FLAVOUR)
    try:
        specs = [image_spec(name, flavour) for name in getattr(args, "names", [])]
    except KeyError as exc:
        print(f"images: {exc.args[0]}", file=sys.stderr)
        return 2
    if args.command == "build":
        for spec in specs or list((IMAGES if flavour == FLAVOUR else GPU_IMAGES).values()):
            try:
                built = build(spec.name, flavour=flavour, no_cache=args.no_cache)
            except ImageBuildError as exc:
                print(f"images: {exc}", file=sys.stderr)
                return 1
            print(f"images: {spec.tag} is {built[:12]}")
        if not args.keep_stale:
            return _prune()
    elif args.command == "prune":
        return _prune()
    else:
        for spec in [*IMAGES.values(), *GPU_IMAGES.values()]:
            print(f"{spec.tag}\t{(image_id(spec.tag) or 'not built')[:12]}")
    return 0


def _prune() -> int:
    try:
        if prune() is None:
            print("images: nothing removed now (a GPU build is running, or no image was built yet)")
    except ImageBuildError as exc:
        print(f"images: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
