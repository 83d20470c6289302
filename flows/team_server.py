"""A team's Prefect server, as Prefect documents self-hosting at scale: PostgreSQL for the database and Redis
for what one process otherwise keeps in memory — the event bus (``prefect_redis.messaging``), causal ordering of
events (``prefect_redis.ordering``), concurrency leases (``prefect_redis.lease_storage``: the ``gpu`` slots of
runs in flight survive an API process's restart and are seen by every replica), the background-task queue
(Prefect's docket) and the workers' clean-up queue (``prefect_redis.cleanup_queue``). Then the API can run as
several replicas (``prefect server start --no-services``) beside one process of background services (``prefect
server services start``: the scheduler, late runs, triggers...), and any of them can be restarted without losing a
lease or a run.

``laneflow serve --database URL --redis URL`` (or ``LANEFLOW_SERVER_DATABASE`` / ``LANEFLOW_SERVER_REDIS``) starts
one API process and the services on this machine; on a cluster, Prefect's Helm chart with
``deployments/prefect-server-values.yaml`` runs the same split. A URL with a password is taken from the
environment only: on the command line it would show in every process list.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

DATABASE_ENV = "LANEFLOW_SERVER_DATABASE"
REDIS_ENV = "LANEFLOW_SERVER_REDIS"
#: Where prefect-redis keeps concurrency leases: what a restarted or second API process reads them from.
REDIS_LEASE_STORAGE = "prefect_redis.lease_storage"


class BackendsInvalid(ValueError):
    """The database or Redis URL given cannot be used; the message says which and what to give instead."""


@dataclass(frozen=True)
class TeamBackends:
    """Where a team's server keeps its state: a PostgreSQL database and a Redis."""

    database_url: str
    redis_url: str

    def settings(self) -> dict[str, str]:
        """The environment of every process of the server (API replicas and services) for these backends."""
        return {
            "PREFECT_API_DATABASE_CONNECTION_URL": self.database_url,
            "PREFECT_MESSAGING_BROKER": "prefect_redis.messaging",
            "PREFECT_MESSAGING_CACHE": "prefect_redis.messaging",
            "PREFECT_SERVER_EVENTS_CAUSAL_ORDERING": "prefect_redis.ordering",
            "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": REDIS_LEASE_STORAGE,
            "PREFECT_REDIS_MESSAGING_URL": self.redis_url,
            "PREFECT_SERVER_DOCKET_URL": self.redis_url,
            # The services queue a cancelled run's clean-up for its worker, whose websocket any API process may
            # hold: in memory (the default) the message never reaches a worker on another process.
            "PREFECT_SERVER_WORKER_CHANNEL_CLEANUP_QUEUE_STORAGE": "prefect_redis.cleanup_queue",
            "PREFECT_REDIS_WORKER_CLEANUP_QUEUE_URL": self.redis_url,
        }


def _database(url: str) -> str:
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("postgresql", "postgres", "postgresql+asyncpg") or not parsed.hostname:
        raise BackendsInvalid(f"the database URL must be PostgreSQL's, e.g. postgresql://prefect@db.example.org:5432/"
                              f"prefect (Prefect keeps a team's server only there); got scheme "
                              f"'{parsed.scheme or '(none)'}'")
    if not parsed.path.strip("/"):
        raise BackendsInvalid("the database URL names no database: end it with /<database>, e.g. .../prefect")
    return urllib.parse.urlunsplit(("postgresql+asyncpg", *parsed[1:]))  # Prefect's server drives it with asyncpg


def _redis(url: str) -> str:
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("redis", "rediss", "redis+sentinel", "rediss+sentinel") or not parsed.netloc:
        raise BackendsInvalid(f"the Redis URL must be redis://host:port/db (rediss:// with TLS); got "
                              f"'{parsed.scheme or '(none)'}://...'")
    return url


def team_backends(database: str | None, redis: str | None,
                  environ: Mapping[str, str] = os.environ) -> TeamBackends | None:
    """The backends from ``--database``/``--redis`` (or ``LANEFLOW_SERVER_DATABASE``/``LANEFLOW_SERVER_REDIS``), None
    for neither (the embedded SQLite server). Both or neither; a password only from the environment."""
    for flag, value, variable in (("--database", database, DATABASE_ENV), ("--redis", redis, REDIS_ENV)):
        if value and urllib.parse.urlsplit(value).password:
            raise BackendsInvalid(f"{flag} carries a password, which every process list would show: put the URL in "
                                  f"${variable} instead (and leave out {flag})")
    database = database or environ.get(DATABASE_ENV) or None
    redis = redis or environ.get(REDIS_ENV) or None
    if database is None and redis is None:
        return None
    if database is None or redis is None:
        missing = "--database (or $" + DATABASE_ENV + ")" if database is None else "--redis (or $" + REDIS_ENV + ")"
        raise BackendsInvalid(f"a team's server needs both PostgreSQL and Redis: give {missing} too (Redis keeps "
                              "the leases and events several API processes share; PostgreSQL the runs)")
    return TeamBackends(_database(database), _redis(redis))
