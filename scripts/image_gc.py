"""Keep laneflow's images from filling the disk: what ``scripts/images.py`` leaves behind and how it is removed.

Every change of the sources gives the images a new content key, so a new image: its own top layers, the build
cache of each step (buildah ``--layers`` keeps one untagged image per step), and, once a test session ran pods
from it, a mounted working container (``rootfs``). Nothing removed them, so a machine that builds after each
change ran out of disk (CI failed with ``No space left on device`` in the middle of a build). After a build,
``images.py`` removes every image of laneflow's that nothing needs any more:

* laneflow's images are those built on laneflow's base image (``localhost/laneflow-base``), found by the parent
  each image records (buildah writes it into an image of the docker format); the base itself stays;
* an image stays while a name other than a stale laneflow tag points at it: the flavour tags
  (``localhost/laneflow-train:cpu``...), anything a user tagged (``registry.example.org/...`` for a push);
* an image stays while a process uses it: a test session holds a shared lock on the image's file under
  ``in-use/`` (``InUse.hold``) for as long as its pods may run from the image's root file system, so a
  ``make test`` in another checkout never pulls a running suite's images from under it; an image a container
  other than laneflow's ``rootfs`` ones was made from stays too;
* whatever a staying image was built on stays (its parents are its layers).

The rest goes, children before parents: the ``rootfs`` working containers first, then the images. The layers
go with the last image that uses them (containers/storage counts them).

Only the standard library: it runs before the project's environment is needed.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

#: laneflow's image repositories: ``localhost/laneflow-<name>``.
OURS = "localhost/laneflow-"


@dataclass(frozen=True)
class StoredImage:
    """An image in the local store: its ID, its names and the image it was built on (None for a base)."""

    id: str
    names: tuple[str, ...] = ()
    parent: str | None = None


def ancestry(image_id: str, images: dict[str, StoredImage]) -> list[str]:
    """``image_id`` and the images under it, nearest first, as far as the store has them."""
    chain: list[str] = []
    current: str | None = image_id
    while current is not None and current in images and current not in chain:
        chain.append(current)
        current = images[current].parent
    return chain


def built_on(base_id: str, images: Iterable[StoredImage]) -> set[str]:
    """The images built on ``base_id``, at any depth (not the base itself)."""
    by_id = {image.id: image for image in images}
    return {image_id for image_id in by_id if base_id in ancestry(image_id, by_id)[1:]}


def plan_removal(images: Iterable[StoredImage], *, base_id: str, keep_names: set[str],
                 pinned: set[str]) -> list[str]:
    """The IDs of laneflow's images (built on ``base_id``) that nothing needs, children before parents.

    An image is needed when a name points at it that is not one of laneflow's stale tags (``keep_names``, or
    any name outside ``OURS``), when it is ``pinned`` (in use), or when a needed image was built on it."""
    by_id = {image.id: image for image in images}
    chains = {image_id: ancestry(image_id, by_id) for image_id in by_id}
    ours = built_on(base_id, by_id.values())
    needed: set[str] = {base_id}
    for image_id in ours:
        image = by_id[image_id]
        if image_id in pinned or any(name in keep_names or not name.startswith(OURS) for name in image.names):
            needed.update(chains[image_id])
    stale = [image_id for image_id in ours if image_id not in needed]
    return sorted(stale, key=lambda image_id: (-len(chains[image_id]), image_id))


#: A working container ``buildah bud`` makes for a build stage, named after the stage's base (laneflow's base,
#: or an image ID for the images tests derive): one that is there while no build runs is what a killed or
#: failed build left (``--force-rm`` does not remove it when a ``RUN`` fails, seen with buildah 1.28).
BUILD_CONTAINER = re.compile(r"(?:[0-9a-f]{12}|laneflow-[a-z0-9-]+)-working-container(?:-\d+)?")


@dataclass(frozen=True)
class Container:
    """A buildah working container: its name and the image it was made from."""

    name: str
    image_id: str


def plan_containers(containers: Iterable[Container], *, ours: set[str], stale: set[str],
                    rootfs_prefix: str) -> tuple[list[str], set[str]]:
    """Which containers to remove, and the images the others pin. Removed: laneflow's ``rootfs`` containers of
    stale images, and the working containers builds of laneflow's images left behind (call it while no build
    runs). Any other container pins its image."""
    removable, pinned = [], set()
    for container in containers:
        if container.name.startswith(rootfs_prefix):
            if container.image_id in stale:
                removable.append(container.name)
        elif BUILD_CONTAINER.fullmatch(container.name) and container.image_id in ours:
            removable.append(container.name)
        else:
            pinned.add(container.image_id)
    return removable, pinned


class InUse:
    """Which images running processes use: a shared ``flock`` on ``folder/<image ID>`` per image, held by the
    process until it exits (the kernel drops it then, however the process ends)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._held: dict[str, IO[str]] = {}

    def hold(self, image_id: str) -> None:
        """Mark ``image_id`` as used by this process for the rest of its life."""
        if image_id in self._held:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        handle = (self.folder / image_id).open("a")
        fcntl.flock(handle, fcntl.LOCK_SH)
        self._held[image_id] = handle

    def used(self) -> set[str]:
        """The images some process holds (this one included). A file nobody holds is removed. Call it under
        the build lock, which ``hold``'s callers take too, so nobody takes a hold while it looks."""
        found = set(self._held)
        for path in self.folder.glob("*") if self.folder.is_dir() else []:
            if path.name in found:
                continue
            with path.open("a") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    found.add(path.name)
                    continue
                path.unlink()
        return found


class Vanished(RuntimeError):
    """What buildah was asked about was removed meanwhile (by another build, a test, a user)."""


def _buildah(*argv: str) -> str:
    done = subprocess.run(["buildah", *argv], capture_output=True, text=True)
    if done.returncode != 0:
        kind = Vanished if _NOT_KNOWN.search(done.stderr) else RuntimeError
        raise kind(f"buildah {' '.join(argv[:2])} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout


#: containers/storage's ErrContainerUnknown / ErrImageUnknown / ErrLayerUnknown.
_NOT_KNOWN = re.compile(r"(container|image|layer) not known")


def listing(*argv: str, attempts: int = 10) -> list[dict]:
    """A ``buildah ... --json`` listing of the whole store. Listing is not atomic: ``buildah containers`` reads
    each container's directory after it read the list (buildah's ``OpenAllBuilders``), so a container another
    process removes in between fails the listing with "container not known". Nothing was changed, so it is
    asked again."""
    for attempt in range(attempts):
        try:
            return json.loads(_buildah(*argv, "--json") or "[]")
        except Vanished:
            if attempt == attempts - 1:
                raise
            time.sleep(0.1 * (attempt + 1))
    raise AssertionError("unreachable")


def list_containers() -> list[dict]:
    """Every working container in the store (``containername``, ``imageid``, ...)."""
    return listing("containers")


def _bare(image_id: str) -> str:
    return image_id.removeprefix("sha256:")


def stored_images() -> list[StoredImage]:
    """Every image in the store, intermediate ones included, with the parent each records."""
    listed = listing("images", "--all", "--no-trunc")

    def parent(image_id: str) -> str | Vanished | None:
        try:
            found = _buildah("inspect", "--type", "image", "--format", "{{.Docker.Parent}}", image_id)
        except Vanished as gone:  # removed since the listing: it is not in the store any more
            return gone
        return _bare(found.strip()) or None

    ids = [_bare(image["id"]) for image in listed]
    with ThreadPoolExecutor(max_workers=4) as pool:  # a buildah process per image: a few at a time
        parents = list(pool.map(parent, ids))
    return [StoredImage(image_id, tuple(image.get("names") or ()), image_parent)
            for image_id, image, image_parent in zip(ids, listed, parents, strict=True)
            if not isinstance(image_parent, Vanished)]


@dataclass(frozen=True)
class Removed:
    images: int
    containers: int
    freed_bytes: int


def collect(*, base_id: str, keep_names: set[str], in_use: InUse, rootfs_prefix: str,
            store: Path = Path("/var/lib/containers/storage"), log: Callable[[str], None] = print) -> Removed:
    """Remove laneflow's images that nothing needs (``plan_removal``), their ``rootfs`` containers and what
    builds left behind (``plan_containers``). Call it holding every build lock: no build may run meanwhile."""
    before = _free_bytes(store)
    containers = [Container(listed["containername"], listed["imageid"])
                  for listed in list_containers()]
    images = stored_images()
    ours = built_on(base_id, images)
    _, pinned = plan_containers(containers, ours=ours, stale=set(), rootfs_prefix=rootfs_prefix)
    stale = plan_removal(images, base_id=base_id, keep_names=keep_names, pinned=pinned | in_use.used())
    gone_containers, _ = plan_containers(containers, ours=ours, stale=set(stale), rootfs_prefix=rootfs_prefix)
    for name in gone_containers:
        _buildah("rm", name)
    if stale:
        # One call for all (a call per image costs a second each); removing an image can take its untagged
        # parents with it, so "image not known" for a later one is fine: what counts is what is left.
        subprocess.run(["buildah", "rmi", "--force", *stale], capture_output=True, text=True)
        left = set(stale) & {_bare(listed["id"]) for listed in
                             listing("images", "--all", "--no-trunc")}
        if left:
            raise RuntimeError(f"buildah rmi left {len(left)} of {len(stale)} images, e.g. {sorted(left)[0][:12]}")
    removed = Removed(len(stale), len(gone_containers), max(0, _free_bytes(store) - before))
    if stale or gone_containers:
        log(f"images: removed {removed.images} stale images and {removed.containers} containers "
            f"({removed.freed_bytes / 1e9:.1f} GB freed)")
    return removed


def _free_bytes(path: Path) -> int:
    try:
        stats = os.statvfs(path)
    except OSError:
        return 0
    return stats.f_bavail * stats.f_frsize
