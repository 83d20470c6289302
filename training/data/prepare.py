"""Dataset preparation on a volume: fetch -> verify -> extract -> preprocess, each step cached.

Volume layout::

    <volume>/downloads/<archive name>          verified archive (resumable download)
    <volume>/datasets/<sha256[:16]>/           extracted archive; masks, lists and manifest.json inside

Re-running with the same source does no download, no extraction and no preprocessing, and reports
the same dataset version. ``python -m training.data.prepare --source URL --sha256 HEX --volume DIR``
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from training.data.archive import extract, read_marker
from training.data.fetch import fetch, validate_sha256, validate_url
from training.data.preprocess import PrepareReport, preprocess

log = logging.getLogger("laneflow.data.prepare")


@dataclass(frozen=True)
class PreparedDataset:
    root: Path
    dataset_version: str
    archive_sha256: str
    counts: dict
    downloaded: bool
    extracted: bool
    preprocessed: bool

    def summary(self) -> dict:
        return {
            "dataset_root": str(self.root),
            "dataset_version": self.dataset_version,
            "archive_sha256": self.archive_sha256,
            "counts": self.counts,
            "steps": {"downloaded": self.downloaded, "extracted": self.extracted,
                      "preprocessed": self.preprocessed},
        }


def archive_name(url: str) -> str:
    """The file name a source URL is stored under (``train_set.zip`` for .../train_set.zip?sig=...)."""
    name = PurePosixPath(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).name
    if not name or name in (".", ".."):
        raise ValueError(f"source URL '{url}' does not end in a file name; point it at the archive itself")
    return name


def prepare_dataset(source_url: str, sha256: str, volume: str | Path, *, workers: int | None = None,
                    progress_interval: float = 10.0) -> PreparedDataset:
    """Make the dataset behind ``source_url`` ready for training under ``volume``."""
    digest = validate_sha256(sha256)
    validate_url(source_url)
    volume = Path(volume)
    archive = volume / "downloads" / archive_name(source_url)
    target = volume / "datasets" / digest[:16]
    marker = read_marker(target)
    if marker and marker.get("archive_sha256") == digest:
        # Extracted from this very archive before (or restored from a snapshot): nothing to download.
        log.info("dataset from archive %s already on the volume; not downloading", digest[:16])
        downloaded, extracted = False, False
    else:
        downloaded = not fetch(source_url, archive, digest, progress_interval=progress_interval).cached
        extracted = extract(archive, target, digest)
    report: PrepareReport = preprocess(
        target, workers=workers,
        sources_extra={"archive": {"name": archive.name, "sha256": digest, "url": redact_url(source_url)}},
    )
    return PreparedDataset(report.root, report.dataset_version, digest, report.counts,
                           downloaded=downloaded, extracted=extracted, preprocessed=not report.skipped)


def redact_url(url: str) -> str:
    """Drop query strings and credentials (SAS tokens, presigned signatures) before recording a URL."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.data.prepare",
                                     description="Fetch, verify, extract and preprocess a TuSimple archive.")
    parser.add_argument("--source", required=True, help="archive URL: https://, http:// or file://")
    parser.add_argument("--sha256", required=True, help="expected sha256 of the archive")
    parser.add_argument("--volume", required=True, type=Path, help="folder standing for the dataset volume")
    parser.add_argument("--workers", type=int, default=None, help="preprocessing processes (default: all cores)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        prepared = prepare_dataset(args.source, args.sha256, args.volume, workers=args.workers)
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
