"""laneflow's images are built for real (scripts/images.py, buildah): a Dockerfile that leaves out a module its
commands import fails its own build; an unchanged tree builds nothing; the build context is the sources only."""

from __future__ import annotations

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
