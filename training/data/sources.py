"""What a dataset is made of: artifacts, each a URL with the sha256 of its bytes (pure).

TuSimple is distributed as several artifacts, not one: ``train_set.zip`` (training clips and the three
``label_data_*.json``), ``test_set.zip`` (test clips and ``test_tasks_0627.json``) and ``test_label.json``
(the test ground truth, a single file). An artifact is either an archive, extracted into the dataset
folder, a file, placed there as it is, or an update: an archive whose files replace the same paths of the
others (CULane's ``annotations_new.tar.gz``, its corrected lines files of train and val). One archive on its
own — the usual mirror of ``train_set.zip`` — is a dataset too.
"""

from __future__ import annotations

import hashlib
import json
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath

from training.data.fetch import FetchError, validate_sha256, validate_url

KINDS = ("archive", "file", "update")


class SourceError(ValueError):
    """A dataset definition that cannot be prepared; the message names the artifact and the problem."""


def archive_name(url: str) -> str:
    """The file name a source URL is stored under (``train_set.zip`` for .../train_set.zip?sig=...)."""
    name = PurePosixPath(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).name
    if not name or name in (".", ".."):
        raise ValueError(f"source URL '{url}' does not end in a file name; point it at the archive itself")
    return name


def redact_url(url: str) -> str:
    """Drop query strings and credentials (SAS tokens, presigned signatures) before recording a URL."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


@dataclass(frozen=True)
class Artifact:
    """One downloadable piece of a dataset."""

    url: str
    sha256: str
    kind: str = "archive"

    @property
    def name(self) -> str:
        return archive_name(self.url)

    def record(self) -> dict[str, str]:
        """Safe to publish: the URL without query strings or credentials."""
        return {"name": self.name, "url": redact_url(self.url), "sha256": self.sha256, "kind": self.kind}


def validate_artifacts(artifacts: Iterable[Artifact]) -> list[Artifact]:
    """Normalised artifacts (lower-case digests), or an error naming the artifact and what to fix."""
    checked: list[Artifact] = []
    names: dict[str, int] = {}
    for index, artifact in enumerate(artifacts):
        where = f"dataset artifact {index + 1}"
        if artifact.kind not in KINDS:
            raise SourceError(f"{where}: kind '{artifact.kind}' must be one of {', '.join(KINDS)}")
        try:
            validate_url(artifact.url)
            digest = validate_sha256(artifact.sha256)
            name = archive_name(artifact.url)
        except (FetchError, ValueError) as exc:
            raise SourceError(f"{where}: {exc}") from None
        if name in names:
            raise SourceError(f"{where}: '{name}' is also the file name of artifact {names[name] + 1}; each artifact "
                              "is stored under its URL's file name, so they must differ")
        names[name] = index
        checked.append(Artifact(artifact.url, digest, artifact.kind))
    if not checked:
        raise SourceError("a dataset needs at least one artifact (an archive such as train_set.zip)")
    return checked


def is_single_archive(artifacts: list[Artifact]) -> bool:
    return len(artifacts) == 1 and artifacts[0].kind == "archive"


def dataset_key(artifacts: list[Artifact]) -> str:
    """The dataset's folder name on a volume: one archive keeps its digest's first 16 hex characters (as
    before artifacts were lists); several are keyed by all of theirs, in any order."""
    if is_single_archive(artifacts):
        return artifacts[0].sha256[:16]
    parts = sorted(f"{a.kind}:{a.sha256}:{a.name}" for a in artifacts)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


#: The variable the dataset stage passes its artifacts in, never its command line: a URL may carry a credential
#: (an Azure SAS, a presigned signature), and a command line is public (``ps``, ``/proc/<pid>/cmdline``, a pod
#: spec kept in etcd). Locally only the user's own processes read another's environment; on a cluster the
#: value comes from a Secret the pod spec only names.
SOURCES_ENV = "LANEFLOW_DATASET_SOURCES"


def sources_json(artifacts: Iterable[Artifact]) -> str:
    """The artifacts as the dataset stage passes them (``SOURCES_ENV``): a JSON list of kind, url, sha256."""
    return json.dumps([{"kind": a.kind, "url": a.url, "sha256": a.sha256} for a in artifacts])


def artifacts_from_json(text: str) -> list[Artifact]:
    """The artifacts ``sources_json`` wrote, or a ``SourceError`` saying what is wrong (never the URLs)."""
    try:
        items = json.loads(text)
    except ValueError as exc:
        raise SourceError(f"{SOURCES_ENV} is not JSON ({exc.msg} at character {exc.pos}); laneflow writes it as a "
                          "list of {kind, url, sha256}") from None
    fields = {"kind", "url", "sha256"}
    if not isinstance(items, list) or not all(isinstance(item, dict) and set(item) == fields
                                              and all(isinstance(item[f], str) for f in fields) for item in items):
        raise SourceError(f"{SOURCES_ENV} must be a JSON list of objects with exactly the string fields kind, url "
                          "and sha256")
    return [Artifact(item["url"], item["sha256"], item["kind"]) for item in items]
