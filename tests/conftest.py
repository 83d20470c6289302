from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.http_server import FileServer, RunningServer
from training.data.synthetic import generate, pack_archive

SMALL_SIZE = (320, 180)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("LANEFLOW_KUBECONFIG"):
        return
    skip = pytest.mark.skip(reason="needs a real cluster: set LANEFLOW_KUBECONFIG")
    for item in items:
        if "cluster" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def file_server() -> Iterator[FileServer]:
    """A real HTTP server on 127.0.0.1 serving ``state.files``; faults are queued per request."""
    with RunningServer() as state:
        yield state


@pytest.fixture(scope="session")
def synthetic_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic TuSimple-layout folder (read-only for tests: copy before changing it)."""
    out = tmp_path_factory.mktemp("synthetic") / "tusimple"
    generate(out, train=8, val=3, test=3, seed=7, width=SMALL_SIZE[0], height=SMALL_SIZE[1])
    return out


@pytest.fixture(scope="session")
def synthetic_archive(synthetic_source: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    archive = tmp_path_factory.mktemp("archive") / "train_set.zip"
    return archive, pack_archive(synthetic_source, archive)


@pytest.fixture
def dataset_copy(synthetic_source: Path, tmp_path: Path) -> Path:
    """A private, writable copy of the synthetic dataset."""
    target = tmp_path / "tusimple"
    shutil.copytree(synthetic_source, target)
    return target
