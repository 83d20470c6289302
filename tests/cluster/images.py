"""The emulated cluster's images: real ones, built from ``deployments/Dockerfile.*`` by ``scripts/images.py``
(buildah, every ``RUN`` executed; ``make image``), and the registry the kubelet pulls from.

A container runs from its image's root file system (the lower layer of its overlay root, ``podinit.py``) with
the image's OCI config: ``Entrypoint``, ``Cmd``, ``Env`` and ``WorkingDir`` as the builder recorded them.
Nothing of this machine is in it: a module the Dockerfile does not copy, a package it does not install, is
missing in the pod as it would be on a cluster.

The registry holds the references the platform blocks name (``registry.example.org/laneflow-train:0.1.0``),
each pointing at a locally built image; any other reference cannot be pulled (``ErrImagePull``).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from pathlib import Path

from scripts import images as builder

#: The PATH a container gets when its image sets none (moby ``oci/defaults.go``; containerd the same).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class ImageConfig:
    """An image as the container runtime sees it: its OCI config and its root file system."""

    reference: str
    image_id: str
    rootfs: Path
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    #: The image's ``USER`` ("" when it sets none: root), as its config has it ("1000", "1000:0", "name").
    user: str = ""


def read_image(reference: str, local: str) -> ImageConfig:
    """``reference`` as the locally built image ``local`` (a buildah reference or image ID)."""
    config = builder.image_config(local)
    if config is None:
        raise LookupError(f"no local image {local} (make image builds laneflow's)")
    env = dict(item.split("=", 1) for item in config.get("Env") or [])
    env.setdefault("PATH", DEFAULT_PATH)
    return ImageConfig(reference, config["id"], builder.rootfs(config["id"]), list(config.get("Entrypoint") or []),
                       list(config.get("Cmd") or []), config.get("WorkingDir") or "/", env,
                       config.get("User") or "")


def container_argv(image: ImageConfig, command: list[str] | None, args: list[str] | None) -> list[str]:
    """What a container runs, as Kubernetes composes it (pkg/kubelet/kuberuntime ``kubecontainer``,
    concepts "Define a Command and Arguments for a Container"): ``command`` replaces the image's
    ENTRYPOINT, ``args`` its CMD; ``command`` without ``args`` drops the CMD."""
    if command:
        return [*command, *(args or [])]
    if args:
        return [*image.entrypoint, *args]
    return [*image.entrypoint, *image.cmd]


_built: dict[str, str] = {}
_built_lock = threading.Lock()


def built(name: str) -> str:
    """The ID of laneflow's image ``name``, built (or found up to date) once per test process: the sources do
    not change while the suite runs."""
    with _built_lock:
        if name not in _built:
            _built[name] = builder.build(name)
        return _built[name]


_read: dict[str, ImageConfig] = {}


def _read_built(image_id: str) -> ImageConfig:
    """The image with ID ``image_id`` (built or derived here), read once per test process: an ID names its
    content, so its config and mounted root file system stay what they are while the suite runs (each read
    is several buildah processes, and every emulated cluster adds both images)."""
    with _built_lock:
        if image_id not in _read:
            _read[image_id] = read_image(image_id, image_id)
        return _read[image_id]


@dataclass
class ImageRegistry:
    """The images that can be pulled, by reference. ``add`` resolves (and, for laneflow's own, builds) the
    image in the caller's thread, so that a pull — under the cluster's lock — only looks it up."""

    _images: dict[str, ImageConfig] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, reference: str, image: str) -> ImageConfig:
        """Make ``reference`` pullable as ``image``: one of laneflow's images by name (``train``, ``data``:
        built now unless up to date) or a local image reference."""
        return self._register(reference, _read_built(built(image)) if image in builder.IMAGES else
                              read_image(reference, image))

    def derive(self, reference: str, parent: str, lines: list[str]) -> ImageConfig:
        """Make ``reference`` pullable as laneflow's image ``parent`` changed by a few Dockerfile lines (the
        training image without openssh-server, say), built now (cached by content)."""
        local = f"localhost/laneflow-{parent}:{reference.rsplit(':', 1)[-1]}"
        return self._register(reference, _read_built(builder.build_derived(built(parent), lines, local)))

    def _register(self, reference: str, image: ImageConfig) -> ImageConfig:
        config = dataclasses.replace(image, reference=reference)
        with self._lock:
            self._images[reference] = config
        return config

    def pull(self, reference: str) -> ImageConfig | None:
        with self._lock:
            return self._images.get(reference)
