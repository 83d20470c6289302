"""Two preparations of one dataset on one volume at once, as two real ``training.data.prepare`` processes (the
nightly and a run started from the UI on a new drop): they take turns and end with one complete dataset."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from contextlib import ExitStack
from pathlib import Path

from tasks.processes import running
from tests.http_server import Fault, FileServer
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[1]
WAITS = "waits for the other preparation to finish"


def test_two_preparations_of_one_dataset_at_once_end_with_one_complete_dataset(
        file_server: FileServer, synthetic_archive, synthetic_source: Path, tmp_path: Path) -> None:
    archive, sha = synthetic_archive
    file_server.files["train_set.zip"] = archive.read_bytes()
    # The server answers no download until both preparers are under way: each is past its "already there?"
    # check, so without a lock both would write the one .part and the one staging folder.
    gate = threading.Event()
    file_server.faults.extend([Fault("hold", gate=gate), Fault("hold", gate=gate)])
    volume = tmp_path / "volume"
    command = [sys.executable, "-m", "training.data.prepare", "--source", file_server.url("train_set.zip"),
               "--sha256", sha, "--volume", str(volume), "--workers", "1"]
    outs = [tmp_path / f"prepare-{i}.out" for i in range(2)]
    errs = [tmp_path / f"prepare-{i}.err" for i in range(2)]

    def asked() -> int:
        return sum(request.get("path") == "train_set.zip" for request in file_server.requests)

    with ExitStack() as stack:
        stack.callback(gate.set)  # however the test ends, no server thread is left waiting
        processes = [stack.enter_context(running(command, cwd=REPO, stdout=stack.enter_context(out.open("w")),
                                                 stderr=stack.enter_context(err.open("w"))))
                     for out, err in zip(outs, errs, strict=True)]
        wait_until("both preparations under way", lambda: asked() >= 2
                   or any(WAITS in err.read_text() for err in errs)
                   or any(process.poll() is not None for process in processes), every_s=0.1)
        gate.set()
        codes = [process.wait(timeout=600) for process in processes]  # a guard only
    stderr = [err.read_text() for err in errs]
    assert codes == [0, 0], "\n---\n".join(text[-3000:] for text in stderr)

    summaries = [json.loads(out.read_text().splitlines()[-1]) for out in outs]
    assert summaries[0]["dataset_version"] == summaries[1]["dataset_version"]
    assert summaries[0]["dataset_dir"] == summaries[1]["dataset_dir"] == f"datasets/{sha[:16]}"
    assert sorted(summary["steps"]["downloaded"] for summary in summaries) == [False, True]
    assert asked() == 1  # the second found the dataset ready and downloaded nothing

    # The one that waited said so once, naming the other (its process id).
    waited = [index for index, text in enumerate(stderr) if WAITS in text]
    assert len(waited) == 1 and stderr[waited[0]].count(WAITS) == 1
    (line,) = [line for line in stderr[waited[0]].splitlines() if WAITS in line]
    assert f"pid {processes[1 - waited[0]].pid} " in line and f"dataset {sha[:16]}" in line

    root = volume / summaries[0]["dataset_dir"]
    for source in (path for path in synthetic_source.rglob("*") if path.is_file()):
        copy = root / source.relative_to(synthetic_source)
        assert copy.is_file() and copy.read_bytes() == source.read_bytes(), copy
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["counts"]["read"] == manifest["counts"]["kept"] == 14
    assert manifest["counts"]["quarantined"] == 0
    listed = [line.split() for split in ("train", "val", "test")
              for line in (root / "seg_label" / "list" / f"{split}_gt.txt").read_text().splitlines()]
    assert len(listed) == 14
    for image, mask, *_ in listed:
        assert (root / image.lstrip("/")).is_file() and (root / mask.lstrip("/")).is_file(), (image, mask)
    assert sorted(path.name for path in (volume / "downloads").iterdir()) == ["train_set.zip"]  # no .part
    assert sorted(path.name for path in (volume / "datasets").iterdir()) == [sha[:16]]  # no staging folder


def test_a_preparer_that_dies_releases_its_lock(synthetic_archive, tmp_path: Path) -> None:
    """A preparation waits while another holds the dataset's lock; killed outright (no handler runs), that
    holder leaves no lock behind and the waiting preparation goes ahead."""
    archive, sha = synthetic_archive
    volume = tmp_path / "volume"
    hold = ("import sys, time\n"
            "from pathlib import Path\n"
            "from training.data.lock import holding, lock_file\n"
            "with holding(lock_file(Path(sys.argv[1]), 'dataset', sys.argv[2]), 'a preparer about to die'):\n"
            "    print('held', flush=True)\n"
            "    time.sleep(3600)\n")
    out, err = tmp_path / "prepare.out", tmp_path / "prepare.err"
    with ExitStack() as stack:
        holder = stack.enter_context(running([sys.executable, "-c", hold, str(volume), sha[:16]], cwd=REPO,
                                             stop_signals=(signal.SIGKILL,), stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE))
        assert holder.stdout.readline() == b"held\n", holder.stderr.read().decode()[-2000:]
        preparer = stack.enter_context(running(
            [sys.executable, "-m", "training.data.prepare", "--source", archive.as_uri(), "--sha256", sha,
             "--volume", str(volume), "--workers", "1"], cwd=REPO, stdout=stack.enter_context(out.open("w")),
            stderr=stack.enter_context(err.open("w"))))
        wait_until("the preparation waiting for the holder", lambda: WAITS in err.read_text()
                   or preparer.poll() is not None, every_s=0.1)
        assert preparer.poll() is None, err.read_text()[-3000:]
        holder.kill()
        holder.wait()
        code = preparer.wait(timeout=600)  # a guard only
    assert code == 0, err.read_text()[-3000:]
    (line,) = [line for line in err.read_text().splitlines() if WAITS in line]
    assert f"a preparer about to die (pid {holder.pid} " in line
    assert json.loads(out.read_text())["counts"]["kept"] == 14
