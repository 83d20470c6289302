"""laneflow's images are built for real (scripts/images.py, buildah): a Dockerfile that leaves out a module its
commands import fails its own build; an unchanged tree builds nothing; the build context is the sources only."""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
from pathlib import Path

import pytest

from scripts import images
from tests.conftest import PROJECT_ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def builder() -> None:
    if missing := images.missing_tools():
        pytest.skip(missing)


def test_the_build_context_is_the_sources_the_dockerfiles_copy() -> None:
    files = images.context_files(PROJECT_ROOT)
    assert "training/data/prepare.py" in files and "deployments/ssh/sshd_config.conf" in files
    assert "scripts/versions.env" in files and "pyproject.toml" in files
    assert not [f for f in files if f.startswith((".git/", ".venv/", "tests/", ".laneflow/", "bench/", "docs/"))]
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]


def test_dockerignore_patterns_match_as_docker_reads_them() -> None:
    patterns = ["tests", "**/__pycache__", "*.egg-info", ".venv"]
    assert images.ignored("tests/test_x.py", patterns) and images.ignored("tests", patterns)
    assert images.ignored("training/data/__pycache__/x.pyc", patterns)
    assert images.ignored("laneflow.egg-info/PKG-INFO", patterns)
    assert not images.ignored("training/tests.py", patterns)  # a top-level pattern, not any path's name
    assert not images.ignored("flows/train.py", patterns)


def test_the_gpu_flavour_is_the_training_image_under_its_own_tag_and_build_arguments() -> None:
    gpu = images.image_spec("train", "gpu")
    assert gpu.tag == "localhost/laneflow-train:gpu" and gpu.build_args == {"FLAVOUR": "gpu"}
    cpu = images.image_spec("train")  # the tests' pods run this one, built as before
    assert cpu is images.IMAGES["train"] and cpu.tag == "localhost/laneflow-train:cpu"
    assert cpu.build_args == {"FLAVOUR": "cpu", "TORCH_INDEX_URL": ""}
    assert images.image_spec("data").tag == "localhost/laneflow-data:cpu"
    with pytest.raises(KeyError, match="no image 'data' in the gpu flavour"):
        images.image_spec("data", "gpu")  # the data image has no GPU stack
    with pytest.raises(KeyError, match="no flavour 'rocm'"):
        images.image_spec("train", "rocm")


def test_every_build_argument_the_builder_passes_is_one_the_dockerfile_declares() -> None:
    for spec in [*images.IMAGES.values(), *images.GPU_IMAGES.values()]:
        declared = set(re.findall(r"^ARG (\w+)", (PROJECT_ROOT / spec.dockerfile).read_text(), re.M))
        assert {"BASE_IMAGE", *spec.build_args} <= declared, spec


def test_the_dockerfiles_default_base_is_docker_hubs_debian_pinned_by_digest() -> None:
    """A ``docker build`` without ``--build-arg BASE_IMAGE`` gets one base image every time, not whatever the tag
    names that day (a tag moves with every Debian point release; a digest names one manifest)."""
    expected = {"deployments/Dockerfile.train": "debian:bookworm",
                "deployments/Dockerfile.data": "debian:bookworm-slim"}
    for dockerfile, tag in expected.items():
        (default,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", (PROJECT_ROOT / dockerfile).read_text(), re.M)
        assert re.fullmatch(re.escape(tag) + r"@sha256:[0-9a-f]{64}", default), (dockerfile, default)


def test_the_flavours_build_under_separate_locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`make test` builds the CPU images under images.lock; a GPU build beside it (tens of minutes) must not hold
    that lock while it builds: it takes it only to make sure the base exists, then builds under its own."""
    monkeypatch.setattr(images, "CACHE", tmp_path)
    monkeypatch.setattr(images, "LOCK", tmp_path / "images.lock")
    assert images.lock_path("cpu") == tmp_path / "images.lock"
    assert images.lock_path("gpu") == tmp_path / "images-gpu.lock"

    def cpu_lock_is_free() -> bool:
        with (tmp_path / "images.lock").open("a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(handle, fcntl.LOCK_UN)
            return True

    seen: dict[str, object] = {}

    def fake_base(log=print) -> str:
        seen["base, cpu lock free"] = cpu_lock_is_free()
        return "base-id"

    def fake_build(dockerfile: Path, tag: str, **kwargs) -> str:
        seen["build, cpu lock free"] = cpu_lock_is_free()
        seen["tag"], seen["args"] = tag, kwargs["build_args"]
        return "image-id"

    monkeypatch.setattr(images, "ensure_base", fake_base)
    monkeypatch.setattr(images, "build_dockerfile", fake_build)
    assert images.build("train", flavour="gpu") == "image-id"
    assert seen == {"base, cpu lock free": False, "build, cpu lock free": True, "tag": "localhost/laneflow-train:gpu",
                    "args": {"BASE_IMAGE": images.BASE_IMAGE, "FLAVOUR": "gpu"}}
    images.build("train")  # the CPU flavour: base and build under the CPU lock, as ever
    assert seen["base, cpu lock free"] is False and seen["build, cpu lock free"] is False
    assert seen["tag"] == "localhost/laneflow-train:cpu"


def test_cpu_and_gpu_horovod_wheels_are_cached_apart(tmp_path: Path) -> None:
    def cache_dir(**env: str) -> str:
        return subprocess.run([str(PROJECT_ROOT / "scripts/install_horovod.sh"), "--cache-dir"], check=True,
                              capture_output=True, text=True,
                              env={"PATH": os.environ["PATH"], "LANEFLOW_WHEEL_CACHE": str(tmp_path), **env},
                              ).stdout.strip()

    cpu = cache_dir(LANEFLOW_HOROVOD_MPI="1")
    assert cpu == f"{tmp_path}/horovod-cpu-mpi"  # where the bootstrap's wheel has always been
    assert cache_dir(LANEFLOW_HOROVOD_MPI="0") == f"{tmp_path}/horovod-cpu"
    cuda = re.search(r"^TORCH_CUDA_VERSION=(\S+)", (PROJECT_ROOT / "scripts/versions.env").read_text(), re.M)[1]
    gpu = cache_dir(LANEFLOW_HOROVOD_MPI="1", HOROVOD_GPU_OPERATIONS="NCCL", HOROVOD_BUILD_CUDA_CC_LIST="80,90")
    assert gpu == f"{tmp_path}/horovod-gpu-nccl-cu{cuda.replace('.', '')}-sm80_90-mpi"  # e.g. CUDA 13.0: cu130
    # Other GPU architectures are another build too.
    assert cache_dir(LANEFLOW_HOROVOD_MPI="1", HOROVOD_GPU_OPERATIONS="NCCL", HOROVOD_BUILD_CUDA_CC_LIST="90") != gpu


def test_an_unchanged_tree_builds_nothing_and_names_its_content(builder: None) -> None:
    first = images.build("data")
    said: list[str] = []
    assert images.build("data", log=said.append) == first
    assert said == []  # found by its content key: buildah was not asked to build
    key = images.content_key((PROJECT_ROOT / "deployments/Dockerfile.data").read_bytes(),
                             {"BASE_IMAGE": images.BASE_IMAGE}, images.ensure_base(), PROJECT_ROOT)
    assert images.image_id(f"localhost/laneflow-data:{key}") == first


def test_a_data_image_that_leaves_out_a_module_prepare_imports_fails_its_own_build(
        builder: None, tmp_path: Path) -> None:
    """The data image once copied training/ piecemeal without training/signals.py: on a cluster every data Job
    would have failed with ModuleNotFoundError. Its build imports what its Jobs run, so the build fails."""
    dockerfile = (PROJECT_ROOT / "deployments" / "Dockerfile.data").read_text()
    without = dockerfile.replace(" training/signals.py", "")
    assert without != dockerfile
    (tmp_path / "Dockerfile.data").write_text(without)
    with pytest.raises(images.ImageBuildError, match=r"No module named 'training\.signals'"):
        images.build_dockerfile(tmp_path / "Dockerfile.data", "localhost/laneflow-data:without-signals",
                                context=PROJECT_ROOT, build_args={"BASE_IMAGE": images.BASE_IMAGE},
                                base_id=images.ensure_base())


def test_the_data_image_has_the_prepare_code_and_no_gpu_stack(builder: None) -> None:
    from tests.cluster.images import ImageRegistry

    image = ImageRegistry().add("registry.example.org/laneflow-data:0.1.0", "data")
    assert (image.rootfs / "opt/laneflow/training/data/prepare.py").is_file()
    assert (image.rootfs / "opt/laneflow/training/signals.py").is_file()
    site = image.rootfs / "opt/venv/lib/python3.11/site-packages"
    assert (site / "cv2").is_dir() and not (site / "torch").exists() and not (site / "horovod").exists()
