"""Dataset preparation on a volume: fetch -> verify -> extract -> preprocess, each step cached.

Volume layout::

    <volume>/downloads/<artifact file name>    verified artifacts (resumable downloads)
    <volume>/datasets/<key>/                   the dataset: archives extracted, files placed; masks,
                                               lists and manifest.json inside

``<key>`` is the archive's sha256[:16] for a one-archive dataset, else a digest of every artifact's
(``training.data.sources.dataset_key``). Re-running with the same artifacts downloads, extracts and
preprocesses nothing and reports the same dataset version. Preparers of one dataset on one volume take
turns (an ``flock`` under ``<volume>/.laneflow/locks/``): the second waits and then finds it ready.

    python -m training.data.prepare --source URL --sha256 HEX --volume DIR           # one archive
    python -m training.data.prepare --archive URL HEX --archive URL HEX --file URL HEX --volume DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from training.data.archive import Part, assemble, extract, read_marker
from training.data.fetch import MAX_DOWNLOAD_BYTES, fetch
from training.data.lock import holding, lock_file
from training.data.preprocess import PrepareReport, preprocess
from training.data.preprocess_culane import is_culane, preprocess_culane
from training.data.redact import RedactingFormatter, redact_text
from training.data.sources import (
    SOURCES_ENV,
    Artifact,
    archive_name,
    artifacts_from_json,
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
                    progress_interval: float = 10.0, max_download_bytes: int = MAX_DOWNLOAD_BYTES) -> PreparedDataset:
    """Make the dataset made of ``artifacts`` ready for training under ``volume``.

    One preparer at a time per volume and dataset (``training.data.lock``): a second one waits, saying for
    whom, and then finds the dataset ready. While it downloads and extracts, a preparer also holds the lock of
    each of its downloads (taken in name order, so two datasets sharing a file name cannot deadlock): another
    dataset with a file of the same name never writes that ``.part`` or replaces that file meanwhile."""
    artifacts = validate_artifacts(artifacts)
    volume = Path(volume)
    key = dataset_key(artifacts)
    target = volume / "datasets" / key
    what = f"preparation of dataset {key} on {volume}"
    with holding(lock_file(volume, "dataset", key), what):
        if _already_there(target, artifacts):
            log.info("dataset from %s already on the volume; not downloading", ", ".join(a.name for a in artifacts))
            downloaded, extracted = False, False
        else:
            with ExitStack() as downloads:
                for name in sorted(a.name for a in artifacts):
                    downloads.enter_context(holding(lock_file(volume, "download", name), f"{what} (download {name})"))
                downloaded, extracted = _fetch_and_extract(artifacts, volume, target, progress_interval,
                                                           max_download_bytes)
        records = [artifact.record() for artifact in artifacts]
        prepare = preprocess_culane if is_culane(target) else preprocess  # CULane's lists, or TuSimple's labels
        report: PrepareReport = prepare(target, workers=workers, sources_extra={"artifacts": records}, volume=volume)
    return PreparedDataset(report.root, report.dataset_version, report.counts, downloaded=downloaded,
                           extracted=extracted, preprocessed=not report.skipped, artifacts=records)


def _fetch_and_extract(artifacts: list[Artifact], volume: Path, target: Path, progress_interval: float,
                       max_download_bytes: int) -> tuple[bool, bool]:
    """Download (or reuse) every artifact, then extract them into ``target``: (downloaded, extracted)."""
    paths = []
    downloaded = False
    for artifact in artifacts:
        result = fetch(artifact.url, volume / "downloads" / artifact.name, artifact.sha256,
                       progress_interval=progress_interval, volume=volume, max_bytes=max_download_bytes)
        downloaded |= not result.cached
        paths.append(result.path)
    if is_single_archive(artifacts):
        return downloaded, extract(paths[0], target, artifacts[0].sha256, volume=volume)
    return downloaded, assemble([Part(path, a.sha256, a.kind) for path, a in zip(paths, artifacts, strict=True)],
                                target, volume=volume)


def artifacts_from_args(args: argparse.Namespace) -> list[Artifact]:
    """The artifacts the command line names: ``--source/--sha256`` (one archive), ``--archive``, ``--file``; with
    ``--sources-from-env``, those of ``SOURCES_ENV`` first (how laneflow passes them: a URL may hold a credential)."""
    found: list[Artifact] = []
    if args.sources_from_env:
        if SOURCES_ENV not in os.environ:
            raise ValueError(f"--sources-from-env: {SOURCES_ENV} is not set; it holds the artifacts as a JSON list of "
                             "{kind, url, sha256}")
        found += artifacts_from_json(os.environ[SOURCES_ENV])
    if args.source or args.sha256:
        if not (args.source and args.sha256):
            raise ValueError("--source and --sha256 go together (one archive); or use --archive URL SHA256")
        found.append(Artifact(args.source, args.sha256, "archive"))
    found += [Artifact(url, digest, "archive") for url, digest in args.archive]
    found += [Artifact(url, digest, "file") for url, digest in args.file]
    found += [Artifact(url, digest, "update") for url, digest in args.update]
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
    parser.add_argument("--update", nargs=2, action="append", default=[], metavar=("URL", "SHA256"),
                        help="an archive whose files replace the same paths of the others (CULane's "
                             "annotations_new.tar.gz)")
    parser.add_argument("--sources-from-env", action="store_true",
                        help=f"read the artifacts from {SOURCES_ENV} (a JSON list of kind, url, sha256), keeping "
                             "credentials in their URLs off the command line")
    parser.add_argument("--volume", required=True, type=Path, help="folder standing for the dataset volume")
    parser.add_argument("--workers", type=int, default=None, help="preprocessing processes (default: all cores)")
    parser.add_argument("--max-download-gib", type=float, default=MAX_DOWNLOAD_BYTES / 2**30,
                        help="refuse (and remove) a download larger than this many GiB (default: %(default).0f)")
    args = parser.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(RedactingFormatter("%(asctime)s %(name)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    exit_on_sigterm()
    try:
        if not (args.max_download_gib > 0 and math.isfinite(args.max_download_gib)):
            raise ValueError(f"--max-download-gib must be a positive number of GiB, not {args.max_download_gib}")
        prepared = prepare_dataset(artifacts_from_args(args), args.volume, workers=args.workers,
                                   max_download_bytes=int(args.max_download_gib * 2**30))
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {redact_text(str(exc))}", file=sys.stderr)
        return 2
    # One JSON line with an "event" key: orchestrators find it in mixed logs (a Kubernetes Job's, say).
    summary = {"event": "prepared", **prepared.summary(),
               "dataset_dir": str(prepared.root.resolve().relative_to(args.volume.resolve()))}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
