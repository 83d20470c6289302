"""What a container image is, read from the Dockerfile that builds it (never restated here).

No image is built: there is no Docker daemon on the test machines, and base images cannot be pulled. An
image is modelled as **the project's environment plus the Dockerfile's own facts**:

- ``ENTRYPOINT``, ``CMD``, ``WORKDIR`` and ``ENV`` exactly as the Dockerfile sets them (``$VAR`` expanded
  in order, as the builder does; a base image's own ``ENV`` is not known, so ``PATH`` starts from
  Docker's default, ``/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin``);
- every ``COPY`` from the build context (the project checkout) lands at its destination;
- a ``python -m venv DIR`` in a ``RUN`` is where the image's Python environment lives: the project's own
  virtual environment (the one the tests run in) is put there — what the ``pip install`` lines would have
  installed is what the project installs;
- ``mkdir -p DIR`` in a ``RUN`` makes that directory (``/var/run/sshd``, which sshd needs).

Other ``RUN`` steps (apt-get, pip, builds) are not executed: their results are the project's environment
(the bootstrap installs the same Debian packages and Python packages on this machine).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from dockerfile_parse import DockerfileParser

#: The PATH Docker gives an image whose Dockerfile (and base image) sets none (moby ``oci/defaults.go``).
DOCKER_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_VENV = re.compile(r"-m\s+venv\s+(?P<dir>/[^\s;&|]+)")
_MKDIR = re.compile(r"mkdir\s+-p\s+(?P<dirs>(?:/[^\s;&|]+\s*)+)")
_VAR = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")


@dataclass(frozen=True)
class ImageConfig:
    """An image as the kubelet's container runtime sees it (OCI image config) plus where its files come from."""

    reference: str
    dockerfile: Path
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    #: (source in the build context, absolute destination in the image)
    files: list[tuple[Path, str]] = field(default_factory=list)
    venvs: list[str] = field(default_factory=list)
    made_dirs: list[str] = field(default_factory=list)


def _expand(value: str, env: dict[str, str]) -> str:
    return _VAR.sub(lambda m: env.get(m["braced"] or m["plain"], ""), value)


def _exec_form(value: str) -> list[str]:
    """``["a", "b"]`` (exec form) or a shell string (shell form: ``/bin/sh -c``), as Docker reads them."""
    value = value.strip()
    if value.startswith("["):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, list) and all(isinstance(item, str) for item in parsed):
            return parsed
    return ["/bin/sh", "-c", value]


def _env_pairs(value: str) -> list[tuple[str, str]]:
    """``ENV A=1 B="two words"`` or the legacy ``ENV A value``."""
    words = shlex.split(value)
    if words and "=" not in words[0]:
        return [(words[0], " ".join(words[1:]))]
    return [tuple(word.split("=", 1)) for word in words]  # type: ignore[misc]


def read_image(reference: str, dockerfile: Path, context: Path) -> ImageConfig:
    """The image ``reference`` as built by ``docker build -f dockerfile context``."""
    parser = DockerfileParser(fileobj=dockerfile.open("rb"))
    env: dict[str, str] = {"PATH": DOCKER_DEFAULT_PATH}
    args: dict[str, str] = {}
    workdir = "/"
    entrypoint: list[str] = []
    cmd: list[str] = []
    files: list[tuple[Path, str]] = []
    venvs: list[str] = []
    made: list[str] = []
    for instruction in parser.structure:
        kind, value = instruction["instruction"], instruction["value"]
        if kind == "ARG":
            name, _, default = value.partition("=")
            args[name.strip()] = default.strip()
        elif kind == "ENV":
            for name, raw in _env_pairs(value):
                env[name] = _expand(raw, {**args, **env})
        elif kind == "WORKDIR":
            target = _expand(value.strip(), {**args, **env})
            workdir = str(Path(workdir) / target) if not target.startswith("/") else target
        elif kind in ("COPY", "ADD"):
            words = [w for w in shlex.split(value) if not w.startswith("--")]
            *sources, destination = words
            destination = _expand(destination, {**args, **env})
            absolute = destination if destination.startswith("/") else str(Path(workdir) / destination)
            into_dir = destination.endswith("/") or destination in (".", "./") or len(sources) > 1
            for source in sources:
                path = (context / source).resolve()
                if context.resolve() not in (path, *path.parents):
                    raise ValueError(f"{dockerfile}: COPY source {source} is outside the build context")
                if not path.exists():
                    raise FileNotFoundError(f"{dockerfile}: COPY source {source} does not exist in {context} "
                                            "(the build would fail)")
                target = str(Path(absolute) / path.name) if into_dir and path.is_file() else absolute
                files.append((path, target))
        elif kind == "RUN":
            venvs += [m["dir"] for m in _VENV.finditer(value)]
            made += [d for m in _MKDIR.finditer(value) for d in m["dirs"].split()]
        elif kind == "ENTRYPOINT":
            entrypoint, cmd = _exec_form(value), []  # a new ENTRYPOINT resets the CMD inherited before it
        elif kind == "CMD":
            cmd = _exec_form(value)
    return ImageConfig(reference, dockerfile, entrypoint, cmd, workdir, env, files, venvs, made)


def container_argv(image: ImageConfig, command: list[str] | None, args: list[str] | None) -> list[str]:
    """What a container runs, as Kubernetes composes it (pkg/kubelet/kuberuntime ``kubecontainer``,
    concepts "Define a Command and Arguments for a Container"): ``command`` replaces the image's
    ENTRYPOINT, ``args`` its CMD; ``command`` without ``args`` drops the CMD."""
    if command:
        return [*command, *(args or [])]
    if args:
        return [*image.entrypoint, *args]
    return [*image.entrypoint, *image.cmd]
