"""Dataset preparation on a volume: fetch -> verify -> extract -> preprocess, each step cached.

Volume layout::

    <volume>/downloads/<artifact file name>    verified artifacts (resumable downloads)
    <volume>/datasets/<key>/                   the dataset: archives extracted, files placed; masks,
                                               lists and manifest.json inside

``<key>`` is the archive's sha256[:16] for a one-archive dataset, else a digest of every artifact's
(``training.data.sources.dataset_key``). Re-running with the same artifacts downloads, extracts and
preprocesses nothing and reports the same dataset version.

    python -m training.data.prepare --source URL --sha256 HEX --volume DIR           # one archive
    python -m training.data.prepare --archive URL HEX --archive URL HEX --file URL HEX --volume DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from training.data.archive import Part, assemble, extract, read_marker
from training.data.fetch import fetch
from training.data.preprocess import PrepareReport, preprocess
from training.data.sources import (
    Artifact,
    archive_name,
    dataset_key,
    is_single_archive,
    redact_url,
    validate_artifacts,
)
from training.signals import exit_on_sigterm

log = logging.getLogger("laneflow.data.prepare")

__all__ = ["Artifact", "PreparedDataset", "archive_name", "prepare_dataset", "redact_url"]


@dataclass(frozen=True)
class PreparedDataset:
    root: Path
    dataset_version: str
    counts: dict
    downloaded: bool
    extracted: bool
    preprocessed: bool
    artifacts: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "dataset_root": str(self.root),
            "dataset_version": self.dataset_version,
            "artifacts": self.artifacts,
            "counts": self.counts,
            "steps": {"downloaded": self.downloaded, "extracted": self.extracted,
                      "preprocessed": self.preprocessed},
        }


def _already_there(target: Path, artifacts: list[Artifact]) -> bool:
    """Extracted from exactly these artifacts before (or restored from a snapshot that was)."""
    marker = read_marker(target) or {}
    if is_single_archive(artifacts):
        return marker.get("archive_sha256") == artifacts[0].sha256
    return sorted(entry.get("sha256") for entry in marker.get("artifacts", [])) == sorted(a.sha256 for a in artifacts)


def prepare_dataset(artifacts: Sequence[Artifact], volume: str | Path, *, workers: int | None = None,
                    progress_interval: float = 10.0) -> PreparedDataset:
    """Make the dataset made of ``artifacts`` ready for training under ``volume``."""
    artifacts = validate_artifacts(artifacts)
    volume = Path(volume)
    target = volume / "datasets" / dataset_key(artifacts)
    if _already_there(target, artifacts):
        log.info("dataset from %s already on the volume; not downloading", ", ".join(a.name for a in artifacts))
        downloaded, extracted = False, False
    else:
        paths = []
        downloaded = False
        for artifact in artifacts:
            result = fetch(artifact.url, volume / "downloads" / artifact.name, artifact.sha256,
                           progress_interval=progress_interval, volume=volume)
            downloaded |= not result.cached
            paths.append(result.path)
        if is_single_archive(artifacts):
            extracted = extract(paths[0], target, artifacts[0].sha256, volume=volume)
        else:
            extracted = assemble([Part(path, a.sha256, a.kind) for path, a in zip(paths, artifacts, strict=True)],
                                 target, volume=volume)
    records = [artifact.record() for artifact in artifacts]
    report: PrepareReport = preprocess(target, workers=workers, sources_extra={"artifacts": records}, volume=volume)
    return PreparedDataset(report.root, report.dataset_version, report.counts, downloaded=downloaded,
                           extracted=extracted, preprocessed=not report.skipped, artifacts=records)


def artifacts_from_args(args: argparse.Namespace) -> list[Artifact]:
    """The artifacts the command line names: ``--source/--sha256`` (one archive), ``--archive``, ``--file``."""
    found: list[Artifact] = []
    if args.source or args.sha256:
        if not (args.source and args.sha256):
            raise ValueError("--source and --sha256 go together (one archive); or use --archive URL SHA256")
        found.append(Artifact(args.source, args.sha256, "archive"))
    found += [Artifact(url, digest, "archive") for url, digest in args.archive]
    found += [Artifact(url, digest, "file") for url, digest in args.file]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.data.prepare",
                                     description="Fetch, verify, extract and preprocess a TuSimple dataset.")
    parser.add_argument("--source", help="one archive's URL: https://, http:// or file:// (with --sha256)")
    parser.add_argument("--sha256", help="expected sha256 of --source")
    parser.add_argument("--archive", nargs=2, action="append", default=[], metavar=("URL", "SHA256"),
                        help="an archive of the dataset (repeat for train_set.zip, test_set.zip, ...)")
    parser.add_argument("--file", nargs=2, action="append", default=[], metavar=("URL", "SHA256"),
                        help="a single file of the dataset, placed at its root (e.g. test_label.json)")
    parser.add_argument("--volume", required=True, type=Path, help="folder standing for the dataset volume")
    parser.add_argument("--workers", type=int, default=None, help="preprocessing processes (default: all cores)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    exit_on_sigterm()
    try:
        prepared = prepare_dataset(artifacts_from_args(args), args.volume, workers=args.workers)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # One JSON line with an "event" key: orchestrators find it in mixed logs (a Kubernetes Job's, say).
    summary = {"event": "prepared", **prepared.summary(),
               "dataset_dir": str(prepared.root.resolve().relative_to(args.volume.resolve()))}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
