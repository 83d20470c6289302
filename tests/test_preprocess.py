"""Preprocessing on real files: masks, list files, manifest, quarantine and the no-op re-run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import cv2
import numpy as np
import pytest

from training.data import labels
from training.data.preprocess import DatasetLayoutError, find_dataset_root, preprocess


def read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def append_label(root: Path, label_file: str, text: str) -> None:
    with (root / label_file).open("a") as handle:
        handle.write(text + "\n")


def a_record(root: Path, label_file: str = "label_data_0313.json") -> dict:
    return json.loads(read_lines(root / label_file)[0])


def test_outputs_follow_the_contract(dataset_copy: Path):
    report = preprocess(dataset_copy, workers=2)
    assert not report.skipped
    assert report.counts["read"] == report.counts["kept"] == 14
    assert report.counts["by_split"] == {
        "train": {"read": 8, "kept": 8, "quarantined": 0},
        "val": {"read": 3, "kept": 3, "quarantined": 0},
        "test": {"read": 3, "kept": 3, "quarantined": 0},
    }
    for split, expected in (("train", 8), ("val", 3), ("test", 3)):
        lines = read_lines(dataset_copy / f"seg_label/list/{split}_gt.txt")
        assert len(lines) == expected
        for line in lines:
            image, mask_file, *flags = line.split()
            assert image.startswith("/clips/") and mask_file.startswith("/seg_label/")
            assert len(flags) == 4 and set(flags) <= {"0", "1"}
            mask = cv2.imread(str(dataset_copy / mask_file[1:]), cv2.IMREAD_UNCHANGED)
            assert mask.dtype == np.uint8 and mask.ndim == 2 and mask.shape == (180, 320)
            # A slot has pixels exactly when its existence flag is set.
            present = {int(v) for v in np.unique(mask)} - {0}
            assert present == {slot + 1 for slot, flag in enumerate(flags) if flag == "1"}
    manifest = json.loads((dataset_copy / "manifest.json").read_text())
    assert manifest["dataset_version"] == report.dataset_version
    assert set(manifest["sources"]["label_files"]) == set(labels.LABEL_FILES)
    for info in manifest["sources"]["label_files"].values():
        assert len(info["sha256"]) == 64


def test_masks_match_the_pure_rasterizer(dataset_copy: Path):
    preprocess(dataset_copy, workers=2)
    record = labels.parse_label_line(read_lines(dataset_copy / "label_data_0531.json")[0])
    expected = labels.rasterize_mask(labels.assign_slots(record.lanes, record.h_samples), 320, 180)
    written = cv2.imread(str(dataset_copy / labels.mask_path_for(record.raw_file)), cv2.IMREAD_UNCHANGED)
    np.testing.assert_array_equal(written, expected)


def test_every_quarantine_reason_is_reported_with_file_and_line(dataset_copy: Path):
    root = dataset_copy
    good = a_record(root)
    lines_before = len(read_lines(root / "label_data_0313.json"))
    bad = [
        ('{"lanes": [[1, 2', "invalid_json"),
        (json.dumps({**good, "lanes": [good["lanes"][0][:-1]]}), "length_mismatch"),
        (json.dumps({**good, "raw_file": "clips/x/1/20.jpg",
                     "lanes": [[5000, *good["lanes"][0][1:]]]}), "x_out_of_range"),
        (json.dumps({**good, "raw_file": "clips/0313-1/missing/20.jpg"}), "missing_image"),
        (json.dumps({**good, "raw_file": "clips/0313-1/broken/20.jpg"}), "unreadable_image"),
        (json.dumps({**good, "raw_file": "clips/0313-1/empty/20.jpg"}), "unreadable_image"),
        (json.dumps({"h_samples": good["h_samples"], "raw_file": "clips/a/20.jpg"}), "invalid_record"),
        (json.dumps(good), "duplicate_raw_file"),
        # Lines that made the whole preparation fail (exit 2) before: a RecursionError, a ValueError of int().
        ('{"raw_file": ' + "[" * 20_000 + "]" * 20_000 + "}", "invalid_json"),
        (json.dumps({**good, "raw_file": "clips/big/20.jpg"})[:-1] + ', "n": ' + "9" * 5000 + "}", "invalid_json"),
        ('{"raw_file": ' + "[" * 200_000 + "]" * 200_000 + "}", "line_too_long"),  # not even parsed
    ]
    # A truncated JPEG and an empty file stand for broken images.
    jpeg = (root / good["raw_file"]).read_bytes()
    for name, data in (("broken", jpeg[: len(jpeg) // 2]), ("empty", b"")):
        (root / f"clips/0313-1/{name}").mkdir(parents=True)
        (root / f"clips/0313-1/{name}/20.jpg").write_bytes(data)
    (root / "clips/x/1").mkdir(parents=True)
    (root / "clips/x/1/20.jpg").write_bytes(jpeg)
    for text, _ in bad:
        append_label(root, "label_data_0313.json", text)

    report = preprocess(root, workers=2)
    counts = report.counts
    assert counts["read"] == 14 + len(bad)
    assert counts["kept"] == 14
    assert counts["read"] == counts["kept"] + counts["quarantined"]
    assert counts["by_split"]["train"]["quarantined"] == len(bad)
    quarantine = report.manifest["quarantine"]
    assert [(q["file"], q["line"], q["reason"]) for q in quarantine] == [
        ("label_data_0313.json", lines_before + 1 + i, reason) for i, (_, reason) in enumerate(bad)
    ]
    assert counts["quarantine_reasons"] == {"duplicate_raw_file": 1, "invalid_json": 3, "invalid_record": 1,
                                            "length_mismatch": 1, "line_too_long": 1, "missing_image": 1,
                                            "unreadable_image": 2, "x_out_of_range": 1}
    assert "nested too deeply" in quarantine[8]["detail"] and "digits" in quarantine[9]["detail"]
    assert "truncated" in quarantine[4]["detail"] and "empty file" in quarantine[5]["detail"]
    assert "label_data_0313.json:1" in quarantine[7]["detail"]
    # Quarantined records are in no list file.
    listed = "".join((root / f"seg_label/list/{s}_gt.txt").read_text() for s in ("train", "val", "test"))
    assert "missing" not in listed and "broken" not in listed and "clips/x/1" not in listed


def test_rerun_on_unchanged_inputs_does_nothing(dataset_copy: Path):
    first = preprocess(dataset_copy, workers=2)
    mask = dataset_copy / read_lines(dataset_copy / "seg_label/list/train_gt.txt")[0].split()[1][1:]
    manifest = dataset_copy / "manifest.json"
    stamps = (mask.stat().st_mtime_ns, manifest.stat().st_mtime_ns)
    second = preprocess(dataset_copy, workers=2)
    assert second.skipped and second.dataset_version == first.dataset_version
    assert second.counts == first.counts
    assert (mask.stat().st_mtime_ns, manifest.stat().st_mtime_ns) == stamps


def test_version_is_deterministic_and_content_based(dataset_copy: Path):
    serial = preprocess(dataset_copy, workers=1)
    parallel = preprocess(dataset_copy, workers=2, force=True)
    assert serial.dataset_version == parallel.dataset_version
    assert not parallel.skipped
    # A changed label changes the version; a touched-but-identical image re-runs but keeps it.
    image = dataset_copy / a_record(dataset_copy)["raw_file"]
    os.utime(image, ns=(1, 1))
    touched = preprocess(dataset_copy, workers=2)
    assert not touched.skipped and touched.dataset_version == serial.dataset_version
    record = a_record(dataset_copy, "label_data_0531.json")
    record["lanes"] = record["lanes"][:-1]
    lines = read_lines(dataset_copy / "label_data_0531.json")
    lines[0] = json.dumps(record)
    (dataset_copy / "label_data_0531.json").write_text("\n".join(lines) + "\n")
    changed = preprocess(dataset_copy, workers=2)
    assert changed.dataset_version != serial.dataset_version


def test_missing_label_files_give_empty_splits(dataset_copy: Path):
    (dataset_copy / "test_label.json").unlink()
    report = preprocess(dataset_copy, workers=1)
    assert report.counts["by_split"]["test"] == {"read": 0, "kept": 0, "quarantined": 0}
    assert (dataset_copy / "seg_label/list/test_gt.txt").read_text() == ""


def test_dataset_root_is_found_one_level_down(dataset_copy: Path, tmp_path: Path):
    assert find_dataset_root(tmp_path) == dataset_copy
    with pytest.raises(DatasetLayoutError, match="no TuSimple label files"):
        find_dataset_root(dataset_copy / "clips")
    with pytest.raises(DatasetLayoutError, match="does not exist"):
        find_dataset_root(tmp_path / "absent")


def test_a_malformed_line_does_not_claim_its_image(dataset_copy: Path):
    """When the first line naming an image is malformed, a later well-formed one is kept."""
    lines = read_lines(dataset_copy / "label_data_0531.json")
    good = json.loads(lines[0])
    broken = json.dumps({**good, "lanes": [good["lanes"][0][:-3]]})
    (dataset_copy / "label_data_0531.json").write_text("\n".join([broken, *lines[1:]]) + "\n")
    append_label(dataset_copy, "label_data_0531.json", lines[0])
    report = preprocess(dataset_copy, workers=2)
    assert [(q["line"], q["reason"]) for q in report.manifest["quarantine"]] == [(1, "length_mismatch")]
    assert good["raw_file"] in (dataset_copy / "seg_label/list/val_gt.txt").read_text()
