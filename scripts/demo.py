"""The local demo: make a synthetic TuSimple archive offline, then prepare it like a real download.

Prints the dataset counts and version. Run through ``make demo``; safe to run again (everything
is cached: the second run downloads, extracts and preprocesses nothing).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from training.data.prepare import prepare_dataset
from training.data.synthetic import generate, pack_archive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path(".laneflow/demo"))
    parser.add_argument("--train", type=int, default=120)
    parser.add_argument("--val", type=int, default=30)
    parser.add_argument("--test", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    source_dir = args.workdir / "source" / f"synthetic-seed{args.seed}"
    archive = args.workdir / "source" / f"train_set-seed{args.seed}-{args.train}-{args.val}-{args.test}.zip"
    checksum_file = archive.with_name(archive.name + ".sha256")
    if not (archive.exists() and checksum_file.exists()):
        generate(source_dir, train=args.train, val=args.val, test=args.test, seed=args.seed)
        checksum_file.write_text(pack_archive(source_dir, archive) + "\n")
    sha256 = checksum_file.read_text().strip()

    prepared = prepare_dataset(archive.resolve().as_uri(), sha256, args.workdir / "volume")
    summary = prepared.summary()
    counts = summary["counts"]
    print()
    print(f"dataset version : {summary['dataset_version']}")
    print(f"dataset root    : {summary['dataset_root']}")
    print(f"archive sha256  : {summary['archive_sha256']}")
    print(f"records         : read {counts['read']}, kept {counts['kept']}, quarantined {counts['quarantined']}")
    for split, c in counts["by_split"].items():
        print(f"  {split:<5}         : read {c['read']}, kept {c['kept']}, quarantined {c['quarantined']}")
    print(f"steps           : {json.dumps(summary['steps'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
