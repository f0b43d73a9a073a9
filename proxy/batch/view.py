"""The running jobs as others see them: their estimate gauges on ``/metrics`` and
their rows on ``/status`` (``GET /status/batches``).

The metrics read the runner's view of the active jobs as of its last poll (every
``poll_s``; a scrape does no store I/O), the status rows the store's; both the
runner's throughput. Reads: nothing changes.
"""

from __future__ import annotations

from proxy.batch.runner import BatchRunner
from proxy.batch.store import BatchRecord, Json
from proxy.metrics import Deadline


def job_row(runner: BatchRunner, batch: BatchRecord) -> Json:
    """One active job: its tenant, whether it waits for one of the tenant's
    ``batch_jobs``, progress, rate, estimate (``None`` where not measured yet) and
    the estimate's ``basis``."""
    done = batch.completed + batch.failed
    estimate = runner.estimate(batch)
    body = estimate.body() if estimate is not None else {}
    return {
        "id": batch.id,
        "tenant": batch.tenant,
        "waiting": runner.waiting(batch),
        "status": batch.status,
        "created_at": batch.created_at,
        "expires_at": batch.expires_at,
        "total": batch.total,
        "completed": batch.completed,
        "failed": batch.failed,
        "valid": batch.valid,
        "invalid": batch.invalid,
        "progress": done / batch.total if batch.total else 0.0,
        **body,
    }


async def jobs_body(runner: BatchRunner | None) -> Json:
    """``GET /status/batches``: ``{"enabled": bool, "jobs": [row, ...]}``, the active
    jobs oldest first."""
    if runner is None:
        return {"enabled": False, "jobs": []}
    active = await runner.store.active_batches()
    return {"enabled": True, "jobs": [job_row(runner, b) for b in active]}


def deadlines(runner: BatchRunner) -> list[Deadline]:
    """Each active job's completion window and estimate (None where not measured
    yet), for ``whoseturn_batch_expires_timestamp_seconds`` and
    ``whoseturn_batch_estimated_completion_timestamp_seconds``."""
    out = []
    for batch in runner.active:
        estimate = runner.estimate(batch)
        eta = estimate.estimated_completion_at if estimate is not None else None
        out.append(Deadline(batch.id, batch.expires_at, eta))
    return out
