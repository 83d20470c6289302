"""Dataset index: the JSON a data team publishes to say "here is a new drop of the dataset".

Nightly retrains with an index source train on the newest version it lists; the ``dataset_watch`` flow
reads it on an interval and announces versions it has not seen. The format (docs/how-to/nightly.md)::

    {"datasets": [
        {"version": "2026-11-30",
         "published": "2026-11-30T18:00:00Z",
         "artifacts": [{"url": "https://data.example.com/tusimple/2026-11-30/train_set.zip",
                        "sha256": "<64 hex>", "kind": "archive"}, ...]}]}

``version``: a unique name (letters, digits, ``.``, ``_``, ``-``; at most 64); ``published``: ISO 8601 with
a time zone, which orders the versions (the newest is the latest ``published``); ``artifacts``: what a
``source`` takes (``kind`` defaults to ``archive``). An index read over the network and the artifacts it
lists must be ``https://``: the sha256s it carries pin what is trained on, so they must come from the
publisher unaltered. A ``file://`` index (a shared folder, the local demo) may list ``file://`` artifacts.

Parsing is pure (``parse_index``); ``read_index`` is the one edge that fetches.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from training.data.sources import KINDS as SOURCE_KINDS
from training.data.sources import redact_url as redact

VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")
KINDS = SOURCE_KINDS
INDEX_SCHEMES = ("https", "file")
READ_TIMEOUT_S = 30.0
MAX_INDEX_BYTES = 8 * 1024 * 1024


class DatasetIndexError(ValueError):
    """The index cannot be used; the message names the index, the entry and what to fix."""


@dataclass(frozen=True)
class DatasetRelease:
    """One version of the dataset as the index lists it."""

    version: str
    published: datetime
    artifacts: tuple[dict[str, str], ...]

    def source(self) -> dict[str, Any]:
        """The ``source`` parameter of a training run on exactly this version."""
        return {"artifacts": [dict(artifact) for artifact in self.artifacts]}

    def record(self, index_url: str) -> dict[str, str]:
        """What lineage remembers about where the run's data came from."""
        return {"index": redact(index_url), "version": self.version, "published": self.published.isoformat()}


def check_index_url(url: str) -> str:
    """An index is read over https (or from a file); anything else is refused before it is fetched."""
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in INDEX_SCHEMES:
        raise DatasetIndexError(f"dataset index {redact(url)!r}: must be an https:// URL (or file:// for a local "
                                f"index), not {scheme + '://' if scheme else 'a bare path'}")
    return url


def parse_index(text: str, index_url: str) -> list[DatasetRelease]:
    """Every version the index lists, oldest first; DatasetIndexError naming the first problem."""
    where = f"dataset index {redact(index_url)}"
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetIndexError(f"{where}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise DatasetIndexError(f"{where}: not JSON this parser reads (nested too deeply)") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise DatasetIndexError(f"{where}: not JSON this parser reads ({str(exc)[:120]})") from None
    if not isinstance(document, dict) or not isinstance(document.get("datasets"), list):
        raise DatasetIndexError(f'{where}: expected an object with a "datasets" list (docs/how-to/nightly.md '
                                'shows the format)')
    if not document["datasets"]:
        raise DatasetIndexError(f"{where}: lists no datasets")
    local = urllib.parse.urlsplit(index_url).scheme == "file"
    releases = [_release(entry, f"{where}: datasets[{number}]", local)
                for number, entry in enumerate(document["datasets"])]
    versions = [release.version for release in releases]
    if duplicated := sorted({version for version in versions if versions.count(version) > 1}):
        raise DatasetIndexError(f"{where}: version {duplicated[0]!r} is listed more than once")
    return sorted(releases, key=lambda release: release.published)


def _release(entry: Any, where: str, local: bool) -> DatasetRelease:
    if not isinstance(entry, dict):
        raise DatasetIndexError(f"{where}: expected an object with version, published and artifacts")
    version = entry.get("version")
    if not isinstance(version, str) or not VERSION.match(version):
        raise DatasetIndexError(f"{where}.version: {version!r} is not a version name (letters, digits, '.', '_', "
                                "'-'; at most 64)")
    where = f"{where} ({version})"
    published = entry.get("published")
    try:
        when = datetime.fromisoformat(published) if isinstance(published, str) else None
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise DatasetIndexError(f"{where}.published: {published!r} is not an ISO 8601 time with a time zone "
                                "(e.g. 2026-11-30T18:00:00Z)")
    artifacts = entry.get("artifacts")
    if not isinstance(artifacts, list) or not artifacts:
        raise DatasetIndexError(f"{where}.artifacts: expected a non-empty list of {{url, sha256, kind}}")
    return DatasetRelease(version, when, tuple(_artifact(item, f"{where}.artifacts[{number}]", local)
                                               for number, item in enumerate(artifacts)))


def _artifact(item: Any, where: str, local: bool) -> dict[str, str]:
    if not isinstance(item, dict):
        raise DatasetIndexError(f"{where}: expected an object with url, sha256 and kind")
    url, sha256, kind = item.get("url"), item.get("sha256"), item.get("kind", "archive")
    if not isinstance(url, str) or not url:
        raise DatasetIndexError(f"{where}.url: missing")
    scheme = urllib.parse.urlsplit(url).scheme
    allowed = ("https", "file") if local else ("https",)
    if scheme not in allowed:
        raise DatasetIndexError(f"{where}.url: {redact(url)!r} must be https://"
                                + (" (or file:// in a local index)" if local else "") +
                                ": the index pins the artifacts' sha256, so they must come from the publisher "
                                "unaltered")
    if sha256 is None:
        raise DatasetIndexError(f"{where}.sha256: missing (every artifact needs its sha256)")
    if not isinstance(sha256, str) or not SHA256.match(sha256):
        raise DatasetIndexError(f"{where}.sha256: {sha256!r} is not 64 hex characters")
    if kind not in KINDS:
        raise DatasetIndexError(f"{where}.kind: {kind!r} is not one of {', '.join(KINDS)}")
    secret = item.get("query_secret")
    if secret is None:
        return {"url": url, "sha256": sha256.lower(), "kind": kind}
    # The artifact's query string (a SAS) in a Prefect Secret block of that name, as a run's own artifacts may
    # have it: the index, and the parameters of the runs it starts, then hold no credential.
    if not isinstance(secret, str) or not secret.strip():
        raise DatasetIndexError(f"{where}.query_secret: {secret!r} is not the name of a Prefect Secret block")
    if "?" in url:
        raise DatasetIndexError(f"{where}: url {redact(url)!r} has a query string and query_secret {secret!r} names "
                                "another: keep the query string in the Secret block only")
    return {"url": url, "sha256": sha256.lower(), "kind": kind, "query_secret": secret}


def newest(releases: list[DatasetRelease]) -> DatasetRelease:
    """The version a retrain uses: the one published last."""
    return max(releases, key=lambda release: release.published)


def unseen(releases: list[DatasetRelease], seen: set[str]) -> list[DatasetRelease]:
    """Versions not announced before, oldest first."""
    return [release for release in releases if release.version not in seen]


def read_index(url: str, timeout_s: float = READ_TIMEOUT_S) -> str:
    """The index's text: a file, or an https GET (redirects followed, at most MAX_INDEX_BYTES).

    OSError/httpx errors propagate: the caller's task retries what may be transient."""
    check_index_url(url)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file":
        path = Path(urllib.parse.unquote(parts.path))
        try:
            return path.read_text()
        except FileNotFoundError:
            raise DatasetIndexError(f"dataset index {url}: no such file") from None
    with httpx.Client(timeout=timeout_s, follow_redirects=True) as client, client.stream("GET", url) as response:
        if response.status_code in (401, 403, 404, 410):  # asking again will not help
            raise DatasetIndexError(f"dataset index {redact(url)}: HTTP {response.status_code}")
        response.raise_for_status()
        body = b""
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > MAX_INDEX_BYTES:
                raise DatasetIndexError(f"dataset index {redact(url)}: larger than {MAX_INDEX_BYTES} bytes; an "
                                        "index lists versions, not data")
    return body.decode("utf-8", errors="replace")


def release_for(index_url: str) -> tuple[DatasetRelease, list[DatasetRelease]]:
    """The newest version the index lists, and all of them (read now)."""
    releases = parse_index(read_index(index_url), index_url)
    return newest(releases), releases


def index_json(releases: list[DatasetRelease]) -> str:
    """An index document listing ``releases`` (what a data team publishes; the local demo writes one)."""
    return json.dumps({"datasets": [{"version": release.version, "published": release.published.isoformat(),
                                     "artifacts": [dict(artifact) for artifact in release.artifacts]}
                                    for release in releases]}, indent=2) + "\n"
