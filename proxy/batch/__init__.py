"""Batch jobs: the OpenAI Files and Batch API over a durable store, run line by
line through the scheduler as batch-class work.

- :mod:`proxy.batch.store`: the store's contract; :mod:`proxy.batch.sqlite` its
  SQLite backend.
- :mod:`proxy.batch.lines`: input lines checked, requests built, result lines.
- :mod:`proxy.batch.runner`: drives every active job; its metrics.
- :mod:`proxy.batch.estimate`: when a job will be done, from recent throughput.
- :mod:`proxy.batch.view`: the active jobs on ``/metrics`` and ``/status``.
- :mod:`proxy.batch.routes`: the HTTP routes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from proxy.batch.routes import BatchAPI, install_batch_routes
from proxy.batch.runner import BatchMetrics, BatchRunner, Complete, RunnerLimits
from proxy.batch.sqlite import SQLiteStore
from proxy.batch.view import EstimateCollector
from proxy.config import Settings
from proxy.metrics import ProxyMetrics

__all__ = ["BatchAPI", "build_batch", "install_batch_routes"]


async def build_batch(
    settings: Settings,
    complete: Complete,
    metrics: ProxyMetrics,
    models_known: Callable[[], bool],
) -> BatchAPI | None:
    """The store (opened: schema created or checked) and the runner, or None when
    ``batch_store_path`` is not set. ``models_known``: whether every engine's models
    are known (the runner feeds no line before)."""
    if not settings.batch_store_path:
        return None
    store = SQLiteStore(Path(settings.batch_store_path), time.time)
    await store.open()
    limits = RunnerLimits(
        window=settings.batch_window,
        max_attempts=settings.batch_max_attempts,
        backoff_s=settings.batch_retry_backoff_s,
        max_lines=settings.batch_max_lines,
    )
    runner = BatchRunner(
        store,
        complete,
        BatchMetrics(metrics.registry, metrics.batch_records),
        limits,
        time.time,
        models_known,
    )
    metrics.registry.register(EstimateCollector(runner))
    return BatchAPI(settings, store, runner)
