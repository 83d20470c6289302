"""The whole data stage over a real HTTP server: fetch -> verify -> extract -> preprocess, cached."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.http_server import Fault, FileServer
from training.data.fetch import ChecksumMismatch
from training.data.prepare import archive_name, prepare_dataset

REPO = Path(__file__).resolve().parents[1]


def test_prepare_over_http_then_everything_is_cached(file_server: FileServer, synthetic_archive, tmp_path):
    archive, sha = synthetic_archive
    file_server.files["train_set.zip"] = archive.read_bytes()
    file_server.faults.append(Fault("cut", cut_after=archive.stat().st_size // 3))
    volume = tmp_path / "volume"
    url = file_server.url("train_set.zip") + "?sv=2024&sig=SECRET"

    first = prepare_dataset(url, sha, volume, workers=2)
    assert (first.downloaded, first.extracted, first.preprocessed) == (True, True, True)
    assert first.counts["kept"] == 14
    assert first.root == volume / "datasets" / sha[:16]
    assert (volume / "downloads" / "train_set.zip").is_file()
    manifest = json.loads((first.root / "manifest.json").read_text())
    assert manifest["sources"]["archive"]["sha256"] == sha
    assert "SECRET" not in json.dumps(manifest)  # signed-URL tokens are not recorded

    requests = len(file_server.requests)
    second = prepare_dataset(url, sha, volume, workers=2)
    assert (second.downloaded, second.extracted, second.preprocessed) == (False, False, False)
    assert second.dataset_version == first.dataset_version
    assert len(file_server.requests) == requests


def test_prepare_refuses_a_wrong_checksum_before_extracting(file_server: FileServer, synthetic_archive, tmp_path):
    archive, _ = synthetic_archive
    file_server.files["train_set.zip"] = archive.read_bytes()
    with pytest.raises(ChecksumMismatch):
        prepare_dataset(file_server.url("train_set.zip"), "f" * 64, tmp_path / "volume")
    assert not (tmp_path / "volume" / "datasets").exists()


def test_archive_name_from_url():
    assert archive_name("https://mirror.example/tusimple/train_set.zip?sig=x") == "train_set.zip"
    assert archive_name("file:///data/train%20set.zip") == "train set.zip"
    with pytest.raises(ValueError, match="does not end in a file name"):
        archive_name("https://mirror.example/")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "training.data.prepare", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_cli_prints_counts_and_version(synthetic_archive, tmp_path):
    archive, sha = synthetic_archive
    done = run_cli("--source", archive.as_uri(), "--sha256", sha, "--volume", str(tmp_path / "v"), "--workers", "2")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["counts"]["read"] == 14 and len(summary["dataset_version"]) == 16


def test_cli_errors_are_one_clear_line(synthetic_archive, tmp_path):
    archive, _ = synthetic_archive
    done = run_cli("--source", archive.as_uri(), "--sha256", "nothex", "--volume", str(tmp_path / "v"))
    assert done.returncode == 2
    assert "error: checksum 'nothex' is not a sha256 hex digest" in done.stderr
    assert "Traceback" not in done.stderr
