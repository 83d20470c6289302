"""``dataset_watch``: notice a new dataset drop in the data team's index and announce it.

Run on an interval (deployment ``dataset_watch``). The first look at an index takes the newest version
it lists as the baseline and announces nothing (the nightly retrain trains on the newest anyway); after
that, a version published later than the newest one seen is announced as the event
``laneflow.dataset.published``, whose payload's ``source`` is exactly that version's artifacts: the
``nightly`` deployment's trigger starts a retrain on it. What was seen is a Prefect variable
(``laneflow-dataset-watch-<hash of the index URL>``), visible and resettable in the UI.

A bad index (not JSON, a missing sha256, an http:// artifact...) fails the run naming the problem and
announces nothing.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.events import emit_event
from prefect.variables import Variable

from flows.params import check_one_query, with_secret_query
from tasks.dataset_index import DatasetRelease, newest, parse_index, read_index, redact
from tasks.retry import RETRY_POLICY

PUBLISHED_EVENT = "laneflow.dataset.published"


def watch_variable(index_url: str) -> str:
    """The Prefect variable remembering what the watch has seen of one index."""
    return "laneflow-dataset-watch-" + hashlib.sha256(redact(index_url).encode()).hexdigest()[:12]


def index_resource(index_url: str) -> dict[str, str]:
    """The event's resource: one per index (the nightly trigger matches laneflow.dataset-index.*)."""
    return {"prefect.resource.id": f"laneflow.dataset-index.{watch_variable(index_url).rsplit('-', 1)[1]}",
            "prefect.resource.name": redact(index_url)}


def to_announce(releases: list[DatasetRelease], memory: dict[str, Any] | None) -> list[DatasetRelease]:
    """Versions published after the newest one seen (pure); none on the first look, which is the baseline."""
    if not memory or not memory.get("published"):
        return []
    seen = datetime.fromisoformat(str(memory["published"]))
    return [release for release in releases if release.published > seen and release.version != memory.get("version")]


@task(name="read_dataset_versions", task_run_name="read-index", **RETRY_POLICY)
def read_dataset_versions(index_url: str) -> list[DatasetRelease]:
    """Every version the index lists, checked; network errors are retried, a bad index is not."""
    return parse_index(read_index(index_url), index_url)


@flow(name="dataset_watch")
def dataset_watch(index: str, index_query_secret: str | None = None) -> dict[str, Any]:
    """Read the dataset index; announce a version published since the last look.

    Args:
        index: URL of the dataset index (https://, or file:// for a local one); docs/how-to/nightly.md
            shows its format
        index_query_secret: name of a Prefect Secret block holding the index URL's query string (a SAS
            token), which then stays out of the run's parameters
    """
    logger = get_run_logger()
    check_one_query(index, index_query_secret, "index_query_secret")
    # Checked as a training run's source would be (parse_index).
    releases = read_dataset_versions(with_secret_query(index, index_query_secret, "index_query_secret"))
    latest = newest(releases)
    name = watch_variable(index)
    memory = Variable.get(name, default=None)
    memory = memory if isinstance(memory, dict) and memory.get("published") else None  # else a first look
    announce = to_announce(releases, memory)
    if memory is None:
        logger.info("first look at %s: %d version(s), newest %s; versions published after it will start a "
                    "retrain", redact(index), len(releases), latest.version)
    elif not announce:
        logger.info("no new dataset version in %s (newest %s)", redact(index), latest.version)
    else:
        chosen = newest(announce)
        emit_event(PUBLISHED_EVENT, resource=index_resource(index),
                   payload={**chosen.record(index), "source": chosen.source(),
                            "new_versions": [release.version for release in announce]})
        logger.info("announced dataset version %s of %s (%s new: %s)", chosen.version, redact(index),
                    len(announce), ", ".join(release.version for release in announce))
    # After the event: a crash in between announces the version again next time, never loses it. The
    # newest ever seen stays the mark (an index that drops its latest entry does not re-announce older ones).
    if memory is None or announce or datetime.fromisoformat(str(memory["published"])) < latest.published:
        Variable.set(name, latest.record(index), overwrite=True)
    return {"index": redact(index), "newest": latest.version,
            "announced": newest(announce).version if announce else None,
            "new_versions": [release.version for release in announce]}
