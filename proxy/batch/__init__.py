"""Batch jobs: the OpenAI Files and Batch API over a durable store, run line by
line through the scheduler as batch-class work.

- :mod:`proxy.batch.store`: the store's contract; :mod:`proxy.batch.sqlite` its
  SQLite backend (one replica), :mod:`proxy.batch.postgres` its PostgreSQL backend
  (several replicas share the jobs).
- :mod:`proxy.batch.lines`: input lines checked, requests built, result lines.
- :mod:`proxy.batch.health`: the store's outages noticed, answered fast, waited out.
- :mod:`proxy.batch.runner`: drives every active job, and counts it in the metrics.
- :mod:`proxy.batch.estimate`: when a job will be done, from its lines per busy second.
- :mod:`proxy.batch.quality`: an answered line judged ``valid`` or ``invalid``.
- :mod:`proxy.batch.view`: the active jobs as ``/metrics`` and ``/status`` show them.
- :mod:`proxy.batch.routes`: the HTTP routes.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from proxy.batch.health import GuardedStore
from proxy.batch.routes import BatchAPI, install_batch_routes
from proxy.batch.runner import BatchRunner, Complete, RunnerLimits
from proxy.batch.sqlite import SQLiteStore
from proxy.batch.store import BatchStore
from proxy.batch.view import deadlines
from proxy.config import Settings
from proxy.metrics import ProxyMetrics
from proxy.scheduler.limits import TenantMeter

__all__ = ["BatchAPI", "build_batch", "install_batch_routes"]
OPEN_TIMEOUT_S = 5.0  # PostgreSQL at start: longer, and the proxy starts without it


async def build_batch(
    settings: Settings,
    complete: Complete,
    metrics: ProxyMetrics,
    models_known: Callable[[], bool],
    meter: TenantMeter | None = None,
) -> BatchAPI | None:
    """The store (opened: schema created or migrated) and the runner, or None when
    the store is not set (``batch_store_path`` for SQLite, ``batch_dsn`` for
    PostgreSQL). ``models_known``: whether every engine's models are known (the
    runner feeds no line before); ``meter``: the tenants' use of their limits, the
    HTTP edge's (a job's lines count against its tenant's limits with its other
    requests)."""
    store = _guarded_store(settings)
    if store is None:
        return None
    await store.open()
    limits = RunnerLimits(
        window=settings.batch.window,
        max_attempts=settings.batch.max_attempts,
        backoff_s=settings.batch.retry_backoff_s,
        max_lines=settings.batch.max_lines,
        lease_s=settings.batch.lease_s,
        max_line_bytes=settings.edge.max_body_bytes,
    )
    runner = BatchRunner(
        store,
        complete,
        metrics.batch,
        limits,
        time.time,
        models_known,
        owner=f"{socket.gethostname()}-{os.getpid()}",
        tenant_of=settings.access.tenant,
        meter=meter,
        limited=metrics.tenants.limited,
    )
    metrics.batch.attach(store.health, partial(deadlines, runner))
    return BatchAPI(settings, store, runner)


def _guarded_store(settings: Settings) -> GuardedStore | None:
    """The configured backend behind its outage guard (not yet opened); None when
    no store is set."""
    backend: BatchStore
    timeout_s: float | None = settings.batch.store_timeout_s
    if settings.batch.store == "postgres" and settings.batch.dsn:
        import psycopg  # loads only when used

        from proxy.batch.postgres import PostgresStore

        backend = PostgresStore(settings.batch.dsn, time.time, settings.batch.pool_size)
        outages: tuple[type[BaseException], ...] = (
            psycopg.OperationalError,
            psycopg.InterfaceError,
        )
    elif settings.batch.store == "sqlite" and settings.batch.store_path:
        exclusive = settings.replicas.workers == 1  # else the workers share the file
        backend = SQLiteStore(Path(settings.batch.store_path), time.time, exclusive=exclusive)
        outages = (sqlite3.OperationalError,)
        timeout_s = None  # its calls run on a thread, which cannot be cut short
    else:
        return None
    return GuardedStore(
        backend,
        time.monotonic,
        timeout_s=timeout_s,
        outage_errors=outages,
        open_timeout_s=None if timeout_s is None else OPEN_TIMEOUT_S,
    )
