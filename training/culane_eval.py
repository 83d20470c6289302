"""CULane evaluation over files: ``.lines.txt`` predictions against the ground truth, per scenario and in total.

What the official tool's ``Run.sh`` does, in one command: every scenario list of the test split
(``list/test_split/test<k>_<name>.txt``) scored on its own, and their sum as the official total (which counts
the crossroads frames' false positives); with no split lists, ``list/test.txt`` alone. A prediction is a
``.lines.txt`` per image under its own directory, at the image's path (``driver_…/<clip>.MP4/<frame>.lines.txt``);
an image without one has no lanes, as the official tool reads it. The per-image rule is
``training.culane_metric``.

    python -m training.culane_eval --data /data/datasets/<key> --predictions /data/runs/<run>/culane-test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from training.culane_metric import IOU_THRESHOLD, SCENARIOS, THRESHOLDS, Counts, Lane, parse_lines, score_image
from training.data.culane import lines_path_for

#: Where the lists are under a CULane root, as the dataset ships them.
SPLIT_DIR = Path("list/test_split")
TEST_LIST = Path("list/test.txt")


@dataclass(frozen=True)
class ListScore:
    """A list's counts at each threshold, summed over its images."""

    images: int
    counts: Mapping[float, Counts]

    @property
    def f1(self) -> float | None:
        return self.counts[IOU_THRESHOLD].f1

    @property
    def mean_f1(self) -> float | None:
        """The mean F1 over 0.5:0.95 (None when one of them is undefined)."""
        values = [self.counts[threshold].f1 for threshold in THRESHOLDS]
        return None if any(value is None for value in values) else sum(values) / len(values)

    def __add__(self, other: ListScore) -> ListScore:
        return ListScore(self.images + other.images,
                         {threshold: self.counts[threshold] + other.counts[threshold] for threshold in self.counts})

    def as_dict(self) -> dict:
        """IoU 0.5's counts and rates, F1 at 0.75 and the mean F1 over 0.5:0.95 (None where undefined)."""
        base = self.counts[IOU_THRESHOLD]
        return {"images": self.images, "tp": base.tp, "fp": base.fp, "fn": base.fn, "precision": base.precision,
                "recall": base.recall, "f1": base.f1, "f1_75": self.counts[0.75].f1, "mean_f1": self.mean_f1}


def empty_score() -> ListScore:
    return ListScore(0, {threshold: Counts() for threshold in THRESHOLDS})


def read_lanes(path: Path) -> list[Lane]:
    """A ``.lines.txt`` file's lanes; a missing file has none, as the official tool reads it."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return parse_lines(text, str(path))


def lines_path(root: Path, image: str) -> Path:
    """Where the ``.lines.txt`` of list entry ``image`` (``/driver_…/00000.jpg``, the first field of a line) is
    under ``root``."""
    return root / lines_path_for(image.split()[0])


def _score_images(images: Sequence[str], truth_root: Path, predicted_root: Path) -> ListScore:
    total = empty_score()
    for image in images:
        counts = score_image(read_lanes(lines_path(truth_root, image)), read_lanes(lines_path(predicted_root, image)))
        total += ListScore(1, counts)
    return total


def score_list(images: Iterable[str], truth_root: Path, predicted_root: Path, workers: int = 1) -> ListScore:
    """The summed counts of the images a list names (blank lines skipped), over ``workers`` processes."""
    entries = [image for image in images if image.strip()]
    if workers <= 1 or len(entries) < 64:
        return _score_images(entries, truth_root, predicted_root)
    chunks = [entries[start:start + 256] for start in range(0, len(entries), 256)]
    total = empty_score()
    with ProcessPoolExecutor(workers) as pool:
        for part in pool.map(_score_images, chunks, [truth_root] * len(chunks), [predicted_root] * len(chunks)):
            total += part
    return total


def score_lists(lists: Mapping[str, Sequence[str]], truth_root: Path, predicted_root: Path,
                workers: int = 1) -> dict[str, ListScore]:
    """Each named list's score (the scenarios) and, as ``"all"``, their sum — the official total."""
    scores = {name: score_list(images, truth_root, predicted_root, workers) for name, images in lists.items()}
    if scores:
        scores["all"] = sum(scores.values(), empty_score())
    return scores


def scenario_lists(data_root: Path) -> dict[str, list[str]]:
    """The scenario lists of a CULane root by name (``normal`` … ``night``), or ``{"test": …}`` when it has no
    split lists. A root with neither is an error that says what is looked for."""
    split = data_root / SPLIT_DIR
    found = {}
    for index, name in enumerate(SCENARIOS):
        path = split / f"test{index}_{name}.txt"
        if path.is_file():
            found[name] = path.read_text().splitlines()
    if found:
        return found
    if (data_root / TEST_LIST).is_file():
        return {"test": (data_root / TEST_LIST).read_text().splitlines()}
    raise FileNotFoundError(f"{data_root} has no CULane test lists: expected {SPLIT_DIR}/test<k>_<scenario>.txt "
                            f"(test0_normal.txt … test8_night.txt) or {TEST_LIST}; point --data at the folder "
                            "that holds list/")


def format_table(scores: Mapping[str, ListScore]) -> str:
    """A Markdown table: one row per list, F1 in percent; the crossroads show their false positives only."""
    def percent(value: float | None) -> str:
        return "—" if value is None else f"{100 * value:.2f}"

    rows = ["| list | images | TP | FP | FN | precision | recall | F1 | F1@0.75 | mF1 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, score in scores.items():
        figures = score.as_dict()
        if name == "cross":
            rows.append(f"| cross | {score.images} | | {figures['fp']} | | | | | | |")
            continue
        rows.append(f"| {name} | {score.images} | {figures['tp']} | {figures['fp']} | {figures['fn']} | "
                    f"{percent(figures['precision'])} | {percent(figures['recall'])} | {percent(figures['f1'])} | "
                    f"{percent(figures['f1_75'])} | {percent(figures['mean_f1'])} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Score CULane .lines.txt predictions per scenario as the official tool does; print a table and, with
    --json, write every figure."""
    parser = argparse.ArgumentParser(prog="python -m training.culane_eval", description=main.__doc__)
    parser.add_argument("--data", type=Path, required=True,
                        help="the CULane root: list/ and the ground-truth .lines.txt next to each image")
    parser.add_argument("--predictions", type=Path, required=True,
                        help="the predicted .lines.txt files, at the images' paths")
    parser.add_argument("--json", type=Path, help="write every list's figures here")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: every CPU)")
    args = parser.parse_args(argv)
    if not args.predictions.is_dir():
        parser.error(f"--predictions {args.predictions} is not a directory")
    try:
        scores = score_lists(scenario_lists(args.data), args.data, args.predictions, max(1, args.workers))
    except (FileNotFoundError, ValueError) as exc:
        print(f"culane_eval: {exc}", file=sys.stderr)
        return 2
    print(format_table(scores))
    if args.json:
        args.json.write_text(json.dumps({name: score.as_dict() for name, score in scores.items()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
