"""The runner: every active batch job, driven to its end through the scheduler.

For each job it claims the lines that have no result yet, a page at a time, in
order, under a lease it renews while it runs them (:meth:`BatchStore.claim`:
several replicas on one PostgreSQL store share a job so), and keeps at most
``window`` of them in the scheduler at once (memory and the scheduler's cost per
decision do not grow with the job); which of those run now is the scheduler's
decision. When no line is left to claim it waits for the lines others hold until
every line has a result; then one runner finalizes the job. Each line goes
through the same door as a ``/batch/v1/...`` request (admission → engine → relay, via
:meth:`proxy.api.forward.Forwarder.complete`); an engine error (5xx, 429) is
retried with backoff up to ``max_attempts``, then recorded in the error file.

A line's result is recorded once (see :mod:`proxy.batch.store`); a line whose
answer came but was not recorded before a crash runs again after the restart:
that is the one place an engine call may repeat, and so is a line whose lease ran
out while it ran (its runner stalled past ``lease_s``): another runner claims it.
Cancel and expiry stop the feeding, cancel the lines in flight (the scheduler forgets them, upstream
streams are closed) and finalize with what was recorded.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
from prometheus_client import CollectorRegistry, Counter, Gauge

from proxy.api.inputs import ChatRequest
from proxy.batch.lines import answered, line_request
from proxy.batch.store import (
    STATUSES,
    BatchRecord,
    BatchStore,
    Json,
    LineResult,
    PendingLine,
)

logger = logging.getLogger(__name__)
Complete = Callable[[ChatRequest, str], Awaitable[tuple[int, Json]]]


@dataclass(frozen=True, kw_only=True)
class RunnerLimits:
    window: int = 64
    max_attempts: int = 3
    backoff_s: float = 0.5
    poll_s: float = 0.2
    lease_s: float = 30.0


class BatchMetrics:
    """``whoseturn_batch_jobs{status}`` (registered here) and
    ``whoseturn_batch_records_total{status}`` (the proxy's metrics own it)."""

    def __init__(self, registry: CollectorRegistry, records: Counter) -> None:
        self.jobs = Gauge(
            "whoseturn_batch_jobs", "Batch jobs by status", ["status"], registry=registry
        )
        self.records = records

    def set_jobs(self, counts: dict[str, int]) -> None:
        for status in STATUSES:
            self.jobs.labels(status).set(counts.get(status, 0))

    def count(self, result: LineResult) -> None:
        if result.quality:
            self.records.labels(result.quality).inc()
        if not result.ok:
            self.records.labels("failed").inc()


class _Run:
    """One job being driven here: its cancel scope and how it is to end."""

    def __init__(self, scope: anyio.CancelScope) -> None:
        self.scope = scope
        self.outcome = "completed"

    def stop(self, outcome: str) -> None:
        if self.outcome == "completed":
            self.outcome = outcome
        self.scope.cancel()


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        complete: Complete,
        metrics: BatchMetrics,
        limits: RunnerLimits,
        now: Callable[[], float],
        models_known: Callable[[], bool] = lambda: True,
        owner: str = "",
    ) -> None:
        self.store = store
        self.owner = owner or f"runner-{uuid.uuid4().hex[:12]}"
        self.models_known = models_known
        self.complete = complete
        self.metrics = metrics
        self.limits = limits
        self._now = now
        self._runs: dict[str, _Run | None] = {}
        self._held: dict[str, set[int]] = {}  # lines claimed here, not yet recorded

    async def run(self) -> None:
        """Forever: start every active job not yet driven; keep the jobs gauge."""
        async with anyio.create_task_group() as group:
            while True:
                for batch in await self.store.active_batches():
                    if batch.id not in self._runs:
                        self._runs[batch.id] = None
                        group.start_soon(self._job, batch.id)
                self.metrics.set_jobs(await self.store.count_by_status())
                await anyio.sleep(self.limits.poll_s)

    def cancel(self, batch_id: str) -> None:
        """Stop a job driven here now (the store already says ``cancelling``)."""
        run = self._runs.get(batch_id)
        if run is not None:
            run.stop("cancelled")

    async def _job(self, batch_id: str) -> None:
        try:
            final = await self._drive(batch_id)
            done = await self.store.finalize(batch_id, final)
            logger.info(
                "batch %s %s: %d ok, %d failed of %d",
                batch_id, done.status, done.completed, done.failed, done.total,
            )  # fmt: skip
        except Exception:
            logger.exception("batch %s: the runner failed; it will try again", batch_id)
            await anyio.sleep(1.0)
        finally:
            self._runs.pop(batch_id, None)

    async def _drive(self, batch_id: str) -> str:
        """Run the job's remaining lines; the status to finalize with."""
        batch = await self.store.get_batch(batch_id)
        assert batch is not None
        if batch.status != "in_progress":
            return {"finalizing": "completed", "cancelling": "cancelled"}[batch.status]
        try:
            with anyio.CancelScope() as scope:
                run = self._runs[batch_id] = _Run(scope)
                async with anyio.create_task_group() as group:
                    group.start_soon(self._watch, batch, run)
                    group.start_soon(self._renew, batch_id)
                    await self._feed(batch)
                    group.cancel_scope.cancel()
        finally:
            self._held.pop(batch_id, None)
            with anyio.CancelScope(shield=True):
                await self.store.release(batch_id, self.owner)
        if run.outcome != "completed":
            return run.outcome
        if await self.store.set_status(batch_id, "finalizing", ("in_progress",)):
            return "completed"
        return await self._drive(batch_id)  # cancelled in the meantime

    async def _watch(self, batch: BatchRecord, run: _Run) -> None:
        """Expiry, and a cancel asked through another door than :meth:`cancel`."""
        while True:
            await anyio.sleep(self.limits.poll_s)
            if self._now() >= batch.expires_at:
                run.stop("expired")
                return
            current = await self.store.get_batch(batch.id)
            if current is None or current.status == "cancelling":
                run.stop("cancelled")
                return

    async def _renew(self, batch_id: str) -> None:
        """Keep this runner's leases on the job's lines it holds live."""
        while True:
            await anyio.sleep(self.limits.lease_s / 3)
            held = sorted(self._held.get(batch_id, ()))
            await self.store.renew(batch_id, self.owner, held, self.limits.lease_s)

    async def _feed(self, batch: BatchRecord) -> None:
        room = anyio.Semaphore(self.limits.window)
        async with anyio.create_task_group() as group:
            while True:
                page = await self._next_page(batch.id)
                for line in page:
                    await room.acquire()
                    group.start_soon(self._line, batch, line, room)
                if not page:
                    if await self._all_recorded(batch.id):
                        break
                    await anyio.sleep(self.limits.poll_s)  # lines running here or elsewhere

    async def _all_recorded(self, batch_id: str) -> bool:
        current = await self.store.get_batch(batch_id)
        return current is None or current.completed + current.failed >= current.total

    async def _next_page(self, batch_id: str) -> list[PendingLine]:
        """The next lines to feed, once every engine's models are known (a line
        for a model no engine serves is an error, not a wait)."""
        while True:
            if self.models_known():
                break
            await anyio.sleep(self.limits.poll_s)
        return await self.store.claim(batch_id, self.owner, self.limits.window, self.limits.lease_s)

    async def _line(self, batch: BatchRecord, line: PendingLine, room: anyio.Semaphore) -> None:
        try:
            result = await self._attempts(batch, line)
            with anyio.CancelScope(shield=True):
                if await self.store.record(batch.id, line.idx, result):
                    self.metrics.count(result)
        finally:
            self._held.get(batch.id, set()).discard(line.idx)
            room.release()

    async def _attempts(self, batch: BatchRecord, line: PendingLine) -> LineResult:
        req = line_request(line.body, batch.endpoint)
        status, body = 0, Json()
        for attempt in range(1, self.limits.max_attempts + 1):
            job_id = f"{batch.id}/{line.custom_id}/{attempt}"
            status, body = await self.complete(req, job_id)
            if status < 500 and status != 429:
                break
            logger.warning(
                "batch %s line %d: HTTP %d (try %d)", batch.id, line.idx, status, attempt
            )
            if attempt < self.limits.max_attempts:
                await anyio.sleep(self.limits.backoff_s * 2 ** (attempt - 1))
        return answered(line.custom_id, status, body, line.body)
