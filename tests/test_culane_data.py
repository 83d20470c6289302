"""CULane's format (training.data.culane) and the synthetic CULane-format data (training.data.synthetic_culane)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.http_server import FileServer
from training.culane_eval import scenario_lists, score_lists
from training.culane_metric import SCENARIOS, format_lines, parse_lines
from training.data.culane import (
    CulaneListError,
    lanes_in_slots,
    lines_path_for,
    parse_gt_list_line,
    seg_label,
)
from training.data.prepare import Artifact, prepare_dataset
from training.data.preprocess_culane import is_culane, preprocess_culane, slots_by_position
from training.data.synthetic_culane import generate, pack_artifacts, pack_tar


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("culane")
    assert generate(root, train=6, val=3, test=9, seed=3) == {"train_gt.txt": 6, "val_gt.txt": 3, "test.txt": 9}
    return root


def test_the_synthetic_set_is_laid_out_as_culane_ships_it(synthetic: Path) -> None:
    """Frames of 1640x590 under driver folders, a lines file beside each, labels whose flags the lines fill,
    segmentation labels drawn from the lines (value k for slot k), and the test list split by scenario."""
    for split in ("train", "val"):
        for line in (synthetic / "list" / f"{split}_gt.txt").read_text().splitlines():
            entry = parse_gt_list_line(line)
            image = cv2.imread(str(synthetic / entry.image))
            assert image.shape == (590, 1640, 3) and entry.image.split("/")[0].startswith("driver_")
            lanes = parse_lines((synthetic / lines_path_for(entry.image)).read_text())
            slots = lanes_in_slots([[tuple(point) for point in lane] for lane in lanes], entry.existence)
            mask = cv2.imread(str(synthetic / entry.mask), cv2.IMREAD_UNCHANGED)
            np.testing.assert_array_equal(mask, seg_label(slots))
            assert set(np.unique(mask)) == {0, *(k + 1 for k, flag in enumerate(entry.existence) if flag)}
    tests = (synthetic / "list" / "test.txt").read_text().splitlines()
    lists = scenario_lists(synthetic)
    assert list(lists) == list(SCENARIOS)
    assert sorted(image for images in lists.values() for image in images) == sorted(tests)
    assert all(len(images) == 1 for images in lists.values())
    assert (synthetic / lines_path_for(lists["cross"][0])).read_text() == ""  # crossroads: no lanes
    assert all(parse_lines((synthetic / lines_path_for(image)).read_text())
               for name, images in lists.items() if name != "cross" for image in images)


def test_the_ground_truth_scores_perfectly_on_every_scenario_with_no_false_positive_at_the_crossroads(
        synthetic: Path) -> None:
    scores = score_lists(scenario_lists(synthetic), synthetic, synthetic)
    assert all(scores[name].f1 == 1.0 for name in SCENARIOS if name != "cross"), scores
    assert scores["cross"].counts[0.5].fp == 0 and scores["all"].f1 == 1.0


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_frames(tmp_path: Path) -> None:
    def digest(root: Path) -> str:
        files = sorted(path for path in root.rglob("*") if path.is_file())
        return hashlib.sha256(b"".join(str(p.relative_to(root)).encode() + p.read_bytes() for p in files)).hexdigest()

    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        generate(tmp_path / name, train=2, val=1, test=2, seed=seed)
    assert digest(tmp_path / "a") == digest(tmp_path / "b") != digest(tmp_path / "c")


@pytest.mark.parametrize(("line", "says"), [
    ("/a.jpg /a.png 1 1 1", "expected '/image /label e1 e2 e3 e4' (6 fields), found 5"),
    ("/a.jpg /a.png 1 1 2 0", "existence flags must be 0 or 1, found '1 1 2 0'"),
    ("/../etc/x.jpg /a.png 1 1 1 1", "the image path '/../etc/x.jpg' is not a path inside the dataset"),
    ("/a.jpg / 1 1 1 1", "the label path '/' is not a path inside the dataset"),
])
def test_a_bad_list_line_says_what_is_wrong(line: str, says: str) -> None:
    with pytest.raises(CulaneListError) as raised:
        parse_gt_list_line(line)
    assert str(raised.value) == says


def test_lanes_fill_the_flagged_slots_in_order_and_a_disagreeing_count_is_an_error() -> None:
    left, right = [(100.0, 590.0), (200.0, 400.0)], [(900.0, 590.0), (800.0, 400.0)]
    assert lanes_in_slots([left, right], (0, 1, 1, 0)) == [[], left, right, []]
    with pytest.raises(CulaneListError, match="the existence flags 1 1 1 0 name 3 lane"):
        lanes_in_slots([left, right], (1, 1, 1, 0))


def test_preparation_writes_the_tusimple_shaped_lists_and_quarantines_each_bad_frame_with_its_reason(
        tmp_path: Path) -> None:
    """Every way a CULane frame can be unusable, each on one frame of a synthetic set: the others are prepared,
    the shipped labels used where they are, masks drawn where they are not; a second run on unchanged inputs
    does nothing, and a changed lines file prepares again."""
    root = tmp_path / "culane"
    generate(root, train=9, val=3, test=9, seed=5)
    train_list = root / "list" / "train_gt.txt"
    lines = train_list.read_text().splitlines()
    frames = [parse_gt_list_line(line) for line in lines]
    (root / frames[0].image).unlink()                                    # missing image
    (root / lines_path_for(frames[1].image)).write_text("10 590 x 580\n")  # a token that is not a number
    (root / lines_path_for(frames[2].image)).unlink()                    # no lines file
    assert sum(frames[3].existence) > 0
    lines[3] = f"/{frames[3].image} /{frames[3].mask} 0 0 0 0"          # flags its lines file disagrees with
    cv2.imwrite(str(root / frames[4].mask), np.zeros((10, 10), np.uint8))  # a shipped label of the wrong size
    (root / frames[5].mask).unlink()                                     # no shipped label: drawn from the lines
    cv2.imwrite(str(root / frames[6].image), np.zeros((288, 800, 3), np.uint8))  # not CULane's size
    lines.append(lines[7])                                               # the same frame twice
    lines.append("/driver_23_30frame/x.MP4/00000.jpg /x.png 1 1")        # a line that is not a list line
    train_list.write_text("".join(f"{line}\n" for line in lines))

    report = preprocess_culane(tmp_path, workers=2)
    reasons = {(q["line"], q["reason"]) for q in report.manifest["quarantine"]}
    assert reasons == {(1, "missing_image"), (2, "bad_lines_file"), (3, "missing_lines_file"),
                       (4, "existence_mismatch"), (5, "bad_seg_label"), (7, "wrong_image_size"),
                       (10, "duplicate_image"), (11, "bad_list_line")}, reasons
    detail = next(q["detail"] for q in report.manifest["quarantine"] if q["line"] == 2)
    assert detail == f"{lines_path_for(frames[1].image)}, line 1: 'x' is not a number; each line is one lane as " \
                     "'x y' pairs of image pixels"
    assert report.counts["by_split"] == {"train": {"read": 11, "kept": 3, "quarantined": 8},
                                         "val": {"read": 3, "kept": 3, "quarantined": 0},
                                         "test": {"read": 9, "kept": 9, "quarantined": 0}}
    kept = {line.split()[0]: line.split() for line in (root / "seg_label/list/train_gt.txt").read_text().splitlines()}
    assert set(kept) == {f"/{frames[index].image}" for index in (5, 7, 8)}
    drawn = kept[f"/{frames[5].image}"][1].lstrip("/")
    assert drawn.startswith("seg_label/") and kept[f"/{frames[7].image}"][1] == f"/{frames[7].mask}"
    slots = lanes_in_slots([[tuple(p) for p in lane] for lane in
                            parse_lines((root / lines_path_for(frames[5].image)).read_text())], frames[5].existence)
    np.testing.assert_array_equal(cv2.imread(str(root / drawn), cv2.IMREAD_UNCHANGED), seg_label(slots))
    assert len((root / "seg_label/list/test_gt.txt").read_text().splitlines()) == 9

    again = preprocess_culane(root, workers=1)
    assert again.skipped and again.dataset_version == report.dataset_version
    (root / lines_path_for(frames[8].image)).write_text("100 590 200 400\n")
    changed = preprocess_culane(root, workers=1)
    assert not changed.skipped and changed.dataset_version != report.dataset_version
    assert is_culane(tmp_path) and not is_culane(root / "list")


def test_lanes_of_a_test_frame_take_slots_by_where_they_meet_the_bottom_of_the_image() -> None:
    far_left, left, right = [(100.0, 590.0), (600.0, 300.0)], [(700.0, 590.0), (780.0, 300.0)], \
        [(1000.0, 590.0), (850.0, 300.0)]
    assert slots_by_position([right, far_left, left]) == [far_left, left, right, []]
    assert slots_by_position([[(300.0, 590.0), (500.0, 300.0)], far_left, left]) == \
        [[(300.0, 590.0), (500.0, 300.0)], left, [], []]  # the two nearest the centre on the left
    assert slots_by_position([[(5.0, 5.0)]]) == [[], [], [], []]  # one point is no lane


def test_a_culane_release_served_over_http_is_prepared_with_its_lists_and_scenario_splits(
        file_server: FileServer, tmp_path: Path) -> None:
    """The archives as CULane ships them (a .tar.gz per driver folder, the labels', the lists'), each wrapping
    its one folder: assembled into one root, prepared into the same lists as TuSimple's, and cached."""
    generate(tmp_path / "release", train=6, val=2, test=9, seed=7)
    artifacts = []
    for packed in pack_artifacts(tmp_path / "release", tmp_path / "archives"):
        name = Path(packed["path"]).name
        file_server.files[name] = Path(packed["path"]).read_bytes()
        artifacts.append(Artifact(file_server.url(name), packed["sha256"], "archive"))
    assert [artifact.name for artifact in artifacts] == [
        "driver_100_30frame.tar.gz", "driver_161_90frame.tar.gz", "driver_23_30frame.tar.gz",
        "driver_37_30frame.tar.gz", "laneseg_label_w16.tar.gz", "list.tar.gz"]
    volume = tmp_path / "volume"
    first = prepare_dataset(artifacts, volume, workers=2)
    assert first.counts["by_split"] == {"train": {"read": 6, "kept": 6, "quarantined": 0},
                                        "val": {"read": 2, "kept": 2, "quarantined": 0},
                                        "test": {"read": 9, "kept": 9, "quarantined": 0}}
    assert (first.root / "driver_23_30frame").is_dir() and (first.root / "laneseg_label_w16").is_dir()
    assert list(scenario_lists(first.root)) == list(SCENARIOS)
    manifest = json.loads((first.root / "manifest.json").read_text())
    assert manifest["dataset"] == "culane" and len(manifest["sources"]["artifacts"]) == 6
    for split in ("train", "val", "test"):
        for line in (first.root / "seg_label" / "list" / f"{split}_gt.txt").read_text().splitlines():
            image, mask, *flags = line.split()
            assert (first.root / image.lstrip("/")).is_file() and (first.root / mask.lstrip("/")).is_file()
            assert len(flags) == 4
    again = prepare_dataset(list(reversed(artifacts)), volume, workers=2)
    assert (again.downloaded, again.extracted, again.preprocessed) == (False, False, False)
    assert again.dataset_version == first.dataset_version


def test_culanes_corrected_annotations_replace_the_shipped_lines_files_as_an_update(tmp_path: Path) -> None:
    """CULane's annotations_new.tar.gz corrects lines files of train and val: given as an update it replaces them
    (in whatever order the artifacts come) and their frames' masks are drawn from the corrected lines; as a plain
    archive the two disagree and it is refused, and two updates that disagree are refused too, since the dataset
    would depend on their order."""
    generate(tmp_path / "release", train=4, val=2, test=9, seed=7)
    artifacts = [Artifact(Path(packed["path"]).as_uri(), packed["sha256"], "archive")
                 for packed in pack_artifacts(tmp_path / "release", tmp_path / "archives")]
    image = (tmp_path / "release" / "list" / "train_gt.txt").read_text().split()[0].lstrip("/")
    lines = lines_path_for(image)
    shifted = format_lines([(x + 2, y) for x, y in lane]
                           for lane in parse_lines((tmp_path / "release" / lines).read_text()))

    def annotations(name: str, text: str) -> Path:
        corrected = tmp_path / name / lines
        corrected.parent.mkdir(parents=True)
        corrected.write_text(text)
        return tmp_path / "archives" / f"{name}.tar.gz"

    archive = annotations("annotations_new", shifted)
    update = Artifact(archive.as_uri(), pack_tar(tmp_path / "annotations_new" / lines.split("/")[0], archive),
                      "update")
    prepared = prepare_dataset([update, *artifacts], tmp_path / "volume", workers=1)
    assert (prepared.root / lines).read_text() == shifted != (tmp_path / "release" / lines).read_text()
    assert prepared.counts["by_split"]["train"] == {"read": 4, "kept": 4, "quarantined": 0}
    # The shipped label was drawn from the old lines: the frame's mask is drawn from the corrected ones, the
    # shipped file stays as it was, and every other frame keeps its shipped label.
    listed = [parse_gt_list_line(line) for line in (tmp_path / "release" / "list" / "train_gt.txt").read_text()
              .splitlines()]
    masks = {line.split()[0].lstrip("/"): line.split()[1].lstrip("/")
             for line in (prepared.root / "seg_label" / "list" / "train_gt.txt").read_text().splitlines()}
    assert masks == {entry.image: (f"seg_label/{entry.image.removesuffix('.jpg')}.png" if entry.image == image
                                   else entry.mask) for entry in listed}
    drawn = cv2.imread(str(prepared.root / masks[image]), cv2.IMREAD_UNCHANGED)
    expected = seg_label(lanes_in_slots(parse_lines(shifted), listed[0].existence))
    assert np.array_equal(drawn, expected)
    shipped = listed[0].mask
    assert (prepared.root / shipped).read_bytes() == (tmp_path / "release" / shipped).read_bytes()
    assert not np.array_equal(cv2.imread(str(prepared.root / shipped), cv2.IMREAD_UNCHANGED), expected)
    driver = lines.split("/")[0]
    with pytest.raises(ValueError, match=rf"'{re.escape(lines)}' is in both {driver}\.tar\.gz and "
                                         r"annotations_new\.tar\.gz with different contents"):
        prepare_dataset([*artifacts, Artifact(update.url, update.sha256, "archive")], tmp_path / "other")
    other = annotations("annotations_other", format_lines([[(1.0, 580.0), (9.0, 300.0)]]))
    second = Artifact(other.as_uri(), pack_tar(tmp_path / "annotations_other" / lines.split("/")[0], other), "update")
    with pytest.raises(ValueError, match="with different contents"):
        prepare_dataset([*artifacts, update, second], tmp_path / "third")
