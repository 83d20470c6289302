"""The training entrypoint as the orchestrator runs it: real processes, real horovodrun, real files."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.processes import run_to_end, running
from training.config import parse_overrides
from training.data.preprocess import preprocess
from training.data.synthetic import generate
from training.dataset import DataError, LaneDataset, poly_lr, read_list
from training.evaluate import lanes_from_probabilities
from training.stop_request import STOP_REQUEST, read_stop_request
from training.tensorboard_log import TensorBoardLog
from training.train import EXIT_PREEMPTED

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
FAST = ["--set", "batch_size=2", "--set", "num_workers=0", "--set", "log_every=1", "--set", "warmup_steps=2"]


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prepared") / "tusimple"
    generate(root, train=16, val=4, test=4, seed=3, width=320, height=180)
    preprocess(root, workers=1)
    return root


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(REPO), **extra}


def train_cmd(data_root: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "training.train", "--data-root", str(data_root), "--run-dir", str(run_dir),
            "--preset", "cpu-demo", *FAST, *extra]


def events(stdout: str) -> list[dict]:
    found = []
    for line in stdout.splitlines():
        line = re.sub(r"^\[\d+\]<stdout>:", "", line)
        if line.startswith("{"):
            found.append(json.loads(line))
    return found


def run(cmd: list[str], timeout: int = 600, **extra_env: str) -> subprocess.CompletedProcess:
    return run_to_end(cmd, timeout, env=env(**extra_env), cwd=REPO)


def curves_in_metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """What TensorBoard must show, from metrics.jsonl: per tag, step -> value. An attempt's ``start`` drops
    the points earlier attempts wrote after the step it resumes from (it writes them again)."""
    curves: dict[str, dict[int, float]] = {}
    last_step = 0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        kind = record["event"]
        if kind == "start":
            curves = {tag: {s: v for s, v in points.items() if s <= record["step"]} for tag, points in curves.items()}
        elif kind == "step":
            last_step = record["step"]
            for tag, key in ("train/loss", "loss"), ("train/lr", "lr"), ("train/images_per_second", "img_per_s"):
                curves.setdefault(tag, {})[record["step"]] = record[key]
        if kind in ("val", "eval"):  # the final eval carries no step: it scores the last one
            split, at = record.get("split", "val"), record.get("step", last_step)
            for key in "accuracy", "untimed_accuracy", "fp", "fn":
                curves.setdefault(f"{split}/{key}", {})[at] = record[key]
    return curves


def curves_in_tensorboard(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Per tag, the (step, value) points TensorBoard's own reader shows for the run."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={SCALARS: 0})
    accumulator.Reload()
    return {tag: [(s.step, s.value) for s in accumulator.Scalars(tag)] for tag in accumulator.Tags()[SCALARS]}


def assert_tensorboard_shows_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    expected, shown = curves_in_metrics(run_dir), curves_in_tensorboard(run_dir)
    assert set(shown) == set(expected)
    for tag, points in shown.items():
        steps = [step for step, _ in points]
        assert steps == sorted(set(steps)), f"{tag}: each step once, in order: {steps}"
        assert steps == sorted(expected[tag]), tag
        assert [value for _, value in points] == pytest.approx([expected[tag][s] for s in steps], rel=1e-6), tag
    return shown


def test_the_orchestrator_writes_the_stop_request_where_the_trainer_reads_it() -> None:
    from tasks import pruning

    assert pruning.STOP_REQUEST == STOP_REQUEST  # tasks.pruning keeps its own literal


def test_a_stop_request_is_read_once_it_is_written(tmp_path: Path) -> None:
    assert read_stop_request(tmp_path) is None
    (tmp_path / STOP_REQUEST).write_text("")  # created, not yet written: looked at again at the next check
    assert read_stop_request(tmp_path) is None
    (tmp_path / STOP_REQUEST).write_text('{"reason": "pruned", "state": "Pruned", "event": "x", "step": 3}\n')
    assert read_stop_request(tmp_path) == {"reason": "pruned", "state": "Pruned"}  # cannot clash with the record
    (tmp_path / STOP_REQUEST).write_text('{"reason": "pru')  # torn: it was still written to stop the run
    assert read_stop_request(tmp_path) == {"reason": f"{STOP_REQUEST} was found"}


def test_plain_run_writes_checkpoints_metrics_model_and_eval(prepared: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # Left by an earlier attempt that never saw it: a new attempt drops it (the orchestrator asks again).
    (run_dir / STOP_REQUEST).write_text('{"reason": "an old request", "state": "Pruned"}\n')
    done = run(train_cmd(prepared, run_dir, "--set", "epochs=2", "--set", "checkpoint_every=3",
                         "--set", "eval_every=8"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ignoring a stop request left from an earlier attempt" in done.stderr
    assert not (run_dir / STOP_REQUEST).exists()
    kinds = [e["event"] for e in events(done.stdout)]
    assert kinds[0] == "start" and kinds[-2:] == ["eval", "done"] and "stopped" not in kinds
    (val,) = [e for e in events(done.stdout) if e["event"] == "val"]  # at step 8; step 16 is the final eval
    assert val["step"] == 8 and {"accuracy", "untimed_accuracy", "fp", "fn"} <= set(val)
    steps = [e for e in events(done.stdout) if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 17))
    for event in steps:
        assert {"loss", "lr", "img_per_s", "input_stall"} <= set(event)
        assert 0.0 <= event["input_stall"] <= 1.0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step-00000012.pt", "step-00000015.pt", "step-00000016.pt"]  # newest three kept
    assert (run_dir / "model.pt").is_file() and (run_dir / "overlay.png").is_file()
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert evaluation["split"] == "val" and evaluation["images"] == 4
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == len(events(done.stdout)) - 1  # no "done"
    shown = assert_tensorboard_shows_metrics(run_dir)
    assert {"train/loss", "train/lr", "train/images_per_second", "val/accuracy", "val/untimed_accuracy"} <= set(shown)
    assert [step for step, _ in shown["val/accuracy"]] == [8, 16]  # the periodic val, then the final eval
    assert [step for step, _ in shown["train/loss"]] == list(range(1, 17))


def test_horovodrun_two_ranks_end_identical_and_only_rank0_writes(prepared: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    # Channels-last activations (what auto picks on GPUs and on many CPUs): Horovod allreduces only contiguous
    # tensors, so the weights and their gradients must stay contiguous whatever the activations' layout.
    cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
           *train_cmd(prepared, run_dir, "--set", "epochs=1", "--set", "checkpoint_every=2",
                      "--set", "memory_format=channels_last")]
    done = run(cmd, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    # One run, one numeric path: rank 0's choice (precision auto) is every rank's.
    chosen = re.findall(r"rank(\d) laneflow.train numerics \(rank \d\): (\S+)", done.stderr)
    assert len(chosen) == 2 and len({c for _, c in chosen}) == 1 and chosen[0][1].endswith("/channels_last:"), chosen
    digests = dict(re.findall(r"final weights sha256 ([0-9a-f]{64}) \(rank (\d)\)", done.stdout + done.stderr))
    assert len(set(re.findall(r"final weights sha256 ([0-9a-f]{64}) \(rank (\d)\)",
                              done.stdout + done.stderr))) == 2, "both ranks must report"
    assert len(set(digests)) == 1, f"ranks diverged: {digests}"
    # Rank 1 prints no events and writes nothing: each event is in metrics.jsonl exactly once.
    assert not re.search(r"^\[1\]<stdout>:\{", done.stdout, re.M)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["event"] for m in metrics].count("start") == 1
    start = metrics[0]
    assert start["world_size"] == 2 and start["total_steps"] == 4  # 16 images / 2 ranks / batch 2
    assert [m["step"] for m in metrics if m["event"] == "checkpoint"] == [2, 4]
    assert len(list(run_dir.rglob("events.out.tfevents.*"))) == 1  # rank 0's writer alone
    assert [step for step, _ in assert_tensorboard_shows_metrics(run_dir)["train/loss"]] == [1, 2, 3, 4]


def wait_for(path_glob: Path, pattern: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if list(path_glob.glob(pattern)):
            return
        time.sleep(0.2)
    raise AssertionError(f"nothing matching {pattern} appeared in {path_glob}")


def wait_for_a_step_after_a_checkpoint(metrics: Path, timeout: float = 240) -> None:
    """Until the newest line of metrics.jsonl is a step after a checkpoint: a kill then loses that step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = []
        for line in metrics.read_text().splitlines() if metrics.exists() else []:
            try:
                records.append(json.loads(line))
            except ValueError:  # the newest line, half-written
                break
        saved = [r["step"] for r in records if r["event"] == "checkpoint"]
        if saved and records[-1]["event"] == "step" and records[-1]["step"] > saved[-1]:
            return
        time.sleep(0.05)
    raise AssertionError(f"no step after a checkpoint appeared in {metrics}")


def test_killed_run_resumes_from_its_checkpoint_not_from_zero(prepared: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    cmd = train_cmd(prepared, run_dir, "--set", "epochs=3", "--set", "checkpoint_every=2")
    with running(cmd, stop_signals=(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env(), cwd=REPO):
        wait_for_a_step_after_a_checkpoint(run_dir / "metrics.jsonl")  # then killed at once (SIGKILL)
    saved = max(int(p.stem.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*.pt"))
    killed = {step for step, _ in curves_in_tensorboard(run_dir)["train/loss"]}
    done = run(cmd)
    assert done.returncode == 0, done.stderr[-3000:]
    start = events(done.stdout)[0]
    assert start["resumed"] is True and start["step"] == saved >= 2
    assert events(done.stdout)[1]["step"] == saved + 1
    # Both attempts wrote to one folder; TensorBoard shows each step once, the killed attempt's steps after
    # the checkpoint (there usually are some: see the wait above) purged and written again.
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert set(range(1, saved + 1)) <= killed
    shown = assert_tensorboard_shows_metrics(run_dir)
    assert [step for step, _ in shown["train/loss"]] == list(range(1, 25))


def test_sigterm_checkpoints_and_exits_preempted(prepared: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    cmd = train_cmd(prepared, run_dir, "--set", "epochs=20", "--set", "checkpoint_every=1000")
    with running(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO) as process:
        wait_for(run_dir, "metrics.jsonl")
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == EXIT_PREEMPTED, stderr[-3000:]
    preempted = [e for e in events(stdout) if e["event"] == "preempted"]
    assert len(preempted) == 1
    assert (run_dir / "checkpoints" / f"step-{preempted[0]['step']:08d}.pt").is_file()


def test_truncated_checkpoint_is_skipped_with_a_warning(prepared: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    first = run(train_cmd(prepared, run_dir, "--set", "epochs=1", "--set", "checkpoint_every=2",
                          "--set", "max_steps=4"))
    assert first.returncode == 0, first.stderr[-3000:]
    newest = run_dir / "checkpoints" / "step-00000004.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    second = run(train_cmd(prepared, run_dir, "--set", "epochs=1", "--set", "checkpoint_every=2",
                           "--set", "max_steps=6"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "skipping unreadable checkpoint" in second.stderr and "step-00000004.pt" in second.stderr
    assert events(second.stdout)[0]["step"] == 2


def test_mismatched_checkpoint_is_a_clear_error(prepared: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    assert run(train_cmd(prepared, run_dir, "--set", "max_steps=2", "--set", "checkpoint_every=2")).returncode == 0
    done = run(train_cmd(prepared, run_dir, "--set", "max_steps=4", "--set", "model.mp_kernel=3"))
    assert done.returncode == 2
    assert "was written for a different model" in done.stderr and "Traceback" not in done.stderr


def test_a_run_resumed_on_another_dataset_version_is_refused(prepared: Path, tmp_path: Path):
    """A run key reused after a new dataset drop finds the old run's checkpoints: resuming there would record a model
    trained mostly on the old data as trained on the new. The same data (another copy of it) still resumes."""
    run_dir = tmp_path / "run"
    assert run(train_cmd(prepared, run_dir, "--set", "max_steps=2", "--set", "checkpoint_every=2")).returncode == 0
    old_version = json.loads((prepared / "manifest.json").read_text())["dataset_version"]
    newer = tmp_path / "newer"
    shutil.copytree(prepared, newer)
    manifest = json.loads((newer / "manifest.json").read_text())
    (newer / "manifest.json").write_text(json.dumps({**manifest, "dataset_version": "0123456789abcdef"}))
    refused = run(train_cmd(newer, run_dir, "--set", "max_steps=4"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"was trained on dataset version {old_version}; this run trains on version 0123456789abcdef" \
        in refused.stderr and "another run_key" in refused.stderr
    same = tmp_path / "same"
    shutil.copytree(prepared, same)
    resumed = run(train_cmd(same, run_dir, "--set", "max_steps=4"))
    assert resumed.returncode == 0, resumed.stderr
    assert [e["step"] for e in events(resumed.stdout) if e["event"] == "start"] == [2]


class _RunsCodeOnLoad:
    """What someone with write access to the volume could leave as a checkpoint: unpickling it calls a function."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def test_a_checkpoint_whose_pickle_would_run_code_is_refused_and_the_run_fails_naming_it(prepared: Path,
                                                                                       tmp_path: Path):
    """The newest checkpoint on the volume is not the trainer's: loading it would run code. Resuming refuses it
    (nothing runs) and the run stops with exit 2 naming the file; it is not skipped, which would quietly start
    the run over from an older checkpoint."""
    run_dir = tmp_path / "run"
    first = run(train_cmd(prepared, run_dir, "--set", "max_steps=2", "--set", "checkpoint_every=2"))
    assert first.returncode == 0, first.stderr[-3000:]
    marker = tmp_path / "code-ran"
    planted = run_dir / "checkpoints" / "step-00000099.pt"
    torch.save({"step": 99, "model": _RunsCodeOnLoad(marker)}, planted)
    done = run(train_cmd(prepared, run_dir, "--set", "max_steps=4", "--set", "checkpoint_every=2"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert not marker.exists()
    assert f"{planted} holds objects other than tensors and plain data" in done.stderr
    assert "could run code" in done.stderr and "Traceback" not in done.stderr
    # The same file as the model a finished run left: evaluate refuses it too.
    (run_dir / "model.pt").write_bytes(planted.read_bytes())
    scored = run([sys.executable, "-m", "training.evaluate", "--run-dir", str(run_dir), "--data-root", str(prepared),
                  "--split", "val"])
    assert scored.returncode == 2 and not marker.exists()
    assert "model.pt holds objects other than tensors and plain data" in scored.stderr


def test_every_field_the_trainer_checkpoints_loads_as_data(prepared: Path, tmp_path: Path):
    """Checkpoints and model.pt load with weights_only=True (no unpickling of code), a mixed-precision run's scaler
    included; an elastic run's (its sampler's place in the epoch) is loaded by every elastic resume test."""
    from training.checkpoints import load_latest_checkpoint, load_weights

    run_dir = tmp_path / "run"
    done = run(train_cmd(prepared, run_dir, "--set", "max_steps=2", "--set", "checkpoint_every=2",
                         "--set", "precision=bf16"))
    assert done.returncode == 0, done.stderr[-3000:]
    state = load_latest_checkpoint(run_dir)
    assert state is not None and state["step"] == 2 and state["precision"] == "bf16"
    assert {"model", "optimizer", "model_name", "model_config", "train_config", "world_size", "scaler"} <= set(state)
    assert set(load_weights(run_dir / "model.pt")) == {"model", "model_name", "model_config", "step"}


def test_a_learning_rate_that_blows_the_weights_up_is_a_clear_error_not_a_crash(prepared: Path, tmp_path: Path):
    done = run(train_cmd(prepared, tmp_path / "run", "--set", "lr=10", "--set", "max_steps=6"))
    assert done.returncode == 2, done.stderr[-3000:]  # exit 2: not retried, it would diverge again
    assert "training diverged" in done.stderr and "lower lr" in done.stderr and "Traceback" not in done.stderr


def test_missing_data_root_and_empty_split_are_clear_errors(tmp_path: Path):
    done = run(train_cmd(tmp_path / "nowhere", tmp_path / "run"))
    assert done.returncode == 2 and "data root" in done.stderr and "does not exist" in done.stderr
    with pytest.raises(DataError, match=r"split 'train' .* is empty"):
        empty = tmp_path / "empty"
        (empty / "seg_label" / "list").mkdir(parents=True)
        (empty / "seg_label" / "list" / "train_gt.txt").write_text("")
        read_list(empty, "train")


def test_tensorboard_files_that_cannot_be_written_never_stop_training(tmp_path: Path, caplog):
    (tmp_path / "run").write_text("not a folder")  # the writer cannot make its folder here
    with caplog.at_level(logging.WARNING, "laneflow.train"), TensorBoardLog.open(tmp_path / "run" / "tb", 0) as board:
        board.write("step", {"step": 1, "loss": 1.0, "lr": 0.1, "img_per_s": 3.0}, 1)
    assert caplog.text.count("not writing TensorBoard files") == 1

    class Broken:
        def add_scalar(self, *_args: object) -> None:
            raise OSError("No space left on device")

    caplog.clear()
    with caplog.at_level(logging.WARNING, "laneflow.train"), TensorBoardLog(Broken(), tmp_path) as board:
        for step in (1, 2):  # the first failure is reported once, then the writer is left alone
            board.write("step", {"step": step, "loss": 1.0, "lr": 0.1, "img_per_s": 3.0}, step)
    assert caplog.text.count("stopped writing TensorBoard files") == 1 and "No space left" in caplog.text


def test_overrides_are_typed_and_checked():
    config = parse_overrides("cpu-demo", ["epochs=5", "lr=0.1", "model.input_width=320"])
    assert config.epochs == 5 and config.lr == 0.1 and config.model_overrides == {"input_width": 320}
    for bad, message in (["epochs=x"], "needs a int"), (["nope=1"], "unknown setting"), \
            (["epochs=0"], "must be >= 1"), (["model.input_width=100"], "multiple of 16"), (["lr"], "key=value"):
        with pytest.raises(ValueError, match=message):
            parse_overrides("cpu-demo", bad)


def test_poly_lr_warms_up_then_decays_to_zero():
    lrs = [poly_lr(s, 100, 0.1, 10) for s in range(101)]
    assert lrs[0] == pytest.approx(0.01) and lrs[9] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    assert lrs[100] == 0.0


def test_loader_output_matches_the_network_input(prepared: Path):
    dataset = LaneDataset(prepared, "train", (256, 144), augment=True)
    image, mask, exist = dataset[0]
    assert image.shape == (144, 256, 3) and image.dtype == torch.uint8
    assert mask.shape == (144, 256) and int(mask.max()) <= 4
    assert exist.shape == (4,)


def test_lanes_from_probabilities():
    probs = np.zeros((5, 36, 64), np.float32)
    probs[0] = 1.0
    probs[2, 10:, 19:22] = 0.9  # slot 2 lane centred on column 20 from row 10 down
    lanes = lanes_from_probabilities(probs, np.array([0.1, 0.9, 0.2, 0.3]), list(range(160, 720, 10)),
                                     (1280, 720))
    assert len(lanes) == 1
    lane = lanes[0]
    expected_x = round(20.5 * 1280 / 64 - 0.5)
    assert {x for x in lane if x >= 0} == {expected_x}
    assert lane[0] == -2 and lane[-1] == expected_x  # row 160 maps above row 10 of the map


def test_decoded_sample_cache_matches_decoding_and_follows_the_dataset_version(prepared: Path, tmp_path: Path):
    import shutil

    root = tmp_path / "tusimple"
    shutil.copytree(prepared, root, ignore=shutil.ignore_patterns("cache"))
    plain = LaneDataset(root, "val", (256, 144))
    cached = LaneDataset(root, "val", (256, 144), cache=True)
    for index in range(len(plain)):
        for a, b in zip(plain.load(index), cached.load(index), strict=True):
            np.testing.assert_array_equal(a, b)
    first_cache = cached._cache_path
    assert first_cache is not None and first_cache.parent == root / "cache"
    # Same inputs: the cache is reused; a new dataset version gets a new cache.
    assert LaneDataset(root, "val", (256, 144), cache=True)._cache_path == first_cache
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["dataset_version"] = "0" * 16
    (root / "manifest.json").write_text(json.dumps(manifest))
    assert LaneDataset(root, "val", (256, 144), cache=True)._cache_path != first_cache


def test_cache_falls_back_to_decoding_on_a_read_only_volume(prepared: Path, tmp_path: Path, caplog):
    import shutil

    root = tmp_path / "tusimple"
    shutil.copytree(prepared, root)
    shutil.rmtree(root / "cache", ignore_errors=True)
    (root / "cache").write_text("not a folder")  # the cache cannot be created here
    dataset = LaneDataset(root, "val", (256, 144), cache=True)
    assert dataset._cache_path is None
    assert "decoding every epoch" in caplog.text
    image, mask = dataset.load(0)
    assert image.shape == (144, 256, 3) and mask.shape == (144, 256)
