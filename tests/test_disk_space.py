"""A volume too small for the dataset: refused before anything is written, with the step and the numbers.

Real file systems throughout: the always-run tests use a download and an archive larger than the free
space of the disk the tests run on; the others mount a tmpfs of a chosen size as the volume (root with
CAP_SYS_ADMIN, as CI has; they skip where mounting is not allowed), run out of it, and grow it.
"""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tasks.platforms import LocalPlatform
from tests.http_server import FileServer
from training.data.archive import extract
from training.data.fetch import fetch, sha256_of
from training.data.prepare import prepare_dataset
from training.data.sources import Artifact
from training.data.space import InsufficientSpace, allocated, archive_needs, block_bytes, free_bytes

ANY_SHA = "0" * 64


def test_a_download_larger_than_the_free_space_is_refused_before_writing(tmp_path: Path,
                                                                       file_server: FileServer) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    size = free_bytes(volume) + (1 << 30)  # one GiB more than the disk has
    file_server.zeros["train_set.zip"] = size
    with pytest.raises(InsufficientSpace) as refused:
        prepare_dataset([Artifact(file_server.url("train_set.zip"), ANY_SHA)], volume)
    error = refused.value
    assert error.step == "download train_set.zip" and error.needed == allocated(size, block_bytes(volume))
    assert error.free < error.needed
    message = str(error)
    assert str(volume) in message and f"{error.needed:,} bytes" in message and f"{error.free:,} bytes" in message
    assert "grow the volume" in message
    written = {p.relative_to(volume) for p in volume.rglob("*") if p.is_file()}
    locks = {p for p in written if p.parts[:2] == (".laneflow", "locks")}  # kept on purpose: training/data/lock.py
    assert written == locks and all((volume / p).stat().st_size == 0 for p in locks)  # not even a partial download


def claims_to_unpack_to(path: Path, size: int) -> Path:
    """A real zip whose index says its one entry unpacks to ``size`` bytes (as a 10 GB archive's would)."""
    with zipfile.ZipFile(path, "w", allowZip64=True) as zf:
        zf.writestr("clips/0530/1/20.jpg", b"x")
        zf.filelist[0].file_size = size  # written into the central directory at close
    return path


def test_an_archive_larger_than_the_free_space_is_refused_before_extracting(tmp_path: Path) -> None:
    target = tmp_path / "datasets" / "d"
    archive = claims_to_unpack_to(tmp_path / "train_set.zip", free_bytes(tmp_path) + (1 << 30))
    with pytest.raises(InsufficientSpace) as refused:
        extract(archive, target, sha256_of(archive), volume=tmp_path)
    assert refused.value.step == "extract train_set.zip"
    assert refused.value.needed == archive_needs(archive, block_bytes(tmp_path)) > refused.value.free
    assert not (tmp_path / "datasets").exists() or not any((tmp_path / "datasets").iterdir())


def test_archive_needs_counts_whole_blocks_per_file_and_a_block_per_folder(tmp_path: Path) -> None:
    archive = tmp_path / "a.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("clips/", b"")
        zf.writestr("clips/a.jpg", b"x" * 5000)
        zf.writestr("clips/b.jpg", b"")
        zf.writestr("label.json", b"{}")
    assert archive_needs(archive, 4096) == 8192 + 0 + 4096 + 4096  # a.jpg, b.jpg, label.json, clips/
    tar = tmp_path / "a.tar"
    subprocess.run(["tar", "-cf", str(tar), "-C", str(tmp_path), "a.zip"], check=True)
    assert archive_needs(tar, 4096) == allocated(archive.stat().st_size, 4096)
    gz = tmp_path / "a.tar.gz"
    subprocess.run(["tar", "-czf", str(gz), "-C", str(tmp_path), "a.zip"], check=True)
    assert archive_needs(gz, 4096) is None  # known only by decompressing it all


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Callable[[Path, int], Path]]:
    """``mount(path, bytes)``: a tmpfs of that size at ``path`` (mounted again to grow it)."""
    mounted: list[Path] = []

    def mount(path: Path, size: int) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        options = f"size={size}" + (",remount" if path in mounted else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); needs root with CAP_SYS_ADMIN")
        if path not in mounted:
            mounted.append(path)
        return path

    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_too_small_for_extraction_fails_first_then_a_grown_volume_reuses_the_downloads(
        laneflow_home: Path, synthetic_artifacts: list[dict], small_volume: Callable[[Path, int], Path]) -> None:
    artifacts = [Artifact(a["url"], a["sha256"], a["kind"]) for a in synthetic_artifacts]
    sources = [Path(a["url"].removeprefix("file://")) for a in synthetic_artifacts]
    page = 4096
    downloads = sum(allocated(path.stat().st_size, page) for path in sources)
    unpacked = sum(archive_needs(path, page) if a.kind == "archive" else allocated(path.stat().st_size, page)
                   for path, a in zip(sources, artifacts, strict=True))
    platform = LocalPlatform()
    volume = platform.ensure_volume("small")
    root = small_volume(Path(volume.location), downloads + unpacked // 2)

    with pytest.raises(ValueError) as refused:  # the dataset stage's own process refused it (exit code 2)
        platform.prepare_dataset(volume, artifacts, lambda _: None)
    message = str(refused.value)
    assert "not enough space on volume" in message and str(root) in message
    assert "to extract train_set.zip, test_set.zip, test_label.json" in message
    assert f"needs {unpacked:,} bytes" in message
    assert not (root / "datasets").exists() or not any((root / "datasets").iterdir())  # nothing half-made
    kept = sorted(path.name for path in (root / "downloads").iterdir())
    assert kept == ["test_label.json", "test_set.zip", "train_set.zip"]  # verified, not partial

    small_volume(root, 64 << 20)  # the volume grown
    summary = platform.prepare_dataset(volume, artifacts, lambda _: None)
    assert summary["steps"] == {"downloaded": False, "extracted": True, "preprocessed": True}
    assert summary["counts"]["kept"] > 0


def test_a_download_of_unannounced_size_that_fills_the_volume_is_named_and_gives_the_space_back(
        tmp_path: Path, file_server: FileServer, small_volume: Callable[[Path, int], Path]) -> None:
    """The volume is shared (other runs' datasets, checkpoints): a download whose size nobody announced must not
    leave it full. Its partial file goes; one of announced size is checked before writing instead."""
    from tests.http_server import Fault

    volume = small_volume(tmp_path / "volume", 1 << 20)
    file_server.zeros["big.zip"] = 4 << 20
    file_server.faults.append(Fault("chunked"))  # a size nobody announced: only writing finds out
    with pytest.raises(InsufficientSpace) as full:
        fetch(file_server.url("big.zip"), volume / "downloads" / "big.zip", ANY_SHA, volume=volume)
    assert full.value.step == "download big.zip" and full.value.needed is None
    partial = volume / "downloads" / "big.zip.part"
    message = str(full.value)
    assert f"ran out of space while it was being used to download big.zip (writing {partial})" in message
    assert str(volume) in message and f"{partial} was removed" in message
    assert not partial.exists() and free_bytes(volume) > (1 << 20) * 9 // 10  # the space is back
