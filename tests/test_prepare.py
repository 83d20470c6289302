"""The whole data stage over a real HTTP server: fetch -> verify -> extract -> preprocess, cached."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.processes import run_to_end
from tests.http_server import Fault, FileServer
from training.data.fetch import ChecksumMismatch
from training.data.prepare import Artifact, archive_name, prepare_dataset
from training.data.sources import SourceError

REPO = Path(__file__).resolve().parents[1]


def test_prepare_over_http_then_everything_is_cached(file_server: FileServer, synthetic_archive, tmp_path):
    archive, sha = synthetic_archive
    file_server.files["train_set.zip"] = archive.read_bytes()
    file_server.faults.append(Fault("cut", cut_after=archive.stat().st_size // 3))
    volume = tmp_path / "volume"
    url = file_server.url("train_set.zip") + "?sv=2024&sig=SECRET"

    first = prepare_dataset([Artifact(url, sha)], volume, workers=2)
    assert (first.downloaded, first.extracted, first.preprocessed) == (True, True, True)
    assert first.counts["kept"] == 14
    assert first.root == volume / "datasets" / sha[:16]
    assert (volume / "downloads" / "train_set.zip").is_file()
    manifest = json.loads((first.root / "manifest.json").read_text())
    assert [a["sha256"] for a in manifest["sources"]["artifacts"]] == [sha]
    assert "SECRET" not in json.dumps(manifest)  # signed-URL tokens are not recorded

    requests = len(file_server.requests)
    second = prepare_dataset([Artifact(url, sha)], volume, workers=2)
    assert (second.downloaded, second.extracted, second.preprocessed) == (False, False, False)
    assert second.dataset_version == first.dataset_version
    assert len(file_server.requests) == requests


def test_prepare_refuses_a_wrong_checksum_before_extracting(file_server: FileServer, synthetic_archive, tmp_path):
    archive, _ = synthetic_archive
    file_server.files["train_set.zip"] = archive.read_bytes()
    with pytest.raises(ChecksumMismatch):
        prepare_dataset([Artifact(file_server.url("train_set.zip"), "f" * 64)], tmp_path / "volume")
    assert not (tmp_path / "volume" / "datasets").exists()


def test_archive_name_from_url():
    assert archive_name("https://mirror.example/tusimple/train_set.zip?sig=x") == "train_set.zip"
    assert archive_name("file:///data/train%20set.zip") == "train set.zip"
    with pytest.raises(ValueError, match="does not end in a file name"):
        archive_name("https://mirror.example/")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return run_to_end([sys.executable, "-m", "training.data.prepare", *args], 600, cwd=REPO)


def test_cli_prints_counts_and_version(synthetic_archive, tmp_path):
    archive, sha = synthetic_archive
    done = run_cli("--source", archive.as_uri(), "--sha256", sha, "--volume", str(tmp_path / "v"), "--workers", "2")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["counts"]["read"] == 14 and len(summary["dataset_version"]) == 16


def test_the_three_artifacts_as_tusimple_ships_them_make_one_dataset(file_server: FileServer, synthetic_artifacts,
                                                                      tmp_path):
    """train_set.zip, test_set.zip and test_label.json over HTTP: the test clips land beside the training
    clips of the same dates, the test split finds every image, and the version covers all three."""
    artifacts = []
    for item in synthetic_artifacts:
        name = item["url"].rsplit("/", 1)[-1]
        file_server.files[name] = Path(item["url"].removeprefix("file://")).read_bytes()
        artifacts.append(Artifact(file_server.url(name), item["sha256"], item["kind"]))
    volume = tmp_path / "volume"
    first = prepare_dataset(artifacts, volume, workers=2)
    assert first.counts["by_split"]["test"] == {"read": 3, "kept": 3, "quarantined": 0}
    assert first.counts["kept"] == 14 and first.counts["quarantined"] == 0
    assert (first.root / "test_label.json").is_file() and (first.root / "test_tasks_0627.json").is_file()
    assert {p.name for p in (first.root / "clips" / "0531").iterdir()} == {"1000", "1001", "1002", "20001"}
    assert sorted(p.name for p in (volume / "downloads").iterdir()) == ["test_label.json", "test_set.zip",
                                                                        "train_set.zip"]
    manifest = json.loads((first.root / "manifest.json").read_text())
    assert [a["name"] for a in manifest["sources"]["artifacts"]] == ["train_set.zip", "test_set.zip",
                                                                      "test_label.json"]
    again = prepare_dataset(list(reversed(artifacts)), volume, workers=2)  # the same dataset, in any order
    assert (again.downloaded, again.extracted, again.preprocessed, again.root) == (False, False, False, first.root)
    without_test = prepare_dataset(artifacts[:1], tmp_path / "other", workers=2)
    assert without_test.counts["by_split"]["test"]["read"] == 0  # the archive alone has no test labels
    assert without_test.dataset_version != first.dataset_version


def test_artifacts_that_disagree_on_a_file_are_refused_naming_both(synthetic_artifacts, tmp_path):
    train, test, _ = synthetic_artifacts
    clash = tmp_path / "labels" / "label_data_0313.json"
    clash.parent.mkdir()
    clash.write_text("{}\n")
    artifacts = [Artifact(**train), Artifact(**test),
                 Artifact(clash.as_uri(), hashlib.sha256(clash.read_bytes()).hexdigest(), "file")]
    with pytest.raises(ValueError, match=r"'label_data_0313\.json' is in both train_set\.zip and "
                                         r"label_data_0313\.json with different contents"):
        prepare_dataset(artifacts, tmp_path / "volume")
    assert not (tmp_path / "volume" / "datasets").exists() or not any((tmp_path / "volume" / "datasets").iterdir())
    with pytest.raises(SourceError, match=r"dataset artifact 2: 'train_set\.zip' is also the file name of artifact 1"):
        prepare_dataset([Artifact(**train), Artifact(**train)], tmp_path / "volume")


def test_cli_takes_several_artifacts(synthetic_artifacts, tmp_path):
    args = [arg for item in synthetic_artifacts for arg in (f"--{item['kind']}", item["url"], item["sha256"])]
    done = run_cli(*args, "--volume", str(tmp_path / "v"), "--workers", "2")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["counts"]["by_split"]["test"]["kept"] == 3 and len(summary["artifacts"]) == 3


def test_cli_errors_are_one_clear_line(synthetic_archive, tmp_path):
    archive, _ = synthetic_archive
    done = run_cli("--source", archive.as_uri(), "--sha256", "nothex", "--volume", str(tmp_path / "v"))
    assert done.returncode == 2
    assert "error: dataset artifact 1: checksum 'nothex' is not a sha256 hex digest" in done.stderr
    assert "Traceback" not in done.stderr


def test_prepare_as_a_containers_pid_1_ends_on_sigterm_instead_of_running_out_its_grace(
        file_server: FileServer, synthetic_archive, tmp_path):
    """A Job's pod is deleted with SIGTERM to the container's PID 1, which Linux gives no default action:
    without a handler the download would crawl on, writing to the volume, until the kubelet's SIGKILL."""
    import os
    import signal
    import time

    from tasks.processes import running
    from tests.cluster.runtime import pod_runtime_missing

    if missing := pod_runtime_missing():
        pytest.skip(missing)
    archive, sha = synthetic_archive
    file_server.files["train_set.zip"] = archive.read_bytes()
    file_server.faults.append(Fault("slow", delay=60))  # 64 KiB a minute: still downloading when it is told
    command = ["unshare", "--pid", "--fork", "--kill-child=SIGKILL", sys.executable, "-m", "training.data.prepare",
               "--source", file_server.url("train_set.zip"), "--sha256", sha, "--volume", str(tmp_path / "volume")]
    with running(command, stop_signals=(signal.SIGKILL,), cwd=REPO, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE) as unshare:
        deadline = time.monotonic() + 120
        while not ((tmp_path / "volume" / "downloads").is_dir()
                   and any((tmp_path / "volume" / "downloads").iterdir())):
            assert unshare.poll() is None and time.monotonic() < deadline, unshare.stderr.read().decode()[-2000:]
            time.sleep(0.1)
        (pid_1,) = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children").read_text().split()
        (ids,) = [line.split()[1:] for line in Path(f"/proc/{pid_1}/status").read_text().splitlines()
                  if line.startswith("NSpid:")]
        assert ids[-1] == "1"  # PID 1 of its own PID namespace, as a container's first process is
        os.kill(int(pid_1), signal.SIGTERM)
        # Guard only: without the handler it would still be downloading when this gives up.
        code = unshare.wait(timeout=120)
    assert code == 128 + signal.SIGTERM  # it ended itself, as a process killed by SIGTERM reports
