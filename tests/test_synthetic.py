"""The synthetic generator writes the public TuSimple layout, deterministically by seed."""

from __future__ import annotations

import json
import zipfile

import cv2
import numpy as np
import pytest

from training.data import synthetic
from training.data.labels import LABEL_FILES, assign_slots, existence_flags, parse_label_line


def test_layout_and_label_format(tmp_path):
    counts = synthetic.generate(tmp_path, train=4, val=2, test=2, seed=3)
    assert counts == {"label_data_0313.json": 2, "label_data_0601.json": 2,
                      "label_data_0531.json": 2, "test_label.json": 2}
    assert set(LABEL_FILES) <= {p.name for p in tmp_path.iterdir()}
    for name in LABEL_FILES:
        for line in (tmp_path / name).read_text().splitlines():
            raw = json.loads(line)
            assert list(raw) == ["lanes", "h_samples", "raw_file"]
            assert raw["h_samples"] == list(range(160, 720, 10))
            assert raw["raw_file"].startswith("clips/") and raw["raw_file"].endswith("/20.jpg")
            assert 2 <= len(raw["lanes"]) <= 5
            for lane in raw["lanes"]:
                assert all(x == -2 or 0 <= x < 1280 for x in lane)
            image = cv2.imread(str(tmp_path / raw["raw_file"]))
            assert image.shape == (720, 1280, 3)
            record = parse_label_line(line)
            # The ego lane boundaries are always there and long enough to learn from.
            assert existence_flags(assign_slots(record.lanes, record.h_samples))[1:3] == (1, 1)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    digests = []
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        synthetic.generate(tmp_path / name, train=2, val=1, test=1, seed=seed, width=320, height=180)
        digests.append(synthetic.pack_archive(tmp_path / name, tmp_path / f"{name}.zip"))
    assert digests[0] == digests[1]
    assert digests[0] != digests[2]


def test_images_do_not_depend_on_how_many_are_made(tmp_path):
    synthetic.generate(tmp_path / "few", train=2, val=0, test=0, seed=1, width=320, height=180)
    synthetic.generate(tmp_path / "many", train=6, val=0, test=0, seed=1, width=320, height=180)
    first = "clips/0313-1/1000/20.jpg"
    assert (tmp_path / "few" / first).read_bytes() == (tmp_path / "many" / first).read_bytes()


def test_scenes_vary():
    rng_counts = set()
    for index in range(40):
        _, lanes = synthetic.generate_image(0, "train", index, 320, 180)
        rng_counts.add(len(lanes))
    assert rng_counts == {2, 3, 4, 5}


def test_lanes_are_drawn_where_labelled():
    image, lanes = synthetic.generate_image(11, "val", 0, 1280, 720)
    gray = cv2.cvtColor(image, cv2.COLOR_BGR2GRAY).astype(np.int32)
    h_samples = synthetic.h_samples_for(720)
    # Near the camera, marks are wide and bright: the labelled column is brighter than the road beside it.
    brighter = 0
    checked = 0
    for lane in lanes:
        for x, y in zip(lane, h_samples, strict=True):
            if x >= 40 and x < 1240 and y > 600:
                checked += 1
                brighter += gray[y, x] > gray[y, x - 40] or gray[y, x] > gray[y, x + 40]
    assert checked > 0 and brighter / checked > 0.6


def test_size_is_configurable(tmp_path):
    synthetic.generate(tmp_path, train=1, val=0, test=0, seed=0, width=640, height=360)
    raw = json.loads((tmp_path / "label_data_0313.json").read_text().splitlines()[0])
    assert cv2.imread(str(tmp_path / raw["raw_file"])).shape == (360, 640, 3)
    assert raw["h_samples"][0] == 80 and raw["h_samples"][-1] == 355
    assert all(x == -2 or 0 <= x < 640 for lane in raw["lanes"] for x in lane)


def test_archive_is_a_train_set_like_zip(tmp_path):
    synthetic.generate(tmp_path / "d", train=2, val=1, test=1, seed=0, width=320, height=180)
    synthetic.pack_archive(tmp_path / "d", tmp_path / "train_set.zip")
    with zipfile.ZipFile(tmp_path / "train_set.zip") as zf:
        names = zf.namelist()
        assert names == sorted(names)
        assert "label_data_0313.json" in names and any(n.startswith("clips/") for n in names)
        assert {i.date_time for i in zf.infolist()} == {synthetic.ZIP_DATE}


def test_cli(tmp_path, capsys):
    assert synthetic.main(["--out", str(tmp_path / "d"), "--train", "2", "--val", "1", "--test", "1",
                           "--size", "320x180", "--archive", str(tmp_path / "a.zip")]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[1]["sha256"] == synthetic.pack_archive(tmp_path / "d", tmp_path / "b.zip")


@pytest.mark.parametrize("size", ["big", "10x10", "1280"])
def test_cli_refuses_bad_sizes(size: str, tmp_path):
    with pytest.raises(SystemExit):
        synthetic.main(["--out", str(tmp_path), "--size", size])


def test_artifacts_are_packed_as_the_benchmark_ships_them(tmp_path):
    synthetic.generate(tmp_path / "d", train=4, val=2, test=3, seed=2, width=320, height=180)
    train, test, labels = synthetic.pack_artifacts(tmp_path / "d", tmp_path / "out")
    assert [a["kind"] for a in (train, test, labels)] == ["archive", "archive", "file"]
    with zipfile.ZipFile(train["path"]) as zf:
        names = zf.namelist()
    assert {"label_data_0313.json", "label_data_0601.json", "label_data_0531.json"} <= set(names)
    assert "test_label.json" not in names and len([n for n in names if n.endswith(".jpg")]) == 6
    with zipfile.ZipFile(test["path"]) as zf:
        names = zf.namelist()
        tasks = [json.loads(line) for line in zf.read("test_tasks_0627.json").decode().splitlines()]
    test_images = sorted(n for n in names if n.endswith(".jpg"))
    assert test_images == sorted(t["raw_file"] for t in tasks) and all(t["lanes"] == [] for t in tasks)
    # Test clips share date folders with training clips (as in the public release), under other clip ids.
    assert {n.split("/")[1] for n in test_images} == {"0530", "0531", "0601"}
    assert (tmp_path / "out" / "test_label.json").read_bytes() == (tmp_path / "d" / "test_label.json").read_bytes()
    again = synthetic.pack_artifacts(tmp_path / "d", tmp_path / "again")
    assert [a["sha256"] for a in again] == [a["sha256"] for a in (train, test, labels)]  # deterministic
