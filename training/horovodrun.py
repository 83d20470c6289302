"""``horovodrun``, with its check of how Horovod was built answered once per installed build, not at every launch.

Every ``horovodrun --gloo`` first asks whether Horovod was built with Gloo (horovod 0.28.1
``runner/launch.py`` ``run_controller`` and ``_run_elastic`` -> ``common/util.py`` ``gloo_built``), and it
finds out by importing each framework's Horovod extension in a forked process — for PyTorch, torch itself:
two to three seconds of CPU before any worker starts, at every launch, on a machine whose workers then import
torch again. The answer only changes when Horovod is installed again, so this launcher asks Horovod's own
check once per installed build (its PyTorch extension library: path, size, modification time) and keeps the
answer next to the environment (``RECORD``); then it is horovodrun (``runner/launch.py`` ``run_commandline``),
with that answer. The local platform and the cluster's MPIJob launcher start training with it: ``python -m
training.horovodrun <horovodrun's arguments>`` (the training image records its answer when it is built).
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path

#: Where the answers are kept: in the environment Horovod is installed in.
RECORD = Path(sys.prefix) / ".laneflow-horovod-build.json"


def build_key() -> dict:
    """What identifies the installed Horovod build: its version, its PyTorch extension library's file, and the
    torch it was checked with (an upgraded torch can break the extension)."""
    from importlib.metadata import PackageNotFoundError, version

    import horovod

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = None
    library = Path(horovod.__file__).parent / "torch" / f"mpi_lib_v2{sysconfig.get_config_var('EXT_SUFFIX')}"
    key = {"version": horovod.__version__, "torch": torch_version, "library": str(library)}
    try:
        found = library.stat()
    except OSError:
        return {**key, "missing": True}
    return {**key, "size": found.st_size, "mtime_ns": found.st_mtime_ns}


def recorded_build(record: Path = RECORD) -> dict[str, bool]:
    """``{"gloo": ..., "mpi": ...}`` as Horovod's own checks answer them for the installed build; asked once per
    build and kept in ``record`` (replaced whole, so launches side by side never read half of it)."""
    key = build_key()
    try:
        kept = json.loads(record.read_text())
        if kept.get("key") == key:
            return {"gloo": bool(kept["gloo"]), "mpi": bool(kept["mpi"])}
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    from horovod.common.util import gloo_built, mpi_built

    gloo, mpi = gloo_built(), mpi_built()
    answers = {"gloo": bool(gloo), "mpi": bool(mpi)}
    if gloo is None or mpi is None:  # no extension could be loaded at all: not an answer to keep
        return answers
    partial = record.with_name(f".{record.name}.{os.getpid()}")
    try:
        partial.write_text(json.dumps({"key": key, **answers}))
        partial.replace(record)
    except OSError:
        partial.unlink(missing_ok=True)  # a read-only environment: asked again next time, as horovodrun does
    return answers


def main(argv: list[str] | None = None) -> int:
    from horovod.runner import launch

    built = recorded_build()
    launch.gloo_built = lambda verbose=False: built["gloo"]
    launch.mpi_built = lambda verbose=False: built["mpi"]
    sys.argv = ["horovodrun", *(sys.argv[1:] if argv is None else argv)]
    return launch.run_commandline() or 0


if __name__ == "__main__":
    sys.exit(main())
